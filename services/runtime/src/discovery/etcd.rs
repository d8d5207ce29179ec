//! Discovery over etcd: each instance is a key under a lease that a
//! background task keeps alive; watches resume from the last seen revision
//! after a disconnect and re-list (emitting only differences) when that
//! revision has been compacted away. An owner marks its entry as leaving
//! before revoking its lease, so watchers can tell a departure from a lost
//! lease, which they forgive for the grace period (see [`super`]).

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::{
    Discovery, DiscoveryEvent, Instance, Registration, Seen, Watch, component_prefix, instance_key,
    parse_entry, settle,
};
use crate::RuntimeError;

/// How long one attempt to connect to etcd may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// HTTP/2 pings on the connection to etcd while a call is open: a
/// connection whose peer stopped answering (a stalled etcd, a proxy in
/// front of a dead one) fails its calls after about both together instead
/// of holding them for good. etcd turns away clients that ping more often
/// than every 5 s with a call open (`--grpc-keepalive-min-time`), or at all
/// within 2 h without one (gRPC's enforcement policy: after three such
/// pings it closes the connection with `too_many_pings`), so an idle
/// connection does not ping.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);

const RETRY: Duration = Duration::from_millis(500);

/// Discovery backed by an etcd cluster.
#[derive(Clone)]
pub struct EtcdDiscovery {
    client: Client,
    endpoint: String,
    namespace: String,
    grace: Duration,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("endpoint", &self.endpoint)
            .field("namespace", &self.namespace)
            .field("grace", &self.grace)
            .finish()
    }
}

impl EtcdDiscovery {
    /// Connects to `endpoint` (e.g. `http://127.0.0.1:2379`). Watches drop a
    /// member whose lease was lost at once; see [`Self::with_grace`].
    pub async fn connect(endpoint: &str, namespace: &str) -> Result<Self, RuntimeError> {
        // The client connects on first use. A connection attempt that hangs
        // (a filtered port) fails after the connect timeout; a call on a
        // connection that opens but never answers, after the keep-alive's.
        let options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_keep_alive(KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT)
            .with_keep_alive_while_idle(false);
        let client = Client::connect([endpoint], Some(options))
            .await
            .map_err(|source| RuntimeError::Etcd {
                endpoint: endpoint.to_string(),
                source,
            })?;
        Ok(Self {
            client,
            endpoint: endpoint.into(),
            namespace: namespace.into(),
            grace: Duration::ZERO,
        })
    }

    /// Watches keep a member whose lease was lost (rather than revoked by
    /// its owner) for `grace`, waiting for it to register again.
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    fn err(&self, source: etcd_client::Error) -> RuntimeError {
        RuntimeError::Etcd {
            endpoint: self.endpoint.clone(),
            source,
        }
    }

    /// Grants a lease and puts the entry under it; returns the lease id.
    async fn put_with_lease(
        &self,
        key: &str,
        value: &str,
        ttl: u32,
    ) -> Result<i64, etcd_client::Error> {
        let mut c = self.client.clone();
        let lease = c.lease_grant(i64::from(ttl), None).await?.id();
        c.put(key, value, Some(PutOptions::new().with_lease(lease)))
            .await?;
        Ok(lease)
    }

    /// Keeps `lease` alive until cancelled or lost; returns true when cancelled.
    async fn keep_alive(&self, lease: i64, ttl: u32, stop: &CancellationToken) -> bool {
        let mut c = self.client.clone();
        let (mut keeper, mut responses) = match c.lease_keep_alive(lease).await {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(error = %e, "etcd keep-alive stream");
                return stop.is_cancelled();
            }
        };
        let period =
            Duration::from_millis(u64::from(ttl) * 1000 / 3).max(Duration::from_millis(200));
        loop {
            tokio::select! {
                _ = stop.cancelled() => return true,
                _ = tokio::time::sleep(period) => {}
            }
            if let Err(e) = keeper.keep_alive().await {
                tracing::warn!(error = %e, "etcd keep-alive failed");
                return false;
            }
            match responses.message().await {
                Ok(Some(r)) if r.ttl() > 0 => {}
                Ok(_) => {
                    tracing::warn!(lease, "etcd lease lost; registering again");
                    return false;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "etcd keep-alive response");
                    return false;
                }
            }
        }
    }

    async fn list_map(
        &self,
        component: &str,
    ) -> Result<(BTreeMap<String, Instance>, i64), RuntimeError> {
        let prefix = component_prefix(&self.namespace, component);
        let mut c = self.client.clone();
        let resp = c
            .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err(e))?;
        let rev = resp.header().map(|h| h.revision()).unwrap_or(0);
        let mut out = BTreeMap::new();
        for kv in resp.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            if let Some(i) = parse_entry(&key, kv.value())
                && !i.leaving
            {
                out.insert(id_from_key(&key).to_string(), i);
            }
        }
        Ok((out, rev))
    }
}

/// Why a watch's follower stopped following one stream.
enum Next {
    /// Open a new stream from the last revision seen.
    Resume,
    /// The revisions were compacted away: re-list, then resume.
    Relist,
    /// The watch was dropped or cancelled.
    Stop,
}

/// One watch's task: follows the component's keys from a revision, resumes
/// after an interruption from the last revision seen, re-lists (reporting
/// the difference) when etcd compacted that revision away, and sends what
/// it sees to the watch's settling stage.
struct Follower {
    discovery: EtcdDiscovery,
    component: String,
    prefix: String,
    /// The entries as last reported, by id.
    known: BTreeMap<String, Instance>,
    /// The last revision seen.
    rev: i64,
    tx: mpsc::Sender<Seen>,
    token: CancellationToken,
}

impl Follower {
    async fn run(mut self) {
        let mut relist = false;
        loop {
            if self.token.is_cancelled() || self.tx.is_closed() {
                return;
            }
            if relist {
                match self.relist().await {
                    Next::Stop => return,
                    Next::Relist => {
                        if !self.pause().await {
                            return;
                        }
                        continue;
                    }
                    Next::Resume => relist = false,
                }
            }
            match self.follow().await {
                Next::Stop => return,
                Next::Relist => relist = true,
                Next::Resume => {}
            }
            if !self.pause().await {
                return;
            }
        }
    }

    /// Waits before the next try; false when cancelled meanwhile.
    async fn pause(&self) -> bool {
        tokio::select! {
            _ = self.token.cancelled() => false,
            _ = tokio::time::sleep(RETRY) => true,
        }
    }

    /// Lists the component again and reports what changed since `known`.
    async fn relist(&mut self) -> Next {
        match self.discovery.list_map(&self.component).await {
            Ok((now, rev)) => {
                for e in diff_seen(&self.known, &now) {
                    if self.tx.send(e).await.is_err() {
                        return Next::Stop;
                    }
                }
                self.known = now;
                self.rev = rev;
                Next::Resume
            }
            Err(e) => {
                tracing::debug!(error = %e, "etcd re-list");
                Next::Relist
            }
        }
    }

    /// Opens a watch stream from the revision after the last seen and
    /// follows it until it ends.
    async fn follow(&mut self) -> Next {
        let mut client = self.discovery.client.clone();
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(self.rev + 1);
        let mut stream = match client.watch(self.prefix.as_str(), Some(opts)).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "etcd watch; retrying");
                return Next::Resume;
            }
        };
        loop {
            let msg = tokio::select! {
                _ = self.token.cancelled() => return Next::Stop,
                m = stream.message() => m,
            };
            let resp = match msg {
                Ok(Some(r)) => r,
                Ok(None) => return Next::Resume,
                Err(e) => {
                    tracing::info!(error = %e, "etcd watch interrupted; resuming from revision {}", self.rev);
                    return Next::Resume;
                }
            };
            if resp.canceled() {
                if resp.compact_revision() > 0 {
                    tracing::info!(
                        compacted = resp.compact_revision(),
                        "watch revision compacted; re-listing"
                    );
                    return Next::Relist;
                }
                return Next::Resume;
            }
            for ev in resp.events() {
                let Some(seen) = self.seen(ev) else { continue };
                if self.tx.send(seen).await.is_err() {
                    return Next::Stop;
                }
            }
        }
    }

    /// What one event means for the watch, given what is known; `None`
    /// when nothing changed (a malformed entry, a repeat departure).
    fn seen(&mut self, ev: &etcd_client::Event) -> Option<Seen> {
        let kv = ev.kv()?;
        self.rev = self.rev.max(kv.mod_revision());
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        let id = id_from_key(&key).to_string();
        match ev.event_type() {
            EventType::Put => match parse_entry(&key, kv.value())? {
                i if i.leaving => self.known.remove(&id).map(|_| Seen::Left(id)),
                i => {
                    self.known.insert(id, i.clone());
                    Some(Seen::Put(i))
                }
            },
            EventType::Delete => self.known.remove(&id).map(|_| Seen::Lost(id)),
        }
    }
}

fn id_from_key(key: &str) -> &str {
    key.rsplit('/').next().unwrap_or(key)
}

/// What turns `old` into `new` for one watch: entries gone from `new` count
/// as lost leases (a departure marked in between was not seen).
fn diff_seen(old: &BTreeMap<String, Instance>, new: &BTreeMap<String, Instance>) -> Vec<Seen> {
    let mut out: Vec<Seen> = old
        .keys()
        .filter(|id| !new.contains_key(*id))
        .map(|id| Seen::Lost(id.clone()))
        .collect();
    for (id, i) in new {
        if old.get(id) != Some(i) {
            out.push(Seen::Put(i.clone()));
        }
    }
    out
}

/// The events that turn `old` into `new` for one component.
pub(super) fn diff(
    component: &str,
    old: &BTreeMap<String, Instance>,
    new: &BTreeMap<String, Instance>,
) -> Vec<DiscoveryEvent> {
    let mut out = Vec::new();
    for (id, _) in old.iter().filter(|(id, _)| !new.contains_key(*id)) {
        out.push(DiscoveryEvent::Delete {
            component: component.into(),
            id: id.clone(),
        });
    }
    for (id, i) in new {
        if old.get(id) != Some(i) {
            out.push(DiscoveryEvent::Put(i.clone()));
        }
    }
    out
}

#[async_trait::async_trait]
impl Discovery for EtcdDiscovery {
    async fn register(
        &self,
        instance: Instance,
        ttl_secs: u32,
    ) -> Result<Registration, RuntimeError> {
        let key = instance_key(&self.namespace, &instance.component, &instance.id);
        // Encoded once, with the leaving mark written before revoking.
        let encode = |i: &Instance| {
            serde_json::to_string(i).map_err(|source| RuntimeError::BadEntry {
                key: key.clone(),
                source,
            })
        };
        let value = encode(&instance)?;
        let leaving_value = encode(&Instance {
            leaving: true,
            ..instance.clone()
        })?;
        let ttl = ttl_secs.max(1);
        let mut lease = self
            .put_with_lease(&key, &value, ttl)
            .await
            .map_err(|e| self.err(e))?;
        let stop = CancellationToken::new();
        let (done_tx, done_rx) = oneshot::channel();
        let this = self.clone();
        let token = stop.clone();
        tokio::spawn(async move {
            loop {
                if this.keep_alive(lease, ttl, &token).await {
                    break;
                }
                // Lease lost (etcd restarted, partition): register again until it works.
                loop {
                    tokio::select! {
                        _ = token.cancelled() => { let _ = done_tx.send(()); return; }
                        _ = tokio::time::sleep(RETRY) => {}
                    }
                    match this.put_with_lease(&key, &value, ttl).await {
                        Ok(l) => {
                            lease = l;
                            tracing::info!(%key, "re-registered in etcd");
                            break;
                        }
                        Err(e) => tracing::debug!(error = %e, "etcd re-register"),
                    }
                }
            }
            let mut c = this.client.clone();
            // Marked first, so watchers drop it at once instead of waiting
            // for it to come back as they do for a lost lease.
            let opts = PutOptions::new().with_lease(lease);
            if let Err(e) = c.put(key.as_str(), leaving_value, Some(opts)).await {
                tracing::debug!(error = %e, %key, "marking the entry as leaving");
            }
            if let Err(e) = c.lease_revoke(lease).await {
                tracing::debug!(error = %e, %key, "revoking lease; it will expire");
            }
            let _ = done_tx.send(());
        });
        Ok(Registration::new(instance, stop, done_rx))
    }

    async fn list(&self, component: &str) -> Result<Vec<Instance>, RuntimeError> {
        Ok(self.list_map(component).await?.0.into_values().collect())
    }

    async fn watch(&self, component: &str) -> Result<Watch, RuntimeError> {
        let (known, rev) = self.list_map(component).await?;
        let (tx, raw) = mpsc::channel(256);
        for i in known.values() {
            let _ = tx.try_send(Seen::Put(i.clone()));
        }
        let (out, rx) = mpsc::channel(256);
        let stop = CancellationToken::new();
        let token = stop.clone();
        tokio::spawn(settle(
            component.to_string(),
            raw,
            out,
            self.grace,
            stop.clone(),
        ));
        let follower = Follower {
            prefix: component_prefix(&self.namespace, component),
            discovery: self.clone(),
            component: component.to_string(),
            known,
            rev,
            tx,
            token,
        };
        tokio::spawn(follower.run());
        Ok(Watch::new(rx, stop))
    }
}
