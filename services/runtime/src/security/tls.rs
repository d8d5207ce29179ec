//! rustls configurations from PEM files, rebuilt when the files change, and
//! the connector that dials mesh peers over TLS.
//!
//! One [`TlsFiles`] serves both directions: the server presents the
//! certificate and, with a CA, verifies client certificates when offered
//! (optional at the handshake, so public clients and probes still connect;
//! [`super::Security::is_member`] requires one for internal APIs); the
//! client presents the same certificate and verifies servers against the CA
//! and the host it dialled.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::future::BoxFuture;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;

/// How often at most the files' metadata is checked for changes.
const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// What can fail loading TLS files.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}")]
    Pem {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("{path} holds no PEM certificate")]
    NoCertificate { path: PathBuf },
    #[error("{what}")]
    Rustls {
        what: &'static str,
        #[source]
        source: rustls::Error,
    },
    #[error("the CA in {path} cannot verify client certificates")]
    Verifier {
        path: PathBuf,
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |source| TlsError::Pem {
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| TlsError::Pem {
        path: path.to_owned(),
        source,
    })
}

fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certs(path)? {
        roots.add(cert).map_err(|source| TlsError::Rustls {
            what: "adding a CA certificate",
            source,
        })?;
    }
    Ok(roots)
}

/// Reads every certificate of `path` (PEM) as trust anchors (for clients
/// such as `sluice bench`).
pub fn client_config_trusting(path: &Path) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = roots(path)?;
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            what: "TLS protocol versions",
            source,
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Both configurations, built from the files as they are now.
struct Built {
    server: Arc<ServerConfig>,
    /// With a CA only: outgoing calls need something to verify peers with.
    client: Option<Arc<ClientConfig>>,
}

fn build(cert: &Path, key_path: &Path, ca: Option<&Path>) -> Result<Built, TlsError> {
    let chain = certs(cert)?;
    let versions = |source| TlsError::Rustls {
        what: "TLS protocol versions",
        source,
    };
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(versions)?;
    let roots = ca
        .map(|ca| roots(ca).map(|r| (ca, Arc::new(r))))
        .transpose()?;
    let builder = match &roots {
        Some((ca, roots)) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::clone(roots), provider())
                    .allow_unauthenticated()
                    .build()
                    .map_err(|source| TlsError::Verifier {
                        path: ca.to_path_buf(),
                        source,
                    })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut server = builder
        .with_single_cert(chain.clone(), key(key_path)?)
        .map_err(|source| TlsError::Rustls {
            what: "the certificate does not match its key",
            source,
        })?;
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let client = match roots {
        None => None,
        Some((_, roots)) => {
            let mut client = ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(versions)?
                .with_root_certificates(roots)
                .with_client_auth_cert(chain, key(key_path)?)
                .map_err(|source| TlsError::Rustls {
                    what: "the client certificate does not match its key",
                    source,
                })?;
            client.alpn_protocols = vec![b"h2".to_vec()];
            Some(Arc::new(client))
        }
    };
    Ok(Built {
        server: Arc::new(server),
        client,
    })
}

/// Size and modification time of a file (what "changed" means here).
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &Path) -> Stamp {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

struct State {
    stamps: Vec<Stamp>,
    checked: Instant,
    built: Built,
}

/// The certificate, key and CA files, and the configurations last built
/// from them.
pub(crate) struct TlsFiles {
    cert: PathBuf,
    key: PathBuf,
    ca: Option<PathBuf>,
    state: Mutex<State>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .field("ca", &self.ca)
            .finish()
    }
}

impl TlsFiles {
    /// Loads the files once; errors say which file and why.
    pub(crate) fn load(cert: PathBuf, key: PathBuf, ca: Option<PathBuf>) -> Result<Self, TlsError> {
        let stamps = Self::stamps_of(&cert, &key, ca.as_deref());
        let built = build(&cert, &key, ca.as_deref())?;
        Ok(Self {
            cert,
            key,
            ca,
            state: Mutex::new(State {
                stamps,
                checked: Instant::now(),
                built,
            }),
        })
    }

    fn stamps_of(cert: &Path, key: &Path, ca: Option<&Path>) -> Vec<Stamp> {
        let mut s = vec![stamp(cert), stamp(key)];
        if let Some(ca) = ca {
            s.push(stamp(ca));
        }
        s
    }

    pub(crate) fn has_ca(&self) -> bool {
        self.ca.is_some()
    }

    /// Rebuilds the configurations when a file changed since the last look
    /// (looking at most once per [`RELOAD_CHECK`]).
    fn refresh(&self) -> parking_lot::MutexGuard<'_, State> {
        let mut state = self.state.lock();
        if state.checked.elapsed() < RELOAD_CHECK {
            return state;
        }
        state.checked = Instant::now();
        let stamps = Self::stamps_of(&self.cert, &self.key, self.ca.as_deref());
        if stamps == state.stamps {
            return state;
        }
        match build(&self.cert, &self.key, self.ca.as_deref()) {
            Ok(built) => {
                tracing::info!(cert = %self.cert.display(), "TLS files changed; reloaded them");
                state.built = built;
                state.stamps = stamps;
            }
            Err(e) => {
                // A half-written file is common during rotation: try again
                // on the next look, keep serving with what works.
                tracing::warn!(error = %e, source = ?std::error::Error::source(&e), cert = %self.cert.display(), "TLS files changed but do not load; keeping the previous ones");
            }
        }
        state
    }

    pub(crate) fn server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.refresh().built.server)
    }

    fn client_config(&self) -> Option<Arc<ClientConfig>> {
        self.refresh().built.client.clone()
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Dials a mesh peer and runs the TLS handshake with the client
/// configuration in force at that moment.
#[derive(Clone, Debug)]
pub(crate) struct Connector {
    files: Arc<TlsFiles>,
}

impl Connector {
    pub(crate) fn new(files: Arc<TlsFiles>) -> Self {
        Self { files }
    }
}

impl tower::Service<http::Uri> for Connector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let files = Arc::clone(&self.files);
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or("the endpoint has no host")?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri.port_u16().ok_or("the endpoint has no port")?;
            let config = files
                .client_config()
                .ok_or("TLS to the mesh needs --tls-ca")?;
            let name = ServerName::try_from(host.clone())?;
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await?;
            Ok(TokioIo::new(tls))
        })
    }
}
