//! A worker's streams over gRPC. KV events: a late subscriber replays from
//! the ring, a too-late one is told to take a snapshot, and snapshot +
//! stream agree. `Generate`: the worker is named on the first and the last
//! message only. `GenerateSession`: generations share one stream, each
//! ending on its own; a session whose caller stops reading ends.

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
        // Still cached, in another tier.
        Some(wpb::kv_event::Kind::Moved(_)) | None => {}
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

/// A greedy 24-token prompt run to `max_tokens` on the worker directly.
fn generate_request(max_tokens: u32) -> wpb::GenerateRequest {
    wpb::GenerateRequest {
        request_id: "worker-stream".into(),
        model: "sluice-tiny".into(),
        prompt_token_ids: (0..24u32).map(|t| t * 11 % 900 + 4).collect(),
        sampling: Some(sluice_proto::common::v1::SamplingParams {
            max_tokens,
            ignore_eos: true,
            temperature: Some(0.0),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generate_stream_names_its_worker_on_the_first_and_last_message() -> anyhow::Result<()> {
    // The mocker at its modelled speed: steps milliseconds apart, so the
    // stream has middle messages (a reader that falls behind would get
    // them merged).
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    let mesh = Mesh::start(opts).await?;
    let worker = mesh.endpoints("decode").await?.remove(0);
    let mut client = wpb::worker_client::WorkerClient::connect(format!("http://{worker}")).await?;
    let mut stream = client.generate(generate_request(32)).await?.into_inner();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_share_one_session_and_each_ends_on_its_own() -> anyhow::Result<()> {
    use std::collections::HashMap;
    use std::time::Duration;

    use wpb::generate_session_response::Msg;

    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    let mesh = Mesh::start(opts).await?;
    let worker = mesh.endpoints("decode").await?.remove(0);
    let mut client = wpb::worker_client::WorkerClient::connect(format!("http://{worker}")).await?;

    // What `Generate` gives for the request.
    let mut reference = Vec::new();
    let mut stream = client.generate(generate_request(16)).await?.into_inner();
    while let Some(m) = stream.message().await? {
        reference.extend(m.token_ids);
    }

    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let send = |id: u64, request: Option<wpb::GenerateRequest>| {
        tx.send(wpb::GenerateSessionRequest {
            id,
            request,
            traceparent: String::new(),
        })
        .map_err(|_| anyhow::anyhow!("the session's outbound channel is closed"))
    };
    send(1, Some(generate_request(16)))?;
    // Long enough to be aborted while it runs (the mocker at its modelled
    // speed takes milliseconds a step).
    send(2, Some(generate_request(5_000)))?;
    send(
        3,
        Some(wpb::GenerateRequest {
            model: "another-model".into(),
            ..generate_request(4)
        }),
    )?;
    // Id 1 is live: this message alone is refused.
    send(1, Some(generate_request(4)))?;
    let mut answers = client
        .generate_session(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await?
        .into_inner();

    let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut errors: HashMap<u64, Vec<tonic::Code>> = HashMap::new();
    let mut finished = Vec::new();
    let mut aborted = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !(finished.contains(&1) && errors.len() == 2 && aborted && finished.contains(&4)) {
        let answer = tokio::time::timeout_at(deadline, answers.message())
            .await??
            .expect("the session stays open");
        match answer.msg.expect("a response or an error") {
            Msg::Response(r) => {
                tokens.entry(answer.id).or_default().extend(&r.token_ids);
                if r.finish_reason != 0 {
                    finished.push(answer.id);
                }
                if answer.id == 2 && !aborted {
                    // Generation 2 runs: abort it, then start 4 on the same
                    // session, which must still work.
                    send(2, None)?;
                    send(4, Some(generate_request(8)))?;
                    aborted = true;
                }
            }
            Msg::Error(e) => errors.entry(answer.id).or_default().push(e.code.into()),
        }
    }
    assert_eq!(
        tokens[&1], reference,
        "a session generates what Generate does"
    );
    assert_eq!(tokens[&4].len(), 8);
    assert_eq!(errors[&3], [tonic::Code::NotFound], "{errors:?}");
    assert_eq!(errors[&1], [tonic::Code::InvalidArgument], "{errors:?}");
    assert!(
        !finished.contains(&2),
        "the aborted generation ran to its end"
    );

    // The abort freed the engine: nothing runs once 1 and 4 are done.
    let mut load = client
        .load(wpb::LoadRequest {
            min_interval_ms: 10,
            max_interval_ms: 50,
        })
        .await?
        .into_inner();
    let idle = async {
        while let Some(report) = load.message().await? {
            if report.running == 0 && report.waiting == 0 {
                return anyhow::Ok(());
            }
        }
        anyhow::bail!("the load stream ended")
    };
    tokio::time::timeout(Duration::from_secs(10), idle).await??;
    assert!(!finished.contains(&2));
    drop(tx);
    mesh.stop().await
}

/// The value of a metric on the first worker's `/metrics` (summed over its
/// label sets).
async fn worker_gauge(mesh: &Mesh, name: &str) -> anyhow::Result<f64> {
    Ok(sluice_tests::wait::total(
        &mesh.metrics("decode").await?,
        name,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_caller_stops_reading_ends_and_frees_its_generations() -> anyhow::Result<()>
{
    use std::time::Duration;

    use futures::StreamExt;

    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    let mesh = Mesh::start(opts).await?;
    let worker = mesh.endpoints("decode").await?.remove(0);
    // A caller in this process: no socket, so no reset tells the worker
    // that the caller left. Its requests never end either.
    let mut client = wpb::worker_client::WorkerClient::new(sluice_runtime::grpc::channel(&worker)?);
    let before = worker_gauge(&mesh, "sluice_worker_generate_sessions").await?;
    let outbound = futures::stream::iter([wpb::GenerateSessionRequest {
        id: 1,
        // Long enough to be running when the caller leaves.
        request: Some(generate_request(5_000)),
        traceparent: String::new(),
    }])
    .chain(futures::stream::pending());
    let mut answers = client.generate_session(outbound).await?.into_inner();
    answers
        .message()
        .await?
        .expect("the generation's first answer");
    assert_eq!(
        worker_gauge(&mesh, "sluice_worker_generate_sessions").await?,
        before + 1.0
    );

    drop(answers);
    sluice_tests::wait::until(
        "the session and its generation to end once nobody reads its answers",
        Duration::from_secs(10),
        || async {
            let open = worker_gauge(&mesh, "sluice_worker_generate_sessions").await?;
            let running = worker_gauge(&mesh, "sluice_worker_running_sequences").await?
                + worker_gauge(&mesh, "sluice_worker_waiting_sequences").await?;
            anyhow::ensure!(
                open == before && running == 0.0,
                "{open} sessions open (was {before}), {running} sequences"
            );
            Ok(Some(()))
        },
    )
    .await?;
    mesh.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_refuses_new_generations_and_finishes_its_own() -> anyhow::Result<()> {
    use std::sync::Arc;
    use std::time::Duration;

    use sluice_runtime::discovery::MemoryDiscovery;
    use sluice_runtime::{Discovery, ModelArgs, ServiceContext, Shutdown};
    use wpb::generate_session_response::Msg;

    // A worker of its own, so that it alone drains.
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("drain"));
    let shutdown = Shutdown::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = listener.local_addr()?.to_string();
    let args = sluice_worker::WorkerArgs {
        engine: sluice_worker::EngineKind::Mocker,
        num_gpu_blocks: 512,
        ..Default::default()
    };
    let model = ModelArgs {
        model: Some(sluice_tests::mesh::builtin_model_dir()?),
        served_model_name: Some("sluice-tiny".into()),
    };
    let ctx = ServiceContext::new(discovery, shutdown.clone());
    let worker = tokio::spawn(sluice_decode::serve(listener, args, model, ctx));

    let mut client =
        sluice_tests::wait::until("the worker to listen", Duration::from_secs(5), || {
            let url = format!("http://{endpoint}");
            async move { Ok(wpb::worker_client::WorkerClient::connect(url).await.ok()) }
        })
        .await?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let send = |id: u64, request: wpb::GenerateRequest| {
        tx.send(wpb::GenerateSessionRequest {
            id,
            request: Some(request),
            traceparent: String::new(),
        })
        .map_err(|_| anyhow::anyhow!("the session's outbound channel is closed"))
    };
    send(1, generate_request(200))?;
    let mut answers = client
        .generate_session(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await?
        .into_inner();
    let within = Duration::from_secs(30);
    let first = tokio::time::timeout(within, answers.message()).await??;
    assert!(
        matches!(
            first,
            Some(wpb::GenerateSessionResponse {
                id: 1,
                msg: Some(Msg::Response(_))
            })
        ),
        "{first:?}"
    );

    // The session hears the drain before any message that follows it.
    shutdown.cancel();
    send(2, generate_request(4))?;
    let mut tokens = first.map_or(0, |a| match a.msg {
        Some(Msg::Response(r)) => r.token_ids.len(),
        _ => 0,
    });
    let mut refused = None;
    let mut finished = false;
    while let Some(answer) = tokio::time::timeout(within, answers.message()).await?? {
        match (answer.id, answer.msg.expect("a response or an error")) {
            (1, Msg::Response(r)) => {
                tokens += r.token_ids.len();
                finished |= r.finish_reason != 0;
            }
            (2, Msg::Error(e)) => refused = Some(tonic::Code::from(e.code)),
            other => panic!("unexpected {other:?}"),
        }
    }
    // The session ended on its own once generation 1 was over.
    assert!(finished, "the running generation finished");
    assert_eq!(tokens, 200);
    assert_eq!(refused, Some(tonic::Code::Unavailable));
    drop(tx);
    tokio::time::timeout(within, worker).await???;
    Ok(())
}
