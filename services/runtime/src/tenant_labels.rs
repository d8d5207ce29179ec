//! Tenant labels of bounded cardinality for per-tenant metrics: the top-N
//! tenants by volume get a label of their own, every other tenant shares
//! `other`.
//!
//! Volumes (served tokens, say) are tracked with the space-saving
//! algorithm in a fixed number of counters (8·N: the smallest unlabelled
//! counter goes to a newcomer, which inherits its count as possible
//! error, so a heavy tenant is never missed), halved every [`DECAY`] so the
//! ranking follows current traffic. The first N tenants seen get labels at
//! once; later, a tenant takes the label of the smallest labelled tenant
//! only when its guaranteed volume (count less inherited error) is more
//! than twice that one's (hysteresis: two tenants of similar volume do not
//! swap labels back and forth). The caller is told
//! which tenant lost its label, to remove that tenant's series, so at most
//! N + 1 label values exist at any time.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// The label every tenant outside the top N shares.
pub const OTHER: &str = "other";

/// How often volumes are halved.
pub const DECAY: Duration = Duration::from_secs(300);

/// The labelled tenants and the volume counters; cheap to share behind an
/// `Arc` (one lock, held for a few map operations).
#[derive(Debug)]
pub struct TenantLabels {
    top: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Tenant → (count, error inherited when it took over a counter).
    volumes: HashMap<String, (f64, f64)>,
    labelled: HashSet<String>,
    decayed: Instant,
}

impl TenantLabels {
    /// Labels for the `top` largest tenants (at least 1).
    pub fn new(top: usize) -> Self {
        Self {
            top: top.max(1),
            inner: Mutex::new(Inner {
                volumes: HashMap::new(),
                labelled: HashSet::new(),
                decayed: Instant::now(),
            }),
        }
    }

    /// The label of `tenant`: its name when it is among the top N, else
    /// [`OTHER`].
    pub fn label(&self, tenant: &str) -> String {
        if self.inner.lock().labelled.contains(tenant) {
            tenant.to_owned()
        } else {
            OTHER.to_owned()
        }
    }

    /// Adds `volume` to `tenant`, which may give it a label. Returns the
    /// tenant that lost its label as a result, whose series the caller
    /// removes.
    pub fn record(&self, tenant: &str, volume: f64) -> Option<String> {
        self.record_at(tenant, volume, Instant::now())
    }

    fn record_at(&self, tenant: &str, volume: f64, now: Instant) -> Option<String> {
        let mut inner = self.inner.lock();
        if now.saturating_duration_since(inner.decayed) >= DECAY {
            inner.decayed = now;
            for (count, error) in inner.volumes.values_mut() {
                *count /= 2.0;
                *error /= 2.0;
            }
        }
        let capacity = self.top * 8;
        let guaranteed = match inner.volumes.get_mut(tenant) {
            Some((count, error)) => {
                *count += volume;
                *count - *error
            }
            None => {
                // Space-saving: when full, the smallest unlabelled counter
                // goes to the newcomer, which inherits its count as error.
                let mut inherited = 0.0;
                if inner.volumes.len() >= capacity {
                    let smallest = inner
                        .volumes
                        .iter()
                        .filter(|(t, _)| !inner.labelled.contains(*t))
                        .min_by(|a, b| a.1.0.total_cmp(&b.1.0))
                        .map(|(t, (count, _))| (t.clone(), *count));
                    if let Some((t, count)) = smallest {
                        inner.volumes.remove(&t);
                        inherited = count;
                    }
                }
                inner
                    .volumes
                    .insert(tenant.to_owned(), (inherited + volume, inherited));
                volume
            }
        };
        if inner.labelled.contains(tenant) {
            return None;
        }
        if inner.labelled.len() < self.top {
            inner.labelled.insert(tenant.to_owned());
            return None;
        }
        let weakest = inner
            .labelled
            .iter()
            .map(|t| (t, inner.volumes.get(t).map_or(0.0, |(count, _)| *count)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(t, v)| (t.clone(), v));
        match weakest {
            Some((t, v)) if guaranteed > 2.0 * v => {
                inner.labelled.remove(&t);
                inner.labelled.insert(tenant.to_owned());
                Some(t)
            }
            _ => None,
        }
    }

    /// The labelled tenants (for tests and debugging).
    pub fn labelled(&self) -> Vec<String> {
        let mut v: Vec<String> = self.inner.lock().labelled.iter().cloned().collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_n_tenants_get_labels_and_the_rest_share_other() {
        let labels = TenantLabels::new(2);
        assert_eq!(labels.record("a", 10.0), None);
        assert_eq!(labels.record("b", 10.0), None);
        assert_eq!(labels.record("c", 5.0), None);
        assert_eq!(labels.label("a"), "a");
        assert_eq!(labels.label("c"), OTHER);
        assert_eq!(labels.labelled(), ["a", "b"]);
    }

    #[test]
    fn a_tenant_twice_the_smallest_labelled_one_takes_its_label() {
        let labels = TenantLabels::new(2);
        labels.record("a", 100.0);
        labels.record("b", 10.0);
        assert_eq!(labels.record("c", 15.0), None, "not yet twice b");
        assert_eq!(labels.record("c", 10.0), Some("b".to_owned()));
        assert_eq!(labels.labelled(), ["a", "c"]);
        assert_eq!(labels.label("b"), OTHER);
    }

    #[test]
    fn counters_stay_bounded_and_volumes_decay() {
        let labels = TenantLabels::new(1);
        let start = Instant::now();
        for i in 0..1000 {
            labels.record_at(&format!("t{i}"), 1.0, start);
        }
        assert!(labels.inner.lock().volumes.len() <= 8);
        assert_eq!(labels.labelled(), ["t0"]);
        // A newcomer beats t0's decayed volume after a few DECAYs.
        let later = start + DECAY * 3;
        assert_eq!(labels.record_at("heavy", 5.0, later), Some("t0".to_owned()));
    }
}
