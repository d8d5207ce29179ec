//! The frontend's view of the mesh: which queues and workers exist (from
//! discovery), and one reusable traced channel per endpoint.
//!
//! A member a call just found dead (it may stay listed until its lease
//! expires and the grace period passes) is suspected for a while: picks
//! prefer the others.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use sluice_runtime::discovery::WorkerInfo;
use sluice_runtime::grpc::TracedChannel;
use sluice_runtime::{DiscoveryEvent, Instance, Security, ServiceContext};

use crate::error::FrontendError;

/// How long a member that failed a call is passed over while others remain.
const SUSPECT_FOR: Duration = Duration::from_secs(5);

/// Live membership of one component, kept current by a discovery watch.
#[derive(Debug, Default)]
pub(crate) struct Members {
    instances: RwLock<BTreeMap<String, Instance>>,
    next: AtomicUsize,
    /// Members that failed a call, until when they are passed over.
    suspects: RwLock<HashMap<String, Instant>>,
}

impl Members {
    /// Follows `component` in discovery, as one of `ctx`'s tasks, until the
    /// frontend has drained (failover needs the members while it drains).
    pub(crate) async fn follow(
        ctx: &ServiceContext,
        component: &'static str,
    ) -> Result<Arc<Self>, FrontendError> {
        let watch =
            ctx.discovery
                .watch(component)
                .await
                .map_err(|e| FrontendError::Unavailable {
                    component: "discovery",
                    message: e.to_string(),
                })?;
        let members = Arc::new(Self::default());
        let m = Arc::clone(&members);
        let stop = ctx.background().clone();
        ctx.spawn(async move {
            watch
                .follow(&stop, |event| match event {
                    DiscoveryEvent::Put(i) => {
                        tracing::info!(component, id = %i.id, endpoint = %i.endpoint, "instance joined");
                        m.instances.write().insert(i.id.clone(), i);
                    }
                    DiscoveryEvent::Delete { id, .. } => {
                        tracing::info!(component, %id, "instance left");
                        m.instances.write().remove(&id);
                    }
                })
                .await;
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

    /// `fact` of every worker serving `model` that says it (see
    /// [`WorkerInfo`]).
    pub(crate) fn worker_facts<T>(
        &self,
        model: &str,
        fact: impl Fn(&WorkerInfo) -> Option<T>,
    ) -> Vec<T> {
        self.instances
            .read()
            .values()
            .filter(|i| model.is_empty() || i.model == model)
            .filter_map(|i| fact(i.worker.as_ref()?))
            .collect()
    }

    /// `fact` of the first worker serving `model` that says it.
    pub(crate) fn worker_fact<T>(
        &self,
        model: &str,
        fact: impl Fn(&WorkerInfo) -> Option<T>,
    ) -> Option<T> {
        self.instances
            .read()
            .values()
            .filter(|i| model.is_empty() || i.model == model)
            .find_map(|i| fact(i.worker.as_ref()?))
    }

    /// One instance not in `tried`, round-robin, passing over suspects
    /// while any other is left.
    pub(crate) fn pick(&self, tried: &[String]) -> Option<Instance> {
        let now = Instant::now();
        let suspects = self.suspects.read();
        let all = self.instances.read();
        let untried = || all.values().filter(|i| !tried.contains(&i.id));
        let healthy =
            || untried().filter(|i| suspects.get(&i.id).is_none_or(|until| *until <= now));
        // Counted, then walked: no per-request allocation on the hot path.
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        match healthy().count() {
            0 => {
                let len = untried().count();
                (len > 0).then(|| untried().nth(n % len)).flatten().cloned()
            }
            len => healthy().nth(n % len).cloned(),
        }
    }

    /// `id` failed a call: pass it over for a while.
    pub(crate) fn suspect(&self, id: &str) {
        let now = Instant::now();
        let mut suspects = self.suspects.write();
        suspects.retain(|_, until| *until > now);
        suspects.insert(id.to_string(), now + SUSPECT_FOR);
    }

    /// `id` answered: no longer suspected.
    pub(crate) fn cleared(&self, id: &str) {
        if self.suspects.read().contains_key(id) {
            self.suspects.write().remove(id);
        }
    }
}

/// One lazily connected channel per endpoint, reused across requests, with
/// the service's TLS and mesh token.
#[derive(Debug, Default)]
pub(crate) struct Channels {
    by_endpoint: RwLock<HashMap<String, TracedChannel>>,
    security: Arc<Security>,
}

impl Channels {
    pub(crate) fn new(security: Arc<Security>) -> Self {
        Self {
            by_endpoint: RwLock::default(),
            security,
        }
    }

    pub(crate) fn get(&self, endpoint: &str) -> Result<TracedChannel, FrontendError> {
        if let Some(c) = self.by_endpoint.read().get(endpoint) {
            return Ok(c.clone());
        }
        let c = self
            .security
            .channel(endpoint)
            .map_err(FrontendError::broken(format!(
                "opening a channel to {endpoint}"
            )))?;
        self.by_endpoint
            .write()
            .insert(endpoint.to_string(), c.clone());
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(ids: &[&str]) -> Members {
        let m = Members::default();
        for id in ids {
            let mut i = Instance::new("queue", format!("{id}:1"));
            i.id = (*id).to_string();
            m.instances.write().insert(i.id.clone(), i);
        }
        m
    }

    fn picks(m: &Members, tried: &[String], n: usize) -> Vec<String> {
        let mut out: Vec<String> = (0..n).filter_map(|_| m.pick(tried).map(|i| i.id)).collect();
        out.sort();
        out.dedup();
        out
    }

    #[test]
    fn pick_skips_tried_members_and_passes_over_suspects_while_others_remain() {
        let m = members(&["a", "b", "c"]);
        assert_eq!(picks(&m, &[], 6), ["a", "b", "c"]);
        assert_eq!(picks(&m, &["a".into(), "c".into()], 4), ["b"]);
        assert!(m.pick(&["a".into(), "b".into(), "c".into()]).is_none());

        m.suspect("a");
        assert_eq!(picks(&m, &[], 6), ["b", "c"]);
        // Only suspects left untried: one of them is better than none.
        assert_eq!(picks(&m, &["b".into(), "c".into()], 2), ["a"]);
        m.cleared("a");
        assert_eq!(picks(&m, &[], 6), ["a", "b", "c"]);
    }
}
