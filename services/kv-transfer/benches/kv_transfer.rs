//! KV transfer bandwidth per transport, for 1, 16 and 256 blocks, beside
//! two baselines measured in the same run: `memcpy` of the same bytes into
//! one buffer, and raw loopback TCP (the same bytes through one connection,
//! one-byte reply). Every transport run is the whole path a remote prefill
//! takes on the decode side's behalf, from the sender's blocks (fresh
//! buffers, as `read_blocks` gives them; `memcpy` copies from fresh buffers
//! too, `memcpy_hot` from the same ones every time): the checksums the
//! region asks for, the transport, the receiver's checks, and the blocks in
//! a real engine's KV memory (mocker backend with a shared arena, as a
//! decode worker offering `shm` has). `engine` is the receiver's
//! verify-and-copy alone. Blocks have the built-in model's geometry (4
//! layers, 4 KV heads, head_dim 64, 16 tokens, f32: 128 KiB). Prints a
//! table at the end; goals: shm ≥ 80% of memcpy, tcp ≥ 70% of raw loopback.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use parking_lot::Mutex;
use sluice_engine::backend::{Backend, KvBacking};
use sluice_engine::{
    EngineConfig, EngineHandle, MockerBackend, MockerConfig, RemoteSlot, SchedulerConfig,
};
use sluice_kv_transfer::shm::ShmSender;
use sluice_kv_transfer::tcp::{TcpSender, loopback_pair};
use sluice_kv_transfer::{
    Block, Expectation, GrpcSender, KvSender, KvTransferService, Receiver, ReceiverConfig,
    TransportKind, start_receiver,
};
use sluice_proto::kv::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SIZES: [usize; 3] = [1, 16, 256];

/// Time per iteration of every (series, blocks): one figure per criterion
/// call (warm-up included); the table reports their median, so a call that
/// a neighbour on this shared machine stalled does not move a row.
#[derive(Default)]
struct Results(Mutex<BTreeMap<(String, usize), Vec<f64>>>);

impl Results {
    fn add(&self, series: &str, n: usize, d: Duration, iters: u64) {
        let per = d.as_secs_f64() / iters.max(1) as f64;
        self.0
            .lock()
            .entry((series.to_string(), n))
            .or_default()
            .push(per);
    }

    fn gbps(&self, series: &str, n: usize, bytes: usize) -> Option<f64> {
        let m = self.0.lock();
        let mut per = m.get(&(series.to_string(), n))?.clone();
        per.sort_by(f64::total_cmp);
        let median = *per.get(per.len() / 2)?;
        Some(bytes as f64 / median / 1e9)
    }
}

/// A prefill worker's engine: KV memory of its own (private).
fn source_engine() -> EngineHandle {
    engine_in(&KvBacking::Private)
}

fn engine() -> EngineHandle {
    // As a decode worker offering shm: KV memory in a shared file.
    engine_in(&KvBacking::Shared)
}

fn engine_in(backing: &KvBacking) -> EngineHandle {
    let mut backend = MockerBackend::new(MockerConfig {
        num_layers: 4,
        num_kv_heads: 4,
        head_dim: 64,
        block_size: 16,
        num_blocks: 1024,
        ..MockerConfig::default()
    })
    .expect("mocker config");
    backend.set_kv_backing(backing).expect("KV memory");
    EngineHandle::spawn(
        Box::new(backend),
        EngineConfig {
            num_blocks: Some(1024),
            scheduler: SchedulerConfig {
                max_model_len: 1 << 14,
                max_num_batched_tokens: 1 << 14,
                ..SchedulerConfig::default()
            },
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

fn payload(n: usize, block_bytes: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|b| {
            (0..block_bytes)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8 ^ b as u8)
                .collect()
        })
        .collect()
}

/// A decode side with every transport, its gRPC endpoint served.
struct DecodeSide {
    engine: EngineHandle,
    receiver: Arc<Receiver>,
    /// The same engine's `shm` with `--kv-shm-checksums`.
    checking: Arc<Receiver>,
}

async fn decode_side() -> DecodeSide {
    let engine = engine();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let bound = listener.local_addr().expect("addr");
    let shutdown = sluice_runtime::Shutdown::new();
    let receiver = start_receiver(
        &ReceiverConfig {
            transports: vec![TransportKind::Shm, TransportKind::Tcp, TransportKind::Grpc],
            endpoint: bound.to_string(),
            tcp_listen: None,
            shm_checksums: false,
            security: Default::default(),
        },
        bound,
        shutdown.clone(),
        &tokio_util::task::TaskTracker::new(),
    )
    .await
    .expect("receiver");
    let checking = start_receiver(
        &ReceiverConfig {
            transports: vec![TransportKind::Shm],
            endpoint: bound.to_string(),
            tcp_listen: None,
            shm_checksums: true,
            security: Default::default(),
        },
        bound,
        shutdown.clone(),
        &tokio_util::task::TaskTracker::new(),
    )
    .await
    .expect("checking receiver");
    let server = sluice_runtime::grpc::GrpcServer::new()
        .expect("grpc server")
        .add_service(
            pb::kv_transfer_server::KvTransferServer::new(KvTransferService {
                receiver: Arc::clone(&receiver),
            })
            .max_decoding_message_size(256 << 20),
        );
    tokio::spawn(server.serve(listener, shutdown));
    DecodeSide {
        engine,
        receiver,
        checking,
    }
}

impl Transfer {
    /// `data` as this transfer's blocks, with checksums when `checked`.
    fn blocks(&self, data: Vec<Vec<u8>>, checked: bool) -> Vec<Block> {
        self.ids
            .iter()
            .zip(data)
            .map(|(&id, d)| Block::for_region(id, d, checked))
            .collect()
    }

    /// The region `kind` offers for this transfer.
    fn region(&self, kind: TransportKind) -> pb::Region {
        self.regions
            .iter()
            .find(|r| r.transport == kind.to_pb() as i32)
            .cloned()
            .expect("region offered")
    }
}

/// One registered transfer of `n` blocks, reused for every iteration.
struct Transfer {
    _slot: RemoteSlot,
    exp: Expectation,
    id: String,
    ids: Vec<u32>,
    regions: Vec<pb::Region>,
}

async fn transfer(side: &DecodeSide, n: usize, salt: u32) -> Transfer {
    transfer_on(side, &side.receiver, n, salt).await
}

fn request(n: usize, salt: u32) -> sluice_engine::Request {
    sluice_engine::Request {
        request_id: format!("bench-{salt}"),
        prompt: (0..n as u32 * 16)
            .map(|i| (i * 7 + salt * 7919) % 30_000 + 1)
            .collect(),
        sampling: sluice_engine::SamplingParams::default(),
        priority: 0,
        constraint: None,
        first_token_by: None,
        tpot_target: None,
    }
}

async fn transfer_on(side: &DecodeSide, receiver: &Arc<Receiver>, n: usize, salt: u32) -> Transfer {
    let slot = side
        .engine
        .reserve_remote(request(n, salt))
        .await
        .expect("slot");
    let ids = slot.block_ids()[slot.skip_blocks()..].to_vec();
    assert_eq!(ids.len(), n, "fresh prompt, nothing cached");
    let id = format!("bench-{salt}");
    let (exp, regions) = receiver
        .expect(&id, side.engine.clone(), slot.id(), ids.clone(), true)
        .expect("registered");
    Transfer {
        _slot: slot,
        exp,
        id,
        ids,
        regions,
    }
}

/// What one size's benches share: the runtime, both engines, the payload
/// and where every figure goes.
struct Size<'a> {
    rt: &'a tokio::runtime::Runtime,
    side: &'a DecodeSide,
    source: &'a EngineHandle,
    results: &'a Results,
    /// Blocks per transfer.
    n: usize,
    block_bytes: usize,
    data: Vec<Vec<u8>>,
}

type Group<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;

impl Size<'_> {
    fn bytes(&self) -> usize {
        self.n * self.block_bytes
    }

    /// The memcpy baselines: from fresh copies of the blocks, as every
    /// transport gets them (the prefill worker's `read_blocks` makes new
    /// buffers), and from the same long-lived buffers every time
    /// (`memcpy_hot`).
    fn memcpy(&self, g: &mut Group<'_>) {
        let (n, block_bytes, bytes) = (self.n, self.block_bytes, self.bytes());
        let (data, results) = (&self.data, self.results);
        // Half a page between source and destination offsets: a destination
        // a few bytes ahead of its source within a page (what two fresh
        // allocations give) makes `rep movsb` ten times slower, which
        // would flatter everything measured against it.
        let mut buf = vec![0u8; bytes + 8192];
        let skew = (data[0].as_ptr() as usize + 2048).wrapping_sub(buf.as_ptr() as usize) % 4096;
        let dst = &mut buf[skew..skew + bytes];
        g.bench_function("memcpy", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let copies = data.clone();
                    let t = Instant::now();
                    for (i, d) in copies.iter().enumerate() {
                        dst[i * block_bytes..(i + 1) * block_bytes].copy_from_slice(d);
                    }
                    std::hint::black_box(&mut *dst);
                    total += t.elapsed();
                }
                results.add("memcpy", n, total, iters);
                total
            })
        });
        g.bench_function("memcpy_hot", |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    for (i, d) in data.iter().enumerate() {
                        dst[i * block_bytes..(i + 1) * block_bytes].copy_from_slice(d);
                    }
                    std::hint::black_box(&mut *dst);
                }
                let e = t.elapsed();
                results.add("memcpy_hot", n, e, iters);
                e
            })
        });
    }

    /// The raw loopback baseline: the same bytes through one connection,
    /// a one-byte reply.
    fn tcp_raw(&self, g: &mut Group<'_>) {
        let (rt, n, bytes, data) = (self.rt, self.n, self.bytes(), &self.data);
        let (mut tx, mut rx) = rt.block_on(loopback_pair()).expect("loopback pair");
        g.bench_function("tcp_raw", |b| {
            b.iter_custom(|iters| {
                let e = rt.block_on(async {
                    let mut sink = vec![0u8; bytes];
                    let t = Instant::now();
                    for _ in 0..iters {
                        let read = async {
                            rx.read_exact(&mut sink).await.expect("read");
                            rx.write_all(&[1]).await.expect("reply");
                        };
                        let write = async {
                            for d in data {
                                tx.write_all(d).await.expect("write");
                            }
                            let mut one = [0u8; 1];
                            tx.read_exact(&mut one).await.expect("reply");
                        };
                        tokio::join!(read, write);
                    }
                    t.elapsed()
                });
                self.results.add("tcp_raw", n, e, iters);
                e
            })
        });
    }

    /// The receiver's verify-and-copy into the KV memory alone.
    fn engine(&self, g: &mut Group<'_>, salt: u32) {
        let (rt, side, data) = (self.rt, self.side, &self.data);
        let t = rt.block_on(transfer(side, self.n, salt));
        g.bench_function("engine", |b| {
            b.iter_custom(|iters| {
                let e = rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let copies = data.clone();
                        let start = Instant::now();
                        let blocks = t.blocks(copies, true);
                        side.receiver.write(&t.id, blocks).await.expect("written");
                        total += start.elapsed();
                    }
                    total
                });
                self.results.add("engine", self.n, e, iters);
                e
            })
        });
    }

    /// One transport end to end, from the sender's blocks to a completed
    /// transfer in the engine's KV memory.
    fn sender(
        &self,
        g: &mut Group<'_>,
        (series, kind, sender): (&str, TransportKind, Box<dyn KvSender>),
        salt: u32,
    ) {
        let (rt, side, n, data) = (self.rt, self.side, self.n, &self.data);
        let receiver = if series == "shm_xxh3" {
            &side.checking
        } else {
            &side.receiver
        };
        let t = rt.block_on(transfer_on(side, receiver, n, salt));
        let region = t.region(kind);
        let checked = sender.needs_checksums(&region);
        g.bench_function(BenchmarkId::new(series, n), |b| {
            b.iter_custom(|iters| {
                let e = rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let copies = data.clone();
                        let start = Instant::now();
                        // What the prefill worker does with its blocks.
                        let blocks = t.blocks(copies, checked);
                        let sent = sender.write(&region, &t.id, blocks).await.expect("written");
                        let done = t.exp.finish(kind).await.expect("finished");
                        total += start.elapsed();
                        assert_eq!(sent as usize, n);
                        assert!(done >= n);
                    }
                    total
                });
                self.results.add(series, n, e, iters);
                e
            })
        });
    }

    /// The prefill worker's real path: straight from its engine's KV
    /// memory into the destination (no buffers in between).
    fn arena_senders(&self, g: &mut Group<'_>, salt: u32) {
        let (rt, source, n) = (self.rt, self.source, self.n);
        let t = rt.block_on(transfer(self.side, n, salt));
        let (src, pairs) = rt.block_on(async {
            let held = source
                .reserve_remote(request(n, salt))
                .await
                .expect("source slot");
            let src_ids = held.block_ids().to_vec();
            source
                .write_blocks(
                    held.id(),
                    src_ids.iter().copied().zip(self.data.clone()).collect(),
                )
                .await
                .expect("source blocks");
            let pairs: Vec<(u32, u32)> = src_ids.into_iter().zip(t.ids.iter().copied()).collect();
            (held, pairs)
        });
        let arena = source.kv_arena().expect("source KV memory").clone();
        let from_arena: [(&str, TransportKind, Box<dyn KvSender>); 2] = [
            (
                "shm_arena",
                TransportKind::Shm,
                Box::new(ShmSender::default()),
            ),
            (
                "tcp_arena",
                TransportKind::Tcp,
                Box::new(TcpSender::default()),
            ),
        ];
        for (series, kind, sender) in from_arena {
            let region = t.region(kind);
            g.bench_function(series, |b| {
                b.iter_custom(|iters| {
                    let e = rt.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            let sent = sender
                                .write_from(&region, &t.id, &arena, &pairs)
                                .await
                                .expect("sends from KV memory")
                                .expect("written");
                            let done = t.exp.finish(kind).await.expect("finished");
                            assert_eq!((sent as usize, done), (n, n));
                        }
                        start.elapsed()
                    });
                    self.results.add(series, n, e, iters);
                    e
                })
            });
        }
        drop(src);
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    let results = Results::default();
    let side = rt.block_on(decode_side());
    let source = source_engine();
    let block_bytes = side.engine.kv_layout().block_bytes();
    let mut salt = 0u32;
    for n in SIZES {
        let size = Size {
            rt: &rt,
            side: &side,
            source: &source,
            results: &results,
            n,
            block_bytes,
            data: payload(n, block_bytes),
        };
        let mut g = c.benchmark_group(format!("kv_transfer/{n}_blocks"));
        g.throughput(Throughput::Bytes(size.bytes() as u64));
        size.memcpy(&mut g);
        size.tcp_raw(&mut g);
        salt += 1;
        size.engine(&mut g, salt);
        let senders: [(&str, TransportKind, Box<dyn KvSender>); 4] = [
            ("shm", TransportKind::Shm, Box::new(ShmSender::default())),
            (
                "shm_xxh3",
                TransportKind::Shm,
                Box::new(ShmSender::default()),
            ),
            ("tcp", TransportKind::Tcp, Box::new(TcpSender::default())),
            ("grpc", TransportKind::Grpc, Box::new(GrpcSender::default())),
        ];
        for sender in senders {
            salt += 1;
            size.sender(&mut g, sender, salt);
        }
        salt += 1;
        size.arena_senders(&mut g, salt);
        g.finish();
    }
    print_table(&results, block_bytes);
    c.final_summary();
}

/// The GB/s table, each transport beside its baseline.
fn print_table(results: &Results, block_bytes: usize) {
    println!();
    println!(
        "KV transfer, {} KiB blocks, GB/s. memcpy: the same bytes from fresh buffers (as every \
         transport gets them) into one buffer; memcpy_hot: from the same buffers every time; \
         engine: the receiver's verify-and-copy into the KV memory alone; shm, tcp, grpc: end \
         to end, from the sender's blocks to a completed transfer in the engine's KV memory; \
         shm_xxh3: shm with --kv-shm-checksums; shm_arena: shm the way a prefill worker \
         sends, from its engine's KV memory (long-lived, compared with memcpy_hot); tcp_arena: tcp \
         the same way, the socket reading the block parts where they lie",
        block_bytes / 1024
    );
    let header = [
        "blocks",
        "memcpy",
        "mcp_hot",
        "tcp_raw",
        "engine",
        "shm",
        "%mcp",
        "%hot",
        "shm_xxh3",
        "%mcp",
        "shm_arena",
        "%hot",
        "tcp_arena",
        "%raw",
        "tcp",
        "%raw",
        "grpc",
    ];
    println!("{}", header.map(|h| format!("{h:>9}")).join(" "));
    for n in SIZES {
        let bytes = n * block_bytes;
        let g = |s: &str| results.gbps(s, n, bytes).unwrap_or(f64::NAN);
        let (memcpy, hot, raw) = (g("memcpy"), g("memcpy_hot"), g("tcp_raw"));
        let pct = |x: f64, of: f64| format!("{:>8.0}%", 100.0 * x / of);
        let row = [
            format!("{n:>9}"),
            format!("{memcpy:>9.2}"),
            format!("{hot:>9.2}"),
            format!("{raw:>9.2}"),
            format!("{:>9.2}", g("engine")),
            format!("{:>9.2}", g("shm")),
            pct(g("shm"), memcpy),
            pct(g("shm"), hot),
            format!("{:>9.2}", g("shm_xxh3")),
            pct(g("shm_xxh3"), memcpy),
            format!("{:>9.2}", g("shm_arena")),
            pct(g("shm_arena"), hot),
            format!("{:>9.2}", g("tcp_arena")),
            pct(g("tcp_arena"), raw),
            format!("{:>9.2}", g("tcp")),
            pct(g("tcp"), raw),
            format!("{:>9.2}", g("grpc")),
        ];
        println!("{}", row.join(" "));
    }
}
