//! A private CA and certificates signed by it, for tests and for trying TLS
//! out (`sluice certs`, `make certs`). Production meshes bring their own.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// What can fail making or writing certificates.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error("generating a certificate")]
    Generate(#[from] rcgen::Error),
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A certificate and its private key, PEM.
#[derive(Debug, Clone)]
pub struct CertPem {
    pub cert: String,
    pub key: String,
}

/// A CA that signs certificates for mesh members.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    /// The CA's own certificate and key, PEM.
    pub pem: CertPem,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

/// Paths of a CA and one certificate it signed, as written by [`TestCa::write`].
#[derive(Debug, Clone)]
pub struct PkiFiles {
    pub ca: PathBuf,
    pub ca_key: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Result<Self, CertsError> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
        ];
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        let pem = CertPem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        };
        Ok(Self {
            issuer: Issuer::new(params, key),
            pem,
        })
    }

    /// A certificate for `hosts` (DNS names or IP addresses) usable both to
    /// serve and to call (server and client authentication).
    pub fn issue(&self, hosts: &[&str]) -> Result<CertPem, CertsError> {
        let names: Vec<String> = hosts.iter().map(|h| (*h).to_owned()).collect();
        let mut params = CertificateParams::new(names)?;
        params.distinguished_name.push(
            DnType::CommonName,
            hosts.first().copied().unwrap_or("sluice"),
        );
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(CertPem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// Writes the CA (`ca.pem`, `ca-key.pem`) and a new certificate for
    /// `hosts` (`<name>.pem`, `<name>-key.pem`) into `dir`; keys are written
    /// readable by their owner only.
    pub fn write(&self, dir: &Path, name: &str, hosts: &[&str]) -> Result<PkiFiles, CertsError> {
        let leaf = self.issue(hosts)?;
        let files = PkiFiles {
            ca: dir.join("ca.pem"),
            ca_key: dir.join("ca-key.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}-key.pem")),
        };
        std::fs::create_dir_all(dir).map_err(|source| CertsError::Write {
            path: dir.to_owned(),
            source,
        })?;
        write(&files.ca, &self.pem.cert, false)?;
        write(&files.ca_key, &self.pem.key, true)?;
        write(&files.cert, &leaf.cert, false)?;
        write(&files.key, &leaf.key, true)?;
        Ok(files)
    }
}

/// Writes `text` to `path`, replacing it atomically (a reader never sees a
/// half-written file); `secret` files get mode 0600.
pub fn write(path: &Path, text: &str, secret: bool) -> Result<(), CertsError> {
    let err = |source| CertsError::Write {
        path: path.to_owned(),
        source,
    };
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(err)?;
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    #[cfg(not(unix))]
    let _ = secret;
    std::fs::rename(&tmp, path).map_err(err)
}
