//! One discovery suite run against both backends: a real etcd-server started
//! by the harness, and the in-process registry. etcd-only cases cover lease
//! expiry after `kill -9` of the owner, resync after an etcd restart, and
//! malformed entries.

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use prost::Message as _;
use sluice_proto::kv::v1::Transport;
use sluice_runtime::discovery::{
    EngineBackend, EtcdDiscovery, MemoryDiscovery, Watch, WorkerInfo, WorkerRole, instance_key,
};
use sluice_runtime::{Discovery, DiscoveryEvent, Instance};
use sluice_tests::etcd::EtcdServer;

const CHILD_ENV: &str = "SLUICE_TEST_CHILD_ETCD";

async fn next_event(w: &mut Watch) -> DiscoveryEvent {
    tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .expect("a discovery event within 10 s")
        .expect("watch still open")
}

async fn suite(d: Arc<dyn Discovery>) {
    // register → list
    // A worker's facts survive the backend unchanged (etcd: encoded once
    // as protobuf inside the entry, decoded once by the reader).
    let a = Instance::new("decode", "127.0.0.1:1111")
        .with_model("m")
        .with_worker(WorkerInfo {
            role: WorkerRole::Decode,
            block_size: 16,
            dp_size: 2,
            engine: Some(EngineBackend::Mocker),
            total_blocks: 1000,
            max_num_seqs: 8,
            max_num_batched_tokens: 512,
            max_model_len: Some(2048),
            kv_transports: vec![Transport::Shm, Transport::Grpc],
            kv_block_bytes: Some(1 << 21),
        });
    let reg_a = d.register(a.clone(), 3).await.expect("register a");
    let listed = d.list("decode").await.expect("list");
    assert_eq!(listed, vec![a.clone()]);
    assert!(
        d.list("prefill")
            .await
            .expect("list other component")
            .is_empty()
    );

    // a watch starts with the current instances, then sees joins and leaves
    let mut w = d.watch("decode").await.expect("watch");
    assert_eq!(next_event(&mut w).await, DiscoveryEvent::Put(a.clone()));
    let b = Instance::new("decode", "127.0.0.1:2222");
    let reg_b = d.register(b.clone(), 3).await.expect("register b");
    assert_eq!(next_event(&mut w).await, DiscoveryEvent::Put(b.clone()));
    reg_b.deregister().await;
    assert_eq!(
        next_event(&mut w).await,
        DiscoveryEvent::Delete {
            component: "decode".into(),
            id: b.id.clone()
        }
    );

    // other components do not leak into the watch
    let _q = d
        .register(Instance::new("queue", "127.0.0.1:3333"), 3)
        .await
        .expect("register queue");
    // dropping a registration removes the entry (etcd: lease revoked)
    drop(reg_a);
    assert_eq!(
        next_event(&mut w).await,
        DiscoveryEvent::Delete {
            component: "decode".into(),
            id: a.id.clone()
        }
    );
    assert!(d.list("decode").await.expect("list").is_empty());
}

#[tokio::test]
async fn memory_backend_passes_the_suite() {
    suite(Arc::new(MemoryDiscovery::new("t"))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_backend_passes_the_suite() -> anyhow::Result<()> {
    let etcd = EtcdServer::start().await?;
    suite(Arc::new(EtcdDiscovery::connect(&etcd.url(), "t").await?)).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_entry_of_killed_owner_expires_within_ttl() -> anyhow::Result<()> {
    let etcd = EtcdServer::start().await?;
    let d = EtcdDiscovery::connect(&etcd.url(), "t").await?;
    let mut w = d.watch("decode").await?;

    let exe = std::env::current_exe()?;
    let mut child = std::process::Command::new(exe)
        .args([
            "--exact",
            "child_registers_and_waits",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD_ENV, etcd.url())
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let joined = next_event(&mut w).await;
    let DiscoveryEvent::Put(inst) = joined else {
        panic!("expected a join, got {joined:?}")
    };

    child.kill()?; // SIGKILL: no deregistration, only the lease can remove it
    let _ = child.wait();
    let killed_at = Instant::now();
    let left = tokio::time::timeout(Duration::from_secs(2 + 1 + 2), next_event(&mut w)).await?;
    assert_eq!(
        left,
        DiscoveryEvent::Delete {
            component: "decode".into(),
            id: inst.id
        }
    );
    // TTL 2 s; etcd rounds leases up to its minimum TTL, and keep-alives
    // refresh it every TTL/3, so expiry lands within TTL + 1 s of the kill.
    assert!(
        killed_at.elapsed() <= Duration::from_secs(3) + Duration::from_millis(500),
        "{:?}",
        killed_at.elapsed()
    );
    Ok(())
}

/// Not a test on its own: the child process of the test above, which runs
/// it with `--ignored` and kills it.
#[tokio::test]
#[ignore = "the child process of etcd_entry_of_killed_owner_expires_within_ttl"]
async fn child_registers_and_waits() {
    let url = std::env::var(CHILD_ENV).unwrap_or_else(|_| {
        panic!("{CHILD_ENV} unset: run by etcd_entry_of_killed_owner_expires_within_ttl only")
    });
    let d = EtcdDiscovery::connect(&url, "t")
        .await
        .expect("child connects");
    let _reg = d
        .register(Instance::new("decode", "127.0.0.1:4444"), 2)
        .await
        .expect("child registers");
    // Holds the registration until the parent kills this process.
    std::future::pending::<()>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_watch_and_registration_resync_after_etcd_restart() -> anyhow::Result<()> {
    let mut etcd = EtcdServer::start().await?;
    let d = EtcdDiscovery::connect(&etcd.url(), "t").await?;
    let mut w = d.watch("router").await?;
    let a = Instance::new("router", "127.0.0.1:5555");
    let _reg_a = d.register(a.clone(), 2).await?;
    assert_eq!(next_event(&mut w).await, DiscoveryEvent::Put(a.clone()));

    etcd.restart().await?;

    // A join after the restart reaches the old watch (resumed by revision).
    let b = Instance::new("router", "127.0.0.1:6666");
    let _reg_b = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match d.register(b.clone(), 2).await {
                Ok(r) => return r,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    })
    .await?;
    loop {
        match next_event(&mut w).await {
            DiscoveryEvent::Put(i) if i.id == b.id => break,
            DiscoveryEvent::Put(i) if i.id == a.id => continue, // a re-registered after its lease was restored
            other => panic!("unexpected event {other:?}"),
        }
    }
    // The registration kept alive across the restart is still listed after
    // more than its TTL.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ids: Vec<String> = d.list("router").await?.into_iter().map(|i| i.id).collect();
    assert!(ids.contains(&a.id) && ids.contains(&b.id), "{ids:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_malformed_entry_is_skipped_not_fatal() -> anyhow::Result<()> {
    let etcd = EtcdServer::start().await?;
    let d = EtcdDiscovery::connect(&etcd.url(), "t").await?;
    let mut raw = etcd_client::Client::connect([etcd.url()], None).await?;
    raw.put(instance_key("t", "decode", "junk"), "{not json", None)
        .await?;
    let good = Instance::new("decode", "127.0.0.1:7777");
    let _reg = d.register(good.clone(), 3).await?;
    assert_eq!(d.list("decode").await?, vec![good.clone()]);

    let mut w = d.watch("decode").await?;
    assert_eq!(next_event(&mut w).await, DiscoveryEvent::Put(good.clone()));
    raw.put(instance_key("t", "decode", "junk2"), "[1,2", None)
        .await?;
    // A worker entry whose facts do not decode, or name no role, is as
    // malformed as bad JSON.
    let envelope = |worker: &str| {
        format!(r#"{{"id":"w","component":"decode","endpoint":"127.0.0.1:1","worker":"{worker}"}}"#)
    };
    raw.put(
        instance_key("t", "decode", "junk3"),
        envelope("not base64!"),
        None,
    )
    .await?;
    let no_role = base64::engine::general_purpose::STANDARD.encode(
        sluice_proto::worker::v1::WorkerInfo {
            block_size: 16,
            ..Default::default()
        }
        .encode_to_vec(),
    );
    raw.put(
        instance_key("t", "decode", "junk4"),
        envelope(&no_role),
        None,
    )
    .await?;
    let later = Instance::new("decode", "127.0.0.1:8888");
    let _reg2 = d.register(later.clone(), 3).await?;
    assert_eq!(next_event(&mut w).await, DiscoveryEvent::Put(later));
    Ok(())
}

/// No event within `d`.
async fn quiet_for(w: &mut Watch, d: Duration) -> Option<DiscoveryEvent> {
    tokio::time::timeout(d, w.next()).await.ok().flatten()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_pause_keeps_members_in_view_until_they_register_again() -> anyhow::Result<()> {
    let etcd = EtcdServer::start().await?;
    let grace = Duration::from_secs(8);
    let d = EtcdDiscovery::connect(&etcd.url(), "t")
        .await?
        .with_grace(grace);
    let a = Instance::new("decode", "127.0.0.1:1212");
    let _reg = d.register(a.clone(), 1).await?;
    let mut w = d.watch("decode").await?;
    assert_eq!(next_event(&mut w).await, DiscoveryEvent::Put(a.clone()));
    // A watch without a grace period sees the same pause as a departure.
    let strict = EtcdDiscovery::connect(&etcd.url(), "t").await?;
    let mut strict_w = strict.watch("decode").await?;
    assert_eq!(
        next_event(&mut strict_w).await,
        DiscoveryEvent::Put(a.clone())
    );

    // Every lease (TTL 1 s) expires while etcd is stopped.
    etcd.pause()?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    etcd.resume()?;

    // The strict watch proves the lease was lost (and the entry came back).
    assert_eq!(
        next_event(&mut strict_w).await,
        DiscoveryEvent::Delete {
            component: "decode".into(),
            id: a.id.clone()
        }
    );
    assert_eq!(
        next_event(&mut strict_w).await,
        DiscoveryEvent::Put(a.clone())
    );
    // The forgiving watch saw nothing: the member re-registered in time.
    assert_eq!(quiet_for(&mut w, Duration::from_secs(3)).await, None);
    assert_eq!(d.list("decode").await?, vec![a.clone()]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_departure_is_seen_at_once_and_a_lost_member_after_the_grace() -> anyhow::Result<()> {
    let etcd = EtcdServer::start().await?;
    let grace = Duration::from_secs(3);
    let d = EtcdDiscovery::connect(&etcd.url(), "t")
        .await?
        .with_grace(grace);
    let mut w = d.watch("decode").await?;

    // Deregistering marks the entry as leaving: no grace period.
    let a = Instance::new("decode", "127.0.0.1:1313");
    let reg = d.register(a.clone(), 2).await?;
    assert_eq!(next_event(&mut w).await, DiscoveryEvent::Put(a.clone()));
    let asked = Instant::now();
    reg.deregister().await;
    assert_eq!(
        next_event(&mut w).await,
        DiscoveryEvent::Delete {
            component: "decode".into(),
            id: a.id.clone()
        }
    );
    assert!(asked.elapsed() < grace, "{:?}", asked.elapsed());

    // A member whose lease is gone for good (its key deleted under it, as
    // an expiry does) is dropped once the grace period has passed.
    let b = Instance::new("decode", "127.0.0.1:1414");
    let _reg_b = d.register(b.clone(), 30).await?;
    assert_eq!(next_event(&mut w).await, DiscoveryEvent::Put(b.clone()));
    let mut raw = etcd_client::Client::connect([etcd.url()], None).await?;
    let key = instance_key("t", "decode", &b.id);
    let lease = raw.get(key.as_str(), None).await?.kvs()[0].lease();
    let lost = Instant::now();
    raw.lease_revoke(lease).await?;
    assert_eq!(
        next_event(&mut w).await,
        DiscoveryEvent::Delete {
            component: "decode".into(),
            id: b.id.clone()
        }
    );
    assert!(
        lost.elapsed() >= grace,
        "dropped after {:?}",
        lost.elapsed()
    );
    Ok(())
}

#[tokio::test]
async fn etcd_calls_to_a_listener_that_never_answers_fail_instead_of_hanging() {
    // Accepts connections and says nothing, like a stalled etcd or a proxy
    // in front of a dead one.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    let started = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(60), async {
        let d = EtcdDiscovery::connect(&format!("http://{addr}"), "stalled").await?;
        d.list("decode").await
    })
    .await;
    let waited = started.elapsed();
    assert!(
        matches!(outcome, Ok(Err(_))),
        "expected an error, got {outcome:?} after {waited:?}"
    );
    assert!(waited < Duration::from_secs(30), "took {waited:?}");
}
