//! A minimal HTTP/1.1 client over a raw stream, so tests see exactly what a
//! server sends (status, headers, every SSE line as it arrives), can drop
//! the connection mid-stream, and can keep one connection (plain or TLS)
//! for several requests.

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// `GET path` → (status, body).
pub async fn get(addr: &str, path: &str) -> anyhow::Result<(u16, String)> {
    request(addr, "GET", path, None, &[]).await
}

/// `POST path` with a JSON body → (status, body).
pub async fn post_json(
    addr: &str,
    path: &str,
    body: &serde_json::Value,
) -> anyhow::Result<(u16, String)> {
    request(addr, "POST", path, Some(body.to_string()), &[]).await
}

/// Any request with extra headers → (status, body). The body is read to the end.
pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<String>,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, String)> {
    let (status, head, mut reader) = open(addr, method, path, body, headers).await?;
    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).await?;
    let text = String::from_utf8_lossy(&rest).into_owned();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(&text)
    } else {
        text
    };
    Ok((status, body))
}

/// Opens a request and returns (status, raw head, reader positioned at the body).
pub async fn open(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<String>,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, String, BufReader<TcpStream>)> {
    let stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream);
    let request = Request {
        host: addr,
        method,
        path,
        body: body.as_deref().unwrap_or_default(),
        headers,
        close: true,
    };
    let (status, head) = send(&mut reader, &request).await?;
    Ok((status, head, reader))
}

/// One request on a kept-alive connection (plain or TLS): its status and
/// head, its body read (by `Content-Length` or chunks) so the connection
/// is ready for the next one.
pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut BufReader<S>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, String)> {
    let request = Request {
        host: "test",
        method,
        path,
        body: "",
        headers,
        close: false,
    };
    let (status, head) = send(io, &request).await?;
    read_body(io, &head).await?;
    Ok((status, head))
}

/// What [`send`] writes.
struct Request<'a> {
    host: &'a str,
    method: &'a str,
    path: &'a str,
    body: &'a str,
    headers: &'a [(&'a str, &'a str)],
    /// Ask the server to close the connection after the response.
    close: bool,
}

/// Writes `r` on `io` and reads the response head: (status, raw head),
/// `io` left at the body.
async fn send<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut BufReader<S>,
    r: &Request<'_>,
) -> anyhow::Result<(u16, String)> {
    let mut req = format!(
        "{} {} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n",
        r.method,
        r.path,
        r.host,
        r.body.len()
    );
    if r.close {
        req.push_str("Connection: close\r\n");
    }
    if !r.body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in r.headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(r.body);
    io.get_mut().write_all(req.as_bytes()).await?;
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if io.read_line(&mut line).await? == 0 {
            anyhow::bail!("connection closed inside the response head");
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status line")?;
    Ok((status, head))
}

/// Reads the body `head` delimits, by `Content-Length` or chunks (none
/// when it says neither).
async fn read_body<S: AsyncRead + Unpin>(
    io: &mut BufReader<S>,
    head: &str,
) -> anyhow::Result<Vec<u8>> {
    let lower = head.to_ascii_lowercase();
    let mut body = Vec::new();
    if let Some(len) = lower
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        body.resize(len, 0);
        io.read_exact(&mut body).await?;
    } else if lower.contains("transfer-encoding: chunked") {
        loop {
            let mut size = String::new();
            io.read_line(&mut size).await?;
            let n = usize::from_str_radix(size.trim(), 16)?;
            let mut chunk = vec![0; n + 2];
            io.read_exact(&mut chunk).await?;
            body.extend_from_slice(&chunk[..n]);
            if n == 0 {
                break;
            }
        }
    }
    Ok(body)
}

fn dechunk(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some((size_line, after)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size_line.trim(), 16) else {
            break;
        };
        if size == 0 || after.len() < size {
            break;
        }
        out.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    out
}
