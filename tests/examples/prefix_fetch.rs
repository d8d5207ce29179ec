//! A cached prefix fetched from a peer against computing it, on the real
//! CPU engine (the built-in model): two decode workers of one mesh (one
//! process, `shm` between them, as two workers of one host), a 2,000-token
//! prompt computed on the first, then sent to the second, which either
//! computes it too or fetches the 1,984 tokens of its full blocks from the
//! first and computes the last 16. Time to the first token each way, the
//! median of a few prompts, and the tokens compared (they must agree).
//!
//! With `processes`, the two workers are `sluice decode` processes of the
//! release binary (`SLUICE_BIN`, default `target/release/sluice`) on a real
//! etcd, as a user runs them on one host; otherwise they share this process.
//!
//! ```text
//! cargo run --release -p sluice-tests --example prefix_fetch -- [PROMPTS] [processes]
//! ```

use std::time::Duration;

use sluice_kv_transfer::TransportKind;
use sluice_proto::common::v1::PrefixSource;
use sluice_tests::etcd::EtcdServer;
use sluice_tests::mesh::{Mesh, MeshOptions, worker_generate};

const PROMPT_TOKENS: u32 = 2_000;

fn prompt(seed: u32) -> Vec<u32> {
    (0..PROMPT_TOKENS)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 900 + 5)
        .collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let prompts: u32 = std::env::args().nth(1).map_or(Ok(5), |a| a.parse())?;
    let processes = std::env::args().nth(2).as_deref() == Some("processes");
    // Kept alive until the end: the mesh, or etcd, the processes and their
    // directory.
    let mut keep: (
        Option<Mesh>,
        Vec<sluice_tests::process::Proc>,
        Option<EtcdServer>,
    ) = (None, Vec::new(), None);
    let dir = tempfile::tempdir()?;
    let (a_at, b_at) = if processes {
        let bin = std::env::var("SLUICE_BIN").unwrap_or_else(|_| "target/release/sluice".into());
        let model = sluice_tests::process::write_model(&bin, dir.path())?;
        let etcd = EtcdServer::start().await?;
        let url = etcd.url();
        let mut at = Vec::new();
        for i in 0..2 {
            let args = [
                "decode",
                "--etcd",
                &url,
                "--listen",
                "127.0.0.1:0",
                "--model",
                &model,
                "--kv-transports",
                "shm",
            ];
            let log = dir.path().join(format!("decode{i}.log"));
            let (p, addr) = sluice_tests::process::Proc::spawn_listening(&bin, args, &log).await?;
            keep.1.push(p);
            at.push(addr);
        }
        keep.2 = Some(etcd);
        let b = at.remove(1);
        (at.remove(0), b)
    } else {
        let mut opts = MeshOptions {
            decode_workers: 2,
            ..Default::default()
        };
        opts.worker.kv_transports = vec![TransportKind::Shm];
        let mesh = Mesh::start(opts).await?;
        let mut list = mesh.discovery.list("decode").await?;
        anyhow::ensure!(list.len() == 2, "two workers");
        let (b, a) = (list.remove(1), list.remove(0));
        keep.0 = Some(mesh);
        (a.endpoint, b.endpoint)
    };
    let (mut computed, mut fetched) = (Vec::new(), Vec::new());
    for seed in 0..prompts {
        let p = prompt(seed);
        // Computed on `a` (its cache now holds the prompt).
        let on_a = worker_generate(&a_at, &p, 8, None).await?;
        // Fetched by `b` from `a`.
        let source = PrefixSource {
            worker_id: on_a.worker_id.clone(),
            dp_rank: 0,
            blocks: PROMPT_TOKENS / 16,
        };
        // `b` dials only peers discovery lists: wait until it knows `a`.
        let on_b = fetched_from(&b_at, &p, source).await?;
        anyhow::ensure!(
            on_b.tokens == on_a.tokens,
            "prompt {seed}: fetched tokens differ"
        );
        let n = on_b.fetched_tokens;
        anyhow::ensure!(n > 0, "prompt {seed}: nothing fetched");
        println!(
            "prompt {seed}: computed {:.1} ms, fetched {n} tokens {:.1} ms",
            on_a.ttft.as_secs_f64() * 1e3,
            on_b.ttft.as_secs_f64() * 1e3
        );
        computed.push(on_a.ttft);
        fetched.push(on_b.ttft);
    }
    let (c, f) = (median(computed), median(fetched));
    println!(
        "median time to first token, {PROMPT_TOKENS}-token prompt ({}): computed {:.1} ms, fetched over shm {:.1} ms: {:.1}x",
        if processes {
            "two sluice decode processes"
        } else {
            "two workers in one process"
        },
        c.as_secs_f64() * 1e3,
        f.as_secs_f64() * 1e3,
        c.as_secs_f64() / f.as_secs_f64().max(1e-9)
    );
    if let Some(mesh) = keep.0.take() {
        mesh.stop().await?;
    }
    Ok(())
}

/// `b`'s run of `p` fetching from `source`, once `b`'s discovery lists the
/// holder (a fetch from a peer it does not know yet is a recompute).
async fn fetched_from(
    b: &str,
    p: &[u32],
    source: PrefixSource,
) -> anyhow::Result<sluice_tests::mesh::WorkerRun> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, metrics) = sluice_tests::http::get(b, "/metrics").await?;
        if sluice_tests::wait::sample(&metrics, "sluice_worker_prefix_peers").unwrap_or(0.0) >= 2.0
        {
            return worker_generate(b, p, 8, Some(source)).await;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "{b} never listed its peer"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
