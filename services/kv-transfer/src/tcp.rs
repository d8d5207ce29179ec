//! The `tcp` transport: blocks as frames over a plain TCP connection.
//!
//! Every frame starts with a 24-byte little-endian header — magic `SLKV`,
//! kind, block id, payload length, XXH3-64 of the payload — followed by the
//! payload. A transfer is `BEGIN` (payload: the transfer id; block id field:
//! the block count), one `BLOCK` per block, `END`; the receiver answers with
//! an ack (magic, status, blocks written, message length, message). The
//! sender gathers headers and payloads into vectored writes (no staging
//! copy); the receiver reads each payload into one cache-resident buffer per
//! connection, checks it and copies it into its block of the engine's KV
//! memory. A refusal (unknown transfer, wrong size, checksum mismatch)
//! is acked with its reason and the connection closed. Connections are kept
//! for the next transfer to the same receiver.
//!
//! **Only mesh members write.** With a mesh token (`--mesh-token-file`) a
//! sender opens every connection with a `HELLO` frame carrying the token;
//! the receiver compares it as a [`sluice_runtime::security::Secret`]
//! (digested, in full) before it reads anything else, and refuses (ack
//! with the reason, then close) a connection whose first frame is not a
//! `HELLO` with the token, or that sends none within [`HELLO_TIMEOUT`].
//! Without a token a receiver skips a `HELLO`. With TLS configured the
//! transport is not offered at all (blocks would cross in cleartext next
//! to TLS-protected gRPC; see `start_receiver`).

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use sluice_proto::kv::v1 as pb;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::task::TaskTracker;

use sluice_engine::backend::KvArena;
use sluice_runtime::Security;
use sluice_runtime::edge::ConnectionGate;
use sluice_runtime::security::ConnectionLimits;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::{AddressInbound, Block, KvSender, KvTransferError, Receiver, TransportKind};

/// `SLKV`, little-endian.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"SLKV");
pub(crate) const HEADER_LEN: usize = 24;
const ACK_LEN: usize = 16;
pub(crate) const KIND_BEGIN: u32 = 1;
pub(crate) const KIND_BLOCK: u32 = 2;
pub(crate) const KIND_END: u32 = 3;
/// The connection's first frame when the mesh has a token: the token.
pub(crate) const KIND_HELLO: u32 = 4;
const MAX_ID_LEN: usize = 1024;
/// Longest `HELLO` payload read (a mesh token is printable ASCII).
const MAX_TOKEN_LEN: usize = 4096;
/// What a refused connection may still send before it is closed.
const REFUSED_DRAIN_BYTES: usize = 1 << 20;
const REFUSED_DRAIN_TIME: Duration = Duration::from_secs(1);
/// Slices per vectored write (IOV_MAX is 1024 on Linux).
const MAX_SLICES: usize = 512;
/// Idle connections kept per receiver.
const MAX_IDLE_PER_PEER: usize = 4;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// One frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: u32,
    pub block_id: u32,
    pub len: u32,
    pub checksum: u64,
}

impl Header {
    pub(crate) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.kind.to_le_bytes());
        b[8..12].copy_from_slice(&self.block_id.to_le_bytes());
        b[12..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, String> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if u32_at(0) != MAGIC {
            return Err("not a Sluice KV frame (bad magic)".into());
        }
        let mut c = [0u8; 8];
        c.copy_from_slice(&b[16..24]);
        Ok(Self {
            kind: u32_at(4),
            block_id: u32_at(8),
            len: u32_at(12),
            checksum: u64::from_le_bytes(c),
        })
    }
}

/// Writes every byte of `bufs` with as few system calls as the socket allows.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = w.write_vectored(bufs).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// Binds `bind` and serves transfers on it until `shutdown`; the region
/// names `endpoint`'s host (or the bound IP when it is specific) and the
/// bound port.
pub async fn listen(
    bind: SocketAddr,
    endpoint: &str,
    receiver: Arc<OnceLock<Weak<Receiver>>>,
    security: Arc<Security>,
    shutdown: sluice_runtime::Shutdown,
    tasks: &TaskTracker,
) -> Result<AddressInbound, KvTransferError> {
    let listener = TcpListener::bind(bind)
        .await
        .map_err(|source| KvTransferError::Listen {
            transport: TransportKind::Tcp,
            bind,
            source,
        })?;
    let local = listener.local_addr().map_err(KvTransferError::failed(
        TransportKind::Tcp,
        "reading the listener's address",
    ))?;
    // The bound address, for whoever picked port 0 (tests, operators).
    tracing::info!(address = %local, "KV tcp listener bound");
    tasks.spawn(accept_loop(
        listener,
        receiver,
        security,
        shutdown,
        tasks.clone(),
    ));
    Ok(AddressInbound {
        kind: TransportKind::Tcp,
        address: advertised(local, endpoint),
    })
}

/// The address a side-channel listener bound to `local` is dialled at:
/// `endpoint`'s host when bound to every interface, else the bound IP.
pub(crate) fn advertised(local: SocketAddr, endpoint: &str) -> String {
    let host = if local.ip().is_unspecified() {
        crate::endpoint_host(endpoint).to_string()
    } else {
        match local.ip() {
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
            ip => ip.to_string(),
        }
    };
    format!("{host}:{}", local.port())
}

async fn accept_loop(
    listener: TcpListener,
    receiver: Arc<OnceLock<Weak<Receiver>>>,
    security: Arc<Security>,
    shutdown: sluice_runtime::Shutdown,
    tasks: TaskTracker,
) {
    let gate = Arc::new(ConnectionGate::new("kv-tcp", security.limits()));
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = gate.accept(&listener) => a,
        };
        let Some((stream, peer, slot)) = accepted else {
            continue;
        };
        let Some(receiver) = receiver.get().and_then(Weak::upgrade) else {
            continue;
        };
        let (shutdown, security, gate) =
            (shutdown.clone(), Arc::clone(&security), Arc::clone(&gate));
        tasks.spawn(async move {
            let _slot = slot;
            let mut stream = stream;
            let _ = stream.set_nodelay(true);
            let serve = async {
                if !admitted(&mut stream, &security, &gate, peer).await {
                    return Ok(());
                }
                serve_connection(stream, receiver, gate.limits()).await
            };
            tokio::select! {
                _ = shutdown.cancelled() => {}
                r = serve => if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "KV tcp connection closed");
                },
            }
        });
    }
}

/// Whether the peer on `stream` may send transfers. With a mesh token, it
/// must open with it (a `HELLO`) within the first-frame deadline; a refused
/// peer is told why before the connection closes. Without one, anyone may:
/// the first frame is read by [`serve_connection`] under the same deadline.
async fn admitted<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    security: &Security,
    gate: &ConnectionGate,
    peer: SocketAddr,
) -> bool {
    if security.mesh_token().is_none() {
        return true;
    }
    let first = gate.limits().header_read_timeout;
    let why = match tokio::time::timeout(first, read_hello(stream)).await {
        Err(_) => format!(
            "no mesh token within {} s (--header-read-timeout)",
            first.as_secs()
        ),
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "KV tcp connection closed before its hello");
            return false;
        }
        Ok(Ok(Some(token))) if security.is_mesh_token(&token) => return true,
        Ok(Ok(Some(_))) => "wrong mesh token".to_string(),
        Ok(Ok(None)) => {
            "this receiver takes transfers from mesh members only: open with the mesh token (HELLO)"
                .to_string()
        }
    };
    gate.refuse(
        peer,
        &format!("KV tcp connection refused: not a mesh member: {why}"),
    );
    let _ = write_ack(stream, 1, 0, &why).await;
    // Close our side, then read (and drop) what the peer already sent, for
    // a little while: closing with unread data would reset the connection
    // and could destroy the answer before the peer reads it.
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 16 << 10];
    let drain = async {
        let mut left = REFUSED_DRAIN_BYTES;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(REFUSED_DRAIN_TIME, drain).await;
    false
}

/// The payload of the first frame when it is a `HELLO`; `None` when it is
/// any other frame.
async fn read_hello<S: AsyncRead + Unpin>(stream: &mut S) -> std::io::Result<Option<Vec<u8>>> {
    let mut raw = [0u8; HEADER_LEN];
    stream.read_exact(&mut raw).await?;
    match Header::decode(&raw) {
        Ok(h) if h.kind == KIND_HELLO && h.len as usize <= MAX_TOKEN_LEN => {
            let mut token = vec![0u8; h.len as usize];
            stream.read_exact(&mut token).await?;
            Ok(Some(token))
        }
        _ => Ok(None),
    }
}

/// Serves transfers on one connection until the peer closes it, a
/// transfer is refused, or the peer is too slow: the first frame must
/// arrive within `header_read_timeout`, the next transfer within
/// `idle_timeout` of the last one's ack, and inside a transfer every read
/// must progress within `idle_timeout` (a stalled sender holds blocks the
/// receiver reserved).
pub(crate) async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    receiver: Arc<Receiver>,
    limits: ConnectionLimits,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut wait = limits.header_read_timeout;
    loop {
        let mut raw = [0u8; HEADER_LEN];
        match tokio::time::timeout(wait, stream.read_exact(&mut raw)).await {
            Err(_) => return Ok(()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e),
        }
        let mut stream = Deadlined {
            inner: &mut stream,
            within: limits.idle_timeout,
        };
        let outcome = match Header::decode(&raw) {
            Ok(h) if h.kind == KIND_BEGIN && h.len as usize <= MAX_ID_LEN => {
                receive_transfer(&mut stream, &receiver, h, &mut buf).await
            }
            // A sender with a token talking to a receiver without one.
            Ok(h) if h.kind == KIND_HELLO && h.len as usize <= MAX_TOKEN_LEN => {
                let mut token = vec![0u8; h.len as usize];
                stream.read_exact(&mut token).await?;
                continue;
            }
            Ok(h) => Err(Refusal::Protocol(format!(
                "expected BEGIN, got frame kind {}",
                h.kind
            ))),
            Err(e) => Err(Refusal::Protocol(e)),
        };
        match outcome {
            Ok(written) => write_ack(stream.inner, 0, written, "").await?,
            Err(Refusal::Io(e)) => return Err(e),
            Err(Refusal::Protocol(msg)) => {
                write_ack(stream.inner, 1, 0, &msg).await?;
                return Ok(());
            }
        }
        wait = limits.idle_timeout;
    }
}

/// A stream whose every `read_exact` must finish within `within`.
struct Deadlined<'a, S> {
    inner: &'a mut S,
    within: Duration,
}

impl<S: AsyncRead + Unpin> Deadlined<'_, S> {
    async fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        match tokio::time::timeout(self.within, self.inner.read_exact(buf)).await {
            Ok(r) => r.map(|_| ()),
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the sender stalled mid-transfer for {} s (--idle-timeout)",
                    self.within.as_secs()
                ),
            )),
        }
    }
}

enum Refusal {
    Io(std::io::Error),
    Protocol(String),
}

impl From<std::io::Error> for Refusal {
    fn from(e: std::io::Error) -> Self {
        Refusal::Io(e)
    }
}

impl From<KvTransferError> for Refusal {
    fn from(e: KvTransferError) -> Self {
        Refusal::Protocol(e.to_string())
    }
}

async fn receive_transfer<S: AsyncRead + Unpin>(
    stream: &mut Deadlined<'_, S>,
    receiver: &Arc<Receiver>,
    begin: Header,
    buf: &mut Vec<u8>,
) -> Result<u32, Refusal> {
    let mut id = vec![0u8; begin.len as usize];
    stream.read_exact(&mut id).await?;
    let id =
        String::from_utf8(id).map_err(|_| Refusal::Protocol("transfer id is not UTF-8".into()))?;
    let target = receiver.target(&id)?;
    let block_bytes = target.block_bytes();
    buf.resize(block_bytes, 0);
    let mut written = 0u32;
    loop {
        let mut raw = [0u8; HEADER_LEN];
        stream.read_exact(&mut raw).await?;
        let h = Header::decode(&raw).map_err(Refusal::Protocol)?;
        match h.kind {
            KIND_BLOCK => {
                if h.len as usize != block_bytes {
                    return Err(Refusal::Protocol(format!(
                        "block {} of transfer {id} has {} bytes, the layout says {block_bytes}",
                        h.block_id, h.len
                    )));
                }
                // One reused buffer per connection: the block stays in cache
                // from the socket read through the checksum to its copy into
                // the engine's KV memory.
                stream.read_exact(buf).await?;
                if xxh3_64(buf) != h.checksum {
                    return Err(Refusal::Protocol(format!(
                        "checksum mismatch on block {} of transfer {id}",
                        h.block_id
                    )));
                }
                target.write(h.block_id, buf).await?;
                written += 1;
            }
            KIND_END => break,
            other => {
                return Err(Refusal::Protocol(format!(
                    "unexpected frame kind {other} inside transfer {id}"
                )));
            }
        }
    }
    Ok(written)
}

async fn write_ack<W: AsyncWrite + Unpin>(
    w: &mut W,
    status: u32,
    written: u32,
    msg: &str,
) -> std::io::Result<()> {
    let mut ack = [0u8; ACK_LEN];
    ack[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    ack[4..8].copy_from_slice(&status.to_le_bytes());
    ack[8..12].copy_from_slice(&written.to_le_bytes());
    ack[12..16].copy_from_slice(&(msg.len() as u32).to_le_bytes());
    let mut bufs = [IoSlice::new(&ack), IoSlice::new(msg.as_bytes())];
    write_all_vectored(w, &mut bufs).await?;
    w.flush().await
}

/// Sends over `tcp`, keeping a few idle connections per receiver; opens
/// each with the mesh token when it has one.
#[derive(Default)]
pub struct TcpSender {
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
    token: Option<Vec<u8>>,
}

impl std::fmt::Debug for TcpSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpSender")
            .field("idle", &self.idle.lock().len())
            .field("token", &self.token.as_ref().map(|_| ".."))
            .finish()
    }
}

pub(crate) enum SendError {
    Io(std::io::Error),
    Refused(String),
}

impl TcpSender {
    /// A sender that opens every connection with `token` (the mesh token,
    /// [`Security::mesh_token`]); `None`: no hello.
    pub fn with_token(token: Option<&[u8]>) -> Self {
        Self {
            idle: Mutex::default(),
            token: token.map(<[u8]>::to_vec),
        }
    }

    async fn connect(&self, address: &str) -> Result<TcpStream, KvTransferError> {
        let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
            .await
            .map_err(|_| {
                KvTransferError::transport(
                    TransportKind::Tcp,
                    format!("connect to {address} timed out"),
                )
            })?
            .map_err(KvTransferError::failed(
                TransportKind::Tcp,
                format!("connect to {address}"),
            ))?;
        stream.set_nodelay(true).map_err(KvTransferError::failed(
            TransportKind::Tcp,
            "setting TCP_NODELAY",
        ))?;
        if let Some(token) = &self.token {
            let hello = Header {
                kind: KIND_HELLO,
                block_id: 0,
                len: token.len() as u32,
                checksum: 0,
            }
            .encode();
            let mut iov = [IoSlice::new(&hello), IoSlice::new(token)];
            write_all_vectored(&mut stream, &mut iov)
                .await
                .map_err(KvTransferError::failed(
                    TransportKind::Tcp,
                    format!("hello to {address}"),
                ))?;
        }
        Ok(stream)
    }

    fn take_idle(&self, address: &str) -> Option<TcpStream> {
        self.idle.lock().get_mut(address).and_then(Vec::pop)
    }

    fn put_idle(&self, address: &str, stream: TcpStream) {
        let mut idle = self.idle.lock();
        let list = idle.entry(address.to_string()).or_default();
        if list.len() < MAX_IDLE_PER_PEER {
            list.push(stream);
        }
    }
}

#[tonic::async_trait]
impl KvSender for TcpSender {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    async fn write(
        &self,
        region: &pb::Region,
        transfer_id: &str,
        blocks: Vec<Block>,
    ) -> Result<u32, KvTransferError> {
        let frames: Vec<Frame<'_>> = blocks
            .iter()
            .map(|b| Frame {
                id: b.id,
                checksum: b.checksum,
                parts: vec![&b.data],
            })
            .collect();
        self.send_frames(&region.address, transfer_id, &frames)
            .await
    }

    /// Frames each block straight from the sender engine's KV memory: the
    /// socket reads the parts where they lie (no copy into a buffer); each
    /// block's checksum is taken over its parts first.
    async fn write_from(
        &self,
        region: &pb::Region,
        transfer_id: &str,
        src: &Arc<KvArena>,
        pairs: &[(u32, u32)],
    ) -> Option<Result<u32, KvTransferError>> {
        let frames = pairs
            .iter()
            .map(|&(s, d)| {
                // SAFETY: the source blocks belong to a finished prefill the
                // sender engine holds for this transfer: nobody writes them
                // while they are sent.
                let parts: Vec<&[u8]> = unsafe { src.block_parts(s) }
                    .map_err(KvTransferError::failed(TransportKind::Tcp, "source"))?
                    .collect();
                let mut h = Xxh3::new();
                parts.iter().for_each(|p| h.update(p));
                Ok(Frame {
                    id: d,
                    checksum: h.digest(),
                    parts,
                })
            })
            .collect::<Result<Vec<_>, KvTransferError>>();
        Some(match frames {
            Ok(frames) => {
                self.send_frames(&region.address, transfer_id, &frames)
                    .await
            }
            Err(e) => Err(e),
        })
    }
}

impl TcpSender {
    /// Sends `frames` to `address` on a kept connection (retrying once on a
    /// fresh one if it died) or a new one.
    async fn send_frames(
        &self,
        address: &str,
        transfer_id: &str,
        frames: &[Frame<'_>],
    ) -> Result<u32, KvTransferError> {
        if let Some(mut stream) = self.take_idle(address) {
            match send_on(&mut stream, transfer_id, frames).await {
                Ok(n) => {
                    self.put_idle(address, stream);
                    return Ok(n);
                }
                Err(SendError::Refused(reason)) => {
                    return Err(KvTransferError::Refused {
                        transport: TransportKind::Tcp,
                        reason,
                    });
                }
                Err(SendError::Io(e)) => {
                    tracing::debug!(error = %e, "kept KV connection failed; reconnecting");
                }
            }
        }
        let mut stream = self.connect(address).await?;
        match send_on(&mut stream, transfer_id, frames).await {
            Ok(n) => {
                self.put_idle(address, stream);
                Ok(n)
            }
            Err(SendError::Refused(reason)) => Err(KvTransferError::Refused {
                transport: TransportKind::Tcp,
                reason,
            }),
            Err(SendError::Io(e)) => Err(KvTransferError::Failed {
                transport: TransportKind::Tcp,
                what: format!("to {address}"),
                source: e.into(),
            }),
        }
    }
}

/// One block on the wire: destination id, XXH3-64 of its bytes, and the
/// bytes as they lie in memory (one buffer, or a block's parts in the slabs).
#[derive(Debug)]
pub(crate) struct Frame<'a> {
    pub id: u32,
    pub checksum: u64,
    pub parts: Vec<&'a [u8]>,
}

impl Frame<'_> {
    fn len(&self) -> usize {
        self.parts.iter().map(|p| p.len()).sum()
    }
}

/// One transfer on an open connection: BEGIN, the blocks, END, then the ack.
pub(crate) async fn send_on<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    transfer_id: &str,
    blocks: &[Frame<'_>],
) -> Result<u32, SendError> {
    let id = transfer_id.as_bytes();
    let begin = Header {
        kind: KIND_BEGIN,
        block_id: blocks.len() as u32,
        len: id.len() as u32,
        checksum: 0,
    }
    .encode();
    let end = Header {
        kind: KIND_END,
        block_id: 0,
        len: 0,
        checksum: 0,
    }
    .encode();
    let sent = async {
        // Under IOV_MAX slices per vectored write.
        let per_block = blocks.first().map_or(1, |b| b.parts.len()) + 1;
        let per_write = (MAX_SLICES / per_block).max(1);
        let chunks: Vec<&[Frame<'_>]> = blocks.chunks(per_write).collect();
        let last = chunks.len().saturating_sub(1);
        let mut first = true;
        for (i, chunk) in chunks.iter().enumerate() {
            let headers: Vec<[u8; HEADER_LEN]> = chunk
                .iter()
                .map(|b| {
                    Header {
                        kind: KIND_BLOCK,
                        block_id: b.id,
                        len: b.len() as u32,
                        checksum: b.checksum,
                    }
                    .encode()
                })
                .collect();
            let mut iov = Vec::with_capacity(chunk.len() * per_block + 3);
            if first {
                iov.push(IoSlice::new(&begin));
                iov.push(IoSlice::new(id));
                first = false;
            }
            for (h, b) in headers.iter().zip(chunk.iter()) {
                iov.push(IoSlice::new(h));
                iov.extend(b.parts.iter().map(|p| IoSlice::new(p)));
            }
            if i == last {
                iov.push(IoSlice::new(&end));
            }
            write_all_vectored(stream, &mut iov).await?;
        }
        if blocks.is_empty() {
            let mut iov = [IoSlice::new(&begin), IoSlice::new(id), IoSlice::new(&end)];
            write_all_vectored(stream, &mut iov).await?;
        }
        stream.flush().await
    }
    .await;
    // On a write error the receiver may already have said why: read its ack.
    let ack = read_ack(stream).await;
    match (sent, ack) {
        (_, Ok((0, written, _))) => Ok(written),
        (_, Ok((_, _, msg))) => Err(SendError::Refused(msg)),
        (Err(e), Err(_)) | (Ok(()), Err(e)) => Err(SendError::Io(e)),
    }
}

async fn read_ack<S: AsyncRead + Unpin>(stream: &mut S) -> std::io::Result<(u32, u32, String)> {
    let mut ack = [0u8; ACK_LEN];
    stream.read_exact(&mut ack).await?;
    let u32_at = |i: usize| u32::from_le_bytes([ack[i], ack[i + 1], ack[i + 2], ack[i + 3]]);
    if u32_at(0) != MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "bad ack magic",
        ));
    }
    let len = (u32_at(12) as usize).min(64 << 10);
    let mut msg = vec![0u8; len];
    stream.read_exact(&mut msg).await?;
    Ok((
        u32_at(4),
        u32_at(8),
        String::from_utf8_lossy(&msg).into_owned(),
    ))
}

/// Raw loopback bandwidth for the bench: the same framing cost aside, how
/// fast this host moves bytes through one TCP connection.
#[doc(hidden)]
pub async fn loopback_pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (a, b) = tokio::join!(TcpStream::connect(addr), listener.accept());
    let a = a?;
    let (b, _) = b?;
    a.set_nodelay(true)?;
    b.set_nodelay(true)?;
    Ok((a, b))
}
