//! Two queue replicas in front of one worker pool, with default flags, keep
//! one priority order: a replica does not grant a lower-priority request
//! while the other holds a higher one for the same workers, and each counts
//! the other's grants against the workers' slots (real router, real
//! worker, leases opened on each replica's `Admit` directly).

use std::time::Duration;

use anyhow::Context;
use sluice_proto::common::v1 as common;
use sluice_proto::queue::v1 as pb;
use sluice_proto::queue::v1::queue_client::QueueClient;
use sluice_tests::http::get;
use sluice_tests::mesh::{Mesh, MeshOptions};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

/// An admission lease on one replica: dropping `tx` ends it.
struct Lease {
    tx: mpsc::Sender<pb::AdmitRequest>,
    answers: Streaming<pb::AdmitResponse>,
}

async fn admit(queue: &str, model: &str, id: &str, priority: i32) -> anyhow::Result<Lease> {
    let mut client = QueueClient::new(sluice_runtime::grpc::channel(queue)?);
    let (tx, rx) = mpsc::channel(4);
    tx.send(pb::AdmitRequest {
        msg: Some(pb::admit_request::Msg::Open(pb::AdmitOpen {
            description: Some(common::RequestDescription {
                request_id: id.into(),
                model: model.into(),
                priority,
                prompt_tokens: 4,
                block_size: 16,
                expected_output_tokens: 4,
                ..Default::default()
            }),
            deadline_ms: 0,
        })),
    })
    .await?;
    let answers = client.admit(ReceiverStream::new(rx)).await?.into_inner();
    Ok(Lease { tx, answers })
}

/// The lease's next answer: whether it is the grant (else a held update).
async fn next(lease: &mut Lease) -> anyhow::Result<bool> {
    let answer = tokio::time::timeout(Duration::from_secs(10), lease.answers.message())
        .await
        .context("no answer within 10 s")??
        .context("the lease ended")?;
    Ok(matches!(
        answer.msg,
        Some(pb::admit_response::Msg::Grant(_))
    ))
}

/// Waits for the lease's grant, skipping held updates.
async fn granted(lease: &mut Lease) -> anyhow::Result<()> {
    while !next(lease).await? {}
    Ok(())
}

/// Waits for a held update (the request is held, not granted).
async fn held(lease: &mut Lease) -> anyhow::Result<()> {
    anyhow::ensure!(!next(lease).await?, "granted, expected held");
    Ok(())
}

/// Waits until `queue`'s `/metrics` shows `series` at `n`.
async fn sees(queue: &str, series: &str, n: f64) -> anyhow::Result<()> {
    sluice_tests::wait::until_true(
        &format!("{queue} to show {series} = {n}"),
        Duration::from_secs(10),
        || async { Ok(metric(queue, series).await? == n) },
    )
    .await
}

/// The `series` value on `queue`'s `/metrics` (0 when absent).
async fn metric(queue: &str, series: &str) -> anyhow::Result<f64> {
    let (_, page) = get(queue, "/metrics").await?;
    Ok(sluice_tests::wait::sum(&page, series))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_holds_a_lower_priority_while_the_other_holds_a_higher_one() -> anyhow::Result<()>
{
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    opts.worker.max_num_seqs = 1;
    opts.queues = 2;
    let mesh = Mesh::start(opts).await?;
    let queues = mesh.endpoints("queue").await?;
    anyhow::ensure!(queues.len() == 2, "two replicas: {queues:?}");
    let (a, b) = (queues[0].clone(), queues[1].clone());
    sluice_tests::wait::until_true(
        "both replicas to see the worker and each other",
        Duration::from_secs(30),
        || async {
            for q in [&a, &b] {
                if metric(q, "sluice_queue_load_view_slots").await? < 1.0
                    || metric(q, "sluice_queue_replicas").await? < 2.0
                {
                    return Ok(false);
                }
            }
            Ok(true)
        },
    )
    .await?;

    let model = mesh.model.clone();
    // Replica A takes the worker's only slot with a priority-3 request.
    let mut first = admit(&a, &model, "first", 3).await?;
    granted(&mut first).await?;
    // Replica B counts A's grant against the slot: its priority-0 request
    // is held (with the slot split per replica, B would have granted it).
    sees(&b, "sluice_queue_load_view_other_placements", 1.0).await?;
    let mut low = admit(&b, &model, "low", 0).await?;
    held(&mut low).await?;
    // A holds another priority-3 request behind the first, and B hears so.
    let mut high = admit(&a, &model, "high", 3).await?;
    held(&mut high).await?;
    sees(&b, "sluice_queue_load_view_held_elsewhere", 1.0).await?;

    // The slot frees: A's priority-3 request goes, B's priority 0 waits.
    let low_granted = tokio::spawn(async move {
        let result = granted(&mut low).await;
        (result, low)
    });
    drop(first);
    granted(&mut high).await?;
    assert!(
        !low_granted.is_finished(),
        "B granted priority 0 while A held priority 3"
    );
    // A's request ends: B's goes.
    drop(high);
    let (result, low) = tokio::time::timeout(Duration::from_secs(10), low_granted)
        .await
        .context("B's request never granted")??;
    result?;
    drop(low.tx);
    mesh.stop().await
}
