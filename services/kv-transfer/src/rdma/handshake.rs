//! Swapping [`QpInfo`]s over the transport's side channel (any tokio byte
//! stream: a TCP connection, a Unix socket, `tokio::io::duplex` in tests).
//!
//! Each side sends one 30-byte frame: a little-endian `u32` magic/version
//! word ([`HANDSHAKE_MAGIC`], `b"SQP"` then the version byte) followed by
//! the 26-byte [`QpInfo::to_bytes`] form. The client writes first and then
//! reads; the server reads first and then writes, so the exchange cannot
//! deadlock however small the stream's buffers are.
//!
//! Neither function times out on its own: wrap the call in
//! `tokio::time::timeout` when the peer may stall.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::qp::{QP_INFO_LEN, QpInfo};
use super::{rdma_err, rdma_failed};
use crate::KvTransferError;

/// Handshake format version; bumped on any change to the frame.
const VERSION: u8 = 1;

/// The first word of every handshake frame: `b"SQP"` and [`VERSION`], read
/// as a little-endian `u32`.
pub const HANDSHAKE_MAGIC: u32 = u32::from_le_bytes([b'S', b'Q', b'P', VERSION]);

const FRAME_LEN: usize = 4 + QP_INFO_LEN;

/// Sends `local`, then reads and returns the peer's [`QpInfo`].
pub async fn exchange_as_client<S>(
    stream: &mut S,
    local: &QpInfo,
) -> Result<QpInfo, KvTransferError>
where
    S: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    send(stream, local).await?;
    receive(stream).await
}

/// Reads the peer's [`QpInfo`], then sends `local`; returns the peer's.
pub async fn exchange_as_server<S>(
    stream: &mut S,
    local: &QpInfo,
) -> Result<QpInfo, KvTransferError>
where
    S: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let remote = receive(stream).await?;
    send(stream, local).await?;
    Ok(remote)
}

fn encode(info: &QpInfo) -> [u8; FRAME_LEN] {
    let mut frame = [0u8; FRAME_LEN];
    frame[..4].copy_from_slice(&HANDSHAKE_MAGIC.to_le_bytes());
    frame[4..].copy_from_slice(&info.to_bytes());
    frame
}

fn decode(frame: &[u8; FRAME_LEN]) -> Result<QpInfo, KvTransferError> {
    let [m0, m1, m2, version, info @ ..] = frame;
    let magic = u32::from_le_bytes([*m0, *m1, *m2, *version]);
    if magic != HANDSHAKE_MAGIC {
        return Err(if [*m0, *m1, *m2] == [b'S', b'Q', b'P'] {
            rdma_err(format!(
                "peer speaks RDMA handshake version {version}, this build speaks {VERSION}"
            ))
        } else {
            rdma_err(format!(
                "wrong RDMA handshake magic {magic:#010x} (expected {HANDSHAKE_MAGIC:#010x}): \
                 the peer is not a sluice rdma endpoint"
            ))
        });
    }
    QpInfo::from_bytes(info)
}

async fn send<S>(stream: &mut S, info: &QpInfo) -> Result<(), KvTransferError>
where
    S: AsyncWrite + Unpin + ?Sized,
{
    let frame = encode(info);
    stream
        .write_all(&frame)
        .await
        .map_err(rdma_failed("sending the RDMA handshake"))?;
    stream
        .flush()
        .await
        .map_err(rdma_failed("sending the RDMA handshake"))
}

async fn receive<S>(stream: &mut S) -> Result<QpInfo, KvTransferError>
where
    S: AsyncRead + Unpin + ?Sized,
{
    let mut frame = [0u8; FRAME_LEN];
    stream.read_exact(&mut frame).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            rdma_err("the peer closed the stream during the RDMA handshake")
        } else {
            rdma_failed("receiving the RDMA handshake")(e)
        }
    })?;
    decode(&frame)
}

#[cfg(test)]
mod tests {
    use tokio::io::duplex;

    use super::*;

    fn info(qpn: u32, gid_byte: u8) -> QpInfo {
        QpInfo {
            lid: 7,
            qpn,
            psn: 0x00ab_cdef,
            gid: [gid_byte; 16],
        }
    }

    #[test]
    fn magic_spells_sqp_and_the_version() {
        assert_eq!(&HANDSHAKE_MAGIC.to_le_bytes(), b"SQP\x01");
    }

    #[tokio::test]
    async fn client_and_server_swap_infos() {
        // A buffer smaller than one frame: the order of reads and writes
        // must still not deadlock.
        for buf in [1, 8, FRAME_LEN, 4096] {
            let (mut a, mut b) = duplex(buf);
            let (client, server) = (info(0x11, 0xaa), info(0x22, 0));
            let (got_by_client, got_by_server) = tokio::join!(
                exchange_as_client(&mut a, &client),
                exchange_as_server(&mut b, &server),
            );
            assert_eq!(got_by_client.expect("client side"), server, "buffer {buf}");
            assert_eq!(got_by_server.expect("server side"), client, "buffer {buf}");
        }
    }

    #[tokio::test]
    async fn server_first_spawned_tasks_work_too() {
        let (mut a, mut b) = duplex(64);
        let server = tokio::spawn(async move { exchange_as_server(&mut b, &info(3, 1)).await });
        let remote = exchange_as_client(&mut a, &info(4, 2))
            .await
            .expect("client");
        assert_eq!(remote, info(3, 1));
        let remote = server.await.expect("joined").expect("server");
        assert_eq!(remote, info(4, 2));
    }

    #[tokio::test]
    async fn a_wrong_magic_is_refused_clearly() {
        let (mut a, mut b) = duplex(64);
        let mut frame = encode(&info(5, 0));
        frame[..4].copy_from_slice(b"HTTP");
        a.write_all(&frame).await.expect("write");
        let msg = exchange_as_server(&mut b, &info(6, 0))
            .await
            .expect_err("wrong magic")
            .to_string();
        assert!(msg.contains("wrong RDMA handshake magic"), "{msg}");
        assert!(msg.contains("not a sluice rdma endpoint"), "{msg}");
    }

    #[tokio::test]
    async fn another_version_is_named() {
        let (mut a, mut b) = duplex(64);
        let mut frame = encode(&info(5, 0));
        frame[3] = 9;
        a.write_all(&frame).await.expect("write");
        let msg = exchange_as_client(&mut b, &info(6, 0))
            .await
            .expect_err("wrong version")
            .to_string();
        assert!(msg.contains("version 9"), "{msg}");
    }

    #[tokio::test]
    async fn a_bad_info_inside_a_good_frame_is_refused() {
        let (mut a, mut b) = duplex(64);
        let mut frame = encode(&info(5, 0));
        frame[4 + 5] = 0xff; // qpn's top byte
        a.write_all(&frame).await.expect("write");
        let msg = exchange_as_server(&mut b, &info(6, 0))
            .await
            .expect_err("qpn out of range")
            .to_string();
        assert!(msg.contains("24 bits"), "{msg}");
    }

    #[tokio::test]
    async fn a_short_frame_then_eof_is_refused() {
        let (mut a, mut b) = duplex(64);
        a.write_all(&encode(&info(5, 0))[..10])
            .await
            .expect("write");
        drop(a);
        let msg = exchange_as_server(&mut b, &info(6, 0))
            .await
            .expect_err("truncated")
            .to_string();
        assert!(msg.contains("closed the stream"), "{msg}");
    }

    #[tokio::test]
    async fn a_closed_peer_fails_the_client_without_panicking() {
        let (mut a, b) = duplex(64);
        drop(b);
        let err = exchange_as_client(&mut a, &info(5, 0))
            .await
            .expect_err("peer gone");
        assert!(err.to_string().contains("rdma: "), "{err}");
    }
}
