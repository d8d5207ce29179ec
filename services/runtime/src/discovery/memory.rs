//! In-process discovery for `sluice up`: a map and a broadcast of changes.
//! Leases are the registrations themselves: dropping one removes the entry.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{Discovery, DiscoveryEvent, Instance, Registration, Watch, instance_key};
use crate::RuntimeError;

/// Discovery inside one process.
#[derive(Debug, Clone)]
pub struct MemoryDiscovery {
    namespace: String,
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    entries: Mutex<BTreeMap<String, Instance>>,
    changes: broadcast::Sender<DiscoveryEvent>,
}

impl MemoryDiscovery {
    /// An empty registry for `namespace`.
    pub fn new(namespace: &str) -> Self {
        let (changes, _) = broadcast::channel(1024);
        Self {
            namespace: namespace.into(),
            inner: Arc::new(Inner {
                entries: Mutex::new(BTreeMap::new()),
                changes,
            }),
        }
    }

    fn remove(inner: &Inner, key: &str) {
        let removed = inner.entries.lock().remove(key);
        if let Some(i) = removed {
            let _ = inner.changes.send(DiscoveryEvent::Delete {
                component: i.component,
                id: i.id,
            });
        }
    }

    fn snapshot(&self, component: &str) -> BTreeMap<String, Instance> {
        self.inner
            .entries
            .lock()
            .values()
            .filter(|i| i.component == component)
            .map(|i| (i.id.clone(), i.clone()))
            .collect()
    }
}

#[async_trait::async_trait]
impl Discovery for MemoryDiscovery {
    async fn register(
        &self,
        instance: Instance,
        _ttl_secs: u32,
    ) -> Result<Registration, RuntimeError> {
        let key = instance_key(&self.namespace, &instance.component, &instance.id);
        {
            let mut entries = self.inner.entries.lock();
            if entries.contains_key(&key) {
                return Err(RuntimeError::AlreadyRegistered {
                    component: instance.component,
                    id: instance.id,
                });
            }
            entries.insert(key.clone(), instance.clone());
            let _ = self
                .inner
                .changes
                .send(DiscoveryEvent::Put(instance.clone()));
        }
        let stop = CancellationToken::new();
        let (done_tx, done_rx) = oneshot::channel();
        let inner = Arc::downgrade(&self.inner);
        let token = stop.clone();
        // Removal runs in a task so that Drop (sync) and deregister (async)
        // share one path; where no runtime remains, the registry is gone too.
        let cleanup = move || {
            if let Some(inner) = inner.upgrade() {
                MemoryDiscovery::remove(&inner, &key);
            }
            let _ = done_tx.send(());
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn(async move {
                    token.cancelled().await;
                    cleanup();
                });
            }
            Err(_) => cleanup(),
        }
        Ok(Registration::new(instance, stop, done_rx))
    }

    async fn list(&self, component: &str) -> Result<Vec<Instance>, RuntimeError> {
        Ok(self.snapshot(component).into_values().collect())
    }

    async fn watch(&self, component: &str) -> Result<Watch, RuntimeError> {
        let mut changes = self.inner.changes.subscribe();
        let mut known = self.snapshot(component);
        let (tx, rx) = mpsc::channel(256);
        let stop = CancellationToken::new();
        let token = stop.clone();
        let this = self.clone();
        let component = component.to_string();
        tokio::spawn(async move {
            for i in known.values() {
                if tx.send(DiscoveryEvent::Put(i.clone())).await.is_err() {
                    return;
                }
            }
            loop {
                let ev = tokio::select! {
                    _ = token.cancelled() => return,
                    ev = changes.recv() => ev,
                };
                let events = match ev {
                    Ok(DiscoveryEvent::Put(i)) if i.component == component => {
                        known.insert(i.id.clone(), i.clone());
                        vec![DiscoveryEvent::Put(i)]
                    }
                    Ok(DiscoveryEvent::Delete { component: c, id }) if c == component => {
                        known.remove(&id);
                        vec![DiscoveryEvent::Delete { component: c, id }]
                    }
                    Ok(_) => continue,
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let now = this.snapshot(&component);
                        let diff = super::etcd::diff(&component, &known, &now);
                        known = now;
                        diff
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                for e in events {
                    if tx.send(e).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Watch::new(rx, stop))
    }
}
