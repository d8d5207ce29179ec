//! `https://` for `sluice bench`: hyper-util's pooled client over a
//! connector that dials TCP and, for `https` URIs, runs a rustls handshake
//! that verifies the server against `--ca` (the mesh's CA, e.g. the one
//! `sluice certs` wrote). Plain `http://` goes straight through.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Dials `http` and `https` URIs; `https` needs a client configuration.
#[derive(Clone)]
pub(crate) struct Connector {
    http: HttpConnector,
    tls: Option<Arc<ClientConfig>>,
}

impl Connector {
    pub(crate) fn new(http: HttpConnector, tls: Option<Arc<ClientConfig>>) -> Self {
        let mut http = http;
        // The scheme is this connector's business: let `https` URIs through.
        http.enforce_http(false);
        Self { http, tls }
    }
}

/// A connection, with or without TLS.
pub(crate) enum Conn {
    Plain(TokioIo<TcpStream>),
    Tls(Box<TokioIo<TlsStream<TcpStream>>>),
}

impl Connection for Conn {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl Read for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(io) => Pin::new(io).poll_read(cx, buf),
            Conn::Tls(io) => Pin::new(io.as_mut()).poll_read(cx, buf),
        }
    }
}

impl Write for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(io) => Pin::new(io).poll_write(cx, buf),
            Conn::Tls(io) => Pin::new(io.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(io) => Pin::new(io).poll_flush(cx),
            Conn::Tls(io) => Pin::new(io.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(io) => Pin::new(io).poll_shutdown(cx),
            Conn::Tls(io) => Pin::new(io.as_mut()).poll_shutdown(cx),
        }
    }
}

impl tower::Service<http::Uri> for Connector {
    type Response = Conn;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Conn, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        tower::Service::poll_ready(&mut self.http, cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let https = uri.scheme_str() == Some("https");
        let tls = self.tls.clone();
        let host = uri
            .host()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned());
        let connecting = tower::Service::call(&mut self.http, uri);
        Box::pin(async move {
            let tcp = connecting.await?;
            if !https {
                return Ok(Conn::Plain(tcp));
            }
            let config = tls.ok_or("https needs --ca (the CA that signed the server)")?;
            let name = ServerName::try_from(host.ok_or("the URL has no host")?)?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp.into_inner())
                .await?;
            Ok(Conn::Tls(Box::new(TokioIo::new(tls))))
        })
    }
}
