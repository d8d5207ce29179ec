//! Transfer tests: negotiation, framing, and each transport writing into a
//! real engine's reserved slot (mocker backend: the real KV cache and block
//! memory, no model maths).

use std::sync::Arc;

use sluice_engine::backend::{Backend, KvBacking};
use sluice_engine::{EngineConfig, EngineHandle, MockerBackend, MockerConfig, SchedulerConfig};
use sluice_proto::kv::v1 as pb;

use super::shm::ShmSender;
use super::tcp::{Header, TcpSender};
use super::*;
use sluice_runtime::security::ConnectionLimits;

/// A mocker engine whose KV memory is a shared arena (as a decode worker
/// offering `shm` has).
fn engine(num_blocks: usize) -> EngineHandle {
    engine_in(num_blocks, &KvBacking::Shared)
}

/// A mocker engine without an arena: transports go through the engine thread.
fn engine_without_arena(num_blocks: usize) -> EngineHandle {
    spawn(mocker(num_blocks), num_blocks)
}

fn mocker(num_blocks: usize) -> MockerBackend {
    MockerBackend::new(MockerConfig {
        num_blocks,
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 16,
        ..MockerConfig::default()
    })
    .expect("mocker config")
}

/// A mocker engine with KV memory of its own (a prefill worker's).
fn engine_with_private_arena(num_blocks: usize) -> EngineHandle {
    engine_in(num_blocks, &KvBacking::Private)
}

fn engine_in(num_blocks: usize, backing: &KvBacking) -> EngineHandle {
    let mut backend = mocker(num_blocks);
    backend.set_kv_backing(backing).expect("KV memory");
    spawn(backend, num_blocks)
}

fn spawn(backend: MockerBackend, num_blocks: usize) -> EngineHandle {
    EngineHandle::spawn(
        Box::new(backend),
        EngineConfig {
            num_blocks: Some(num_blocks),
            scheduler: SchedulerConfig {
                max_model_len: 1 << 14,
                ..SchedulerConfig::default()
            },
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

fn request(blocks: usize, salt: u32) -> sluice_engine::Request {
    sluice_engine::Request {
        request_id: format!("r{salt}"),
        prompt: (0..blocks as u32 * 16)
            .map(|i| (i * 7 + salt * 131) % 30_000 + 1)
            .collect(),
        sampling: sluice_engine::SamplingParams::default(),
        priority: 0,
        constraint: None,
        first_token_by: None,
        tpot_target: None,
    }
}

fn blocks_for(ids: &[u32], block_bytes: usize, seed: u8) -> Vec<Block> {
    ids.iter()
        .map(|&id| {
            let data = (0..block_bytes)
                .map(|i| {
                    (i as u8)
                        .wrapping_mul(31)
                        .wrapping_add(seed)
                        .wrapping_add(id as u8)
                })
                .collect();
            Block::new(id, data)
        })
        .collect()
}

async fn receiver_with(kinds: &[TransportKind], _engine: &EngineHandle) -> Arc<Receiver> {
    receiver_checking(kinds, false).await
}

async fn receiver_checking(kinds: &[TransportKind], shm_checksums: bool) -> Arc<Receiver> {
    receiver_secured(kinds, shm_checksums, Arc::default()).await
}

async fn receiver_secured(
    kinds: &[TransportKind],
    shm_checksums: bool,
    security: Arc<sluice_runtime::Security>,
) -> Arc<Receiver> {
    let cfg = ReceiverConfig {
        transports: kinds.to_vec(),
        endpoint: "127.0.0.1:1".into(),
        tcp_listen: Some("127.0.0.1:0".parse().expect("addr")),
        shm_checksums,
        security,
    };
    start_receiver(
        &cfg,
        "127.0.0.1:0".parse().expect("addr"),
        sluice_runtime::Shutdown::new(),
        &tokio_util::task::TaskTracker::new(),
    )
    .await
    .expect("receiver")
}

/// A reserved slot of `blocks` blocks in `e`, expected as transfer `id`
/// from a sender on this host.
async fn expected(
    e: &EngineHandle,
    receiver: &Arc<Receiver>,
    blocks: usize,
    salt: u32,
    id: &str,
) -> (
    sluice_engine::RemoteSlot,
    Vec<u32>,
    Expectation,
    Vec<pb::Region>,
) {
    let slot = e.reserve_remote(request(blocks, salt)).await.expect("slot");
    let ids = slot.block_ids().to_vec();
    let (exp, regions) = receiver
        .expect(id, e.clone(), slot.id(), ids.clone(), true)
        .expect("registered");
    (slot, ids, exp, regions)
}

fn region(regions: &[pb::Region], kind: TransportKind) -> pb::Region {
    regions
        .iter()
        .find(|r| r.transport == kind.to_pb() as i32)
        .cloned()
        .expect("region offered")
}

/// Reserves a slot, sends its blocks over `sender`, completes the transfer,
/// and checks the engine holds exactly the bytes sent.
async fn round_trip(kind: TransportKind, sender: &dyn KvSender) {
    round_trip_on(engine(64), kind, sender).await
}

async fn round_trip_on(e: EngineHandle, kind: TransportKind, sender: &dyn KvSender) {
    let receiver = receiver_with(&[kind], &e).await;
    let (_slot, ids, exp, regions) = expected(&e, &receiver, 5, 1, "t1").await;
    let blocks = blocks_for(&ids, e.kv_layout().block_bytes(), 3);
    let sent = sender
        .write(&region(&regions, kind), "t1", blocks.clone())
        .await
        .expect("written");
    assert_eq!(sent, 5);
    assert_eq!(exp.finish(kind).await.expect("finished"), 5);
    let back = e.read_blocks(ids).await.expect("read back");
    assert_eq!(
        back,
        blocks.into_iter().map(|b| b.data).collect::<Vec<_>>(),
        "{kind}"
    );
}

#[tokio::test]
async fn tcp_writes_blocks_into_the_reserved_slot() {
    round_trip(TransportKind::Tcp, &TcpSender::default()).await;
}

#[tokio::test]
async fn tcp_writes_through_an_engine_without_an_arena() {
    let e = engine_without_arena(64);
    assert!(e.kv_arena().is_none());
    round_trip_on(e, TransportKind::Tcp, &TcpSender::default()).await;
}

#[tokio::test]
async fn shm_and_tcp_send_straight_from_the_senders_kv_memory() {
    let (src, dst) = (engine_with_private_arena(64), engine(64));
    let block_bytes = dst.kv_layout().block_bytes();
    let cases: [(TransportKind, bool, Box<dyn KvSender>); 3] = [
        (TransportKind::Shm, false, Box::new(ShmSender::default())),
        (TransportKind::Shm, true, Box::new(ShmSender::default())),
        (TransportKind::Tcp, false, Box::new(TcpSender::default())),
    ];
    for (salt, (kind, checksums, sender)) in (20u32..).zip(cases) {
        // Blocks in the sender engine's memory, as a finished prefill leaves them.
        let held = src.reserve_remote(request(4, salt)).await.expect("source");
        let src_ids = held.block_ids().to_vec();
        let data = blocks_for(&src_ids, block_bytes, 5);
        src.write_blocks(
            held.id(),
            data.iter().map(|b| (b.id, b.data.clone())).collect(),
        )
        .await
        .expect("source blocks");
        let receiver = receiver_checking(&[kind], checksums).await;
        let (_slot, ids, exp, regions) = expected(&dst, &receiver, 4, salt + 100, "direct").await;
        let pairs: Vec<(u32, u32)> = src_ids.iter().copied().zip(ids.iter().copied()).collect();
        let arena = src.kv_arena().expect("the source has KV memory");
        let n = sender
            .write_from(&region(&regions, kind), "direct", arena, &pairs)
            .await
            .expect("sends from KV memory")
            .expect("written");
        assert_eq!(n, 4);
        let case = format!("{kind} checksums {checksums}");
        assert_eq!(exp.finish(kind).await.expect("complete"), 4, "{case}");
        let back = dst.read_blocks(ids).await.expect("read back");
        assert_eq!(
            back,
            data.into_iter().map(|b| b.data).collect::<Vec<_>>(),
            "{case}"
        );
    }
}

#[tokio::test]
async fn shm_writes_blocks_into_the_reserved_slot() {
    round_trip(TransportKind::Shm, &ShmSender::default()).await;
}

/// The shm receiver's memory is handed over its socket, never named in a
/// directory: when the receiver goes (its socket and connections close, as
/// when its process dies, `kill -9` included) the sender stops offering the
/// transport to it and lets go of the mapping, and the kernel frees the
/// memory with the last mapping. Nothing is left to reclaim.
#[tokio::test]
async fn shm_sender_lets_go_of_a_gone_receivers_memory() {
    let e = engine(64);
    let shutdown = sluice_runtime::Shutdown::new();
    let cfg = ReceiverConfig {
        transports: vec![TransportKind::Shm],
        endpoint: "127.0.0.1:1".into(),
        tcp_listen: None,
        shm_checksums: false,
        security: Arc::default(),
    };
    let receiver = start_receiver(
        &cfg,
        "127.0.0.1:0".parse().expect("addr"),
        shutdown.clone(),
        &tokio_util::task::TaskTracker::new(),
    )
    .await
    .expect("receiver");
    let (_slot, ids, exp, regions) = expected(&e, &receiver, 2, 3, "t").await;
    let r = region(&regions, TransportKind::Shm);
    assert!(r.address.starts_with("@sluice-kv-"), "{}", r.address);
    let sender = ShmSender::default();
    assert!(sender.accepts(&r));
    let blocks = blocks_for(&ids, e.kv_layout().block_bytes(), 2);
    assert_eq!(sender.write(&r, "t", blocks).await.expect("written"), 2);
    assert_eq!(exp.finish(TransportKind::Shm).await.expect("finished"), 2);
    assert_eq!(sender.mapped(), 1);

    shutdown.cancel();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while sender.accepts(&r) {
        assert!(
            std::time::Instant::now() < deadline,
            "still offered 10 s after the receiver went"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let err = sender
        .write(&r, "t", blocks_for(&ids, e.kv_layout().block_bytes(), 4))
        .await
        .expect_err("the receiver is gone");
    assert!(err.to_string().contains("connect"), "{err}");
    assert_eq!(
        sender.mapped(),
        0,
        "the gone receiver's memory is still mapped"
    );
}

#[tokio::test]
async fn tcp_sender_reuses_its_connection_for_the_next_transfer() {
    let e = engine(64);
    let receiver = receiver_with(&[TransportKind::Tcp], &e).await;
    let sender = TcpSender::default();
    for round in 0..3u32 {
        let slot = e
            .reserve_remote(request(2, 10 + round))
            .await
            .expect("slot");
        let ids = slot.block_ids().to_vec();
        let id = format!("t{round}");
        let (exp, regions) = receiver
            .expect(&id, e.clone(), slot.id(), ids.clone(), false)
            .expect("registered");
        let blocks = blocks_for(&ids, e.kv_layout().block_bytes(), round as u8);
        let n = sender
            .write(&region(&regions, TransportKind::Tcp), &id, blocks)
            .await
            .expect("written");
        assert_eq!((n, exp.written()), (2, 2));
    }
}

#[tokio::test]
async fn tcp_refuses_a_checksum_mismatch_and_says_why() {
    let e = engine(64);
    let receiver = receiver_with(&[TransportKind::Tcp], &e).await;
    let (_slot, ids, exp, regions) = expected(&e, &receiver, 3, 2, "bad").await;
    let mut blocks = blocks_for(&ids, e.kv_layout().block_bytes(), 1);
    blocks[1].data[7] ^= 1;
    let err = TcpSender::default()
        .write(&region(&regions, TransportKind::Tcp), "bad", blocks)
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    assert!(exp.written() < 3);
}

#[tokio::test]
async fn tcp_refuses_an_unknown_transfer() {
    let e = engine(16);
    let receiver = receiver_with(&[TransportKind::Tcp], &e).await;
    let slot = e.reserve_remote(request(1, 3)).await.expect("slot");
    let (exp, regions) = receiver
        .expect(
            "known",
            e.clone(),
            slot.id(),
            slot.block_ids().to_vec(),
            true,
        )
        .expect("registered");
    let r = region(&regions, TransportKind::Tcp);
    drop(exp); // the decode side gave up: late writes are refused
    let err = TcpSender::default()
        .write(
            &r,
            "known",
            blocks_for(slot.block_ids(), e.kv_layout().block_bytes(), 0),
        )
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("unknown or cancelled"), "{err}");
}

#[tokio::test]
async fn shm_refuses_a_checksum_mismatch_when_asked_to_check() {
    let e = engine(64);
    let receiver = receiver_checking(&[TransportKind::Shm], true).await;
    let (_slot, ids, exp, regions) = expected(&e, &receiver, 2, 4, "bad").await;
    let r = region(&regions, TransportKind::Shm);
    let sender = ShmSender::default();
    assert!(r.checksums && sender.needs_checksums(&r));
    let mut blocks = blocks_for(&ids, e.kv_layout().block_bytes(), 1);
    blocks[0].data[0] ^= 0xff;
    sender
        .write(&r, "bad", blocks)
        .await
        .expect("one-sided writes are not checked by the writer");
    let err = exp
        .finish(TransportKind::Shm)
        .await
        .expect_err("refused on completion");
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    assert_eq!(exp.written(), 0);
}

#[tokio::test]
async fn shm_without_checksums_asks_for_none_and_completes_unchecked_blocks() {
    let e = engine(64);
    let receiver = receiver_with(&[TransportKind::Shm], &e).await;
    let (_slot, ids, exp, regions) = expected(&e, &receiver, 2, 8, "fast").await;
    let r = region(&regions, TransportKind::Shm);
    let sender = ShmSender::default();
    assert!(!r.checksums && !sender.needs_checksums(&r));
    let blocks: Vec<Block> = blocks_for(&ids, e.kv_layout().block_bytes(), 2)
        .into_iter()
        .map(|b| Block::unchecked(b.id, b.data))
        .collect();
    sender
        .write(&r, "fast", blocks.clone())
        .await
        .expect("written");
    assert_eq!(exp.finish(TransportKind::Shm).await.expect("complete"), 2);
    let back = e.read_blocks(ids).await.expect("read back");
    assert_eq!(back, blocks.into_iter().map(|b| b.data).collect::<Vec<_>>());
}

#[tokio::test]
async fn shm_never_passes_stale_bytes_of_an_earlier_transfer() {
    let e = engine(64);
    let receiver = receiver_with(&[TransportKind::Shm], &e).await;
    let block_bytes = e.kv_layout().block_bytes();
    let slot = e.reserve_remote(request(2, 5)).await.expect("slot");
    let ids = slot.block_ids().to_vec();
    {
        let (exp, regions) = receiver
            .expect("first", e.clone(), slot.id(), ids.clone(), true)
            .expect("registered");
        ShmSender::default()
            .write(
                &region(&regions, TransportKind::Shm),
                "first",
                blocks_for(&ids, block_bytes, 9),
            )
            .await
            .expect("written");
        assert_eq!(exp.finish(TransportKind::Shm).await.expect("checked"), 2);
    }
    // The same blocks are armed again; nothing is written this time.
    let (exp, _) = receiver
        .expect("second", e.clone(), slot.id(), ids.clone(), true)
        .expect("registered");
    let err = exp
        .finish(TransportKind::Shm)
        .await
        .expect_err("nothing was written");
    assert!(err.to_string().contains("not written"), "{err}");
}

#[tokio::test]
async fn shm_writes_of_a_forgotten_transfer_are_refused_before_they_land() {
    let e = engine(64);
    let receiver = receiver_with(&[TransportKind::Shm], &e).await;
    let block_bytes = e.kv_layout().block_bytes();
    let slot = e.reserve_remote(request(3, 6)).await.expect("slot");
    let ids = slot.block_ids().to_vec();
    let before = e.read_blocks(ids.clone()).await.expect("read");
    let (exp, regions) = receiver
        .expect("gone", e.clone(), slot.id(), ids.clone(), true)
        .expect("registered");
    drop(exp); // timed out or cancelled on the decode side
    let err = ShmSender::default()
        .write(
            &region(&regions, TransportKind::Shm),
            "gone",
            blocks_for(&ids, block_bytes, 4),
        )
        .await
        .expect_err("revoked");
    assert!(err.to_string().contains("no longer expects"), "{err}");
    assert_eq!(
        e.read_blocks(ids).await.expect("read"),
        before,
        "nothing landed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forgetting_an_shm_transfer_waits_for_a_writer_inside_a_block() {
    use super::shm::{STATE, TAG, WRITING};
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let e = engine(16);
    let receiver = receiver_with(&[TransportKind::Shm], &e).await;
    let (_slot, ids, exp, _regions) = expected(&e, &receiver, 1, 40, "inside").await;
    let arena = Arc::clone(e.kv_arena().expect("arena"));
    let c = arena.control(ids[0]).expect("control words");
    // A sender enters the block, as ShmSender does before it copies.
    c[STATE].fetch_add(WRITING, SeqCst);
    let forgotten = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&forgotten);
    let dropper = std::thread::spawn(move || {
        drop(exp);
        f.store(true, SeqCst);
    });
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(
        c[TAG].load(SeqCst),
        0,
        "revoked at once: no new block may start"
    );
    assert!(
        !forgotten.load(SeqCst),
        "the blocks are not given back while a writer is inside"
    );
    c[STATE].fetch_sub(WRITING, SeqCst);
    dropper.join().expect("dropper");
    assert!(forgotten.load(SeqCst));
}

#[tokio::test]
async fn shm_is_not_offered_without_a_shared_arena() {
    let e = engine_without_arena(16);
    let receiver = receiver_with(&[TransportKind::Shm, TransportKind::Tcp], &e).await;
    let (_x, regions) = receiver
        .expect("x", e.clone(), 1, vec![1], true)
        .expect("registered");
    let kinds: Vec<i32> = regions.iter().map(|r| r.transport).collect();
    assert_eq!(kinds, vec![pb::Transport::Tcp as i32]);
}

#[tokio::test]
async fn shm_is_offered_only_to_a_sender_on_this_host() {
    let e = engine(16);
    let receiver = receiver_with(&[TransportKind::Shm, TransportKind::Tcp], &e).await;
    let (_x, remote) = receiver
        .expect("x", e.clone(), 1, vec![1], false)
        .expect("registered");
    let kinds: Vec<i32> = remote.iter().map(|r| r.transport).collect();
    assert_eq!(kinds, vec![pb::Transport::Tcp as i32]);
    let (_y, local) = receiver
        .expect("y", e.clone(), 1, vec![1], true)
        .expect("registered");
    let kinds: Vec<i32> = local.iter().map(|r| r.transport).collect();
    assert_eq!(
        kinds,
        vec![pb::Transport::Shm as i32, pb::Transport::Tcp as i32]
    );
}

#[test]
fn negotiation_picks_the_receivers_first_choice_the_sender_supports() {
    let region = |t: pb::Transport, address: &str| pb::Region {
        transport: t as i32,
        address: address.into(),
        ..Default::default()
    };
    let offered = vec![
        region(pb::Transport::Shm, "@sluice-kv-1-nobody-listens/1"),
        region(pb::Transport::Tcp, "127.0.0.1:9"),
        region(pb::Transport::Grpc, "127.0.0.1:8"),
    ];
    let all = Senders::new(&TransportKind::ALL, &Arc::default());
    // Nobody listens on that shm socket here: the next choice, tcp.
    let (s, r) = all.choose(&offered).expect("a transport in common");
    assert_eq!(
        (s.kind(), r.address.as_str()),
        (TransportKind::Tcp, "127.0.0.1:9")
    );
    let grpc_only = Senders::new(&[TransportKind::Grpc], &Arc::default());
    let (s, _) = grpc_only.choose(&offered).expect("grpc in common");
    assert_eq!(s.kind(), TransportKind::Grpc);
    let shm_only = Senders::new(&[TransportKind::Shm], &Arc::default());
    assert!(shm_only.choose(&offered).is_none());
    assert!(all.choose(&[]).is_none());
}

#[test]
fn rdma_is_skipped_with_a_reason_when_it_cannot_run() {
    assert_eq!(
        available(&[TransportKind::Rdma, TransportKind::Tcp, TransportKind::Tcp]),
        vec![TransportKind::Tcp]
    );
    let why = TransportKind::Rdma
        .availability()
        .expect_err("no RDMA here")
        .to_string();
    assert!(why.contains("rdma") || why.contains("RDMA"), "{why}");
}

#[test]
fn same_host_compares_hosts_and_treats_loopback_as_one() {
    assert!(same_host("127.0.0.1:5000", "localhost:6000"));
    assert!(same_host("http://10.0.0.2:1", "10.0.0.2:2"));
    assert!(same_host("[::1]:1", "127.0.0.1:2"));
    assert!(!same_host("10.0.0.2:1", "10.0.0.3:1"));
    assert!(!same_host("10.0.0.2:1", "127.0.0.1:1"));
    assert_eq!(endpoint_host("http://[::1]:50051/x"), "[::1]");
    assert_eq!(endpoint_host("decode-0.svc:7003"), "decode-0.svc");
}

#[test]
fn frame_headers_round_trip_and_reject_foreign_bytes() {
    let h = Header {
        kind: 2,
        block_id: 77,
        len: 131_072,
        checksum: 0xdead_beef_f00d,
    };
    assert_eq!(Header::decode(&h.encode()), Ok(h));
    let mut bad = h.encode();
    bad[0] = b'X';
    assert!(Header::decode(&bad).is_err());
}

#[test]
fn layout_mismatch_is_refused_with_both_layouts_named() {
    let ours = sluice_engine::backend::KvBlockLayout {
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 16,
        block_size: 16,
        elem_bytes: 4,
    };
    let mut theirs = layout_to_pb(&ours);
    assert!(check_layout(Some(&theirs), &ours).is_ok());
    theirs.dtype = pb::Dtype::F16 as i32;
    let err = check_layout(Some(&theirs), &ours).expect_err("dtype differs");
    assert!(err.to_string().contains("layout mismatch"), "{err}");
    assert!(check_layout(None, &ours).is_err());
}

const MESH_TOKEN: &str = "0123456789abcdef-kv-mesh-token";

/// A raw connection to the tcp KV port as a stranger would open one: the
/// given first bytes, then a whole transfer of junk for `transfer_id`'s
/// first block; returns the receiver's answer (status, message) and
/// whether it then closed the connection.
async fn stranger(
    address: &str,
    first: &[u8],
    transfer_id: &str,
    block_id: u32,
    block_bytes: usize,
) -> (u32, String, bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    let junk = vec![0xA5u8; block_bytes];
    let mut bytes = first.to_vec();
    bytes.extend(
        Header {
            kind: tcp::KIND_BEGIN,
            block_id: 1,
            len: transfer_id.len() as u32,
            checksum: 0,
        }
        .encode(),
    );
    bytes.extend(transfer_id.as_bytes());
    bytes.extend(
        Header {
            kind: tcp::KIND_BLOCK,
            block_id,
            len: block_bytes as u32,
            checksum: xxhash_rust::xxh3::xxh3_64(&junk),
        }
        .encode(),
    );
    bytes.extend(&junk);
    bytes.extend(
        Header {
            kind: tcp::KIND_END,
            block_id: 0,
            len: 0,
            checksum: 0,
        }
        .encode(),
    );
    // The receiver may close before reading everything.
    let _ = s.write_all(&bytes).await;
    let _ = s.shutdown().await;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        s.read_to_end(&mut answer),
    )
    .await
    .expect("the receiver neither answered nor closed within 10 s");
    let closed = read.is_ok();
    assert!(answer.len() >= 16, "no ack: {answer:?}");
    let u32_at =
        |i: usize| u32::from_le_bytes([answer[i], answer[i + 1], answer[i + 2], answer[i + 3]]);
    let message = String::from_utf8_lossy(&answer[16..]).into_owned();
    (u32_at(4), message, closed)
}

/// With a mesh token, the tcp KV listener takes transfers only from
/// connections that open with it: a stranger's connection — no hello, or a
/// wrong token — is refused with the reason and closed before any of its
/// blocks lands, while a member's transfer to the same slot, begun
/// alongside on another connection, completes with its own bytes.
#[tokio::test]
async fn tcp_with_a_mesh_token_refuses_strangers_without_disturbing_a_member() {
    let first_frame = std::time::Duration::from_secs(2);
    let security = Arc::new(
        sluice_runtime::Security::open()
            .with_token(MESH_TOKEN)
            .expect("token")
            .with_limits(ConnectionLimits {
                header_read_timeout: first_frame,
                ..ConnectionLimits::default()
            }),
    );
    let e = engine(64);
    let receiver = receiver_secured(&[TransportKind::Tcp], false, Arc::clone(&security)).await;
    let (_slot, ids, exp, regions) = expected(&e, &receiver, 4, 7, "member").await;
    let r = region(&regions, TransportKind::Tcp);
    let block_bytes = e.kv_layout().block_bytes();

    // A stranger that says nothing holds a connection open meanwhile.
    let silent = tokio::net::TcpStream::connect(&r.address)
        .await
        .expect("connect");
    let member = TcpSender::with_token(security.mesh_token());
    let blocks = blocks_for(&ids, block_bytes, 9);
    let wrong = {
        let token = b"0123456789abcdef-not-the-token";
        let mut hello = Header {
            kind: tcp::KIND_HELLO,
            block_id: 0,
            len: token.len() as u32,
            checksum: 0,
        }
        .encode()
        .to_vec();
        hello.extend(token);
        hello
    };
    let (sent, no_hello, wrong_token) = tokio::join!(
        member.write(&r, "member", blocks.clone()),
        stranger(&r.address, &[], "member", ids[0], block_bytes),
        stranger(&r.address, &wrong, "member", ids[1], block_bytes),
    );
    assert_eq!(sent.expect("the member's transfer"), 4);
    let (status, message, closed) = no_hello;
    assert_eq!(status, 1, "{message}");
    assert!(message.contains("mesh members only"), "{message}");
    assert!(closed, "the connection without a hello stayed open");
    let (status, message, closed) = wrong_token;
    assert_eq!(status, 1, "{message}");
    assert!(message.contains("wrong mesh token"), "{message}");
    assert!(closed, "the connection with a wrong token stayed open");

    // A sender without the token is refused and told why.
    let err = TcpSender::default()
        .write(&r, "member", blocks_for(&ids, block_bytes, 1))
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("mesh members only"), "{err}");

    // Only the member's bytes landed.
    assert_eq!(exp.finish(TransportKind::Tcp).await.expect("finished"), 4);
    let back = e.read_blocks(ids).await.expect("read back");
    assert_eq!(back, blocks.into_iter().map(|b| b.data).collect::<Vec<_>>());

    // The silent stranger is closed after the first-frame deadline, told why.
    let mut silent = silent;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(
        first_frame + std::time::Duration::from_secs(10),
        tokio::io::AsyncReadExt::read_to_end(&mut silent, &mut answer),
    )
    .await
    .expect("the silent connection was not closed");
    assert!(read.is_ok());
    assert!(
        String::from_utf8_lossy(&answer).contains("no mesh token within"),
        "{answer:?}"
    );
}

/// A member with the token still talks to a receiver without one (it skips
/// the hello), and a receiver with TLS configured does not offer tcp.
#[tokio::test]
async fn tcp_hello_is_skipped_without_a_token_and_tls_turns_tcp_off() {
    let e = engine(64);
    let open = receiver_with(&[TransportKind::Tcp], &e).await;
    let (_slot, ids, exp, regions) = expected(&e, &open, 2, 3, "open").await;
    let sender = TcpSender::with_token(Some(MESH_TOKEN.as_bytes()));
    let blocks = blocks_for(&ids, e.kv_layout().block_bytes(), 4);
    let n = sender
        .write(&region(&regions, TransportKind::Tcp), "open", blocks)
        .await
        .expect("written");
    assert_eq!((n, exp.written()), (2, 2));

    let dir = tempfile::tempdir().expect("dir");
    let files = sluice_runtime::security::certs::TestCa::new("kv test")
        .expect("ca")
        .write(dir.path(), "worker", &["127.0.0.1"])
        .expect("certs");
    let tls = sluice_runtime::Security::from_args(&sluice_runtime::SecurityArgs {
        tls_cert: Some(files.cert),
        tls_key: Some(files.key),
        tls_ca: Some(files.ca),
        ..Default::default()
    })
    .expect("tls");
    let tls = Arc::new(tls);
    let receiver = receiver_secured(
        &[TransportKind::Tcp, TransportKind::Grpc],
        false,
        Arc::clone(&tls),
    )
    .await;
    assert_eq!(receiver.kinds(), vec![TransportKind::Grpc]);
    assert_eq!(
        Senders::new(&[TransportKind::Tcp, TransportKind::Grpc], &tls).kinds(),
        vec![TransportKind::Grpc]
    );
}

/// With no mesh token (the default on loopback) the tcp KV listener keeps
/// the edge's limits like every other port: one connection past
/// `--max-connections` is closed at accept, a connection that sends nothing
/// is closed at the first-frame deadline, one idle after its transfer at
/// the idle deadline, and a sender whose kept connection was closed that
/// way sends its next transfer on a new one.
#[tokio::test]
async fn tcp_without_a_token_obeys_the_connection_limits() {
    use tokio::io::AsyncReadExt;
    let limits = ConnectionLimits {
        max_connections: 2,
        header_read_timeout: std::time::Duration::from_secs(3),
        idle_timeout: std::time::Duration::from_secs(1),
    };
    let security = Arc::new(sluice_runtime::Security::open().with_limits(limits));
    let e = engine(64);
    let receiver = receiver_secured(&[TransportKind::Tcp], false, security).await;
    let (_slot, ids, exp, regions) = expected(&e, &receiver, 2, 3, "first").await;
    let r = region(&regions, TransportKind::Tcp);
    let block_bytes = e.kv_layout().block_bytes();
    let closed_within = |mut s: tokio::net::TcpStream, within: std::time::Duration| async move {
        let mut sink = Vec::new();
        tokio::time::timeout(within, s.read_to_end(&mut sink))
            .await
            .is_ok()
    };

    // Two silent connections hold both slots; a third is closed at once.
    let silent: Vec<_> =
        futures::future::join_all((0..2).map(|_| tokio::net::TcpStream::connect(&r.address)))
            .await
            .into_iter()
            .collect::<Result<_, _>>()
            .expect("connect");
    // The listener has taken both (each held a slot) once a third is refused.
    let third = tokio::net::TcpStream::connect(&r.address)
        .await
        .expect("connect");
    // (Well before the silent ones' first-frame deadline.)
    assert!(
        closed_within(third, std::time::Duration::from_millis(2500)).await,
        "a connection past --max-connections stayed open"
    );
    // The silent ones go at the first-frame deadline, which frees the slots.
    for s in silent {
        assert!(
            closed_within(s, std::time::Duration::from_secs(10)).await,
            "a silent connection outlived the first-frame deadline"
        );
    }

    // The sender keeps its connection after a transfer.
    let sender = TcpSender::default();
    let n = sender
        .write(&r, "first", blocks_for(&ids, block_bytes, 5))
        .await
        .expect("sent");
    assert_eq!(
        (n, exp.finish(TransportKind::Tcp).await.expect("finished")),
        (2, 2)
    );
    // A connection idle after its transfer is closed at the idle deadline
    // (this one's started after the sender's kept one's, so that one is
    // closed too by then).
    let (_slot2, ids2, exp2, _) = expected(&e, &receiver, 2, 3, "second").await;
    let mut raw = tokio::net::TcpStream::connect(&r.address)
        .await
        .expect("connect");
    let blocks = blocks_for(&ids2, block_bytes, 6);
    let frames: Vec<tcp::Frame<'_>> = blocks
        .iter()
        .map(|b| tcp::Frame {
            id: b.id,
            checksum: b.checksum,
            parts: vec![&b.data],
        })
        .collect();
    let sent = tcp::send_on(&mut raw, "second", &frames).await;
    assert!(matches!(sent, Ok(2)), "the raw transfer was not acked");
    assert_eq!(exp2.finish(TransportKind::Tcp).await.expect("finished"), 2);
    assert!(
        closed_within(raw, std::time::Duration::from_secs(10)).await,
        "an idle connection outlived the idle deadline"
    );
    // The sender's next transfer goes on a new connection.
    let (_slot3, ids3, exp3, regions3) = expected(&e, &receiver, 2, 3, "third").await;
    let n = sender
        .write(
            &region(&regions3, TransportKind::Tcp),
            "third",
            blocks_for(&ids3, block_bytes, 7),
        )
        .await
        .expect("sent on a new connection");
    assert_eq!(
        (n, exp3.finish(TransportKind::Tcp).await.expect("finished")),
        (2, 2)
    );
}
