//! The order held requests are released in: a static key per request under
//! `fcfs`, `wspt` and `strict`, bands of weighted classes (see [`fair`]) under
//! `wfq` and `fair`.

use super::*;

mod fair;

/// Where a released request's work is charged under `wfq`/`fair`.
#[derive(Debug, Clone)]
pub(super) struct Released {
    pub(super) band: BandKey,
    pub(super) class: Arc<str>,
    /// The cost charged at release (refunded if it never runs).
    pub(super) charged: f64,
}

/// Held requests of one model in release order.
#[derive(Debug)]
pub(super) enum Order {
    /// `fcfs`, `wspt`, `strict`: a static key per request.
    Keyed(BTreeMap<OrderKey, u64>),
    /// `wfq`, `fair`: bands in strict order, classes sharing by weight
    /// inside each.
    Fair(BTreeMap<BandKey, fair::Band>),
}

/// A band: (strict tier, priority) under `fair`, (strict tier, 0) under
/// `wfq`; highest first.
pub(super) type BandKey = (Reverse<u32>, Reverse<i32>);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct OrderKey {
    pub(super) tier: Reverse<u32>,
    pub(super) key: PolicyKey,
    pub(super) seq: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum PolicyKey {
    /// Effective arrival in ns since the queue's epoch; earliest first.
    EffectiveArrival(i128),
    /// Highest priority first.
    Priority(Reverse<i32>),
    /// Largest WSPT score first.
    Score(Reverse<TotalF64>),
}

/// `f64` ordered by `total_cmp`.
#[derive(Debug, Clone, Copy)]
pub(super) struct TotalF64(f64);

impl PartialEq for TotalF64 {
    fn eq(&self, other: &Self) -> bool {
        self.0.total_cmp(&other.0).is_eq()
    }
}
impl Eq for TotalF64 {}
impl PartialOrd for TotalF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for TotalF64 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

pub(super) fn order_key(cfg: &Args, epoch: Instant, seq: u64, entry: &Entry) -> OrderKey {
    let bump = i128::from(entry.desc.priority.max(0));
    let key = match cfg.queue_policy {
        Policy::Fcfs | Policy::Wfq | Policy::Fair => {
            let arrival = if entry.arrival >= epoch {
                entry.arrival.duration_since(epoch).as_nanos() as i128
            } else {
                -(epoch.duration_since(entry.arrival).as_nanos() as i128)
            };
            PolicyKey::EffectiveArrival(arrival - bump * 1_000_000_000)
        }
        Policy::Strict => PolicyKey::Priority(Reverse(entry.desc.priority)),
        Policy::Wspt => {
            let score = (1 + bump) as f64 / f64::from(entry.uncached_tokens().max(1));
            PolicyKey::Score(Reverse(TotalF64(score)))
        }
    };
    OrderKey {
        tier: Reverse(entry.desc.strict_priority),
        key,
        seq,
    }
}

pub(super) fn wfq_class(cfg: &Args, entry: &Entry) -> String {
    let tenant = if entry.desc.tenant.is_empty() {
        crate::tenants::DEFAULT_TENANT
    } else {
        entry.desc.tenant.as_str()
    };
    match cfg.wfq_class {
        WfqClass::Tenant => tenant.to_owned(),
        WfqClass::Priority => entry.desc.priority.to_string(),
        WfqClass::TenantPriority => format!("{tenant}/{}", entry.desc.priority),
    }
}

/// Whether releases cost tokens (`fair`, `wfq --wfq-cost tokens`) rather
/// than one per request.
pub(super) fn tokens_cost(cfg: &Args) -> bool {
    cfg.queue_policy == Policy::Fair || cfg.wfq_cost == WfqCost::Tokens
}

/// `entry`'s band and class under `wfq`/`fair`.
pub(super) fn band_and_class(cfg: &Args, entry: &Entry) -> (BandKey, String) {
    match cfg.queue_policy {
        Policy::Fair => {
            let band = (
                Reverse(entry.desc.strict_priority),
                Reverse(entry.desc.priority),
            );
            let tenant = if entry.desc.tenant.is_empty() {
                crate::tenants::DEFAULT_TENANT
            } else {
                entry.desc.tenant.as_str()
            };
            (band, tenant.to_owned())
        }
        _ => (
            (Reverse(entry.desc.strict_priority), Reverse(0)),
            wfq_class(cfg, entry),
        ),
    }
}

/// A class's weight: `--wfq-weights`' for its key, else the tenant's
/// (`tenant_weight`, for classes of a tenant), else the default.
pub(super) fn class_weight(cfg: &Args, class: &str, tenant_weight: u32) -> u32 {
    let of_tenant = cfg.queue_policy == Policy::Fair
        || matches!(cfg.wfq_class, WfqClass::Tenant | WfqClass::TenantPriority);
    cfg.wfq_weights
        .0
        .get(class)
        .copied()
        .or_else(|| (of_tenant && tenant_weight > 0).then_some(tenant_weight))
        .unwrap_or(cfg.wfq_default_weight)
        .max(1)
}

impl Order {
    /// Holds `seq`; `tenant_weight` is its tenant's weight (0 = none).
    pub(super) fn insert(
        &mut self,
        cfg: &Args,
        epoch: Instant,
        seq: u64,
        entry: &Entry,
        tenant_weight: u32,
    ) {
        match self {
            Order::Keyed(map) => {
                map.insert(order_key(cfg, epoch, seq, entry), seq);
            }
            Order::Fair(bands) => {
                let (band, class) = band_and_class(cfg, entry);
                let weight = class_weight(cfg, &class, tenant_weight);
                let cost = if tokens_cost(cfg) {
                    f64::from(entry.uncached_tokens().max(1))
                } else {
                    1.0
                };
                bands
                    .entry(band)
                    .or_default()
                    .push(Arc::from(class), weight, seq, cost);
            }
        }
    }

    /// Removes `seq` (cancelled, expired or re-keyed); `entry` is its
    /// current entry. Not a release: nothing is charged.
    pub(super) fn remove(&mut self, cfg: &Args, epoch: Instant, seq: u64, entry: &Entry) {
        match self {
            Order::Keyed(map) => {
                map.remove(&order_key(cfg, epoch, seq, entry));
            }
            Order::Fair(bands) => {
                let (key, class) = band_and_class(cfg, entry);
                if let Some(band) = bands.get_mut(&key) {
                    band.remove(&class, seq);
                    if band.is_idle() {
                        bands.remove(&key);
                    }
                }
            }
        }
    }

    /// Charges `work` (tokens, or requests under unit cost; negative: a
    /// refund) to a released request's class.
    pub(super) fn charge(&mut self, released: &Released, work: f64) {
        if let Order::Fair(bands) = self
            && let Some(band) = bands.get_mut(&released.band)
        {
            band.charge(&released.class, work);
        }
    }

    /// A released request ended or was never granted.
    pub(super) fn finish(&mut self, released: &Released) {
        if let Order::Fair(bands) = self
            && let Some(band) = bands.get_mut(&released.band)
        {
            band.finish(&released.class);
            if band.is_idle() {
                bands.remove(&released.band);
            }
        }
    }

    /// Forgets every held request.
    pub(super) fn clear(&mut self) {
        match self {
            Order::Keyed(map) => map.clear(),
            Order::Fair(bands) => bands.clear(),
        }
    }

    /// Takes the next request out for release; under `wfq`/`fair` also
    /// where its work is charged.
    pub(super) fn pop_head(&mut self) -> Option<(u64, Option<Released>)> {
        match self {
            Order::Keyed(map) => map.pop_first().map(|(_, seq)| (seq, None)),
            Order::Fair(bands) => bands.iter_mut().find_map(|(key, band)| {
                band.pop().map(|(seq, class, charged)| {
                    let released = Released {
                        band: *key,
                        class,
                        charged,
                    };
                    (seq, Some(released))
                })
            }),
        }
    }

    /// How many held requests would be released before `entry` if it were
    /// held now (its tenant weighing `tenant_weight`): exact for keyed
    /// orders; under `wfq`/`fair` every earlier band, and in its own band
    /// what the other classes release while its class releases its
    /// backlog and it, in proportion to their weights.
    pub(super) fn ahead_of(
        &self,
        cfg: &Args,
        epoch: Instant,
        entry: &Entry,
        tenant_weight: u32,
    ) -> usize {
        match self {
            Order::Keyed(map) => {
                let key = order_key(cfg, epoch, u64::MAX, entry);
                map.range(..key).count()
            }
            Order::Fair(bands) => {
                let (band, class) = band_and_class(cfg, entry);
                let weight = class_weight(cfg, &class, tenant_weight);
                let earlier: usize = bands.range(..band).map(|(_, b)| b.len).sum();
                earlier + bands.get(&band).map_or(0, |b| b.ahead_of(&class, weight))
            }
        }
    }

    /// The next request to release.
    pub(super) fn head(&self) -> Option<u64> {
        match self {
            Order::Keyed(map) => map.values().next().copied(),
            Order::Fair(bands) => bands.values().find_map(fair::Band::head),
        }
    }

    /// The next request's class under `wfq`/`fair` (`None` otherwise).
    pub(super) fn head_class(&self) -> Option<&str> {
        match self {
            Order::Keyed(_) => None,
            Order::Fair(bands) => bands.values().find_map(fair::Band::head_class),
        }
    }

    /// Every held request in release order.
    pub(super) fn sequence(&self) -> Vec<u64> {
        match self {
            Order::Keyed(map) => map.values().copied().collect(),
            Order::Fair(bands) => bands.values().flat_map(fair::Band::sequence).collect(),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Order::Keyed(map) => map.len(),
            Order::Fair(bands) => bands.values().map(|band| band.len).sum(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        match self {
            Order::Keyed(map) => map.is_empty(),
            Order::Fair(bands) => bands.values().all(|band| band.len == 0),
        }
    }
}
