//! Service discovery: who is out there, at which address, in which role.
//!
//! An [`Instance`] lives at `/sluice/v1/<namespace>/<component>/<id>` under a
//! lease its owner keeps alive; when the owner stops (or crashes and its
//! lease expires) the entry disappears and watchers see a
//! [`DiscoveryEvent::Delete`]. Two backends serve one trait: `etcd` for a
//! distributed mesh, `memory` for everything in one process (`sluice up`).
//! A malformed entry is logged and skipped, never a panic.
//!
//! # The entry
//!
//! A JSON envelope (`id`, `component`, `endpoint`, `model`, `leaving`) that
//! every member kind writes; a worker adds `worker`, its [`WorkerInfo`] as
//! one encoded `sluice.worker.v1.WorkerInfo` message (base64). It is
//! encoded once at registration and decoded and checked once when the
//! entry is read; an entry whose `worker` does not decode or check is
//! malformed.
//!
//! # Leaving and losing a lease are told apart
//!
//! An owner that deregisters marks its entry as leaving
//! ([`Instance::leaving`]) before it removes it: watchers drop it at once.
//! An entry that disappears without that mark lost its lease — its owner
//! crashed, or etcd paused or was cut off long enough for every lease to
//! expire while their owners are fine.
//! A watch keeps such a member in its view for a grace period
//! (`--discovery-grace`) and forgets it only if it has not registered again
//! (same id, same entry) by then; a re-registration within the grace period
//! reaches no watcher at all. A crashed member is meanwhile found dead by
//! its callers, who fail over (see each service).

mod etcd;
mod memory;
mod worker;

use std::fmt::Debug;
use std::sync::Arc;

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

pub use etcd::EtcdDiscovery;
pub use memory::MemoryDiscovery;
pub use worker::{EngineBackend, WorkerInfo, WorkerInfoError, WorkerRank, WorkerRole};

use crate::{CommonArgs, RuntimeError};

/// One running instance of a component.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// Unique within the component (e.g. `decode-4f3a…`).
    pub id: String,
    /// `frontend`, `queue`, `router`, `decode` or `prefill`.
    pub component: String,
    /// gRPC address (`host:port`) others dial.
    pub endpoint: String,
    /// Model served, for workers; empty for control-plane services.
    #[serde(default)]
    pub model: String,
    /// A worker's facts (role, block size, ranks, limits, KV transports);
    /// `None` for other members.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "worker::base64_pb"
    )]
    pub worker: Option<WorkerInfo>,
    /// Set by the owner on its entry just before removing it: the member is
    /// leaving (not lost), so watchers drop it without a grace period.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub leaving: bool,
}

impl Instance {
    /// A new instance with a random id prefixed by the component name.
    pub fn new(component: &str, endpoint: impl Into<String>) -> Self {
        let id = format!(
            "{component}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        Self {
            id,
            component: component.into(),
            endpoint: endpoint.into(),
            model: String::new(),
            worker: None,
            leaving: false,
        }
    }

    /// Sets the model.
    pub fn with_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// Sets the worker's facts.
    pub fn with_worker(mut self, info: WorkerInfo) -> Self {
        self.worker = Some(info);
        self
    }
}

/// A fresh instance id: the component name and 12 random hex digits.
pub fn instance_id(component: &str) -> String {
    format!(
        "{component}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// A change in a watched component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryEvent {
    /// An instance joined or changed.
    Put(Instance),
    /// An instance left (deregistered, or its lease expired).
    Delete { component: String, id: String },
}

/// Events of one watched component. A new watch first yields a `Put` for
/// every current instance; after a disconnect it resyncs and yields only the
/// differences. Dropping it stops the watch.
#[derive(Debug)]
pub struct Watch {
    rx: mpsc::Receiver<DiscoveryEvent>,
    _stop: tokio_util::sync::DropGuard,
}

impl Watch {
    pub(crate) fn new(rx: mpsc::Receiver<DiscoveryEvent>, stop: CancellationToken) -> Self {
        Self {
            rx,
            _stop: stop.drop_guard(),
        }
    }

    /// The next event; `None` once the backend has shut down.
    pub async fn next(&mut self) -> Option<DiscoveryEvent> {
        self.rx.recv().await
    }

    /// Hands every event to `on` until `stop` is cancelled or the watch
    /// ends: the loop of every service that keeps a view of a component
    /// (the caller spawns it where its tasks live). Says which ended it.
    pub async fn follow(
        mut self,
        stop: &CancellationToken,
        mut on: impl FnMut(DiscoveryEvent),
    ) -> Followed {
        loop {
            let event = tokio::select! {
                () = stop.cancelled() => return Followed::Stopped,
                event = self.next() => event,
            };
            match event {
                Some(event) => on(event),
                None => return Followed::WatchEnded,
            }
        }
    }
}

/// Why [`Watch::follow`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Followed {
    /// The caller's stop token was cancelled.
    Stopped,
    /// The discovery backend shut down.
    WatchEnded,
}

/// A live registration. Dropping it stops the keep-alive (memory: removes
/// the entry at once; etcd: revokes the lease if the runtime is still up,
/// else the lease expires); [`Registration::deregister`] waits until the
/// entry is gone.
#[derive(Debug)]
pub struct Registration {
    instance: Instance,
    stop: CancellationToken,
    done: Option<oneshot::Receiver<()>>,
}

impl Registration {
    pub(crate) fn new(
        instance: Instance,
        stop: CancellationToken,
        done: oneshot::Receiver<()>,
    ) -> Self {
        Self {
            instance,
            stop,
            done: Some(done),
        }
    }

    /// The registered instance.
    pub fn instance(&self) -> &Instance {
        &self.instance
    }

    /// Removes the entry and waits until it is gone.
    pub async fn deregister(mut self) {
        self.stop.cancel();
        if let Some(done) = self.done.take() {
            let _ = done.await;
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Where instances register and how others find them.
#[async_trait::async_trait]
pub trait Discovery: Send + Sync + Debug {
    /// Registers `instance` under a lease of `ttl_secs`, kept alive until the
    /// registration is dropped or deregistered.
    async fn register(
        &self,
        instance: Instance,
        ttl_secs: u32,
    ) -> Result<Registration, RuntimeError>;
    /// Current instances of `component`.
    async fn list(&self, component: &str) -> Result<Vec<Instance>, RuntimeError>;
    /// Joins and leaves of `component`, starting with every current instance.
    async fn watch(&self, component: &str) -> Result<Watch, RuntimeError>;
}

/// The backend the common flags ask for: etcd when `--etcd` is set, else
/// `fallback` (the process's in-memory registry).
pub async fn from_args(
    args: &CommonArgs,
    fallback: Option<Arc<dyn Discovery>>,
) -> Result<Arc<dyn Discovery>, RuntimeError> {
    match &args.etcd {
        Some(url) => Ok(Arc::new(
            EtcdDiscovery::connect(url, &args.namespace)
                .await?
                .with_grace(args.grace()),
        )),
        None => Ok(fallback.unwrap_or_else(|| Arc::new(MemoryDiscovery::new(&args.namespace)))),
    }
}

/// What a backend's watch saw, before the grace period is applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seen {
    /// An entry was written.
    Put(Instance),
    /// The owner removed its entry (or marked it leaving).
    Left(String),
    /// The entry disappeared without being marked: its lease was lost.
    Lost(String),
}

/// Turns what a backend saw into the events a [`Watch`] yields: identical
/// re-writes are dropped, a member that left is deleted at once, and a
/// member whose lease was lost is deleted only if it has not been written
/// again within `grace`. Runs until `raw` ends, `out` closes or `stop`.
pub(crate) async fn settle(
    component: String,
    mut raw: mpsc::Receiver<Seen>,
    out: mpsc::Sender<DiscoveryEvent>,
    grace: Duration,
    stop: CancellationToken,
) {
    let mut shown: HashMap<String, Instance> = HashMap::new();
    // Members whose lease was lost, and when they are given up.
    let mut lost: HashMap<String, tokio::time::Instant> = HashMap::new();
    loop {
        let next_expiry = lost.values().min().copied();
        let expire = async {
            match next_expiry {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let seen = tokio::select! {
            () = stop.cancelled() => return,
            () = expire => None,
            seen = raw.recv() => match seen {
                Some(s) => Some(s),
                None => return,
            },
        };
        let mut events = Vec::new();
        match seen {
            None => {
                let now = tokio::time::Instant::now();
                let expired: Vec<String> = lost
                    .iter()
                    .filter(|(_, at)| **at <= now)
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in expired {
                    lost.remove(&id);
                    if shown.remove(&id).is_some() {
                        tracing::warn!(%component, %id, ?grace, "member did not register again within the grace period; dropping it");
                        events.push(DiscoveryEvent::Delete {
                            component: component.clone(),
                            id,
                        });
                    }
                }
            }
            Some(Seen::Put(i)) => {
                if lost.remove(&i.id).is_some() {
                    tracing::info!(%component, id = %i.id, "member registered again within the grace period");
                }
                if shown.get(&i.id) != Some(&i) {
                    shown.insert(i.id.clone(), i.clone());
                    events.push(DiscoveryEvent::Put(i));
                }
            }
            Some(Seen::Left(id)) => {
                lost.remove(&id);
                if shown.remove(&id).is_some() {
                    events.push(DiscoveryEvent::Delete {
                        component: component.clone(),
                        id,
                    });
                }
            }
            Some(Seen::Lost(id)) => {
                if !shown.contains_key(&id) {
                    continue;
                }
                if grace.is_zero() {
                    shown.remove(&id);
                    events.push(DiscoveryEvent::Delete {
                        component: component.clone(),
                        id,
                    });
                } else if let std::collections::hash_map::Entry::Vacant(e) = lost.entry(id) {
                    tracing::info!(%component, id = %e.key(), ?grace, "member's lease lost; keeping it while it registers again");
                    e.insert(tokio::time::Instant::now() + grace);
                }
            }
        }
        for e in events {
            if out.send(e).await.is_err() {
                return;
            }
        }
    }
}

/// The key of an instance: `/sluice/v1/<namespace>/<component>/<id>`.
pub fn instance_key(namespace: &str, component: &str, id: &str) -> String {
    format!("{}{id}", component_prefix(namespace, component))
}

/// The prefix of every instance of a component, with the trailing slash.
pub fn component_prefix(namespace: &str, component: &str) -> String {
    format!("/sluice/v1/{namespace}/{component}/")
}

/// Parses a stored entry, logging and skipping a malformed one.
pub(crate) fn parse_entry(key: &str, value: &[u8]) -> Option<Instance> {
    match serde_json::from_slice::<Instance>(value) {
        Ok(i) => Some(i),
        Err(source) => {
            let err = RuntimeError::BadEntry {
                key: key.to_string(),
                source,
            };
            tracing::warn!(error = %err, cause = %err_source(&err), "skipping malformed discovery entry");
            None
        }
    }
}

fn err_source(e: &dyn std::error::Error) -> String {
    e.source().map(|s| s.to_string()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch() -> (mpsc::Sender<DiscoveryEvent>, Watch) {
        let (tx, rx) = mpsc::channel(8);
        (tx, Watch::new(rx, CancellationToken::new()))
    }

    #[tokio::test]
    async fn follow_hands_every_event_in_order_until_the_watch_ends() {
        let (tx, watch) = watch();
        let a = Instance::new("queue", "127.0.0.1:1");
        let sent = vec![
            DiscoveryEvent::Put(a.clone()),
            DiscoveryEvent::Delete {
                component: "queue".into(),
                id: a.id.clone(),
            },
        ];
        for e in sent.clone() {
            tx.send(e).await.expect("watch open");
        }
        drop(tx);
        let mut seen = Vec::new();
        let followed = watch
            .follow(&CancellationToken::new(), |e| seen.push(e))
            .await;
        assert_eq!(followed, Followed::WatchEnded);
        assert_eq!(seen, sent);
    }

    #[tokio::test]
    async fn follow_returns_when_its_stop_token_is_cancelled() {
        let (_tx, watch) = watch();
        let stop = CancellationToken::new();
        stop.cancel();
        let followed = watch
            .follow(&stop, |e| panic!("no event was sent: {e:?}"))
            .await;
        assert_eq!(followed, Followed::Stopped);
    }
}
