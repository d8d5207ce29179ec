//! A worker's streams over gRPC. KV events: a late subscriber replays from
//! the ring, a too-late one is told to take a snapshot, and snapshot +
//! stream agree. `Generate`: the worker is named on the first and the last
//! message only.

use std::collections::BTreeSet;

use serde_json::json;
use sluice_proto::worker::v1 as wpb;
use sluice_tests::http::post_json;
use sluice_tests::mesh::{Mesh, MeshOptions};

async fn complete(mesh: &Mesh, i: u32) -> anyhow::Result<()> {
    // Distinct 40-token prompts: each stores new blocks.
    let prompt: Vec<u32> = (0..40u32).map(|t| (i * 131 + t * 7) % 1500 + 4).collect();
    let body = json!({"model": "sluice-tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0});
    let (status, resp) = post_json(&mesh.http, "/v1/completions", &body).await?;
    anyhow::ensure!(status == 200, "{resp}");
    Ok(())
}

async fn subscribe(
    endpoint: &str,
    from_seq: u64,
) -> anyhow::Result<tonic::Streaming<wpb::KvEventBatch>> {
    let mut c = wpb::worker_client::WorkerClient::connect(format!("http://{endpoint}")).await?;
    Ok(c.subscribe_kv_events(wpb::SubscribeKvEventsRequest {
        from_seq,
        dp_rank: 0,
    })
    .await?
    .into_inner())
}

/// Applies stored/removed events to a set of hashes.
fn apply(set: &mut BTreeSet<u64>, ev: &wpb::KvEvent) {
    match &ev.kind {
        Some(wpb::kv_event::Kind::Stored(s)) => set.extend(s.block_hashes.iter().copied()),
        Some(wpb::kv_event::Kind::Removed(r)) => r.block_hashes.iter().for_each(|h| {
            set.remove(h);
        }),
        Some(wpb::kv_event::Kind::Cleared(_)) => set.clear(),
        None => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_subscriber_replays_and_too_late_one_resyncs_from_a_snapshot() -> anyhow::Result<()> {
    let mut opts = MeshOptions::default();
    opts.worker.event_ring_capacity = 16;
    opts.worker.num_gpu_blocks = 64; // small: later prompts evict earlier blocks
    let mesh = Mesh::start(opts).await?;
    let worker = mesh.endpoints("decode").await?.remove(0);
    let mut client = wpb::worker_client::WorkerClient::connect(format!("http://{worker}")).await?;

    // A few requests: fewer events than the ring holds.
    for i in 0..2 {
        complete(&mesh, i).await?;
    }
    let snap = client
        .kv_snapshot(wpb::KvSnapshotRequest { dp_rank: 0 })
        .await?
        .into_inner();
    assert!(snap.seq > 0 && snap.seq < 16, "seq {}", snap.seq);
    // A late subscriber replays everything from the first event, gap-free,
    // and the replay rebuilds exactly the snapshot.
    let mut stream = subscribe(&worker, 0).await?;
    let mut set = BTreeSet::new();
    let mut next = 1;
    while next <= snap.seq {
        let batch = stream.message().await?.expect("a batch");
        assert!(!batch.snapshot_required);
        for ev in &batch.events {
            assert_eq!(ev.seq, next, "gap-free from 1");
            next += 1;
            apply(&mut set, ev);
        }
    }
    assert_eq!(
        set,
        snap.block_hashes.iter().copied().collect::<BTreeSet<_>>()
    );

    // Many more requests: the ring wraps past what an old subscriber needs.
    for i in 2..40 {
        complete(&mesh, i).await?;
    }
    let mut too_late = subscribe(&worker, 1).await?;
    let first = too_late.message().await?.expect("an answer");
    assert!(
        first.snapshot_required,
        "a subscriber asking for evicted events must resync"
    );
    assert!(
        too_late.message().await?.is_none(),
        "the stream ends after snapshot_required"
    );

    // Resync: snapshot, then follow from its seq; live events apply on top.
    let snap = client
        .kv_snapshot(wpb::KvSnapshotRequest { dp_rank: 0 })
        .await?
        .into_inner();
    let mut set: BTreeSet<u64> = snap.block_hashes.iter().copied().collect();
    let mut live = subscribe(&worker, snap.seq).await?;
    complete(&mesh, 99).await?;
    let batch = live
        .message()
        .await?
        .expect("live events after the snapshot");
    assert!(!batch.snapshot_required);
    assert_eq!(batch.events[0].seq, snap.seq + 1);
    for ev in &batch.events {
        apply(&mut set, ev);
    }
    let now = client
        .kv_snapshot(wpb::KvSnapshotRequest { dp_rank: 0 })
        .await?
        .into_inner();
    if now.seq == batch.events.last().map(|e| e.seq).unwrap_or(0) {
        assert_eq!(
            set,
            now.block_hashes.iter().copied().collect::<BTreeSet<_>>()
        );
    }
    drop(live);
    mesh.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generate_stream_names_its_worker_on_the_first_and_last_message() -> anyhow::Result<()> {
    // The mocker at its modelled speed: steps milliseconds apart, so the
    // stream has middle messages (a reader that falls behind would get
    // them merged).
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_decode::EngineKind::Mocker;
    let mesh = Mesh::start(opts).await?;
    let worker = mesh.endpoints("decode").await?.remove(0);
    let mut client = wpb::worker_client::WorkerClient::connect(format!("http://{worker}")).await?;
    let mut stream = client
        .generate(wpb::GenerateRequest {
            request_id: "named".into(),
            model: "sluice-tiny".into(),
            prompt_token_ids: (0..24u32).map(|t| t * 11 % 900 + 4).collect(),
            sampling: Some(sluice_proto::common::v1::SamplingParams {
                max_tokens: 32,
                ignore_eos: true,
                temperature: Some(0.0),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut messages = Vec::new();
    while let Some(m) = stream.message().await? {
        messages.push(m);
    }
    let tokens: usize = messages.iter().map(|m| m.token_ids.len()).sum();
    assert_eq!(tokens, 32);
    assert!(messages.len() >= 3, "no middle message: {messages:?}");
    let (first, last) = (&messages[0], &messages[messages.len() - 1]);
    assert!(first.worker_id.starts_with("decode-"), "{first:?}");
    assert_eq!(last.worker_id, first.worker_id);
    for m in &messages[1..messages.len() - 1] {
        assert!(m.worker_id.is_empty(), "a middle message repeats it: {m:?}");
    }
    Ok(())
}
