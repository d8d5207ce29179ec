//! A cached prefix fetched from a peer against computing it, on the real
//! CPU engine (the built-in model): two decode workers of one mesh (one
//! process, `shm` between them, as two workers of one host), a 2,000-token
//! prompt computed on the first, then sent to the second, which either
//! computes it too or fetches the 1,984 tokens of its full blocks from the
//! first and computes the last 16. Time to the first token each way, the
//! median of a few prompts, and the tokens compared (they must agree).
//!
//! ```text
//! cargo run --release -p sluice-tests --example prefix_fetch -- [PROMPTS]
//! ```

use std::time::Duration;

use sluice_kv_transfer::TransportKind;
use sluice_proto::common::v1::PrefixSource;
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
    let mut opts = MeshOptions {
        decode_workers: 2,
        ..Default::default()
    };
    opts.worker.kv_transports = vec![TransportKind::Shm];
    let mesh = Mesh::start(opts).await?;
    let mut list = mesh.discovery.list("decode").await?;
    anyhow::ensure!(list.len() == 2, "two workers");
    let (b, a) = (list.remove(1), list.remove(0));
    let (mut computed, mut fetched) = (Vec::new(), Vec::new());
    for seed in 0..prompts {
        let p = prompt(seed);
        // Computed on `a` (its cache now holds the prompt).
        let on_a = worker_generate(&a.endpoint, &p, 8, None).await?;
        // Fetched by `b` from `a`.
        let source = PrefixSource {
            worker_id: a.id.clone(),
            dp_rank: 0,
            blocks: PROMPT_TOKENS / 16,
        };
        let on_b = worker_generate(&b.endpoint, &p, 8, Some(source)).await?;
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
        "median time to first token, {PROMPT_TOKENS}-token prompt: computed {:.1} ms, fetched over shm {:.1} ms: {:.1}x",
        c.as_secs_f64() * 1e3,
        f.as_secs_f64() * 1e3,
        c.as_secs_f64() / f.as_secs_f64().max(1e-9)
    );
    mesh.stop().await
}
