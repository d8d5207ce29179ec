//! One pool of workers (decode or prefill): its members, their loads, the
//! block index fed by their events, the approximate index, and the placement
//! decision that ties them together.
//!
//! Owns membership and placement bookkeeping; has no networking (the
//! `workers` module feeds it) and no tonic types. A decision reads overlaps
//! from the index without any pool-wide lock, then takes the pool's small
//! choice mutex to read loads, choose and record the placement atomically,
//! so two concurrent requests never both see a target as idle.
//!
//! # Placements
//!
//! A committed placement counts as load on its target (see `load`) until
//! its client says the request ended ([`WorkerPool::update`]). Placements
//! are keyed by their client's identity and the id the client names them by
//! ([`PlacementKey`]), so the same placement heard twice (its own router's
//! answer and a replica's copy, or a reconnecting client's resend) counts
//! once. A placement whose client's session ended, or that nobody can
//! release (a unary `Route` commit), is an orphan: it counts for
//! `placement_max_age`, then goes.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use rand::SeedableRng;
use rand::rngs::StdRng;
use sluice_runtime::RequestDescription;
use sluice_runtime::discovery::WorkerRole;

use crate::approx::ApproxIndex;
use crate::error::RouterError;
use crate::indexer::{KvIndexer, OverlapScores, TargetHandle, TargetId};
use crate::latency::{self, TtftCheck};
use crate::load::{EffectiveLoad, LoadReport, Shape, TargetLoad};
use crate::selector::{self, CostInput, CostParams, CostTerms, RouterMode};
use sluice_runtime::discovery::WorkerRank;

/// Which pool a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// Decode or aggregated workers.
    Decode,
    /// Prefill workers.
    Prefill,
}

impl PoolKind {
    /// The discovery component name of the pool's workers.
    pub fn component(self) -> &'static str {
        self.role().as_str()
    }

    /// The role of a worker in this pool that does not say its own.
    pub fn role(self) -> WorkerRole {
        match self {
            PoolKind::Decode => WorkerRole::Decode,
            PoolKind::Prefill => WorkerRole::Prefill,
        }
    }
}

impl std::fmt::Display for PoolKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.component())
    }
}

/// Placement settings of a pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolConfig {
    /// How to choose.
    pub mode: RouterMode,
    /// Cost weights and temperature.
    pub cost: CostParams,
    /// How long `approx` mode predicts a placed prompt stays cached.
    pub approx_ttl: Duration,
    /// How long an orphaned placement (its client gone, or placed by a unary
    /// `Route`) still counts as load.
    pub placement_max_age: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            mode: RouterMode::Kv,
            cost: CostParams::default(),
            approx_ttl: Duration::from_secs(120),
            placement_max_age: Duration::from_secs(10),
        }
    }
}

/// Names one placement: the client that holds it and its id there.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PlacementKey {
    /// The client's identity (`PlaceHello.client_id`; "" for unary `Route`).
    pub client: Arc<str>,
    /// The id the client names the placement by.
    pub id: u64,
}

/// Whether and how a route counts as load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Commit {
    /// A dry run: nothing is counted.
    DryRun,
    /// Counted until nobody can release it: an orphan from the start
    /// (counts for `placement_max_age`).
    Unreleasable,
    /// Counted until the client releases `key` (or its session `session`
    /// ends and the placement ages out).
    Held {
        /// The placement's name.
        key: PlacementKey,
        /// The client's session the placement belongs to.
        session: u64,
    },
}

/// What a committed placement counts as load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementRecord {
    /// The id the client names it by.
    pub id: u64,
    /// Where it runs.
    pub target: WorkerRank,
    /// Prompt tokens not cached on the target (prefill work until started).
    pub prefill_tokens: u64,
    /// Chained hashes of the prompt's full blocks.
    pub block_hashes: Arc<[u64]>,
    /// Every prompt block, the partial last one included.
    pub blocks: u64,
    /// The request produced its first token.
    pub started: bool,
    /// The request's priority.
    pub priority: i32,
    /// The request's TPOT target in ms (0 = none).
    pub tpot_target_ms: u32,
}

impl PlacementRecord {
    fn shape(&self) -> Shape {
        Shape {
            prefill_tokens: self.prefill_tokens,
            hashes: Arc::clone(&self.block_hashes),
            blocks: self.blocks,
            tpot_target_ms: self.tpot_target_ms,
        }
    }
}

/// A change in a placement's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementState {
    /// The first token: its prefill work is done.
    Started,
    /// The request ended.
    Released,
}

/// A member's identity and address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberInfo {
    /// Worker and rank.
    pub target: WorkerRank,
    /// Address to dial for `Generate` / `Prefill`.
    pub endpoint: String,
    /// Model served ("" = any).
    pub model: String,
    /// What the worker does (its discovery entry says).
    pub role: WorkerRole,
    /// Bytes a KV transfer moves per block there (0: not said; no prefix
    /// is fetched from it).
    pub kv_block_bytes: u64,
}

struct Member {
    info: MemberInfo,
    endpoint: Arc<str>,
    kv_id: TargetId,
    approx_id: TargetId,
    kv_handle: Option<TargetHandle>,
    approx_handle: Option<TargetHandle>,
    /// Shared with the placements counted on it (they update it when they
    /// start or end) and with the member that replaces this one when its
    /// address changes.
    load: Arc<Mutex<TargetLoad>>,
}

impl Member {
    /// Its handle in the index the mode uses (`approx`: the predicted one).
    fn handle(&self, approx: bool) -> Option<&TargetHandle> {
        if approx {
            self.approx_handle.as_ref()
        } else {
            self.kv_handle.as_ref()
        }
    }
}

/// One request's placement question.
#[derive(Debug, Clone)]
pub struct RouteInput {
    /// The request as the queue admitted it (checked on arrival): model
    /// ("" = any), prompt shape, and the worker ids not to place on (a
    /// migrating request's failed workers).
    pub desc: RequestDescription,
    /// Whether and how the placement counts as load.
    pub commit: Commit,
}

/// A candidate's address and cost terms.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Worker and rank.
    pub target: WorkerRank,
    /// Its address.
    pub endpoint: Arc<str>,
    /// Its cost terms.
    pub terms: CostTerms,
}

/// Gives each load whose worker has measured no step yet its measured
/// peers' timing (the median of each figure) until it measures its own:
/// the same model on the same pool, so a worker that has served nothing
/// yet is predicted, and its fetches priced, like the others. Without it
/// no candidate's time is compared (the pool falls back to block costs)
/// and the overlap credit keeps a prompt the others hold off it: a burst
/// of one prompt placed by two router replicas at once, before either
/// heard the other, left a worker without a single request of it.
fn borrow_peer_timing(loads: &mut [EffectiveLoad]) {
    let unmeasured = |l: &EffectiveLoad| l.report.step_time_us == 0;
    if loads.iter().all(unmeasured) || !loads.iter().any(unmeasured) {
        return;
    }
    let median = |figure: fn(&LoadReport) -> u32| {
        median_rate(
            loads
                .iter()
                .filter(|l| !unmeasured(l))
                .map(|l| figure(&l.report)),
        )
    };
    let step_time_us = median(|r| r.step_time_us);
    let prefill_ns_per_token = median(|r| r.prefill_ns_per_token);
    let prefill_step_us = median(|r| r.prefill_step_us);
    let decode_base_us = median(|r| r.decode_base_us);
    let decode_ns_per_seq = median(|r| r.decode_ns_per_seq);
    for l in loads.iter_mut().filter(|l| unmeasured(l)) {
        l.report.step_time_us = step_time_us;
        l.report.prefill_ns_per_token = prefill_ns_per_token;
        l.report.prefill_step_us = prefill_step_us;
        l.report.decode_base_us = decode_base_us;
        l.report.decode_ns_per_seq = decode_ns_per_seq;
    }
}

/// The median of the measured (non-zero) `rates`, 0 with none.
fn median_rate(rates: impl Iterator<Item = u32>) -> u32 {
    let mut rates: Vec<u32> = rates.filter(|&r| r > 0).collect();
    rates.sort_unstable();
    rates.get(rates.len() / 2).copied().unwrap_or(0)
}

/// A request's TTFT target in seconds, if it has one.
fn ttft_target(desc: &RequestDescription) -> Option<f64> {
    (desc.ttft_target_ms > 0).then(|| f64::from(desc.ttft_target_ms) / 1e3)
}

/// What a placement update did in one pool.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Updated {
    /// The placement is counted there.
    pub counted: bool,
    /// It started just now, placed by this router with a prediction.
    pub checked: Option<TtftCheck>,
}

/// The outcome of a placement.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Index of the chosen candidate.
    pub chosen: usize,
    /// Every candidate, in target order.
    pub candidates: Vec<Candidate>,
    /// The mode that chose.
    pub mode: RouterMode,
    /// What the placement counts as load (committed placements only).
    pub placement: Option<PlacementRecord>,
    /// Whether the chosen candidate is predicted to give the first token
    /// within the request's TTFT target (`None`: no target or no
    /// prediction).
    pub within_target: Option<bool>,
    /// The peer the chosen candidate fetches the prompt's prefix from, and
    /// the blocks that peer holds (`None`: no fetch).
    pub prefix_source: Option<(WorkerRank, u32)>,
    /// Candidates whose costs lay within this of the cheapest counted as
    /// equal (in the costs' units: seconds in `latency` mode, blocks in
    /// `kv`); see `score`.
    pub tolerance: f64,
}

impl Decision {
    /// The chosen candidate.
    pub fn target(&self) -> &Candidate {
        &self.candidates[self.chosen]
    }
}

/// A member's view for `WatchLoad`.
#[derive(Debug, Clone, PartialEq)]
pub struct MemberLoad {
    /// Identity and address.
    pub info: MemberInfo,
    /// Placements plus the unplaced report.
    pub load: EffectiveLoad,
}

/// A placement being counted.
struct Counted {
    target: WorkerRank,
    priority: i32,
    /// The load it is counted on (its member's at placement time).
    load: Arc<Mutex<TargetLoad>>,
    shape: Shape,
    started: bool,
    session: u64,
    orphaned_at: Option<Instant>,
    /// When it was placed, and the time to first token predicted then
    /// (checked when it starts).
    placed_at: Instant,
    predicted_ttft: Option<f64>,
}

/// The candidates' cost terms, their total costs and what spreads the cache
/// among the cheapest (see [`selector::choose`]), in candidate order.
struct Scored {
    terms: Vec<CostTerms>,
    costs: Vec<f64>,
    /// A prompt no candidate holds more of than another: the blocks each
    /// stored lately; otherwise each one's share of the index.
    spread: Vec<f64>,
    /// How far above the cheapest a candidate may cost and still be chosen
    /// for its lower `spread`: such a prompt's uncached blocks, else 0.
    tolerance: f64,
    /// The candidate holding the most of the prompt (others may fetch
    /// from it); `None` when none holds any or it cannot send.
    holder: Option<usize>,
}

struct ChoiceState {
    round_robin: usize,
    rng: StdRng,
    placements: HashMap<PlacementKey, Counted>,
    /// Orphaned placements in the order they became orphans.
    orphans: VecDeque<(Instant, PlacementKey)>,
    /// Ids of unreleasable placements.
    next_unreleasable: u64,
    /// The errors of the latest predictions checked here, relative to
    /// each prediction (|predicted − served| / predicted), at most
    /// [`ERRORS_KEPT`].
    errors: VecDeque<f64>,
}

/// How many checked predictions the typical error is taken over.
const ERRORS_KEPT: usize = 64;

impl ChoiceState {
    /// The median error of the latest checked predictions, relative to
    /// each prediction: the band around a prediction that the time served
    /// falls in half the time.
    fn typical_error(&self) -> Option<f64> {
        let mut e: Vec<f64> = self.errors.iter().copied().collect();
        e.sort_unstable_by(f64::total_cmp);
        e.get(e.len() / 2).copied()
    }

    fn checked(&mut self, check: &TtftCheck) {
        let e = check.error_of_prediction();
        if e.is_finite() {
            if self.errors.len() == ERRORS_KEPT {
                self.errors.pop_front();
            }
            self.errors.push_back(e);
        }
    }

    fn count(&mut self, key: PlacementKey, counted: Counted) {
        counted.load.lock().add(&counted.shape, counted.started);
        if let Some(at) = counted.orphaned_at {
            self.orphans.push_back((at, key.clone()));
        }
        if let Some(old) = self.placements.insert(key, counted) {
            old.load.lock().remove(&old.shape, old.started);
        }
    }

    fn release(&mut self, key: &PlacementKey) -> bool {
        match self.placements.remove(key) {
            Some(c) => {
                c.load.lock().remove(&c.shape, c.started);
                true
            }
            None => false,
        }
    }

    fn expire(&mut self, now: Instant, max_age: Duration) -> usize {
        let mut n = 0;
        while let Some((at, _)) = self.orphans.front() {
            if *at + max_age > now {
                break;
            }
            let Some((at, key)) = self.orphans.pop_front() else {
                break;
            };
            // Released (or re-counted) since it became an orphan: skip.
            if self
                .placements
                .get(&key)
                .is_some_and(|c| c.orphaned_at == Some(at))
            {
                self.release(&key);
                n += 1;
            }
        }
        n
    }
}

/// A pool of workers and its placement state.
pub struct WorkerPool {
    kind: PoolKind,
    cfg: PoolConfig,
    indexer: KvIndexer,
    approx: ApproxIndex,
    members: RwLock<BTreeMap<WorkerRank, Arc<Member>>>,
    choice: Mutex<ChoiceState>,
    /// The latest load report of each target that reported before it
    /// joined (its first KV snapshot still coming): it joins with it, so
    /// its slots and speed are known from the start, not a report interval
    /// later.
    early_reports: Mutex<HashMap<WorkerRank, EarlyReport>>,
}

/// A report of a worker not yet joined, kept for its join.
struct EarlyReport {
    report: LoadReport,
    at: Instant,
    /// Its fetch rates by peer (`record_fetch_rates`), once recorded.
    fetch_rates: Option<HashMap<String, u64>>,
}

impl std::fmt::Debug for WorkerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerPool")
            .field("kind", &self.kind)
            .field("cfg", &self.cfg)
            .field("members", &self.members.read().len())
            .finish()
    }
}

impl WorkerPool {
    /// An empty pool.
    pub fn new(kind: PoolKind, cfg: PoolConfig) -> Self {
        Self::with_rng(kind, cfg, StdRng::from_os_rng())
    }

    /// An empty pool with a seeded random source (tests, benches).
    pub fn with_seed(kind: PoolKind, cfg: PoolConfig, seed: u64) -> Self {
        Self::with_rng(kind, cfg, StdRng::seed_from_u64(seed))
    }

    fn with_rng(kind: PoolKind, cfg: PoolConfig, rng: StdRng) -> Self {
        Self {
            kind,
            cfg,
            indexer: KvIndexer::new(),
            approx: ApproxIndex::new(cfg.approx_ttl),
            members: RwLock::new(BTreeMap::new()),
            early_reports: Mutex::new(HashMap::new()),
            choice: Mutex::new(ChoiceState {
                round_robin: 0,
                rng,
                placements: HashMap::new(),
                orphans: VecDeque::new(),
                next_unreleasable: 0,
                errors: VecDeque::with_capacity(ERRORS_KEPT),
            }),
        }
    }

    /// Which pool this is.
    pub fn kind(&self) -> PoolKind {
        self.kind
    }

    /// Its placement settings.
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    /// The block index fed by members' KV events.
    pub fn indexer(&self) -> &KvIndexer {
        &self.indexer
    }

    /// Adds a member (or updates its address); returns its id in
    /// [`WorkerPool::indexer`].
    pub fn add_member(&self, info: MemberInfo) -> TargetId {
        let mut members = self.members.write();
        if let Some(m) = members.get(&info.target)
            && m.info == info
        {
            return m.kv_id;
        }
        let kv_id = self.indexer.register(info.target.clone());
        let kv_handle = self.indexer.handle(kv_id);
        let (approx_id, approx_handle) = self.approx.register(info.target.clone());
        // A changed address keeps the load its placements are counted on.
        let load: Arc<Mutex<TargetLoad>> = members
            .get(&info.target)
            .map(|m| Arc::clone(&m.load))
            .unwrap_or_default();
        if let Some(early) = self.early_reports.lock().remove(&info.target) {
            let mut load = load.lock();
            load.report(early.report, early.at);
            if let Some(by_peer) = early.fetch_rates {
                load.report_fetch_rates(by_peer);
            }
        }
        members.insert(
            info.target.clone(),
            Arc::new(Member {
                endpoint: info.endpoint.as_str().into(),
                info,
                kv_id,
                approx_id,
                kv_handle,
                approx_handle,
                load,
            }),
        );
        kv_id
    }

    /// Removes a member and forgets all its blocks and placements at once;
    /// returns how many indexed blocks it held, or `None` if it was not a
    /// member.
    pub fn remove_member(&self, target: &WorkerRank) -> Option<usize> {
        self.early_reports.lock().remove(target);
        let member = self.members.write().remove(target)?;
        self.choice
            .lock()
            .placements
            .retain(|_, c| c.target != *target);
        self.approx.remove_target(member.approx_id);
        Some(self.indexer.remove_target(member.kv_id))
    }

    /// Members, in target order.
    pub fn members(&self) -> Vec<MemberInfo> {
        self.members
            .read()
            .values()
            .map(|m| m.info.clone())
            .collect()
    }

    /// The index id of a member.
    pub fn kv_id(&self, target: &WorkerRank) -> Option<TargetId> {
        self.members.read().get(target).map(|m| m.kv_id)
    }

    /// Records a member's load report received at `now`. False if unknown.
    pub fn record_load(&self, target: &WorkerRank, report: LoadReport, now: Instant) -> bool {
        let members = self.members.read();
        let Some(member) = members.get(target).cloned() else {
            // Not joined yet: it joins with this report (under the members'
            // lock, so a join either sees it or came first).
            self.early_reports.lock().insert(
                target.clone(),
                EarlyReport {
                    report,
                    at: now,
                    fetch_rates: None,
                },
            );
            return false;
        };
        drop(members);
        member.load.lock().report(report, now);
        true
    }

    /// Records a member's fetch rates by peer from the report just
    /// recorded (the pair's rate prices a fetch from that peer); for a
    /// worker not joined yet, with its early report, for the join. False if
    /// neither.
    pub fn record_fetch_rates(&self, target: &WorkerRank, by_peer: HashMap<String, u64>) -> bool {
        let members = self.members.read();
        let Some(member) = members.get(target).cloned() else {
            // Under the members' lock, as `record_load` keeps the report.
            return match self.early_reports.lock().get_mut(target) {
                Some(early) => {
                    early.fetch_rates = Some(by_peer);
                    true
                }
                None => false,
            };
        };
        drop(members);
        member.load.lock().report_fetch_rates(by_peer);
        true
    }

    /// Counts a placement another router made (or a client still holds)
    /// under `key` for `session`, from now on. False when its target is not
    /// a member (it is not counted).
    pub fn record_placement(
        &self,
        key: PlacementKey,
        session: u64,
        record: &PlacementRecord,
        now: Instant,
    ) -> bool {
        let Some(member) = self.members.read().get(&record.target).cloned() else {
            return false;
        };
        if self.cfg.mode == RouterMode::Approx {
            self.approx
                .record(member.approx_id, &record.block_hashes, now);
        }
        self.choice.lock().count(
            key,
            Counted {
                target: record.target.clone(),
                priority: record.priority,
                load: Arc::clone(&member.load),
                shape: record.shape(),
                started: record.started,
                session,
                orphaned_at: None,
                // Placed by another router: its prediction is not known here.
                placed_at: Instant::now(),
                predicted_ttft: None,
            },
        );
        true
    }

    /// Applies a change in a placement's life: whether it is counted here,
    /// and, when it started just now, its predicted time to first token
    /// beside the one it got (placements this router made).
    pub fn update(&self, key: &PlacementKey, state: PlacementState) -> Updated {
        let mut choice = self.choice.lock();
        match state {
            PlacementState::Released => Updated {
                counted: choice.release(key),
                checked: None,
            },
            PlacementState::Started => match choice.placements.get_mut(key) {
                Some(c) if !c.started => {
                    c.started = true;
                    c.load.lock().start(&c.shape);
                    let checked = c.predicted_ttft.map(|predicted| TtftCheck {
                        target: c.target.clone(),
                        priority: c.priority,
                        predicted,
                        served: c.placed_at.elapsed().as_secs_f64(),
                    });
                    if let Some(check) = &checked {
                        choice.checked(check);
                    }
                    Updated {
                        counted: true,
                        checked,
                    }
                }
                Some(_) => Updated {
                    counted: true,
                    checked: None,
                },
                None => Updated::default(),
            },
        }
    }

    /// Forgets every placement of `client` (a client opening a new session
    /// sends again the ones it still holds).
    pub fn forget_client(&self, client: &str) {
        let mut choice = self.choice.lock();
        let keys: Vec<PlacementKey> = choice
            .placements
            .keys()
            .filter(|k| &*k.client == client)
            .cloned()
            .collect();
        for k in keys {
            choice.release(&k);
        }
    }

    /// The session `session` of `client` ended: its placements become
    /// orphans (they count for `placement_max_age` more).
    pub fn orphan_session(&self, client: &str, session: u64, now: Instant) {
        let mut choice = self.choice.lock();
        let mut orphaned = Vec::new();
        for (k, c) in choice.placements.iter_mut() {
            if &*k.client == client && c.session == session && c.orphaned_at.is_none() {
                c.orphaned_at = Some(now);
                orphaned.push(k.clone());
            }
        }
        choice
            .orphans
            .extend(orphaned.into_iter().map(|k| (now, k)));
    }

    /// Drops orphans older than `placement_max_age`; returns how many.
    pub fn expire(&self, now: Instant) -> usize {
        self.choice.lock().expire(now, self.cfg.placement_max_age)
    }

    /// Placements counted, orphans included.
    pub fn placement_count(&self) -> usize {
        self.choice.lock().placements.len()
    }

    /// When a member last reported.
    pub fn last_report(&self, target: &WorkerRank) -> Option<Instant> {
        let member = self.members.read().get(target).cloned()?;
        member.load.lock().reported_at()
    }

    /// Live placements by target and priority, those of `exclude` (a
    /// client id) left out.
    pub fn placements_by_priority(&self, exclude: &str) -> HashMap<WorkerRank, BTreeMap<i32, u32>> {
        let choice = self.choice.lock();
        let mut out: HashMap<WorkerRank, BTreeMap<i32, u32>> = HashMap::new();
        for (key, c) in &choice.placements {
            if exclude.is_empty() || &*key.client != exclude {
                *out.entry(c.target.clone())
                    .or_default()
                    .entry(c.priority)
                    .or_default() += 1;
            }
        }
        out
    }

    /// Every member's effective load.
    pub fn load_view(&self, now: Instant) -> Vec<MemberLoad> {
        self.expire(now);
        self.members
            .read()
            .values()
            .map(|m| MemberLoad {
                info: m.info.clone(),
                load: m.load.lock().effective(),
            })
            .collect()
    }

    /// Chooses a member for one request at `now`.
    pub fn route(&self, input: &RouteInput, now: Instant) -> Result<Decision, RouterError> {
        self.route_inner(input, now, None)
    }

    /// Like [`WorkerPool::route`], with each candidate's overlap taken from
    /// `overlap` instead of the index: an external view of every cache (the
    /// benchmarks' oracle, which asks the engines themselves).
    pub fn route_with_overlaps(
        &self,
        input: &RouteInput,
        now: Instant,
        overlap: &dyn Fn(&WorkerRank) -> u32,
    ) -> Result<Decision, RouterError> {
        self.route_inner(input, now, Some(overlap))
    }

    fn route_inner(
        &self,
        input: &RouteInput,
        now: Instant,
        external: Option<&dyn Fn(&WorkerRank) -> u32>,
    ) -> Result<Decision, RouterError> {
        if input.desc.block_size == 0 {
            return Err(RouterError::InvalidArgument(
                "block_size must be positive".into(),
            ));
        }
        let candidates = self.candidates(&input.desc)?;
        // Loads are read, and the placement counted, under one lock: a
        // concurrent burst sees each earlier placement of it.
        let mut choice = self.choice.lock();
        choice.expire(now, self.cfg.placement_max_age);
        // Only `latency` compares predictions (see `score`).
        let typical_error = (self.cfg.mode == RouterMode::Latency)
            .then(|| choice.typical_error())
            .flatten();
        let scored = self.score(&input.desc, &candidates, now, external, typical_error);
        let Scored {
            mut terms,
            costs,
            spread,
            tolerance,
            holder,
        } = scored;
        let target = ttft_target(&input.desc);
        let chosen = self.choose(&mut choice, &mut terms, &costs, &spread, tolerance, target);
        let within_target = target
            .zip(terms[chosen].predicted_ttft)
            .map(|(target, predicted)| predicted <= target);
        let prefix_source = holder
            .filter(|_| terms[chosen].fetch_blocks > 0)
            .map(|h| (candidates[h].info.target.clone(), terms[h].overlap_blocks));
        let placement = match &input.commit {
            Commit::DryRun => None,
            commit => Some(self.commit(
                &mut choice,
                input,
                commit,
                &candidates[chosen],
                &terms[chosen],
                now,
            )),
        };
        drop(choice);

        Ok(Decision {
            chosen,
            candidates: candidates
                .iter()
                .zip(terms)
                .map(|(m, terms)| Candidate {
                    target: m.info.target.clone(),
                    endpoint: Arc::clone(&m.endpoint),
                    terms,
                })
                .collect(),
            mode: self.cfg.mode,
            placement,
            within_target,
            prefix_source,
            tolerance,
        })
    }

    /// The members that may take the request: its model's, less the
    /// workers it excludes.
    fn candidates(&self, desc: &RequestDescription) -> Result<Vec<Arc<Member>>, RouterError> {
        let candidates: Vec<Arc<Member>> = self
            .members
            .read()
            .values()
            .filter(|m| {
                (desc.model.is_empty() || m.info.model.is_empty() || m.info.model == desc.model)
                    && !desc
                        .exclude_worker_ids
                        .iter()
                        .any(|x| *x == *m.info.target.worker_id)
            })
            .cloned()
            .collect();
        if candidates.is_empty() {
            return Err(RouterError::NoWorkers {
                pool: self.kind,
                model: desc.model.clone(),
            });
        }
        Ok(candidates)
    }

    /// Each candidate's cost terms (its cached overlap from the index the
    /// mode uses, or from `external`, and its load), and its share of the
    /// index's entries.
    fn score(
        &self,
        desc: &RequestDescription,
        candidates: &[Arc<Member>],
        now: Instant,
        external: Option<&dyn Fn(&WorkerRank) -> u32>,
        typical_error: Option<f64>,
    ) -> Scored {
        let mode = self.cfg.mode;
        let approx = mode == RouterMode::Approx;
        let (scores, index): (OverlapScores, &KvIndexer) = if external.is_some() {
            (OverlapScores::default(), &self.indexer)
        } else if approx {
            self.approx.expire(now);
            (
                self.approx.find_matches(&desc.block_hashes),
                self.approx.index(),
            )
        } else {
            (self.indexer.find_matches(&desc.block_hashes), &self.indexer)
        };
        let id_of = |m: &Member| if approx { m.approx_id } else { m.kv_id };
        let total_entries = index.entry_count().max(1) as f64;
        let mut scored = Scored {
            terms: Vec::with_capacity(candidates.len()),
            costs: Vec::with_capacity(candidates.len()),
            spread: Vec::new(),
            tolerance: 0.0,
            holder: None,
        };
        let overlaps: Vec<u32> = candidates
            .iter()
            .map(|m| match external {
                Some(f) => f(&m.info.target),
                None => scores.get(id_of(m)),
            })
            .collect();
        // The candidate holding the most of the prompt: the others may fetch
        // what they lack of it from there (kv, approx and latency modes).
        let fetching = matches!(
            mode,
            RouterMode::Kv | RouterMode::Approx | RouterMode::Latency
        );
        let holder = (0..candidates.len())
            .filter(|_| fetching)
            .max_by_key(|&i| overlaps[i])
            .filter(|&i| overlaps[i] > 0 && candidates[i].info.kv_block_bytes > 0);
        scored.holder = holder;
        // Each candidate's load, read once for this request.
        let mut loads: Vec<_> = candidates
            .iter()
            .map(|m| m.load.lock().effective())
            .collect();
        borrow_peer_timing(&mut loads);
        let holder_step = holder.map_or(0.0, |h| {
            0.5 * f64::from(loads[h].report.step_time_us) * 1e-6
        });
        // The overlap credit's rate: the candidates' median prompt-token
        // cost (each worker's own reads apart by the noise of its fit).
        let credit_ns_per_token = median_rate(loads.iter().map(|l| l.report.prefill_ns_per_token));
        for (i, (m, load)) in candidates.iter().zip(&loads).enumerate() {
            let overlap = overlaps[i];
            // The prompt's blocks it keeps in its second tier: a copy each.
            let tier2 = if approx || external.is_some() || overlap == 0 {
                0
            } else {
                let end = (overlap as usize).min(desc.block_hashes.len());
                self.indexer
                    .tier2_blocks(m.kv_id, &desc.block_hashes[..end])
            };
            let restore_seconds = match load.report.kv_tier_bytes_per_sec {
                0 => 0.0,
                rate => f64::from(tier2) * m.info.kv_block_bytes as f64 / rate as f64,
            };
            let fetch = holder.and_then(|h| {
                let blocks = overlaps[h].checked_sub(overlap).filter(|&b| b > 0)?;
                // What the pair moves at: this candidate's fetches from the
                // holder, else from anyone.
                let rate = m
                    .load
                    .lock()
                    .fetch_rate_from(&candidates[h].info.target.worker_id);
                // The bytes, and the waits for the engines to take the
                // fetch's requests between their steps: half a step of the
                // holder's on average, and two half steps of the
                // candidate's (reserving the blocks, then making them its
                // cached prefix).
                let own_steps = f64::from(load.report.step_time_us) * 1e-6;
                (rate > 0).then(|| selector::FetchInput {
                    blocks,
                    seconds: f64::from(blocks) * candidates[h].info.kv_block_bytes as f64
                        / rate as f64
                        + holder_step
                        + own_steps,
                })
            });
            // Least-loaded: load only, costed as if nothing were cached.
            let counted_overlap = if mode == RouterMode::LeastLoaded {
                0
            } else {
                overlap
            };
            let mut t = selector::cost(
                &self.cfg.cost,
                &CostInput {
                    overlap_blocks: counted_overlap,
                    fetch,
                    restore_seconds,
                    active_prefill_tokens: load.active_prefill_tokens,
                    long_prefill_tokens: load.long_prefill_tokens,
                    long_prefill_threshold: load.report.long_prefill_token_threshold,
                    active_decode_blocks: load.active_decode_blocks,
                    active_requests: load.active_requests,
                    step_tokens: load.report.max_num_batched_tokens,
                    step_time_us: load.report.step_time_us,
                    prefill_ns_per_token: load.report.prefill_ns_per_token,
                    prefill_step_us: load.report.prefill_step_us,
                    credit_ns_per_token,
                    reported_prefill_tokens: load.reported_prefill_tokens,
                    decode_base_us: load.report.decode_base_us,
                    decode_ns_per_seq: load.report.decode_ns_per_seq,
                    tightest_tpot_ms: load.tightest_tpot_ms,
                    request_tpot_ms: desc.tpot_target_ms,
                    step_in_progress: load.reported_at.map_or_else(Default::default, |at| {
                        latency::step_in_progress(&load.report, now.saturating_duration_since(at))
                    }),
                },
                desc.prompt_tokens,
                desc.block_size,
            );
            t.overlap_blocks = overlap;
            scored.costs.push(t.total_cost);
            scored.terms.push(t);
        }
        // A new prompt (a new conversation, say) evicts as much wherever it
        // goes: among the workers about as cheap in blocks, the one whose
        // cache turned over least lately loses the least (its blocks are
        // older), and the ones that just stored a lot keep it for the
        // follow-ups to come. The tolerance is what the prompt will store: a
        // prompt every candidate holds whole stores nothing and is placed by
        // cost alone. Costs in time place a new prompt on the soonest, within
        // the predictions' noise (below): a tolerance of its own prefill time
        // there cost the Mooncake slice 3-4% of its TTFT mean and kept no
        // more of its prompts cached (`tests/bench/results/routing.md`).
        let overlaps = scored.terms.iter().map(|t| t.overlap_blocks);
        let (least, most) = (overlaps.clone().min(), overlaps.max());
        // In time, where every candidate has a prediction.
        let latency_costs: Option<Vec<f64>> = (mode == RouterMode::Latency)
            .then(|| {
                scored
                    .terms
                    .iter()
                    .map(|t| selector::latency_cost(&self.cfg.cost, t))
                    .collect()
            })
            .flatten();
        let in_time = latency_costs.is_some();
        if let Some(costs) = latency_costs {
            for (t, &cost) in scored.terms.iter_mut().zip(&costs) {
                t.total_cost = cost;
            }
            scored.costs = costs;
        }
        if let Some(overlap) = least.filter(|_| least == most && !in_time)
            && matches!(
                mode,
                RouterMode::Kv | RouterMode::Approx | RouterMode::Latency
            )
        {
            let uncached = selector::uncached_tokens(desc.prompt_tokens, overlap, desc.block_size);
            scored.tolerance = self.cfg.cost.prefill_load_scale * uncached as f64
                / f64::from(desc.block_size.max(1));
            scored.spread = candidates
                .iter()
                .map(|m| m.handle(approx).map_or(0.0, |h| h.recent_stores(now)))
                .collect();
        } else {
            // Otherwise ties go to the smaller share of the index.
            scored.spread = candidates
                .iter()
                .map(|m| m.handle(approx).map_or(0, TargetHandle::blocks) as f64 / total_entries)
                .collect();
        }
        // Predictions in time are built from each worker's measured steps,
        // and identical workers' measurements read apart: candidates within
        // the predictions' own error of the cheapest (the median error of
        // the latest checked here relative to each prediction, times the
        // soonest prediction; at least half the shortest step: reports
        // place the step in progress only to within their interval) are
        // not told apart by the prediction, and
        // the fewest live requests among them wins, then the one holding
        // the most of the prompt in its own KV memory (a local hit moves no
        // bytes and keeps the holder free, where a prediction within noise
        // would send the request to fetch it). A burst of a prompt every
        // worker holds would otherwise go where the steps read fastest, one
        // request after another (each adds less to the prediction than the
        // noise).
        if in_time {
            let half_step = loads
                .iter()
                .map(|l| l.report.step_time_us)
                .min()
                .map_or(0.0, |us| 0.5 * f64::from(us) * 1e-6);
            let soonest = scored
                .terms
                .iter()
                .filter_map(|t| t.predicted_ttft)
                .fold(f64::INFINITY, f64::min);
            let noise = typical_error
                .map(|e| e * soonest)
                .filter(|n| n.is_finite())
                .map_or(half_step, |n| n.max(half_step));
            if scored.tolerance < noise {
                scored.tolerance = noise;
                // Live requests in the whole part, the share of the
                // prompt's blocks not held locally below one.
                let blocks = desc.block_hashes.len() as f64 + 1.0;
                scored.spread = scored
                    .terms
                    .iter()
                    .map(|t| {
                        let missing = blocks - 1.0 - f64::from(t.overlap_blocks);
                        f64::from(t.active_requests) + missing.max(0.0) / blocks
                    })
                    .collect();
            }
        }
        scored
    }

    /// The chosen candidate's position: the cheapest within the balance
    /// bound (kv, approx, latency, least-loaded; over-bound ones are marked
    /// in `terms`), the next in turn, or a random one. In `latency` mode
    /// with a TTFT `target` (seconds), only the candidates predicted to
    /// meet it compete, and when none is, the one predicted soonest wins.
    fn choose(
        &self,
        choice: &mut ChoiceState,
        terms: &mut [CostTerms],
        costs: &[f64],
        spread: &[f64],
        tolerance: f64,
        target: Option<f64>,
    ) -> usize {
        match self.cfg.mode {
            RouterMode::Kv | RouterMode::Approx | RouterMode::LeastLoaded | RouterMode::Latency => {
                let c = &self.cfg.cost;
                selector::apply_bounds(terms, c.balance_bound, c.prefill_queue_bound);
                // Only candidates within the bound (the least loaded always is).
                let mut eligible: Vec<usize> =
                    (0..terms.len()).filter(|&i| !terms[i].over_bound).collect();
                // The batch cap: off workers whose decode step, with this
                // request added, would miss a TPOT target, while another
                // can take it (when none can, the bounds alone decide).
                if eligible.iter().any(|&i| !terms[i].over_tpot) {
                    for &i in &eligible {
                        terms[i].over_bound |= terms[i].over_tpot;
                    }
                    eligible.retain(|&i| !terms[i].over_tpot);
                }
                if self.cfg.mode == RouterMode::Latency
                    && let Some(target) = target
                {
                    match selector::within_target(terms, &eligible, target) {
                        selector::Within::Some(within) => eligible = within,
                        selector::Within::None(soonest) => return soonest,
                        selector::Within::Unknown => {}
                    }
                }
                let costs: Vec<f64> = eligible.iter().map(|&i| costs[i]).collect();
                let spread: Vec<f64> = eligible.iter().map(|&i| spread[i]).collect();
                eligible[selector::choose(
                    &costs,
                    &spread,
                    tolerance,
                    self.cfg.cost.temperature,
                    &mut choice.rng,
                )]
            }
            RouterMode::RoundRobin => {
                let i = choice.round_robin % terms.len();
                choice.round_robin = choice.round_robin.wrapping_add(1);
                i
            }
            RouterMode::Random => {
                use rand::Rng;
                choice.rng.random_range(0..terms.len())
            }
        }
    }

    /// Counts the placement on `member` until it is released (held by a
    /// session) or ages out (unreleasable), and returns its record.
    fn commit(
        &self,
        choice: &mut ChoiceState,
        input: &RouteInput,
        commit: &Commit,
        member: &Member,
        terms: &CostTerms,
        now: Instant,
    ) -> PlacementRecord {
        let overlap = terms.overlap_blocks;
        let desc = &input.desc;
        let (key, session, orphaned_at) = match commit {
            Commit::Held { key, session } => (key.clone(), *session, None),
            _ => {
                choice.next_unreleasable += 1;
                let key = PlacementKey {
                    client: Arc::from(""),
                    id: choice.next_unreleasable,
                };
                (key, 0, Some(now))
            }
        };
        let record = PlacementRecord {
            id: key.id,
            target: member.info.target.clone(),
            prefill_tokens: selector::uncached_tokens(
                desc.prompt_tokens,
                overlap + terms.fetch_blocks,
                desc.block_size,
            ),
            block_hashes: Arc::clone(&desc.block_hashes),
            blocks: u64::from(desc.prompt_tokens).div_ceil(u64::from(desc.block_size)),
            started: false,
            priority: desc.priority,
            tpot_target_ms: desc.tpot_target_ms,
        };
        choice.count(
            key,
            Counted {
                target: record.target.clone(),
                priority: record.priority,
                load: Arc::clone(&member.load),
                shape: record.shape(),
                started: false,
                session,
                orphaned_at,
                placed_at: now,
                predicted_ttft: terms.predicted_ttft,
            },
        );
        if self.cfg.mode == RouterMode::Approx {
            self.approx
                .record(member.approx_id, &desc.block_hashes, now);
        }
        record
    }
}

/// The router's two pools and the signal that a load changed.
#[derive(Debug)]
pub struct Pools {
    decode: WorkerPool,
    prefill: WorkerPool,
    load_version: tokio::sync::watch::Sender<u64>,
    /// Each client's latest report of what it holds unplaced: model →
    /// priority → requests.
    held: Mutex<HashMap<Arc<str>, HeldByModel>>,
}

/// Requests held unplaced by model and priority.
pub type HeldByModel = HashMap<String, BTreeMap<i32, u32>>;

impl Pools {
    /// Both pools, empty, with the same settings.
    pub fn new(cfg: PoolConfig) -> Self {
        Self {
            decode: WorkerPool::new(PoolKind::Decode, cfg),
            prefill: WorkerPool::new(PoolKind::Prefill, cfg),
            load_version: tokio::sync::watch::Sender::new(0),
            held: Mutex::new(HashMap::new()),
        }
    }

    /// `client` now holds `held` unplaced (replacing its last report; an
    /// empty one forgets it). Watchers hear of it.
    pub fn report_held(&self, client: &Arc<str>, held: HeldByModel) {
        let mut all = self.held.lock();
        let changed = if held.is_empty() {
            all.remove(client).is_some()
        } else {
            all.insert(Arc::clone(client), held.clone()) != Some(held)
        };
        drop(all);
        if changed {
            self.load_changed();
        }
    }

    /// What every client but `exclude` holds for `model` ("" = every
    /// model), summed: model → priority → requests.
    pub fn held_by_others(&self, exclude: &str, model: &str) -> HeldByModel {
        let mut sum = HeldByModel::new();
        for (client, held) in self.held.lock().iter() {
            if !exclude.is_empty() && &**client == exclude {
                continue;
            }
            for (m, by_priority) in held {
                if !model.is_empty() && !m.is_empty() && m != model {
                    continue;
                }
                let into = sum.entry(m.clone()).or_default();
                for (&p, &n) in by_priority {
                    *into.entry(p).or_default() += n;
                }
            }
        }
        sum
    }

    /// One pool.
    pub fn get(&self, kind: PoolKind) -> &WorkerPool {
        match kind {
            PoolKind::Decode => &self.decode,
            PoolKind::Prefill => &self.prefill,
        }
    }

    /// Both pools, decode first.
    pub fn all(&self) -> [&WorkerPool; 2] {
        [&self.decode, &self.prefill]
    }

    /// Applies a change in a placement's life in both pools (a client's
    /// decode and prefill placements share its id): what each pool made of
    /// it, decode first.
    pub fn update(&self, key: &PlacementKey, state: PlacementState) -> [Updated; 2] {
        [
            self.decode.update(key, state),
            self.prefill.update(key, state),
        ]
    }

    /// Forgets every placement of `client` in both pools.
    pub fn forget_client(&self, client: &str) {
        for p in self.all() {
            p.forget_client(client);
        }
    }

    /// Orphans the placements of `client`'s session `session`.
    pub fn orphan_session(&self, client: &str, session: u64, now: Instant) {
        for p in self.all() {
            p.orphan_session(client, session, now);
        }
    }

    /// Tells `WatchLoad` streams that a load or the membership changed.
    pub fn load_changed(&self) {
        self.load_version.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// A receiver that wakes on every [`Pools::load_changed`].
    pub fn watch_loads(&self) -> tokio::sync::watch::Receiver<u64> {
        self.load_version.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::indexer::{KvEvent, KvEventKind};
    use sluice_tokens::sequence_block_hashes;

    const BS: u32 = 16;

    fn pool(mode: RouterMode, workers: usize) -> WorkerPool {
        let p = WorkerPool::with_seed(
            PoolKind::Decode,
            PoolConfig {
                mode,
                ..PoolConfig::default()
            },
            7,
        );
        for i in 0..workers {
            p.add_member(info(i));
        }
        p
    }

    fn info(i: usize) -> MemberInfo {
        MemberInfo {
            target: target(i),
            endpoint: format!("127.0.0.1:{}", 9000 + i),
            model: "m".into(),
            role: sluice_runtime::discovery::WorkerRole::Decode,
            kv_block_bytes: 0,
        }
    }

    fn target(i: usize) -> WorkerRank {
        WorkerRank::new(format!("w{i}"), 0)
    }

    fn tokens(seed: u32, len: u32) -> Vec<u32> {
        (0..len)
            .map(|i| seed.wrapping_mul(7919).wrapping_add(i))
            .collect()
    }

    fn input(hashes: &[u64], prompt_tokens: u32) -> RouteInput {
        RouteInput {
            desc: RequestDescription {
                request_id: "r".into(),
                model: "m".into(),
                prompt_tokens,
                block_hashes: hashes.into(),
                block_size: BS,
                ..RequestDescription::default()
            },
            commit: Commit::Unreleasable,
        }
    }

    fn key(id: u64) -> PlacementKey {
        PlacementKey {
            client: Arc::from("queue-a"),
            id,
        }
    }

    fn held(hashes: &[u64], prompt_tokens: u32, id: u64) -> RouteInput {
        RouteInput {
            commit: Commit::Held {
                key: key(id),
                session: 1,
            },
            ..input(hashes, prompt_tokens)
        }
    }

    fn load_of(p: &WorkerPool, t: &WorkerRank) -> EffectiveLoad {
        p.load_view(Instant::now())
            .into_iter()
            .find(|m| m.info.target == *t)
            .expect("member")
            .load
    }

    fn store(p: &WorkerPool, i: usize, seq: u64, hashes: &[u64]) {
        let id = p.kv_id(&target(i)).expect("member");
        p.indexer()
            .apply(
                id,
                &KvEvent {
                    seq,
                    kind: KvEventKind::Stored {
                        parent: None,
                        hashes: hashes.to_vec(),
                    },
                },
            )
            .expect("apply");
    }

    fn idle(p: &WorkerPool, n: usize, now: Instant) {
        for i in 0..n {
            p.record_load(&target(i), LoadReport::default(), now);
        }
    }

    fn chosen(d: &Decision) -> &str {
        &d.target().target.worker_id
    }

    #[test]
    fn the_last_report_s_age_places_the_step_in_progress() {
        // Two workers decoding in 20 ms steps: w1 reported as its step
        // began, 15 ms ago, w0 just now.
        let p = pool(RouterMode::Latency, 2);
        let then = Instant::now();
        let now = then + Duration::from_millis(15);
        let decoding = LoadReport {
            running: 4,
            ..measured(0)
        };
        p.record_load(&target(0), decoding, now);
        p.record_load(&target(1), decoding, then);
        let h = sequence_block_hashes(&tokens(3, 128), BS as usize);
        let d = p.route(&input(&h, 128), now).expect("route");
        let ttft = |i: usize| d.candidates[i].terms.predicted_ttft.expect("measured");
        // w1's step ends 15 ms sooner, beyond the tolerance (half a step).
        assert!(
            (ttft(0) - ttft(1) - 0.015).abs() < 1e-9,
            "{:?}",
            d.candidates
        );
        assert_eq!(chosen(&d), "w1");
    }

    #[test]
    fn a_prompt_step_pays_a_decode_step_where_the_reported_rule_says_it_carries_the_rows() {
        // Prefill first, two steps in a row, on two workers decoding in
        // 20 ms steps, both 10 ms from the end of their step: w0's computes
        // a 200-token prompt that arrived (10 ms, leaving the rows out), so
        // the next prompt there joins the rows' step; w1's decodes, so the
        // next prompt there has a step to itself.
        let p = pool(RouterMode::Latency, 2);
        let then = Instant::now();
        let now = then + Duration::from_millis(10);
        let decoding = LoadReport {
            running: 4,
            prefill_first_steps: 2,
            ..measured(0)
        };
        let arrived = LoadReport {
            pending_prefill_tokens: 200,
            waiting: 1,
            ..decoding
        };
        p.record_load(&target(0), arrived, now);
        p.record_load(&target(1), decoding, then);
        let h = sequence_block_hashes(&tokens(3, 128), BS as usize);
        let d = p.route(&input(&h, 128), now).expect("route");
        let ttft = |i: usize| d.candidates[i].terms.predicted_ttft.expect("measured");
        // w1: 10 ms left, then 128 tokens alone (6.4 ms).
        assert!((ttft(1) - 0.0164).abs() < 1e-9, "{:?}", d.candidates);
        // w0: 10 ms left, then the 128 tokens and a decode step.
        assert!((ttft(0) - 0.0364).abs() < 1e-9, "{:?}", d.candidates);
        assert_eq!(chosen(&d), "w1");
    }

    #[test]
    fn a_request_goes_to_the_worker_holding_its_prefix() {
        let p = pool(RouterMode::Kv, 4);
        let t = tokens(1, 1024);
        let h = sequence_block_hashes(&t, BS as usize);
        store(&p, 2, 1, &h[..48]);
        let d = p.route(&input(&h, 1024), Instant::now()).expect("route");
        assert_eq!(chosen(&d), "w2");
        assert_eq!(d.target().terms.overlap_blocks, 48);
        assert_eq!(d.candidates.len(), 4);
        assert_eq!(d.candidates[2].terms.prefill_cost, 16.0);
        assert_eq!(d.candidates[0].terms.prefill_cost, 64.0);
    }

    #[test]
    fn excluded_workers_are_never_chosen_even_holding_the_prefix() {
        let p = pool(RouterMode::Kv, 3);
        let t = tokens(1, 1024);
        let h = sequence_block_hashes(&t, BS as usize);
        store(&p, 2, 1, &h[..48]);
        let excluding = |ids: &[&str]| {
            let mut i = input(&h, 1024);
            i.desc.exclude_worker_ids = ids.iter().map(|id| id.to_string()).collect();
            i
        };
        let d = p.route(&excluding(&["w2"]), Instant::now()).expect("route");
        assert_ne!(chosen(&d), "w2");
        assert_eq!(d.candidates.len(), 2, "w2 is not even a candidate");
        let none = p.route(&excluding(&["w0", "w1", "w2"]), Instant::now());
        assert!(matches!(none, Err(RouterError::NoWorkers { .. })));
    }

    #[test]
    fn equal_overlap_spreads_by_load() {
        let p = pool(RouterMode::Kv, 3);
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(2, 512), BS as usize);
        for i in 0..3 {
            store(&p, i, 1, &h);
        }
        let busy = |blocks| LoadReport {
            active_blocks: blocks,
            running: 1,
            ..Default::default()
        };
        p.record_load(&target(0), busy(300), now);
        p.record_load(&target(1), busy(100), now);
        p.record_load(&target(2), busy(200), now);
        let d = p.route(&input(&h, 512), now).expect("route");
        assert_eq!(chosen(&d), "w1");
    }

    #[test]
    fn a_new_prompt_goes_where_the_cache_turned_over_least_among_the_near_cheapest() {
        let p = pool(RouterMode::Kv, 3);
        let now = Instant::now();
        idle(&p, 3, now);
        // Other conversations stored lately: 300, 50 and 200 blocks.
        let mut held = Vec::new();
        for (i, blocks) in [(0, 300), (1, 50), (2, 200)] {
            let h = sequence_block_hashes(&tokens(10 + i as u32, blocks * BS), BS as usize);
            store(&p, i, 1, &h);
            held.push(h);
        }
        let busy = |blocks| LoadReport {
            unplaced_requests: 1,
            unplaced_blocks: blocks,
            ..Default::default()
        };
        // w1 runs a little more (10 blocks, under the prompt's 32): it
        // still gets the new prompt, having stored the least.
        p.record_load(&target(1), busy(10), now);
        let h = sequence_block_hashes(&tokens(20, 512), BS as usize);
        let d = p.route(&input(&h, 512), now).expect("route");
        assert_eq!(chosen(&d), "w1");
        // Far busier (100 blocks more): one of the cheapest, of which w2
        // stored less.
        p.record_load(&target(1), busy(100), now);
        let h = sequence_block_hashes(&tokens(21, 512), BS as usize);
        let d = p.route(&input(&h, 512), now).expect("route");
        assert_eq!(chosen(&d), "w2");
        // A prompt with a cached prefix still goes to its holder, however
        // much that one stored.
        let mut next = tokens(10, 300 * BS);
        next.extend(tokens(30, 64));
        let h = sequence_block_hashes(&next, BS as usize);
        assert_eq!(h[..300], held[0][..]);
        let d = p.route(&input(&h, 300 * BS + 64), now).expect("route");
        assert_eq!(chosen(&d), "w0");
    }

    #[test]
    fn in_latency_mode_a_new_prompt_goes_to_the_soonest_beyond_the_noise() {
        let p = pool(RouterMode::Latency, 2);
        let now = Instant::now();
        // w1's cache turned over least (50 blocks stored lately against
        // 300), but it has 1,000 prompt tokens queued: the new prompt's
        // first token comes 50 ms later there, well beyond the noise (half
        // a 20 ms step) though within the prompt's own prefill (~205 ms).
        for (i, blocks) in [(0, 300), (1, 50)] {
            let h = sequence_block_hashes(&tokens(10 + i as u32, blocks * BS), BS as usize);
            store(&p, i, 1, &h);
        }
        p.record_load(&target(0), measured(0), now);
        p.record_load(&target(1), measured(1_000), now);
        let h = sequence_block_hashes(&tokens(20, 4096), BS as usize);
        let d = p.route(&input(&h, 4096), now).expect("route");
        let ttft = |i: usize| d.candidates[i].terms.predicted_ttft.expect("measured");
        assert!(ttft(1) - ttft(0) > 0.04, "{:?}", d.candidates);
        assert_eq!(chosen(&d), "w0", "{:?}", d.candidates);
    }

    #[test]
    fn a_burst_of_one_prompt_to_idle_workers_spreads() {
        let p = pool(RouterMode::Kv, 4);
        let now = Instant::now();
        idle(&p, 4, now);
        let h = sequence_block_hashes(&tokens(3, 2048), BS as usize);
        let mut per_worker = BTreeMap::<String, usize>::new();
        for _ in 0..8 {
            let d = p.route(&input(&h, 2048), now).expect("route");
            *per_worker.entry(chosen(&d).to_owned()).or_default() += 1;
        }
        assert_eq!(per_worker.len(), 4, "{per_worker:?}");
        assert!(per_worker.values().all(|&n| n == 2), "{per_worker:?}");
    }

    #[test]
    fn a_concurrent_burst_of_one_prompt_spreads_evenly() {
        let p = Arc::new(pool(RouterMode::Kv, 4));
        let now = Instant::now();
        idle(&p, 4, now);
        let h = Arc::new(sequence_block_hashes(&tokens(8, 2048), BS as usize));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let p = Arc::clone(&p);
                let h = Arc::clone(&h);
                std::thread::spawn(move || {
                    let d = p.route(&input(&h, 2048), now).expect("route");
                    d.target().target.worker_id.to_string()
                })
            })
            .collect();
        let mut per_worker = BTreeMap::<String, usize>::new();
        for t in threads {
            *per_worker.entry(t.join().expect("thread")).or_default() += 1;
        }
        assert_eq!(per_worker.len(), 4, "{per_worker:?}");
        assert!(per_worker.values().all(|&n| n == 2), "{per_worker:?}");
    }

    #[test]
    fn a_dry_run_is_not_counted_as_load() {
        let p = pool(RouterMode::Kv, 2);
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(4, 256), BS as usize);
        let mut dry = input(&h, 256);
        dry.commit = Commit::DryRun;
        let d = p.route(&dry, now).expect("route");
        assert!(d.placement.is_none());
        assert!(p.load_view(now).iter().all(|m| m.load.placements == 0));
    }

    /// A report of a worker that measured its steps: 20 ms a decode step,
    /// 50 µs a prompt token, 1,024 tokens a step. Reported now, it is 20 ms
    /// from the end of its step in progress.
    fn measured(unplaced_prefill_tokens: u64) -> LoadReport {
        LoadReport {
            step_time_us: 20_000,
            prefill_ns_per_token: 50_000,
            // One request decodes, with no prefill first: every prompt
            // step carries its row.
            running: 1,
            max_num_batched_tokens: 1024,
            max_num_seqs: 64,
            unplaced_prefill_tokens,
            pending_prefill_tokens: unplaced_prefill_tokens,
            unplaced_requests: u32::from(unplaced_prefill_tokens > 0),
            ..LoadReport::default()
        }
    }

    /// Two members that report fetch rates and block bytes; member 0
    /// holds the first 48 blocks of `h`, behind `queued` prefill tokens.
    fn fetch_pool(mode: RouterMode, rate: u64, queued: u64, h: &[u64], now: Instant) -> WorkerPool {
        let p = WorkerPool::with_seed(
            PoolKind::Decode,
            PoolConfig {
                mode,
                ..PoolConfig::default()
            },
            7,
        );
        for i in 0..2 {
            p.add_member(MemberInfo {
                // 1 MiB a block.
                kv_block_bytes: 1 << 20,
                ..info(i)
            });
            let q = if i == 0 { queued } else { 0 };
            p.record_load(
                &target(i),
                LoadReport {
                    kv_fetch_bytes_per_sec: rate,
                    step_time_us: 5_000,
                    ..measured(q)
                },
                now,
            );
        }
        store(&p, 0, 1, &h[..48]);
        p
    }

    #[test]
    fn a_worker_that_measured_nothing_is_predicted_at_its_peers_timing() {
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(3, 1024), BS as usize);
        // w0 holds 48 blocks behind 20,000 queued tokens; w1 has served
        // nothing yet: it reports only its step shape and the rate it
        // expects fetches at.
        let p = fetch_pool(RouterMode::Latency, 10_000_000_000, 20_000, &h, now);
        p.record_load(
            &target(1),
            LoadReport {
                kv_fetch_bytes_per_sec: 10_000_000_000,
                max_num_batched_tokens: 1024,
                max_num_seqs: 64,
                ..LoadReport::default()
            },
            now,
        );
        let d = p.route(&input(&h, 1024), now).expect("route");
        assert_eq!(chosen(&d), "w1");
        let fresh = &d.target().terms;
        // Predicted (in time, not by blocks) at w0's 5 ms steps and 50 µs
        // a token: 16 tokens after a fetch of 48 blocks.
        let ttft = fresh
            .predicted_ttft
            .expect("predicted at its peer's timing");
        assert!(ttft < 0.05, "{ttft}");
        assert_eq!(fresh.fetch_blocks, 48, "the fetch is priced too");
    }

    #[test]
    fn a_busy_holders_prefix_is_fetched_where_that_beats_computing_it() {
        let now = Instant::now();
        let t = tokens(3, 1024);
        let h = sequence_block_hashes(&t, BS as usize);
        for mode in [RouterMode::Kv, RouterMode::Latency] {
            // The holder has 20,000 prefill tokens queued; 48 blocks fetched
            // at 10 GB/s take ~5 ms, with the engines' waits (half a 5 ms
            // step of the holder's, two of the candidate's) ~12.5 ms;
            // computing their 768 tokens ~38 ms.
            let p = fetch_pool(mode, 10_000_000_000, 20_000, &h, now);
            let d = p.route(&input(&h, 1024), now).expect("route");
            assert_eq!(chosen(&d), "w1", "{mode}");
            let fetched = &d.target().terms;
            assert_eq!(fetched.fetch_blocks, 48, "{mode}");
            let seconds = fetched.fetch_seconds.expect("priced");
            assert!(
                (seconds - 48.0 * (1 << 20) as f64 / 1e10 - 0.0075).abs() < 1e-9,
                "{seconds}"
            );
            assert_eq!(d.prefix_source, Some((target(0), 48)), "{mode}");
            // Counted as the prefill left after the fetch.
            let placed = d.placement.as_ref().expect("committed");
            assert_eq!(placed.prefill_tokens, 1024 - 48 * u64::from(BS), "{mode}");
        }
    }

    /// A fetch is priced at what the pair moves at: a candidate's measured
    /// rate from the holder, where it has one, over its rate from anyone.
    #[test]
    fn a_fetch_is_priced_at_the_pairs_rate() {
        let now = Instant::now();
        let t = tokens(3, 1024);
        let h = sequence_block_hashes(&t, BS as usize);
        let fetches = |overall: u64, from_holder: Option<u64>| {
            let p = fetch_pool(RouterMode::Kv, overall, 20_000, &h, now);
            if let Some(rate) = from_holder {
                let by_peer = HashMap::from([(target(0).worker_id.to_string(), rate)]);
                assert!(p.record_fetch_rates(&target(1), by_peer));
            }
            let d = p.route(&input(&h, 1024), now).expect("route");
            d.candidates[1].terms.fetch_blocks
        };
        // 48 MiB: ~5 ms at 10 GB/s, half a second at 100 MB/s.
        assert_eq!(fetches(10_000_000_000, None), 48);
        assert_eq!(fetches(10_000_000_000, Some(100_000_000)), 0);
        assert_eq!(fetches(100_000_000, Some(10_000_000_000)), 48);
    }

    #[test]
    fn pair_rates_reported_before_the_join_price_fetches_after_it() {
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(3, 1024), BS as usize);
        // w1 slow to fetch overall (100 MB/s), fast from w0 (10 GB/s).
        let p = fetch_pool(RouterMode::Kv, 100_000_000, 20_000, &h, now);
        let early = WorkerRank::new("w2", 0);
        let report = LoadReport {
            kv_fetch_bytes_per_sec: 100_000_000,
            step_time_us: 5_000,
            ..measured(0)
        };
        assert!(!p.record_load(&early, report, now), "not joined yet");
        let by_peer = HashMap::from([(target(0).worker_id.to_string(), 10_000_000_000)]);
        assert!(p.record_fetch_rates(&early, by_peer), "kept for the join");
        p.add_member(MemberInfo {
            target: early.clone(),
            kv_block_bytes: 1 << 20,
            ..info(2)
        });
        let d = p.route(&input(&h, 1024), now).expect("route");
        let joined = d
            .candidates
            .iter()
            .find(|c| c.target == early)
            .expect("candidate");
        assert_eq!(joined.terms.fetch_blocks, 48, "{:?}", joined.terms);
        // The one that fetches slowly from everyone does not fetch.
        assert_eq!(d.candidates[1].terms.fetch_blocks, 0);
    }

    /// Computing a prefix costs the engine steps it takes, not only its
    /// tokens: a fetch a little slower than the tokens' own compute still
    /// counts where it saves a step.
    #[test]
    fn a_fetch_counts_the_step_computing_its_blocks_would_take() {
        let now = Instant::now();
        let t = tokens(6, 1792);
        let h = sequence_block_hashes(&t, BS as usize);
        // 48 MiB at 1.5 GB/s and the engines' waits: ~41 ms, against 38.4
        // ms for the 768 tokens' compute; but without the fetch the 1,792
        // tokens take two 1,024-token steps (a 5 ms step each) and with it
        // one.
        let p = fetch_pool(RouterMode::Kv, 1_500_000_000, 20_000, &h, now);
        let d = p.route(&input(&h, 1792), now).expect("route");
        assert_eq!(chosen(&d), "w1");
        let fetched = &d.target().terms;
        assert_eq!(fetched.fetch_blocks, 48, "{fetched:?}");
        let seconds = fetched.fetch_seconds.expect("priced");
        assert!(
            seconds > 768.0 * 50e-6 && seconds < 768.0 * 50e-6 + 0.005,
            "{seconds}"
        );
        assert_eq!(d.prefix_source, Some((target(0), 48)));
    }

    #[test]
    fn a_second_tier_hit_costs_its_copy() {
        let now = Instant::now();
        let t = tokens(5, 1024);
        let h = sequence_block_hashes(&t, BS as usize);
        let p = pool(RouterMode::Kv, 2);
        for i in 0..2 {
            p.add_member(MemberInfo {
                kv_block_bytes: 1 << 20,
                ..info(i)
            });
            // Restores at 1 GB/s: 48 MiB take ~50 ms, computing the 768
            // tokens ~38 ms.
            p.record_load(
                &target(i),
                LoadReport {
                    kv_tier_bytes_per_sec: 1_000_000_000,
                    ..measured(0)
                },
                now,
            );
            store(&p, i, 1, &h[..48]);
        }
        // Worker 0 moved its copy to the second tier.
        let id = p.kv_id(&target(0)).expect("member");
        p.indexer()
            .apply(
                id,
                &KvEvent {
                    seq: 2,
                    kind: KvEventKind::Moved {
                        hashes: h[..48].to_vec(),
                        tier: 2,
                    },
                },
            )
            .expect("apply");
        let d = p.route(&input(&h, 1024), now).expect("route");
        assert_eq!(chosen(&d), "w1", "the copy in KV memory wins");
        let restore = d.candidates[0].terms.restore_seconds;
        assert!(
            (restore - 48.0 * (1 << 20) as f64 / 1e9).abs() < 1e-9,
            "{restore}"
        );
        assert_eq!(d.candidates[1].terms.restore_seconds, 0.0);
    }

    #[test]
    fn a_fetch_slower_than_computing_or_unmeasured_is_not_counted() {
        let now = Instant::now();
        let t = tokens(4, 1024);
        let h = sequence_block_hashes(&t, BS as usize);
        // 48 MiB at 100 MB/s: half a second, far above computing 768 tokens.
        for rate in [100_000_000, 0] {
            let p = fetch_pool(RouterMode::Kv, rate, 20_000, &h, now);
            let d = p.route(&input(&h, 1024), now).expect("route");
            assert!(
                d.candidates.iter().all(|c| c.terms.fetch_blocks == 0),
                "{rate}"
            );
            assert_eq!(d.prefix_source, None, "{rate}");
        }
        // The holder itself never fetches what it holds.
        let p = fetch_pool(RouterMode::Kv, 10_000_000_000, 0, &h, now);
        let d = p.route(&input(&h, 1024), now).expect("route");
        assert_eq!((chosen(&d), d.prefix_source.clone()), ("w0", None));
    }

    #[test]
    fn latency_mode_costs_in_predicted_seconds_and_skips_a_congested_hit() {
        let p = pool(RouterMode::Latency, 2);
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(9, 256), BS as usize);
        store(&p, 0, 1, &h);
        // w0 holds the whole prompt but has 20,000 prompt tokens to go.
        p.record_load(&target(0), measured(20_000), now);
        p.record_load(&target(1), measured(0), now);
        let d = p.route(&input(&h, 256), now).expect("route");
        assert_eq!(chosen(&d), "w1", "{:?}", d.candidates);
        let idle = &d.candidates[d.chosen].terms;
        // The rest of the decode step in progress, then one step with the
        // decode row and 256 tokens: 20 ms + 20 ms + 12.8 ms.
        let predicted = idle.predicted_ttft.expect("measured");
        assert!((predicted - 0.0528).abs() < 1e-9, "{predicted}");
        assert_eq!(idle.total_cost, predicted, "the cost is the prediction");
        let hit = &d.candidates[1 - d.chosen].terms;
        assert!(hit.predicted_ttft.expect("measured") > 1.0, "{hit:?}");
    }

    #[test]
    fn latency_mode_spreads_a_burst_of_a_prompt_every_worker_holds() {
        let p = pool(RouterMode::Latency, 4);
        // Reported a second ago: every step in progress is over.
        let reported = Instant::now();
        let now = reported + Duration::from_secs(1);
        let h = sequence_block_hashes(&tokens(12, 1024), BS as usize);
        // Every worker holds the prompt and measured about the same 10 ms
        // step, w0's the lowest by a little more than one request adds to
        // any prediction, and prompt tokens at rates their fits put far
        // apart (as identical workers' measurements differ): w3's would
        // make its credit for the same prefix four times w0's.
        for i in 0..4 {
            store(&p, i, 1, &h);
            let report = LoadReport {
                step_time_us: 10_000 + 1_000 * i as u32,
                prefill_ns_per_token: 50_000 * (i as u32 + 1),
                ..measured(0)
            };
            p.record_load(&target(i), report, reported);
        }
        let mut per_worker = BTreeMap::<String, usize>::new();
        for id in 0..64 {
            let d = p.route(&held(&h, 1024, id), now).expect("route");
            *per_worker.entry(chosen(&d).to_owned()).or_default() += 1;
        }
        assert_eq!(per_worker.len(), 4, "{per_worker:?}");
        assert!(per_worker.values().all(|&n| n == 16), "{per_worker:?}");
        // A worker predicted sooner by more than the noise still wins.
        p.record_load(
            &target(2),
            LoadReport {
                step_time_us: 4_000,
                ..measured(0)
            },
            reported,
        );
        let d = p.route(&input(&h, 1024), now).expect("route");
        assert_eq!(chosen(&d), "w2", "{:?}", d.candidates);
    }

    #[test]
    fn predictions_closer_than_their_checked_error_are_not_told_apart() {
        let p = pool(RouterMode::Latency, 2);
        // Placed 200 ms before their first tokens come (below).
        let now = Instant::now()
            .checked_sub(Duration::from_millis(200))
            .expect("a monotonic clock 200 ms past its origin");
        let h = sequence_block_hashes(&tokens(14, 1024), BS as usize);
        for (i, step_time_us) in [(0, 10_000), (1, 20_000)] {
            store(&p, i, 1, &h);
            let report = LoadReport {
                step_time_us,
                ..measured(0)
            };
            p.record_load(&target(i), report, now);
        }
        // Nothing checked yet: w0 is predicted 10 ms sooner, more than half
        // its step, and takes every request.
        for id in 0..4 {
            let d = p.route(&held(&h, 1024, id), now).expect("route");
            assert_eq!(chosen(&d), "w0", "{:?}", d.candidates);
        }
        // Their first tokens come ten times later than predicted (an error
        // of 9 of a prediction, where relative to the time served it would
        // read 0.9): 10 ms no longer tells the two apart, and the one
        // running fewer wins.
        for id in 0..4 {
            let u = p.update(&key(id), PlacementState::Started);
            assert!(u.checked.is_some());
        }
        let d = p.route(&held(&h, 1024, 4), now).expect("route");
        assert_eq!(chosen(&d), "w1", "{:?}", d.candidates);
    }

    #[test]
    fn within_the_predictions_noise_the_holder_wins_over_a_fetch() {
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(8, 1024), BS as usize);
        // Steps of 20 ms (nothing checked yet: 10 ms tell nothing apart).
        // w0 holds 48 blocks and has 256 tokens to compute, at a fitted
        // 35 ms more a prefill step (`extra_us`); w1 would fetch the 48
        // blocks at 100 GB/s (0.5 ms and 30 ms of the engines' waits).
        let route = |extra_us| {
            let p = pool(RouterMode::Latency, 0);
            for i in 0..2 {
                p.add_member(MemberInfo {
                    kv_block_bytes: 1 << 20,
                    ..info(i)
                });
                let report = LoadReport {
                    kv_fetch_bytes_per_sec: 100_000_000_000,
                    prefill_step_us: if i == 0 { extra_us } else { 0 },
                    ..measured(0)
                };
                p.record_load(&target(i), report, now);
            }
            store(&p, 0, 1, &h[..48]);
            p.route(&input(&h, 1024), now).expect("route")
        };
        // w1 is predicted 4.5 ms sooner: within the noise, the holder.
        let d = route(35_000);
        let cost = |i: usize| d.candidates[i].terms.total_cost;
        assert!(cost(1) < cost(0), "{:?}", d.candidates);
        assert_eq!(d.candidates[1].terms.fetch_blocks, 48);
        assert_eq!((chosen(&d), d.prefix_source.clone()), ("w0", None));
        // 19.5 ms sooner: beyond it, the fetch.
        let d = route(50_000);
        assert_eq!(
            (chosen(&d), d.prefix_source.clone()),
            ("w1", Some((target(0), 48)))
        );
    }

    #[test]
    fn latency_mode_keeps_a_request_within_its_ttft_target_where_one_can_meet_it() {
        let p = WorkerPool::with_seed(
            PoolKind::Decode,
            PoolConfig {
                mode: RouterMode::Latency,
                cost: CostParams {
                    overlap_credit: 8.0,
                    ..CostParams::default()
                },
                ..PoolConfig::default()
            },
            7,
        );
        p.add_member(info(0));
        p.add_member(info(1));
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(11, 256), BS as usize);
        // w1 holds the prompt behind 1,500 queued tokens: 128 ms predicted,
        // but the credit for its cache makes it the cheaper; w0 decodes and
        // would compute the prompt in 52.8 ms.
        store(&p, 1, 1, &h);
        p.record_load(&target(0), measured(0), now);
        p.record_load(&target(1), measured(1_500), now);
        let with_target = |ms| RouteInput {
            desc: RequestDescription {
                ttft_target_ms: ms,
                ..input(&h, 256).desc
            },
            ..input(&h, 256)
        };
        let d = p.route(&with_target(0), now).expect("route");
        assert_eq!(
            (chosen(&d), d.within_target),
            ("w1", None),
            "no target: cost"
        );
        let d = p.route(&with_target(60), now).expect("route");
        assert_eq!((chosen(&d), d.within_target), ("w0", Some(true)));
        // Nobody meets 10 ms: the one predicted soonest, and it says so.
        let d = p.route(&with_target(10), now).expect("route");
        assert_eq!((chosen(&d), d.within_target), ("w0", Some(false)));
    }

    #[test]
    fn a_tpot_target_keeps_a_request_off_a_batch_it_would_slow_past_it() {
        let p = pool(RouterMode::Kv, 2);
        let now = Instant::now();
        // Decode steps of 5 ms and 0.5 ms a sequence on both; w0 runs 20
        // requests no router placed (a step of 15.5 ms with one more).
        let report = |unplaced_requests| LoadReport {
            step_time_us: 5_000,
            decode_base_us: 5_000,
            decode_ns_per_seq: 500_000,
            unplaced_requests,
            ..LoadReport::default()
        };
        p.record_load(&target(0), report(20), now);
        p.record_load(&target(1), report(0), now);
        let h = sequence_block_hashes(&tokens(13, 256), BS as usize);
        store(&p, 0, 1, &h);
        let with_tpot = |ms, id| RouteInput {
            desc: RequestDescription {
                tpot_target_ms: ms,
                ..input(&h, 256).desc
            },
            ..held(&h, 256, id)
        };
        // No target: the cached prefix wins.
        let d = p.route(&with_tpot(0, 1), now).expect("route");
        assert_eq!(chosen(&d), "w0");
        p.update(&key(1), PlacementState::Released);
        // A 10 ms target: not w0's 15.5 ms step.
        let d = p.route(&with_tpot(10, 2), now).expect("route");
        assert_eq!(chosen(&d), "w1", "{:?}", d.candidates);
        let w0 = &d
            .candidates
            .iter()
            .find(|c| *c.target.worker_id == *"w0")
            .expect("w0")
            .terms;
        assert!(w0.over_tpot && w0.over_bound, "{w0:?}");
        // It runs on w1; with 10 ms targets w1 takes ten in all (a step
        // of 10 ms), while w0 stays over.
        let on_w1 = |d: &Decision| {
            d.candidates
                .iter()
                .find(|c| *c.target.worker_id == *"w1")
                .expect("w1")
                .terms
        };
        for id in 3..=11 {
            let d = p.route(&with_tpot(10, id), now).expect("route");
            assert_eq!(chosen(&d), "w1", "request {id}: {:?}", on_w1(&d));
        }
        // The eleventh would make w1's step 10.5 ms; so would one without
        // a target of its own (the running requests' targets count): it
        // goes to w0, which has room for it.
        let d = p.route(&with_tpot(0, 12), now).expect("route");
        assert!(on_w1(&d).over_tpot, "{:?}", on_w1(&d));
        assert_eq!(chosen(&d), "w0");
        // Where no worker can meet a target, the bounds alone decide.
        let d = p.route(&with_tpot(1, 13), now).expect("route");
        assert!(d.candidates.iter().all(|c| c.terms.over_tpot));
        assert_eq!(chosen(&d), "w0", "the cached prefix, by cost");
    }

    #[test]
    fn a_started_placement_is_checked_against_its_prediction() {
        let p = pool(RouterMode::Kv, 1);
        let now = Instant::now();
        p.record_load(&target(0), measured(0), now);
        let h = sequence_block_hashes(&tokens(3, 256), BS as usize);
        p.route(&held(&h, 256, 1), now).expect("route");
        let started = p.update(&key(1), PlacementState::Started);
        let check = started.checked.expect("a prediction to check");
        assert_eq!((&check.target, check.priority), (&target(0), 0));
        assert!((check.predicted - 0.0528).abs() < 1e-9, "{check:?}");
        assert!(check.served >= 0.0);
        // Started once: nothing more to check.
        assert!(p.update(&key(1), PlacementState::Started).checked.is_none());
        // A worker that measured nothing yet predicts nothing.
        p.record_load(&target(0), LoadReport::default(), now);
        p.route(&held(&h, 256, 2), now).expect("route");
        assert!(p.update(&key(2), PlacementState::Started).checked.is_none());
    }

    #[test]
    fn a_placement_counts_from_placement_to_release_whatever_the_reports_say() {
        let p = pool(RouterMode::Kv, 2);
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(5, 256), BS as usize);
        let d = p.route(&held(&h, 256, 1), now).expect("route");
        let t = d.target().target.clone();
        let placed = d.placement.expect("committed");
        assert_eq!((placed.prefill_tokens, placed.blocks), (256, 16));
        assert_eq!(load_of(&p, &t).active_prefill_tokens, 256);
        // Reports say nothing about placed requests: they change nothing.
        p.record_load(&t, LoadReport::default(), now + Duration::from_millis(500));
        assert_eq!(load_of(&p, &t).placements, 1);
        assert!(p.update(&key(1), PlacementState::Started).counted);
        let l = load_of(&p, &t);
        assert_eq!((l.active_prefill_tokens, l.active_decode_blocks), (0, 16));
        assert!(p.update(&key(1), PlacementState::Released).counted);
        assert_eq!(load_of(&p, &t).active_requests, 0);
        assert_eq!(load_of(&p, &t).active_decode_blocks, 0);
        assert!(
            !p.update(&key(1), PlacementState::Released).counted,
            "released once"
        );
    }

    #[test]
    fn the_worker_holding_a_prefix_wins_right_after_its_request_ended() {
        // A conversation's next turn, sent the moment the previous answer
        // ended: the previous turn's load must be gone, so the cached
        // prefix decides (issue #14's back-to-back misses).
        let p = pool(RouterMode::Kv, 4);
        let now = Instant::now();
        idle(&p, 4, now);
        let turn1 = tokens(9, 850);
        let h1 = sequence_block_hashes(&turn1, BS as usize);
        let d = p.route(&held(&h1, 850, 1), now).expect("route");
        let holder = d.target().target.clone();
        let i = (0..4).find(|&i| target(i) == holder).expect("member");
        store(&p, i, 1, &h1);
        p.update(&key(1), PlacementState::Started);
        p.update(&key(1), PlacementState::Released);
        let mut turn2 = turn1.clone();
        turn2.extend(tokens(10, 40));
        let h2 = sequence_block_hashes(&turn2, BS as usize);
        for id in 2..10 {
            let d = p.route(&held(&h2, 890, id), now).expect("route");
            assert_eq!(d.target().target, holder, "turn {id}");
            p.update(&key(id), PlacementState::Released);
        }
    }

    #[test]
    fn a_placement_heard_twice_counts_once_and_a_replica_copy_counts_like_the_original() {
        let a = pool(RouterMode::Kv, 2);
        let b = pool(RouterMode::Kv, 2);
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(6, 128), BS as usize);
        let d = a.route(&held(&h, 128, 7), now).expect("route");
        let record = d.placement.expect("committed");
        let t = record.target.clone();
        assert!(b.record_placement(key(7), 1, &record, now));
        assert!(b.record_placement(key(7), 1, &record, now));
        assert_eq!(load_of(&a, &t), load_of(&b, &t));
        assert_eq!(load_of(&b, &t).placements, 1);
        b.update(&key(7), PlacementState::Released);
        assert_eq!(load_of(&b, &t).placements, 0);
    }

    #[test]
    fn orphans_count_for_the_max_age_then_go() {
        let p = pool(RouterMode::Kv, 1);
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(7, 64), BS as usize);
        p.route(&held(&h, 64, 1), now).expect("route");
        p.route(&input(&h, 64), now).expect("route");
        assert_eq!(p.placement_count(), 2);
        let max_age = p.config().placement_max_age;
        assert_eq!(p.expire(now + max_age), 1, "the unreleasable one ages out");
        p.orphan_session("queue-a", 1, now + max_age);
        assert_eq!(p.expire(now + max_age + Duration::from_millis(1)), 0);
        assert_eq!(p.expire(now + max_age * 2), 1);
        assert_eq!(p.placement_count(), 0);
        assert_eq!(load_of(&p, &target(0)).active_decode_blocks, 0);
    }

    #[test]
    fn a_clients_new_session_replaces_its_placements_and_a_departed_worker_takes_its_own() {
        let p = pool(RouterMode::Kv, 2);
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(8, 64), BS as usize);
        let d = p.route(&held(&h, 64, 1), now).expect("route");
        p.forget_client("queue-a");
        assert_eq!(p.placement_count(), 0);
        let record = d.placement.expect("committed");
        p.record_placement(key(1), 2, &record, now);
        p.remove_member(&record.target);
        assert_eq!(p.placement_count(), 0);
    }

    #[test]
    fn a_departed_workers_blocks_vanish() {
        let p = pool(RouterMode::Kv, 2);
        let h = sequence_block_hashes(&tokens(6, 512), BS as usize);
        store(&p, 0, 1, &h);
        assert_eq!(p.remove_member(&target(0)), Some(32));
        assert_eq!(p.indexer().block_count(), 0);
        let d = p.route(&input(&h, 512), Instant::now()).expect("route");
        assert_eq!(chosen(&d), "w1");
        assert_eq!(d.candidates.len(), 1);
        assert_eq!(p.remove_member(&target(0)), None);
    }

    #[test]
    fn approx_routes_repeats_of_a_prompt_to_the_same_worker() {
        let p = pool(RouterMode::Approx, 4);
        let mut now = Instant::now();
        let prompts: Vec<Vec<u64>> = (0..4)
            .map(|s| sequence_block_hashes(&tokens(10 + s, 1024), BS as usize))
            .collect();
        let mut first = Vec::new();
        let mut id = 0;
        // Each request ends before the next (released), as a client's
        // requests one after another do.
        let mut place = |h: &[u64], now| {
            id += 1;
            let d = p.route(&held(h, 1024, id), now).expect("route");
            p.update(&key(id), PlacementState::Released);
            d
        };
        for h in &prompts {
            first.push(chosen(&place(h, now)).to_owned());
            now += Duration::from_secs(1);
        }
        for round in 0..3 {
            for (i, h) in prompts.iter().enumerate() {
                let d = place(h, now);
                assert_eq!(chosen(&d), first[i], "round {round} prompt {i}");
                assert_eq!(d.target().terms.overlap_blocks, 64);
                now += Duration::from_secs(1);
            }
        }
    }

    #[test]
    fn approx_forgets_after_the_ttl() {
        let p = pool(RouterMode::Approx, 2);
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(20, 256), BS as usize);
        p.route(&input(&h, 256), now).expect("route");
        let later = now + p.config().approx_ttl;
        let d = p.route(&input(&h, 256), later).expect("route");
        assert!(d.candidates.iter().all(|c| c.terms.overlap_blocks == 0));
    }

    #[test]
    fn round_robin_cycles_and_random_covers_all() {
        let p = pool(RouterMode::RoundRobin, 3);
        let now = Instant::now();
        let got: Vec<String> = (0..6)
            .map(|_| chosen(&p.route(&input(&[], 10), now).expect("route")).to_owned())
            .collect();
        assert_eq!(got, ["w0", "w1", "w2", "w0", "w1", "w2"]);

        let p = pool(RouterMode::Random, 3);
        let seen: std::collections::BTreeSet<String> = (0..60)
            .map(|_| chosen(&p.route(&input(&[], 10), now).expect("route")).to_owned())
            .collect();
        assert_eq!(seen.len(), 3);
    }

    #[test]
    fn least_loaded_ignores_cached_blocks() {
        let p = pool(RouterMode::LeastLoaded, 2);
        let now = Instant::now();
        let h = sequence_block_hashes(&tokens(7, 512), BS as usize);
        store(&p, 0, 1, &h);
        p.record_load(
            &target(0),
            LoadReport {
                active_blocks: 10,
                ..Default::default()
            },
            now,
        );
        p.record_load(&target(1), LoadReport::default(), now);
        let d = p.route(&input(&h, 512), now).expect("route");
        assert_eq!(chosen(&d), "w1");
        assert_eq!(d.candidates[0].terms.overlap_blocks, 32);
    }

    #[test]
    fn no_member_for_the_model_is_no_workers() {
        let p = pool(RouterMode::Kv, 2);
        let mut i = input(&[], 10);
        i.desc.model = "other".into();
        assert!(matches!(
            p.route(&i, Instant::now()),
            Err(RouterError::NoWorkers {
                pool: PoolKind::Decode,
                ..
            })
        ));
    }
}
