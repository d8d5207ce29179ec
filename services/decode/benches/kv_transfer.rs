//! KV transfer bandwidth per transport, for 1, 16 and 256 blocks, beside
//! two baselines measured in the same run: `memcpy` of the same bytes into
//! one buffer, and raw loopback TCP (the same bytes through one connection,
//! one-byte reply). Every transport run is the whole path a remote prefill
//! takes on the decode side's behalf: sender checksums, the transport, the
//! receiver's checks and the write into a real engine's reserved slot
//! (mocker backend, so the engine's own copy is included; `engine` is that
//! last step alone, the floor every transport shares; `shm_write` is the
//! one-sided write alone, without collection, and `shm_copy` the same with
//! the sender's checksums computed beforehand). Blocks have the
//! built-in model's geometry (4 layers, 4 KV heads, head_dim 64, 16 tokens,
//! f32: 128 KiB). Prints a table at the end; goals: shm ≥ 80% of memcpy,
//! tcp ≥ 70% of raw loopback.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use parking_lot::Mutex;
use sluice_decode::transfer::shm::ShmSender;
use sluice_decode::transfer::tcp::{TcpSender, loopback_pair};
use sluice_decode::transfer::{
    Block, Expectation, GrpcSender, KvSender, KvTransferService, Receiver, ReceiverConfig,
    TransportKind, start_receiver,
};
use sluice_engine::backend::{Backend, KvBacking, arena};
use sluice_engine::{
    EngineConfig, EngineHandle, MockerBackend, MockerConfig, RemoteSlot, SchedulerConfig,
};
use sluice_proto::kv::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SIZES: [usize; 3] = [1, 16, 256];

/// Mean time per iteration of every (series, blocks), over all of
/// criterion's calls (warm-up included).
#[derive(Default)]
struct Results(Mutex<BTreeMap<(String, usize), (Duration, u64)>>);

impl Results {
    fn add(&self, series: &str, n: usize, d: Duration, iters: u64) {
        let mut m = self.0.lock();
        let e = m.entry((series.to_string(), n)).or_default();
        e.0 += d;
        e.1 += iters;
    }

    fn gbps(&self, series: &str, n: usize, bytes: usize) -> Option<f64> {
        let m = self.0.lock();
        let (d, iters) = m.get(&(series.to_string(), n))?;
        let per = d.as_secs_f64() / (*iters).max(1) as f64;
        Some(bytes as f64 / per / 1e9)
    }
}

fn engine() -> EngineHandle {
    let mut backend = MockerBackend::new(MockerConfig {
        num_layers: 4,
        num_kv_heads: 4,
        head_dim: 64,
        block_size: 16,
        num_blocks: 1024,
        ..MockerConfig::default()
    })
    .expect("mocker config");
    // As a decode worker offering shm: KV memory in a shared file.
    backend
        .set_kv_backing(&KvBacking::Shared(arena::shm_dir()))
        .expect("shared KV memory");
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
        },
        bound,
        shutdown.clone(),
    )
    .await
    .expect("receiver");
    let server = sluice_runtime::grpc::GrpcServer::new()
        .expect("grpc server")
        .add_service(
            pb::kv_transfer_server::KvTransferServer::new(KvTransferService {
                receiver: Arc::clone(&receiver),
            })
            .max_decoding_message_size(256 << 20),
        );
    tokio::spawn(server.serve(listener, shutdown));
    DecodeSide { engine, receiver }
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
    let req = sluice_engine::Request {
        request_id: format!("bench-{salt}"),
        prompt: (0..n as u32 * 16)
            .map(|i| (i * 7 + salt * 7919) % 30_000 + 1)
            .collect(),
        sampling: sluice_engine::SamplingParams::default(),
        priority: 0,
    };
    let slot = side.engine.reserve_remote(req).await.expect("slot");
    let ids = slot.block_ids()[slot.skip_blocks()..].to_vec();
    assert_eq!(ids.len(), n, "fresh prompt, nothing cached");
    let id = format!("bench-{salt}");
    let (exp, regions) = side
        .receiver
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
    let block_bytes = side.engine.kv_layout().block_bytes();
    let mut salt = 0u32;
    for n in SIZES {
        let bytes = n * block_bytes;
        let data = payload(n, block_bytes);
        let mut g = c.benchmark_group(format!("kv_transfer/{n}_blocks"));
        g.throughput(Throughput::Bytes(bytes as u64));

        // Half a page between source and destination offsets: a destination
        // a few bytes ahead of its source within a page (what two fresh
        // allocations give) makes `rep movsb` ten times slower, which
        // would flatter everything measured against it.
        let mut buf = vec![0u8; bytes + 8192];
        let skew = (data[0].as_ptr() as usize + 2048).wrapping_sub(buf.as_ptr() as usize) % 4096;
        let dst = &mut buf[skew..skew + bytes];
        g.bench_function("memcpy", |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    for (i, d) in data.iter().enumerate() {
                        dst[i * block_bytes..(i + 1) * block_bytes].copy_from_slice(d);
                    }
                    std::hint::black_box(&mut *dst);
                }
                let e = t.elapsed();
                results.add("memcpy", n, e, iters);
                e
            })
        });

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
                            for d in &data {
                                tx.write_all(d).await.expect("write");
                            }
                            let mut one = [0u8; 1];
                            tx.read_exact(&mut one).await.expect("reply");
                        };
                        tokio::join!(read, write);
                    }
                    t.elapsed()
                });
                results.add("tcp_raw", n, e, iters);
                e
            })
        });

        salt += 1;
        let t = rt.block_on(transfer(&side, n, salt));
        g.bench_function("engine", |b| {
            b.iter_custom(|iters| {
                let e = rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let copies = data.clone();
                        let start = Instant::now();
                        let blocks: Vec<Block> = t
                            .ids
                            .iter()
                            .zip(copies)
                            .map(|(&id, d)| Block::new(id, d))
                            .collect();
                        side.receiver.write(&t.id, blocks).await.expect("written");
                        total += start.elapsed();
                    }
                    total
                });
                results.add("engine", n, e, iters);
                e
            })
        });

        let senders: [(TransportKind, Box<dyn KvSender>); 3] = [
            (TransportKind::Shm, Box::new(ShmSender::default())),
            (TransportKind::Tcp, Box::new(TcpSender::default())),
            (TransportKind::Grpc, Box::new(GrpcSender::default())),
        ];
        for (kind, sender) in senders {
            salt += 1;
            let t = rt.block_on(transfer(&side, n, salt));
            let region = t
                .regions
                .iter()
                .find(|r| r.transport == kind.to_pb() as i32)
                .cloned()
                .expect("region offered");
            g.bench_function(BenchmarkId::new(kind.as_str(), n), |b| {
                b.iter_custom(|iters| {
                    let e = rt.block_on(async {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let copies = data.clone();
                            let start = Instant::now();
                            let blocks: Vec<Block> = t
                                .ids
                                .iter()
                                .zip(copies)
                                .map(|(&id, d)| Block::new(id, d))
                                .collect();
                            let sent = sender.write(&region, &t.id, blocks).await.expect("written");
                            let done = t.exp.finish(kind.as_str()).await.expect("finished");
                            total += start.elapsed();
                            assert_eq!(sent as usize, n);
                            assert!(done >= n);
                        }
                        total
                    });
                    results.add(kind.as_str(), n, e, iters);
                    e
                })
            });
        }
        // The one-sided write alone (checksums and copies into the pool),
        // without the receiver's collection and engine write.
        salt += 1;
        let t = rt.block_on(transfer(&side, n, salt));
        let region = t
            .regions
            .iter()
            .find(|r| r.transport == TransportKind::Shm.to_pb() as i32)
            .cloned()
            .expect("shm offered");
        let sender = ShmSender::default();
        g.bench_function("shm_write", |b| {
            b.iter_custom(|iters| {
                let e = rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let copies = data.clone();
                        let start = Instant::now();
                        let blocks: Vec<Block> = t
                            .ids
                            .iter()
                            .zip(copies)
                            .map(|(&id, d)| Block::new(id, d))
                            .collect();
                        sender.write(&region, &t.id, blocks).await.expect("written");
                        total += start.elapsed();
                    }
                    total
                });
                results.add("shm_write", n, e, iters);
                e
            })
        });
        // The same with checksums computed beforehand: the copy alone.
        g.bench_function("shm_copy", |b| {
            b.iter_custom(|iters| {
                let e = rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let blocks: Vec<Block> = t
                            .ids
                            .iter()
                            .zip(data.clone())
                            .map(|(&id, d)| Block::new(id, d))
                            .collect();
                        let start = Instant::now();
                        sender.write(&region, &t.id, blocks).await.expect("written");
                        total += start.elapsed();
                    }
                    total
                });
                results.add("shm_copy", n, e, iters);
                e
            })
        });
        g.finish();
    }

    println!();
    println!(
        "KV transfer, {} KiB blocks, GB/s. shm, tcp, grpc: end to end into the engine; \
         engine: the receiver's engine write alone; shm_write: the one-sided write alone \
         (with the sender's checksums); shm_copy: the same, checksums computed beforehand",
        block_bytes / 1024
    );
    let header = [
        "blocks",
        "memcpy",
        "tcp_raw",
        "engine",
        "shm_copy",
        "%mcp",
        "shm_write",
        "%mcp",
        "shm",
        "%mcp",
        "tcp",
        "%raw",
        "grpc",
    ];
    println!("{}", header.map(|h| format!("{h:>9}")).join(" "));
    for n in SIZES {
        let bytes = n * block_bytes;
        let g = |s: &str| results.gbps(s, n, bytes).unwrap_or(f64::NAN);
        let (memcpy, raw) = (g("memcpy"), g("tcp_raw"));
        let pct = |x: f64, of: f64| format!("{:>8.0}%", 100.0 * x / of);
        let row = [
            format!("{n:>9}"),
            format!("{memcpy:>9.2}"),
            format!("{raw:>9.2}"),
            format!("{:>9.2}", g("engine")),
            format!("{:>9.2}", g("shm_copy")),
            pct(g("shm_copy"), memcpy),
            format!("{:>9.2}", g("shm_write")),
            pct(g("shm_write"), memcpy),
            format!("{:>9.2}", g("shm")),
            pct(g("shm"), memcpy),
            format!("{:>9.2}", g("tcp")),
            pct(g("tcp"), raw),
            format!("{:>9.2}", g("grpc")),
        ];
        println!("{}", row.join(" "));
    }
    c.final_summary();
}
