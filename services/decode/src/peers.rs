//! The peers a decode worker dials, as discovery lists them: prefill
//! workers (remote prefill) and decode workers (prefix fetches). A request
//! names a peer by id; its endpoint comes from discovery, never from the
//! request, so a `Generate` cannot make this worker connect anywhere else.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;
use sluice_runtime::discovery::WorkerRole;
use sluice_runtime::{DiscoveryEvent, ServiceContext};
use sluice_worker::WorkerError;

/// The workers of one role discovery lists, id → endpoint: the only ones
/// of that role this worker ever dials.
#[derive(Debug, Default)]
pub struct Peers {
    by_id: RwLock<HashMap<String, String>>,
}

impl Peers {
    /// Follows `role`'s component in discovery until the service's
    /// background ends; `known` shows how many are known.
    pub async fn follow(
        ctx: &ServiceContext,
        role: WorkerRole,
        known: prometheus::IntGauge,
    ) -> Result<Arc<Self>, WorkerError> {
        let watch = ctx
            .discovery
            .watch(role.as_str())
            .await
            .map_err(WorkerError::startup("watching peer workers"))?;
        let peers = Arc::new(Self::default());
        let p = Arc::clone(&peers);
        let stop = ctx.background().clone();
        ctx.spawn(async move {
            watch
                .follow(&stop, |event| {
                    let mut by_id = p.by_id.write();
                    match event {
                        DiscoveryEvent::Put(i) => {
                            by_id.insert(i.id, i.endpoint);
                        }
                        DiscoveryEvent::Delete { id, .. } => {
                            by_id.remove(&id);
                        }
                    }
                    known.set(i64::try_from(by_id.len()).unwrap_or(i64::MAX));
                })
                .await;
        });
        Ok(peers)
    }

    /// A set of known workers (tests).
    pub fn from_known(known: impl IntoIterator<Item = (String, String)>) -> Self {
        Self {
            by_id: RwLock::new(known.into_iter().collect()),
        }
    }

    /// The endpoint discovery gives for worker `id`.
    pub fn endpoint(&self, id: &str) -> Option<String> {
        self.by_id.read().get(id).cloned()
    }
}
