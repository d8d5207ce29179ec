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

use std::time::{Duration, Instant};

use sluice_kv_transfer::TransportKind;
use sluice_proto::common::v1::{PrefixSource, SamplingParams};
use sluice_proto::worker::v1 as wpb;
use sluice_tests::mesh::{Mesh, MeshOptions};

const PROMPT_TOKENS: u32 = 2_000;

fn prompt(seed: u32) -> Vec<u32> {
    (0..PROMPT_TOKENS)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 900 + 5)
        .collect()
}

/// Time to the first token and the tokens of a greedy 8-token generation.
async fn generate(
    endpoint: &str,
    prompt: &[u32],
    source: Option<PrefixSource>,
) -> anyhow::Result<(Duration, Vec<u32>, u32)> {
    let mut client =
        wpb::worker_client::WorkerClient::connect(format!("http://{endpoint}")).await?;
    let started = Instant::now();
    let mut stream = client
        .generate(wpb::GenerateRequest {
            request_id: "bench".into(),
            model: "sluice-tiny".into(),
            prompt_token_ids: prompt.to_vec(),
            sampling: Some(SamplingParams {
                max_tokens: 8,
                ignore_eos: true,
                temperature: Some(0.0),
                ..Default::default()
            }),
            prefix_source: source,
            ..Default::default()
        })
        .await?
        .into_inner();
    let (mut ttft, mut tokens, mut fetched) = (None, Vec::new(), 0);
    while let Some(m) = stream.message().await? {
        if ttft.is_none() && !m.token_ids.is_empty() {
            ttft = Some(started.elapsed());
        }
        tokens.extend(&m.token_ids);
        fetched = fetched.max(m.fetched_tokens);
    }
    Ok((ttft.unwrap_or_default(), tokens, fetched))
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
        let (on_a, want, _) = generate(&a.endpoint, &p, None).await?;
        // Fetched by `b` from `a`.
        let source = PrefixSource {
            worker_id: a.id.clone(),
            dp_rank: 0,
            blocks: PROMPT_TOKENS / 16,
        };
        let (on_b, got, n) = generate(&b.endpoint, &p, Some(source)).await?;
        anyhow::ensure!(got == want, "prompt {seed}: fetched tokens differ");
        anyhow::ensure!(n > 0, "prompt {seed}: nothing fetched");
        println!(
            "prompt {seed}: computed {:.1} ms, fetched {n} tokens {:.1} ms",
            on_a.as_secs_f64() * 1e3,
            on_b.as_secs_f64() * 1e3
        );
        computed.push(on_a);
        fetched.push(on_b);
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
