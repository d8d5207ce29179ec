//! KV transfer end to end on the real CPU engine: remote prefill over each
//! transport (forced with `--kv-transports`) generates what local prefill
//! generates; injected failures on `shm` and `tcp` fall back to local
//! prefill with the same tokens; a client that goes away mid-transfer frees
//! the blocks on both workers; workers advertise what they really run.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_kv_transfer::TransportKind;
use sluice_prefill::Fault;
use sluice_tests::http::get;
use sluice_tests::mesh::{Mesh, MeshOptions, active_blocks};
use tokio::io::AsyncWriteExt;

fn long_prompt() -> Vec<u32> {
    (0..150u32).map(|i| (i * 37 + 11) % 900 + 5).collect()
}

fn disagg(transports: &[TransportKind]) -> MeshOptions {
    let mut o = MeshOptions {
        prefill_workers: 1,
        ..Default::default()
    };
    o.worker.max_local_prefill_length = 32;
    o.worker.kv_transports = transports.to_vec();
    o
}

async fn local_reference(prompt: &[u32]) -> anyhow::Result<Value> {
    let mesh = Mesh::start(MeshOptions::default()).await?;
    let v = mesh.complete_tokens(prompt, 16).await?;
    mesh.stop().await?;
    Ok(v)
}

/// The KV transports the component's first worker publishes, `shm,tcp,…`.
async fn advertised(mesh: &Mesh, component: &str) -> anyhow::Result<String> {
    let list = mesh.discovery.list(component).await?;
    let kinds: Vec<TransportKind> = list
        .first()
        .and_then(|i| i.worker.as_ref())
        .map(|w| {
            w.kv_transports
                .iter()
                .filter_map(|&t| TransportKind::from_pb(t as i32))
                .collect()
        })
        .unwrap_or_default();
    Ok(sluice_kv_transfer::join(&kinds))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_over_shm_tcp_and_grpc_generates_the_same_tokens_as_local()
-> anyhow::Result<()> {
    let prompt = long_prompt();
    let local = local_reference(&prompt).await?;
    for kind in [TransportKind::Shm, TransportKind::Tcp, TransportKind::Grpc] {
        let mesh = Mesh::start(disagg(&[kind])).await?;
        assert_eq!(advertised(&mesh, "decode").await?, kind.as_str());
        assert_eq!(advertised(&mesh, "prefill").await?, kind.as_str());
        let remote = mesh.complete_tokens(&prompt, 16).await?;
        assert!(
            remote["nvext"]["prefill_worker_id"]
                .as_str()
                .is_some_and(|p| p.starts_with("prefill-")),
            "{kind}: prefilled remotely: {remote}"
        );
        assert_eq!(
            local["choices"][0]["text"], remote["choices"][0]["text"],
            "{kind}"
        );
        assert_eq!(remote["usage"]["completion_tokens"], 16, "{kind}");
        mesh.stop().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_advertise_the_transports_they_run_preferred_first() -> anyhow::Result<()> {
    let mesh = Mesh::start(disagg(&TransportKind::ALL)).await?;
    // rdma cannot run here (no device, or not built): skipped, not advertised.
    assert_eq!(advertised(&mesh, "decode").await?, "shm,tcp,grpc");
    assert_eq!(advertised(&mesh, "prefill").await?, "shm,tcp,grpc");
    let v = mesh.complete_tokens(&long_prompt(), 4).await?;
    assert!(v["nvext"]["prefill_worker_id"].is_string(), "{v}");
    mesh.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_shm_and_tcp_transfers_fall_back_to_local_prefill_with_the_same_tokens()
-> anyhow::Result<()> {
    let prompt = long_prompt();
    let local = local_reference(&prompt).await?;
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        for fault in [Fault::CorruptBlocks, Fault::DropBlocks] {
            let mut opts = MeshOptions {
                prefill_fault: Some(fault),
                ..disagg(&[kind])
            };
            // shm checks only whether every block was written, unless asked
            // to verify checksums too.
            opts.worker.kv_shm_checksums = fault == Fault::CorruptBlocks;
            let mesh = Mesh::start(opts).await?;
            let v = mesh.complete_tokens(&prompt, 16).await?;
            assert_eq!(
                v["choices"][0]["text"], local["choices"][0]["text"],
                "{kind} {fault:?}"
            );
            assert!(
                v["nvext"].get("prefill_worker_id").is_none(),
                "{kind} {fault:?} fell back to local prefill: {v}"
            );
            let (_, metrics) = get(&mesh.endpoints("decode").await?[0], "/metrics").await?;
            let fallback = metrics.lines().any(|l| {
                l.starts_with("sluice_worker_remote_prefill_total{")
                    && !l.contains("outcome=\"ok\"")
                    && !l.ends_with(" 0")
            });
            assert!(
                fallback,
                "{kind} {fault:?}: a fallback is counted\n{metrics}"
            );
            mesh.stop().await?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_mid_transfer_frees_the_blocks_on_both_workers() -> anyhow::Result<()> {
    for kind in [TransportKind::Shm, TransportKind::Tcp] {
        let mut opts = MeshOptions {
            prefill_fault: Some(Fault::StallMidTransfer),
            ..disagg(&[kind])
        };
        // Long enough that nothing times out while the test looks.
        opts.worker.remote_prefill_timeout_ms = 60_000;
        let mesh = Mesh::start(opts).await?;
        let decode = mesh.endpoints("decode").await?.remove(0);
        let prefill = mesh.endpoints("prefill").await?.remove(0);
        let body = json!({"model": "sluice-tiny", "prompt": long_prompt(), "max_tokens": 16, "temperature": 0, "stream": true}).to_string();
        let mut client = tokio::net::TcpStream::connect(&mesh.http).await?;
        client
            .write_all(
                format!(
                    "POST /v1/completions HTTP/1.1\r\nhost: sluice\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            )
            .await?;
        // Both workers hold blocks while the transfer stalls half-way.
        let deadline = Instant::now() + Duration::from_secs(30);
        while active_blocks(&decode).await? == 0 || active_blocks(&prefill).await? == 0 {
            if Instant::now() >= deadline {
                let (_, metrics) = get(&decode, "/metrics").await?;
                let outcomes: Vec<&str> = metrics
                    .lines()
                    .filter(|l| l.starts_with("sluice_worker_remote_prefill_total{"))
                    .collect();
                panic!("{kind}: the transfer never started; remote prefills: {outcomes:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The stalled sender keeps them for the descriptor's timeout (60 s):
        // the client goes away mid-transfer.
        drop(client);
        let dropped = Instant::now();
        loop {
            let (d, p) = (
                active_blocks(&decode).await?,
                active_blocks(&prefill).await?,
            );
            if d == 0 && p == 0 {
                break;
            }
            assert!(
                dropped.elapsed() < Duration::from_secs(3),
                "{kind}: blocks still held {:?} after the disconnect (decode {d}, prefill {p})",
                dropped.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        mesh.stop().await?;
    }
    Ok(())
}
