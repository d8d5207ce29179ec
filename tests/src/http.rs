//! A minimal HTTP/1.1 client over a raw TCP stream, so tests see exactly
//! what the frontend sends (status, headers, every SSE line as it arrives)
//! and can drop the connection mid-stream.

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
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
    let mut stream = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    let body = body.unwrap_or_default();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    stream.write_all(req.as_bytes()).await?;
    let mut reader = BufReader::new(stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await? == 0 {
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
    Ok((status, head, reader))
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
