//! Who may call what, over which wire: TLS and mutual TLS from PEM files
//! (reloaded when they change), the shared mesh token, the limits every
//! listener keeps, and the one membership rule servers apply to internal APIs.
//!
//! The model:
//!
//! - **Public surfaces** — the frontend's OpenAI HTTP API and gRPC
//!   `Inference`, health, reflection, `/metrics`, `/live` — are open at this
//!   layer; the frontend checks its API keys itself (`--api-key-file`).
//! - **Internal APIs** — every other `sluice.*` gRPC service: `Worker`,
//!   `Queue`, `Router`, `KvTransfer` — answer mesh members only. A member is
//!   1. a caller whose TLS client certificate `--tls-ca` signed (verified
//!      in the handshake), or
//!   2. a caller that sends the token of `--mesh-token-file` in the
//!      [`MESH_TOKEN_HEADER`] metadata (compared in constant time), or
//!   3. a server of this process calling in-process ([`crate::local`]):
//!      members by construction, since nothing outside this process can
//!      reach that path (they send the token as well).
//!
//!   Anyone else gets `UNAUTHENTICATED` before any handler runs.
//! - With neither a CA nor a token nothing can tell a member from a stranger:
//!   a server with internal APIs then refuses to listen on a non-loopback
//!   address, unless `--insecure` overrides it (logged as an error-level
//!   warning on every start).
//! - Outgoing mesh calls ([`Security::channel`]) use TLS when `--tls-ca` is
//!   set — presenting `--tls-cert` and verifying the peer's certificate
//!   against the CA and the host it dials — and carry the token when one is
//!   set.
//!
//! Certificates, key and CA are re-read at most once a second when a
//! connection is accepted or dialled and a file's size or modification time
//! changed; a file that fails to load leaves the previous configuration in
//! force (and says why in the log).

pub mod certs;
mod tls;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Endpoint;

pub use tls::{TlsError, client_config_trusting};

use crate::RuntimeError;
use crate::grpc::TracedChannel;
use crate::local::MeshChannel;
use crate::telemetry::TraceInjector;

/// Metadata (HTTP/2 header) that carries the mesh token on internal calls.
pub const MESH_TOKEN_HEADER: &str = "x-sluice-mesh-token";

/// Shortest mesh token accepted, in bytes.
pub const MIN_TOKEN_LEN: usize = 16;

/// HTTP/2 pings on a mesh channel after this long without a frame from the
/// peer...
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// ...and the connection (with every call on it) fails when a ping goes
/// unanswered this long.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);

/// TLS, mesh authentication and connection limits; the same flags for every
/// role and for `sluice up` (flattened into [`crate::CommonArgs`]).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Security and connection limits")]
pub struct SecurityArgs {
    /// PEM certificate (chain) to serve TLS with on this service's port: the
    /// HTTP API, gRPC and `/metrics` alike. Needs `--tls-key`; reloaded when
    /// the file changes.
    #[arg(long, env = "SLUICE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "SLUICE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// PEM certificate(s) of the mesh's CA. Callers presenting a client
    /// certificate it signed are mesh members; this service's own calls to
    /// the mesh use TLS, present `--tls-cert` and verify peers against it.
    /// Needs `--tls-cert` and `--tls-key`.
    #[arg(long, env = "SLUICE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,

    /// A file holding the mesh's shared token (one line, at least 16
    /// bytes): internal RPCs (`Worker`, `Queue`, `Router`, `KvTransfer`)
    /// then require it, and this service sends it on its own calls.
    #[arg(long, env = "SLUICE_MESH_TOKEN_FILE")]
    pub mesh_token_file: Option<PathBuf>,

    /// The mesh token itself, for platforms that hand secrets over as
    /// environment (a Kubernetes Secret through `envFrom`); prefer
    /// `--mesh-token-file` on a command line, where others can read it.
    #[arg(
        long,
        env = "SLUICE_MESH_TOKEN",
        hide_env_values = true,
        conflicts_with = "mesh_token_file"
    )]
    pub mesh_token: Option<Redacted>,

    /// Serve internal APIs on a non-loopback address with neither
    /// `--tls-ca` nor `--mesh-token-file`: anyone who can reach the port can
    /// then generate, admit and route. Only for trusted networks.
    #[arg(long, env = "SLUICE_INSECURE")]
    pub insecure: bool,

    /// Connections a listener holds at once; more are closed at accept.
    /// Keep it below the process's descriptor limit (`ulimit -n`).
    #[arg(long, env = "SLUICE_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,

    /// Seconds a connection may stay open without a request in flight (an
    /// idle HTTP/1.1 keep-alive or HTTP/2 connection) before it is closed.
    #[arg(long, env = "SLUICE_IDLE_TIMEOUT", default_value_t = 60)]
    pub idle_timeout: u64,

    /// Seconds from accept until the first request's headers have arrived
    /// (TLS handshake included); a connection that sends nothing is closed.
    #[arg(long, env = "SLUICE_HEADER_READ_TIMEOUT", default_value_t = 10)]
    pub header_read_timeout: u64,
}

/// A secret flag value that `Debug` never shows.
#[derive(Clone)]
pub struct Redacted(pub String);

impl std::fmt::Debug for Redacted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::str::FromStr for Redacted {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

impl Default for SecurityArgs {
    fn default() -> Self {
        Self {
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            mesh_token_file: None,
            mesh_token: None,
            insecure: false,
            max_connections: 4096,
            idle_timeout: 60,
            header_read_timeout: 10,
        }
    }
}

/// What every listener enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections held at once.
    pub max_connections: usize,
    /// Open without a request in flight, at most.
    pub idle_timeout: Duration,
    /// From accept to the first request's headers, at most.
    pub header_read_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        let a = SecurityArgs::default();
        Self {
            max_connections: a.max_connections,
            idle_timeout: Duration::from_secs(a.idle_timeout),
            header_read_timeout: Duration::from_secs(a.header_read_timeout),
        }
    }
}

/// A secret compared without leaking it through timing: only its SHA-256
/// digest is kept, and a presented value is digested and compared in full,
/// so the time taken depends on neither where the bytes differ nor the
/// secret's length (only on the presented value's own length).
#[derive(Clone)]
pub struct Secret {
    digest: [u8; 32],
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// Keeps `value`'s digest.
    pub fn new(value: &[u8]) -> Self {
        Self {
            digest: digest(value),
        }
    }

    /// Whether `presented` is the secret.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let d = digest(presented);
        self.digest
            .iter()
            .zip(d.iter())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
    }

    /// Whether `presented` is any of `secrets`; every one is compared, so
    /// the time does not tell which matched.
    pub fn any_matches(secrets: &[Secret], presented: &[u8]) -> bool {
        Self::position(secrets, presented).is_some()
    }
}

impl Secret {
    /// Which of `secrets` `presented` is; every one is compared in full, so
    /// the time tells neither whether nor which one matched.
    pub fn position(secrets: &[Secret], presented: &[u8]) -> Option<usize> {
        let d = digest(presented);
        // 1 + the index of the match, 0 for none, chosen without branching
        // on the bytes.
        let mut found = 0usize;
        for (i, s) in secrets.iter().enumerate() {
            let diff = s
                .digest
                .iter()
                .zip(d.iter())
                .fold(0u8, |acc, (x, y)| acc | (x ^ y));
            let equal = usize::from(std::hint::black_box(diff) == 0);
            found |= equal.wrapping_neg() & (i + 1);
        }
        found.checked_sub(1)
    }
}

fn digest(value: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, value);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// The shared mesh token.
#[derive(Clone)]
struct MeshToken {
    value: HeaderValue,
    secret: Secret,
}

impl std::fmt::Debug for MeshToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MeshToken(..)")
    }
}

impl MeshToken {
    fn parse(text: &str, path: &std::path::Path) -> Result<Self, RuntimeError> {
        let token = text.trim();
        let bad = |message: String| RuntimeError::InvalidFlag {
            flag: "--mesh-token-file",
            message,
        };
        if token.len() < MIN_TOKEN_LEN {
            return Err(bad(format!(
                "{} holds a token of {} bytes; use at least {MIN_TOKEN_LEN} random bytes (e.g. `openssl rand -hex 32`)",
                path.display(),
                token.len()
            )));
        }
        let value = HeaderValue::from_str(token).map_err(|_| {
            bad(format!(
                "{}: the token must be printable ASCII without line breaks",
                path.display()
            ))
        })?;
        Ok(Self {
            secret: Secret::new(value.as_bytes()),
            value,
        })
    }

    /// Whether `presented` is this token (see [`Secret`]).
    fn matches(&self, presented: Option<&HeaderValue>) -> bool {
        presented.is_some_and(|p| self.secret.matches(p.as_bytes()))
    }
}

/// Marks a request that came through [`crate::local`]: a server of this
/// process calling another in-process. Only code of this process can insert it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalCall;

/// What the listener learnt about a connection, in every request's extensions.
#[derive(Debug, Clone, Copy)]
pub struct PeerInfo {
    /// The peer's address.
    pub addr: std::net::SocketAddr,
    /// The peer presented a client certificate that `--tls-ca` signed.
    pub verified_client_cert: bool,
}

/// The loaded security configuration of a process (or of one test service):
/// shared by its servers and its clients.
#[derive(Debug, Clone)]
pub struct Security {
    tls: Option<Arc<tls::TlsFiles>>,
    token: Option<MeshToken>,
    insecure: bool,
    limits: ConnectionLimits,
}

impl Default for Security {
    fn default() -> Self {
        Self::open()
    }
}

impl Security {
    /// No TLS, no token, default limits: what in-process tests and a
    /// loopback-only `sluice up` use.
    pub fn open() -> Self {
        Self {
            tls: None,
            token: None,
            insecure: false,
            limits: ConnectionLimits::default(),
        }
    }

    /// Loads the files the flags name; errors name the flag and what to fix.
    pub fn from_args(args: &SecurityArgs) -> Result<Self, RuntimeError> {
        let flag = |flag: &'static str, message: &str| RuntimeError::InvalidFlag {
            flag,
            message: message.into(),
        };
        let tls = match (&args.tls_cert, &args.tls_key, &args.tls_ca) {
            (None, None, None) => None,
            (Some(cert), Some(key), ca) => Some(Arc::new(tls::TlsFiles::load(
                cert.clone(),
                key.clone(),
                ca.clone(),
            )?)),
            (Some(_), None, _) => return Err(flag("--tls-key", "--tls-cert needs --tls-key")),
            (None, Some(_), _) => return Err(flag("--tls-cert", "--tls-key needs --tls-cert")),
            (None, None, Some(_)) => {
                return Err(flag(
                    "--tls-ca",
                    "--tls-ca needs --tls-cert and --tls-key: they are the identity this service presents to its peers",
                ));
            }
        };
        let token = match (&args.mesh_token_file, &args.mesh_token) {
            (None, None) => None,
            (None, Some(token)) => Some(MeshToken::parse(
                &token.0,
                std::path::Path::new("--mesh-token"),
            )?),
            (Some(path), _) => {
                let text =
                    std::fs::read_to_string(path).map_err(|e| RuntimeError::InvalidFlag {
                        flag: "--mesh-token-file",
                        message: format!("cannot read {}: {e}", path.display()),
                    })?;
                Some(MeshToken::parse(&text, path)?)
            }
        };
        if args.max_connections == 0 {
            return Err(flag("--max-connections", "must be at least 1"));
        }
        if args.idle_timeout == 0 {
            return Err(flag("--idle-timeout", "must be at least 1 second"));
        }
        if args.header_read_timeout == 0 {
            return Err(flag("--header-read-timeout", "must be at least 1 second"));
        }
        Ok(Self {
            tls,
            token,
            insecure: args.insecure,
            limits: ConnectionLimits {
                max_connections: args.max_connections,
                idle_timeout: Duration::from_secs(args.idle_timeout),
                header_read_timeout: Duration::from_secs(args.header_read_timeout),
            },
        })
    }

    /// The same configuration with other connection limits.
    pub fn with_limits(mut self, limits: ConnectionLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The same configuration with `token` as the mesh token (tests).
    pub fn with_token(mut self, token: &str) -> Result<Self, RuntimeError> {
        self.token = Some(MeshToken::parse(token, std::path::Path::new("<token>"))?);
        Ok(self)
    }

    /// The limits every listener of this configuration keeps.
    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }

    /// Whether listeners serve TLS.
    pub fn serves_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Whether outgoing mesh calls use TLS (`--tls-ca` is set).
    pub fn dials_tls(&self) -> bool {
        self.tls.as_ref().is_some_and(|t| t.has_ca())
    }

    /// Whether members can be told from strangers (a CA or a token is set);
    /// otherwise internal APIs are open and must stay on loopback.
    pub fn authenticates_members(&self) -> bool {
        self.token.is_some() || self.dials_tls()
    }

    /// `--insecure`.
    pub fn insecure(&self) -> bool {
        self.insecure
    }

    /// The server's TLS configuration now (reloaded if its files changed);
    /// `None` without `--tls-cert`.
    pub(crate) fn server_tls(&self) -> Option<Arc<rustls::ServerConfig>> {
        self.tls.as_ref().map(|t| t.server_config())
    }

    /// Whether `req` comes from a mesh member (see the module docs).
    pub(crate) fn is_member<B>(&self, req: &http::Request<B>) -> bool {
        req.extensions().get::<LocalCall>().is_some()
            || req
                .extensions()
                .get::<PeerInfo>()
                .is_some_and(|p| p.verified_client_cert)
            || self
                .token
                .as_ref()
                .is_some_and(|t| t.matches(req.headers().get(MESH_TOKEN_HEADER)))
    }

    /// The mesh token's bytes, for a side channel that is not gRPC (the
    /// `tcp` KV transport's hello); `None` without a token.
    pub fn mesh_token(&self) -> Option<&[u8]> {
        self.token.as_ref().map(|t| t.value.as_bytes())
    }

    /// Whether `presented` is the mesh token, compared as a [`Secret`]
    /// (digested, in full); `false` without a token.
    pub fn is_mesh_token(&self, presented: &[u8]) -> bool {
        self.token
            .as_ref()
            .is_some_and(|t| t.secret.matches(presented))
    }

    /// The token's header value, for outgoing calls.
    pub(crate) fn token_header(&self) -> Option<HeaderValue> {
        self.token.as_ref().map(|t| t.value.clone())
    }

    /// A channel to a mesh `endpoint` (`host:port`, or a URL whose scheme is
    /// ignored) that injects trace context and the mesh token, speaks TLS
    /// with this service's certificate when `--tls-ca` is set, and calls a
    /// server of this process without a socket when one registered that
    /// endpoint (see [`crate::local`]). Connects lazily (the first call).
    pub fn channel(&self, endpoint: &str) -> Result<TracedChannel, RuntimeError> {
        let host_port = endpoint.rsplit("://").next().unwrap_or(endpoint);
        let ep = Endpoint::from_shared(format!("http://{host_port}"))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(2))
            // A peer that stops answering with its connection still open
            // (hung, SIGSTOPped) fails the calls on it within 8 s, so they
            // fail over instead of waiting out their deadlines.
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        let tls = self.tls.as_ref().filter(|t| t.has_ca()).cloned();
        let mesh = MeshChannel::new(host_port, || match tls {
            Some(tls) => ep.connect_with_connector_lazy(tls::Connector::new(tls)),
            None => ep.connect_lazy(),
        })
        .with_token(self.token_header());
        Ok(InterceptedService::new(mesh, TraceInjector))
    }
}

/// Whether a request path belongs to an internal API: every `sluice.*` gRPC
/// service except the public `Inference` (new services are internal unless
/// listed here).
pub(crate) fn is_internal_path(path: &str) -> bool {
    path.starts_with("/sluice.") && !path.starts_with("/sluice.inference.")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_paths_are_every_sluice_service_but_inference() {
        assert!(is_internal_path("/sluice.worker.v1.Worker/Generate"));
        assert!(is_internal_path("/sluice.queue.v1.Queue/Admit"));
        assert!(is_internal_path("/sluice.router.v1.Router/Route"));
        assert!(is_internal_path("/sluice.kv.v1.KvTransfer/WriteBlocks"));
        assert!(!is_internal_path("/sluice.inference.v1.Inference/Generate"));
        assert!(!is_internal_path("/grpc.health.v1.Health/Check"));
        assert!(!is_internal_path("/v1/chat/completions"));
        assert!(!is_internal_path("/metrics"));
    }

    #[test]
    fn a_token_matches_only_itself_and_short_tokens_are_refused() {
        let p = std::path::Path::new("t");
        let t = MeshToken::parse("0123456789abcdef-mesh\n", p).expect("token");
        assert!(t.matches(Some(&HeaderValue::from_static("0123456789abcdef-mesh"))));
        assert!(!t.matches(Some(&HeaderValue::from_static("0123456789abcdef-mesX"))));
        assert!(!t.matches(Some(&HeaderValue::from_static("0123456789abcdef"))));
        assert!(!t.matches(None));
        let err = MeshToken::parse("short", p).expect_err("too short");
        assert!(err.to_string().contains("--mesh-token-file"), "{err}");
    }

    #[test]
    fn tls_flags_must_come_together() {
        let args = SecurityArgs {
            tls_ca: Some("ca.pem".into()),
            ..SecurityArgs::default()
        };
        let err = Security::from_args(&args).expect_err("ca alone");
        assert!(err.to_string().contains("--tls-ca"), "{err}");
        let args = SecurityArgs {
            tls_cert: Some("c.pem".into()),
            ..SecurityArgs::default()
        };
        let err = Security::from_args(&args).expect_err("cert alone");
        assert!(err.to_string().contains("--tls-key"), "{err}");
    }
}
