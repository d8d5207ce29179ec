//! Prefix fetch end to end on the real CPU engine (the built-in model): a
//! worker named a peer that holds the prompt's cached prefix fetches it
//! over each transport and generates what computing the prompt generates;
//! a peer it does not know, one that holds less than it was said to, and
//! the worker itself named as the peer cost a recompute (or a shorter
//! fetch) with the same tokens, and so does a holder that is gone or never
//! answers; blocks are freed on every path. A prefix
//! evicted from KV memory comes back from the second tier (on by default)
//! with the same tokens as computing it. Two router replicas agree on which
//! worker holds a prefix.

use std::time::{Duration, Instant};

use sluice_kv_transfer::TransportKind;
use sluice_proto::common::v1::PrefixSource;
use sluice_tests::mesh::{
    Mesh, MeshOptions, WorkerRun, active_blocks, load_report, worker_generate,
};

/// 150 tokens: 9 full blocks of 16 before the last token.
fn prompt(seed: u32) -> Vec<u32> {
    (0..150u32)
        .map(|i| (i * 37 + seed * 101 + 11) % 900 + 5)
        .collect()
}

const FULL_BLOCKS: u32 = 9;
const BLOCK: u32 = 16;

/// A greedy 16-token generation of `prompt` on the worker at `endpoint`.
async fn generate(
    endpoint: &str,
    prompt: &[u32],
    source: Option<PrefixSource>,
) -> anyhow::Result<WorkerRun> {
    worker_generate(endpoint, prompt, 16, source).await
}

/// The mesh's two workers, (id, endpoint) each.
async fn workers(mesh: &Mesh) -> anyhow::Result<[(String, String); 2]> {
    let mut list = mesh.discovery.list("decode").await?;
    anyhow::ensure!(list.len() == 2, "two workers: {list:?}");
    let b = list.remove(1);
    let a = list.remove(0);
    Ok([(a.id, a.endpoint), (b.id, b.endpoint)])
}

fn source(id: &str, blocks: u32) -> Option<PrefixSource> {
    Some(PrefixSource {
        worker_id: id.to_string(),
        dp_rank: 0,
        blocks,
    })
}

/// Waits until neither worker holds a block for a request.
async fn all_freed(endpoints: &[&str]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    for e in endpoints {
        while active_blocks(e).await? != 0 {
            anyhow::ensure!(Instant::now() < deadline, "{e} still holds blocks");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// The worker's `sluice_worker_prefix_fetch_total` for `outcome`.
async fn fetches(endpoint: &str, outcome: &str) -> anyhow::Result<u64> {
    let (_, metrics) = sluice_tests::http::get(endpoint, "/metrics").await?;
    Ok(metrics
        .lines()
        .filter(|l| {
            l.starts_with("sluice_worker_prefix_fetch_total{")
                && l.contains(&format!("outcome=\"{outcome}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum())
}

fn two_workers(transport: TransportKind) -> MeshOptions {
    let mut o = MeshOptions {
        decode_workers: 2,
        ..Default::default()
    };
    o.worker.kv_transports = vec![transport];
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetched_prefix_over_shm_tcp_and_grpc_generates_what_computing_it_does()
-> anyhow::Result<()> {
    for (i, kind) in [TransportKind::Shm, TransportKind::Tcp, TransportKind::Grpc]
        .into_iter()
        .enumerate()
    {
        let mesh = Mesh::start(two_workers(kind)).await?;
        let [(a, a_at), (_, b_at)] = workers(&mesh).await?;
        let p = prompt(i as u32);
        let computed = generate(&a_at, &p, None).await?;
        assert_eq!(computed.tokens.len(), 16, "{kind}");
        let fetched = generate(&b_at, &p, source(&a, FULL_BLOCKS)).await?;
        assert_eq!(fetched.tokens, computed.tokens, "{kind}: same tokens");
        assert_eq!(
            fetched.fetched_tokens,
            FULL_BLOCKS * BLOCK,
            "{kind}: fetched the prefix"
        );
        assert_eq!(
            fetched.cached_tokens,
            FULL_BLOCKS * BLOCK,
            "{kind}: served from cache"
        );
        assert_eq!(fetches(&b_at, "ok").await?, 1, "{kind}");
        // The pair's rate is in the worker's load report, for the router
        // to price the next fetch from that peer by.
        let rate = load_report(&b_at)
            .await?
            .and_then(|r| r.kv_fetch_bytes_per_sec_by_peer.get(&a).copied());
        assert!(rate.is_some_and(|r| r > 0), "{kind}: {rate:?}");
        // The fetched blocks are the worker's own cache now: the next turn
        // of the prompt hits it without asking anyone.
        let again = generate(&b_at, &p, None).await?;
        assert_eq!(
            (again.tokens, again.cached_tokens),
            (computed.tokens, FULL_BLOCKS * BLOCK)
        );
        all_freed(&[&a_at, &b_at]).await?;
        mesh.stop().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_a_short_or_a_self_named_peer_costs_a_recompute_with_the_same_tokens()
-> anyhow::Result<()> {
    let mesh = Mesh::start(two_workers(TransportKind::Tcp)).await?;
    let [(a, a_at), (_, b_at)] = workers(&mesh).await?;
    // The reference: computed on the other worker, nothing cached.
    let p = prompt(7);
    let reference = generate(&a_at, &p, None).await?;

    // A peer discovery does not list: never dialled.
    let unknown = generate(&b_at, &p, source("decode-nobody", FULL_BLOCKS)).await?;
    assert_eq!(
        (unknown.tokens, unknown.fetched_tokens),
        (reference.tokens.clone(), 0)
    );
    assert_eq!(fetches(&b_at, "unknown_peer").await?, 1);

    // A peer that holds less than it was said to: `a` computed only the
    // first 3 blocks of `q` (the rest of its sequence was its own output).
    let q = prompt(8);
    let _ = generate(&a_at, &q[..3 * BLOCK as usize + 1], None).await?;
    let short = generate(&b_at, &q, source(&a, FULL_BLOCKS)).await?;
    assert_eq!(
        short.fetched_tokens,
        3 * BLOCK,
        "what `a` still held, no more"
    );
    assert_eq!(fetches(&b_at, "partial").await?, 1);
    // The same tokens as where those blocks were computed.
    let computed = generate(&a_at, &q, None).await?;
    assert_eq!(short.tokens, computed.tokens);

    // The worker itself named: nothing to fetch.
    let own = generate(&a_at, &p, source(&a, FULL_BLOCKS)).await?;
    assert_eq!((own.tokens, own.fetched_tokens), (reference.tokens, 0));
    all_freed(&[&a_at, &b_at]).await?;
    mesh.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_prefix_comes_back_from_the_second_tier_with_the_same_tokens()
-> anyhow::Result<()> {
    // 24 blocks of KV memory: a 150-token prompt and its 16 tokens take 11,
    // so three more such prompts evict all of the first; the second tier is
    // on by default (as much again as the KV memory on the CPU engine).
    let mut opts = MeshOptions::default();
    opts.worker.num_gpu_blocks = 24;
    let mesh = Mesh::start(opts).await?;
    let worker = mesh.endpoints("decode").await?.remove(0);
    let p = prompt(20);
    let first = generate(&worker, &p, None).await?;
    assert_eq!(first.cached_tokens, 0);
    for seed in [21, 22, 23] {
        let _ = generate(&worker, &prompt(seed), None).await?;
    }
    let again = generate(&worker, &p, None).await?;
    assert_eq!(
        again.tokens, first.tokens,
        "same tokens from restored blocks"
    );
    assert_eq!(
        again.cached_tokens,
        FULL_BLOCKS * BLOCK,
        "served from the second tier"
    );
    // Without the second tier the same sequence recomputes the prompt.
    mesh.stop().await?;
    let mut off = MeshOptions::default();
    off.worker.num_gpu_blocks = 24;
    off.worker.kv_tier_bytes = Some(0);
    let mesh = Mesh::start(off).await?;
    let worker = mesh.endpoints("decode").await?.remove(0);
    let _ = generate(&worker, &p, None).await?;
    for seed in [21, 22, 23] {
        let _ = generate(&worker, &prompt(seed), None).await?;
    }
    let recomputed = generate(&worker, &p, None).await?;
    assert_eq!(recomputed.tokens, first.tokens);
    assert_eq!(
        recomputed.cached_tokens, 0,
        "evicted and gone without the tier"
    );
    all_freed(&[&worker]).await?;
    mesh.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_is_gone_or_never_answers_costs_a_recompute() -> anyhow::Result<()> {
    use sluice_runtime::discovery::Instance;
    let mesh = Mesh::start(MeshOptions::default()).await?;
    let worker = mesh.endpoints("decode").await?.remove(0);
    let p = prompt(30);
    // Computed with nothing to fetch: the reference.
    let reference = generate(&worker, &p, None).await?;
    // Two holders discovery lists: one whose port refuses connections (it
    // died), one that takes the connection and never answers (it hangs).
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?
        // dropped: nothing listens there any more
    };
    let gone = Instance::new("decode", dead.to_string()).with_model("sluice-tiny");
    let stuck = Instance::new("decode", hung.local_addr()?.to_string()).with_model("sluice-tiny");
    let _gone = mesh.discovery.register(gone.clone(), 30).await?;
    let _stuck = mesh.discovery.register(stuck.clone(), 30).await?;
    // The worker knows them (itself and the two).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, metrics) = sluice_tests::http::get(&worker, "/metrics").await?;
        let known =
            sluice_tests::wait::sample(&metrics, "sluice_worker_prefix_peers").unwrap_or(0.0);
        if known >= 3.0 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the peers never showed up: {known}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A new prompt each time (the worker holds the reference's).
    for (holder, outcome, seed) in [(&gone, "fetch_error", 31), (&stuck, "timeout", 32)] {
        let q = prompt(seed);
        let alone = generate(&worker, &q, source(&holder.id, FULL_BLOCKS)).await?;
        assert_eq!(alone.fetched_tokens, 0, "{outcome}: nothing fetched");
        assert_eq!(fetches(&worker, outcome).await?, 1, "{outcome}");
        // Computed as without a fetch: a second run, served from the cache
        // the first one filled, agrees.
        let cached = generate(&worker, &q, None).await?;
        assert_eq!(cached.cached_tokens, FULL_BLOCKS * BLOCK);
        assert_eq!(
            alone.tokens, cached.tokens,
            "{outcome}: computed as without a fetch"
        );
    }
    assert_eq!(reference.tokens.len(), 16);
    all_freed(&[&worker]).await?;
    drop(hung);
    mesh.stop().await
}

/// What a router's dry-run placement of `prompt` on the decode pool says:
/// the target, the holder it names (if any) and every candidate's cached
/// blocks.
#[derive(Debug, PartialEq)]
struct DryRoute {
    target: String,
    holder: Option<(String, u32)>,
    overlaps: Vec<(String, u32)>,
}

async fn dry_routes(routers: &[String], prompt: &[u32]) -> anyhow::Result<Vec<DryRoute>> {
    use sluice_proto::common::v1::RequestDescription;
    use sluice_proto::router::v1::{Pool, RouteRequest, router_client::RouterClient};
    let description = RequestDescription {
        request_id: "holder-check".into(),
        prompt_tokens: prompt.len() as u32,
        block_hashes: sluice_tokens::block_hash::sequence_block_hashes(prompt, BLOCK as usize),
        block_size: BLOCK,
        ..Default::default()
    };
    let mut out = Vec::new();
    for router in routers {
        let mut client = RouterClient::connect(format!("http://{router}")).await?;
        let r = client
            .route(RouteRequest {
                description: Some(description.clone()),
                pool: Pool::Decode as i32,
                commit: false,
                ..Default::default()
            })
            .await?
            .into_inner();
        let mut overlaps: Vec<(String, u32)> = r
            .candidates
            .iter()
            .map(|c| {
                let id = c
                    .target
                    .as_ref()
                    .map(|t| t.worker_id.clone())
                    .unwrap_or_default();
                (id, c.overlap_blocks)
            })
            .collect();
        overlaps.sort();
        out.push(DryRoute {
            target: r.target.map(|t| t.worker_id).unwrap_or_default(),
            holder: r.prefix_source.map(|s| (s.worker_id, s.blocks)),
            overlaps,
        });
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_router_replicas_agree_on_who_holds_a_prefix() -> anyhow::Result<()> {
    let mut opts = two_workers(TransportKind::Shm);
    opts.routers = 2;
    let mesh = Mesh::start(opts).await?;
    let [(a, a_ep), (b, b_ep)] = workers(&mesh).await?;
    let routers = mesh.endpoints("router").await?;
    assert_eq!(routers.len(), 2);
    // Worker a computes one prompt, worker b another: each prefix is
    // cached on one worker only.
    let (pa, pb) = (prompt(7), prompt(8));
    generate(&a_ep, &pa, None).await?;
    generate(&b_ep, &pb, None).await?;
    // Once both replicas have heard both workers' KV events, each sees
    // every full block of each prompt on its holder and none elsewhere,
    // and both make the same dry-run placement (nothing is counted): on
    // the holder, or on the other worker with the holder named for a
    // fetch of the whole prefix (predicted times within their noise
    // prefer the holder; one-prompt step fits can read far apart).
    for (p, holder) in [(&pa, &a), (&pb, &b)] {
        let mut want: Vec<(String, u32)> = [&a, &b]
            .iter()
            .map(|w| ((*w).clone(), if *w == holder { FULL_BLOCKS } else { 0 }))
            .collect();
        want.sort();
        let names_the_holder = |g: &DryRoute| {
            g.overlaps == want
                && if g.target == *holder {
                    g.holder.is_none()
                } else {
                    g.holder == Some((holder.clone(), FULL_BLOCKS))
                }
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let got = dry_routes(&routers, p).await?;
            if got.iter().all(names_the_holder) && got.windows(2).all(|w| w[0] == w[1]) {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "replicas never agreed that {holder} holds the prefix ({want:?}): {got:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}
