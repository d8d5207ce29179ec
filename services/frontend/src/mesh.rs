//! The frontend's view of the mesh: which queues and workers exist (from
//! discovery), and one reusable traced channel per endpoint.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::RwLock;
use sluice_runtime::grpc::{TracedChannel, channel};
use sluice_runtime::{Discovery, DiscoveryEvent, Instance, Shutdown};

use crate::error::FrontendError;

/// Live membership of one component, kept current by a discovery watch.
#[derive(Debug, Default)]
pub(crate) struct Members {
    instances: RwLock<BTreeMap<String, Instance>>,
    next: AtomicUsize,
}

impl Members {
    /// Follows `component` in discovery until `shutdown`.
    pub(crate) async fn follow(
        discovery: &Arc<dyn Discovery>,
        component: &'static str,
        shutdown: Shutdown,
    ) -> Result<Arc<Self>, FrontendError> {
        let mut watch =
            discovery
                .watch(component)
                .await
                .map_err(|e| FrontendError::Unavailable {
                    component: "discovery",
                    message: e.to_string(),
                })?;
        let members = Arc::new(Self::default());
        let m = Arc::clone(&members);
        tokio::spawn(async move {
            loop {
                let ev = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    ev = watch.next() => ev,
                };
                match ev {
                    Some(DiscoveryEvent::Put(i)) => {
                        tracing::info!(component, id = %i.id, endpoint = %i.endpoint, "instance joined");
                        m.instances.write().insert(i.id.clone(), i);
                    }
                    Some(DiscoveryEvent::Delete { id, .. }) => {
                        tracing::info!(component, %id, "instance left");
                        m.instances.write().remove(&id);
                    }
                    None => return,
                }
            }
        });
        Ok(members)
    }

    /// How many instances serve `model` (all, when `model` is empty).
    pub(crate) fn count(&self, model: &str) -> usize {
        self.instances
            .read()
            .values()
            .filter(|i| model.is_empty() || i.model == model)
            .count()
    }

    /// The first value of metadata `key` among instances serving `model`.
    pub(crate) fn meta<T: std::str::FromStr>(&self, model: &str, key: &str) -> Option<T> {
        self.instances
            .read()
            .values()
            .filter(|i| model.is_empty() || i.model == model)
            .find_map(|i| i.metadata.get(key)?.parse().ok())
    }

    /// One instance's endpoint, round-robin.
    pub(crate) fn pick(&self) -> Option<String> {
        let all = self.instances.read();
        if all.is_empty() {
            return None;
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed) % all.len();
        all.values().nth(n).map(|i| i.endpoint.clone())
    }
}

/// One lazily connected channel per endpoint, reused across requests.
#[derive(Debug, Default)]
pub(crate) struct Channels {
    by_endpoint: RwLock<HashMap<String, TracedChannel>>,
}

impl Channels {
    pub(crate) fn get(&self, endpoint: &str) -> Result<TracedChannel, FrontendError> {
        if let Some(c) = self.by_endpoint.read().get(endpoint) {
            return Ok(c.clone());
        }
        let c = channel(endpoint).map_err(|e| FrontendError::Internal {
            detail: format!("channel to {endpoint}: {e}"),
        })?;
        self.by_endpoint
            .write()
            .insert(endpoint.to_string(), c.clone());
        Ok(c)
    }
}
