//! The listener edge and the mesh's membership rule, against a real server
//! on 127.0.0.1:0: internal paths need the token or a certificate the mesh
//! CA signed, public ones do not; TLS and mutual TLS from files, reloaded
//! when they change; silent, idle and surplus connections are closed.

use std::convert::Infallible;
use std::future::Ready;
use std::path::Path;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use sluice_runtime::grpc::GrpcServer;
use sluice_runtime::security::certs::{PkiFiles, TestCa, write};
use sluice_runtime::security::{ConnectionLimits, MESH_TOKEN_HEADER};
use sluice_runtime::{RuntimeError, Security, SecurityArgs, Shutdown};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tonic::server::NamedService;
use tower::Service;

/// An internal service (a `sluice.*` name other than `Inference`) that
/// answers every call with an empty 200.
#[derive(Clone)]
struct Probe;

impl NamedService for Probe {
    const NAME: &'static str = "sluice.probe.v1.Probe";
}

impl Service<http::Request<tonic::body::Body>> for Probe {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<tonic::body::Body>) -> Self::Future {
        std::future::ready(Ok(http::Response::new(tonic::body::Body::empty())))
    }
}

const INTERNAL: &str = "/sluice.probe.v1.Probe/Call";
const TOKEN: &str = "a-mesh-token-of-some-length";

struct Served {
    addr: std::net::SocketAddr,
    stop: Shutdown,
    task: tokio::task::JoinHandle<Result<(), RuntimeError>>,
}

impl Served {
    async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.task).await???;
        Ok(())
    }
}

async fn serve(security: Security) -> anyhow::Result<Served> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let public = axum::Router::new().route("/public", axum::routing::get(|| async { "open" }));
    let server = GrpcServer::new()?
        .add_service(Probe)
        .with_http(public)
        .with_security(Arc::new(security));
    let stop = Shutdown::new();
    let task = tokio::spawn(server.serve(listener, stop.clone()));
    Ok(Served { addr, stop, task })
}

/// One HTTP/1.1 request on `io` (kept alive); the status and the head.
async fn request<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut BufReader<S>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, String)> {
    sluice_tests::http::exchange(io, method, path, headers).await
}

fn refused(head: &str) -> bool {
    head.to_ascii_lowercase().contains("grpc-status: 16")
}

/// Resolves when the peer closes `io` (read returns 0 or fails).
async fn closed<S: AsyncRead + Unpin>(io: &mut S) -> bool {
    let mut buf = [0u8; 64];
    loop {
        match io.read(&mut buf).await {
            Ok(0) | Err(_) => return true,
            Ok(_) => continue,
        }
    }
}

fn pki(dir: &Path) -> anyhow::Result<(TestCa, PkiFiles)> {
    let ca = TestCa::new("sluice test CA")?;
    let files = ca.write(dir, "mesh", &["localhost", "127.0.0.1"])?;
    Ok((ca, files))
}

fn tls_args(files: &PkiFiles, with_ca: bool) -> SecurityArgs {
    SecurityArgs {
        tls_cert: Some(files.cert.clone()),
        tls_key: Some(files.key.clone()),
        tls_ca: with_ca.then(|| files.ca.clone()),
        ..SecurityArgs::default()
    }
}

/// A TLS client trusting `ca`, presenting `identity` if given.
fn tls_client(
    ca: &str,
    identity: Option<&(String, String)>,
) -> anyhow::Result<tokio_rustls::TlsConnector> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(c?)?;
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let config = match identity {
        Some((cert, key)) => {
            let chain =
                CertificateDer::pem_slice_iter(cert.as_bytes()).collect::<Result<Vec<_>, _>>()?;
            builder.with_client_auth_cert(chain, PrivateKeyDer::from_pem_slice(key.as_bytes())?)?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

async fn tls_connect(
    addr: std::net::SocketAddr,
    connector: &tokio_rustls::TlsConnector,
) -> anyhow::Result<BufReader<tokio_rustls::client::TlsStream<TcpStream>>> {
    let tcp = TcpStream::connect(addr).await?;
    let tls = connector
        .connect(ServerName::try_from("localhost")?, tcp)
        .await?;
    Ok(BufReader::new(tls))
}

#[tokio::test]
async fn internal_paths_need_the_mesh_token_and_public_ones_do_not() -> anyhow::Result<()> {
    let served = serve(Security::open().with_token(TOKEN)?).await?;
    let mut io = BufReader::new(TcpStream::connect(served.addr).await?);
    let (_, head) = request(&mut io, "POST", INTERNAL, &[]).await?;
    assert!(refused(&head), "no token: {head}");
    let (_, head) = request(
        &mut io,
        "POST",
        INTERNAL,
        &[(MESH_TOKEN_HEADER, "a-mesh-token-of-some-lengtX")],
    )
    .await?;
    assert!(refused(&head), "wrong token: {head}");
    let (status, head) = request(&mut io, "POST", INTERNAL, &[(MESH_TOKEN_HEADER, TOKEN)]).await?;
    assert!(status == 200 && !refused(&head), "token: {head}");
    let (status, _) = request(&mut io, "GET", "/public", &[]).await?;
    assert_eq!(status, 200);
    let (status, _) = request(&mut io, "GET", "/live", &[]).await?;
    assert_eq!(status, 200);

    // The channel services use sends the token: a gRPC health check (public)
    // and the same channel reach the server alike.
    let ch = Security::open()
        .with_token(TOKEN)?
        .channel(&served.addr.to_string())?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch);
    let reply = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await?;
    assert_eq!(reply.into_inner().status, 1, "SERVING");
    served.stop().await
}

#[tokio::test]
async fn an_open_server_refuses_to_expose_internal_apis_beyond_loopback() -> anyhow::Result<()> {
    let listener = TcpListener::bind("0.0.0.0:0").await?;
    let server = GrpcServer::new()?.add_service(Probe);
    let err = server
        .serve(listener, Shutdown::new())
        .await
        .expect_err("internal API on 0.0.0.0 without authentication");
    assert!(matches!(err, RuntimeError::Exposed { .. }), "{err}");
    assert!(err.to_string().contains("--mesh-token-file"), "{err}");

    // A token, or --insecure (loudly), lets it start.
    let server = GrpcServer::new()?
        .add_service(Probe)
        .with_security(Arc::new(Security::open().with_token(TOKEN)?));
    server.check_exposure("0.0.0.0:7000".parse()?)?;
    let insecure = Security::from_args(&SecurityArgs {
        insecure: true,
        ..SecurityArgs::default()
    })?;
    let server = GrpcServer::new()?
        .add_service(Probe)
        .with_security(Arc::new(insecure));
    server.check_exposure("0.0.0.0:7000".parse()?)?;
    // Public-only servers (a frontend) may listen anywhere.
    GrpcServer::new()?.check_exposure("0.0.0.0:7000".parse()?)?;
    Ok(())
}

#[tokio::test]
async fn mutual_tls_makes_certified_callers_members_and_keeps_public_routes_open()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (ca, files) = pki(dir.path())?;
    let served = serve(Security::from_args(&tls_args(&files, true))?).await?;
    let member = ca.issue(&["member"])?;
    let identity = (member.cert, member.key);

    // A member: its certificate is signed by the mesh CA.
    let with_cert = tls_client(&ca.pem.cert, Some(&identity))?;
    let mut io = tls_connect(served.addr, &with_cert).await?;
    let (status, head) = request(&mut io, "POST", INTERNAL, &[]).await?;
    assert!(status == 200 && !refused(&head), "member: {head}");

    // No certificate: public routes only.
    let anonymous = tls_client(&ca.pem.cert, None)?;
    let mut io = tls_connect(served.addr, &anonymous).await?;
    let (_, head) = request(&mut io, "POST", INTERNAL, &[]).await?;
    assert!(refused(&head), "anonymous: {head}");
    let (status, _) = request(&mut io, "GET", "/public", &[]).await?;
    assert_eq!(status, 200);

    // A certificate from another CA does not get through the handshake.
    let other = TestCa::new("another CA")?;
    let stranger = other.issue(&["stranger"])?;
    let forged = tls_client(&ca.pem.cert, Some(&(stranger.cert, stranger.key)))?;
    let handshake = async {
        let mut io = tls_connect(served.addr, &forged).await?;
        request(&mut io, "POST", INTERNAL, &[]).await
    };
    assert!(
        handshake.await.is_err(),
        "a foreign certificate must be refused"
    );

    // Plaintext is not served on a TLS port.
    let mut plain = BufReader::new(TcpStream::connect(served.addr).await?);
    assert!(request(&mut plain, "GET", "/public", &[]).await.is_err());

    // The mesh's own channel: TLS with the CA, presenting its certificate.
    let security = Security::from_args(&tls_args(&files, true))?;
    let ch = security.channel(&format!("localhost:{}", served.addr.port()))?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch);
    let reply = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await?;
    assert_eq!(reply.into_inner().status, 1, "SERVING over mutual TLS");
    served.stop().await
}

#[tokio::test]
async fn changed_certificate_files_are_served_without_a_restart() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (ca, files) = pki(dir.path())?;
    let served = serve(Security::from_args(&tls_args(&files, false))?).await?;
    let client = tls_client(&ca.pem.cert, None)?;
    let served_cert = |io: &BufReader<tokio_rustls::client::TlsStream<TcpStream>>| {
        io.get_ref()
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first().map(|c| c.as_ref().to_vec()))
    };
    let first = served_cert(&tls_connect(served.addr, &client).await?);

    let renewed = ca.issue(&["localhost", "127.0.0.1"])?;
    write(&files.key, &renewed.key, true)?;
    write(&files.cert, &renewed.cert, false)?;
    let want = CertificateDer::from_pem_slice(renewed.cert.as_bytes())?
        .as_ref()
        .to_vec();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = served_cert(&tls_connect(served.addr, &client).await?);
        if now.as_deref() == Some(want.as_slice()) {
            break;
        }
        assert_eq!(now, first, "either the old or the new certificate");
        assert!(
            Instant::now() < deadline,
            "the renewed certificate was not picked up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A broken file keeps the last good configuration in force: every
    // handshake over two of the server's reload looks (one a second) gets
    // the renewed certificate.
    write(&files.cert, "not a certificate", false)?;
    let looked = Instant::now() + Duration::from_millis(2200);
    while Instant::now() < looked {
        let now = served_cert(&tls_connect(served.addr, &client).await?);
        assert_eq!(now.as_deref(), Some(want.as_slice()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    served.stop().await
}

fn limits(max_connections: usize, idle: u64, header: u64) -> ConnectionLimits {
    ConnectionLimits {
        max_connections,
        idle_timeout: Duration::from_secs(idle),
        header_read_timeout: Duration::from_secs(header),
    }
}

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_after_the_header_read_timeout()
-> anyhow::Result<()> {
    let served = serve(Security::open().with_limits(limits(16, 30, 1))).await?;
    let mut silent = TcpStream::connect(served.addr).await?;
    let started = Instant::now();
    let closed_in = tokio::time::timeout(Duration::from_secs(5), closed(&mut silent)).await;
    assert!(closed_in.is_ok(), "a silent connection must be closed");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "{took:?}"
    );

    // An HTTP/2 client that sends the preface and nothing else, too.
    let mut h2 = TcpStream::connect(served.addr).await?;
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await?;
    assert!(
        tokio::time::timeout(Duration::from_secs(8), closed(&mut h2))
            .await
            .is_ok()
    );
    served.stop().await
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() -> anyhow::Result<()> {
    let served = serve(Security::open().with_limits(limits(16, 1, 10))).await?;
    let mut io = BufReader::new(TcpStream::connect(served.addr).await?);
    let (status, _) = request(&mut io, "GET", "/public", &[]).await?;
    assert_eq!(status, 200);
    // Still usable within the idle timeout.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _) = request(&mut io, "GET", "/public", &[]).await?;
    assert_eq!(status, 200);
    let started = Instant::now();
    assert!(
        tokio::time::timeout(Duration::from_secs(8), closed(&mut io))
            .await
            .is_ok()
    );
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    served.stop().await
}

#[tokio::test]
async fn connections_over_the_limit_are_closed_at_accept() -> anyhow::Result<()> {
    let served = serve(Security::open().with_limits(limits(2, 30, 30))).await?;
    // Both held connections are accepted and served before the third.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut io = BufReader::new(TcpStream::connect(served.addr).await?);
        let (status, _) = request(&mut io, "GET", "/public", &[]).await?;
        assert_eq!(status, 200);
        held.push(io);
    }
    let mut surplus = TcpStream::connect(served.addr).await?;
    assert!(
        tokio::time::timeout(Duration::from_secs(2), closed(&mut surplus))
            .await
            .is_ok(),
        "the third connection must be closed at once"
    );
    drop(held);
    // Slots come back when connections end.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut io = BufReader::new(TcpStream::connect(served.addr).await?);
        if let Ok((200, _)) = request(&mut io, "GET", "/public", &[]).await {
            break;
        }
        assert!(Instant::now() < deadline, "no slot freed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    served.stop().await
}
