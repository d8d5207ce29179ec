//! The dispatcher: admission checks, releases in policy order, placement
//! and refresh results, leases ending, deadlines, draining and displacement.
//! A request in the queue changes phase only through [`set_phase`], and
//! enters or leaves it through [`PhaseCounts::moved`]: the one writer of
//! the counts and gauges that follow phases (pending in all, per tenant and
//! by priority; active in all and per model). [`State::check`] recounts
//! them from the slots after every change, in debug builds.

use super::*;

/// The counts that follow requests' phases. Only [`PhaseCounts::moved`]
/// changes them.
#[derive(Debug, Default)]
pub(super) struct PhaseCounts {
    /// Held, refreshing or being placed.
    pending: usize,
    /// Granted, lease not yet ended.
    active: usize,
    /// Pending by tenant (no zero entries).
    tenants: HashMap<String, usize>,
}

impl PhaseCounts {
    pub(super) fn pending(&self) -> usize {
        self.pending
    }

    pub(super) fn active(&self) -> usize {
        self.active
    }

    #[cfg(debug_assertions)]
    pub(super) fn tenants(&self) -> impl Iterator<Item = (&String, &usize)> {
        self.tenants.iter()
    }

    fn tenant_pending(&self, tenant: &str) -> usize {
        self.tenants.get(tenant).copied().unwrap_or(0)
    }

    /// A request (`entry`, of `model`) moved from phase `from` to `to`
    /// (`None`: not in the queue, before admission or after it left).
    pub(super) fn moved(
        &mut self,
        model: Option<&mut ModelQueue>,
        entry: &Entry,
        from: Option<Phase>,
        to: Option<Phase>,
        metrics: &QueueMetrics,
    ) {
        let pending = |p: Option<Phase>| p.is_some_and(|p| p != Phase::Active);
        let active = |p: Option<Phase>| p == Some(Phase::Active);
        let tenant = &entry.desc.tenant;
        match (pending(from), pending(to)) {
            (false, true) => {
                self.pending += 1;
                *self.tenants.entry(tenant.clone()).or_default() += 1;
                metrics.pending(entry.desc.priority, entry.desc.prompt_tokens, 1);
            }
            (true, false) => {
                self.pending -= 1;
                if let Some(count) = self.tenants.get_mut(tenant) {
                    *count -= 1;
                    if *count == 0 {
                        self.tenants.remove(tenant);
                    }
                }
                metrics.pending(entry.desc.priority, entry.desc.prompt_tokens, -1);
            }
            _ => {}
        }
        match (active(from), active(to)) {
            (false, true) => {
                self.active += 1;
                if let Some(model) = model {
                    model.active += 1;
                }
                metrics.active(1);
            }
            (true, false) => {
                self.active -= 1;
                if let Some(model) = model {
                    model.active -= 1;
                }
                metrics.active(-1);
            }
            _ => {}
        }
    }
}

/// Sets the phase of `slot` (a request of `model`): the one place a
/// request in the queue changes phase.
fn set_phase(
    counts: &mut PhaseCounts,
    model: Option<&mut ModelQueue>,
    slot: &mut Slot,
    to: Phase,
    metrics: &QueueMetrics,
) {
    let from = std::mem::replace(&mut slot.phase, to);
    counts.moved(model, &slot.entry, Some(from), Some(to), metrics);
}

/// Work the dispatcher starts outside the lock.
pub(super) enum Op {
    Place(u64, Entry),
    Refresh(u64, Entry),
}

pub(super) enum Outcome {
    Placed {
        seq: u64,
        model: String,
        priority: i32,
        result: Result<Placed, QueueError>,
    },
    Refreshed(Refreshed),
}

/// An overlap read's answer for request `seq` of `model`.
pub(super) struct Refreshed {
    seq: u64,
    model: String,
    result: Result<u32, QueueError>,
}

impl Op {
    pub(super) fn start<P: Placer>(self, placer: Arc<P>) -> BoxFuture<'static, Outcome> {
        match self {
            Op::Place(seq, entry) => Box::pin(async move {
                let span = entry.span.clone();
                let result = tracing::Instrument::instrument(placer.place(&entry), span).await;
                Outcome::Placed {
                    seq,
                    priority: entry.desc.priority,
                    model: entry.desc.model,
                    result,
                }
            }),
            Op::Refresh(seq, entry) => Box::pin(async move {
                let span = entry.span.clone();
                let result = tracing::Instrument::instrument(placer.overlap(&entry), span).await;
                Outcome::Refreshed(Refreshed {
                    seq,
                    model: entry.desc.model,
                    result,
                })
            }),
        }
    }
}

impl State {
    pub(super) fn check_admission(
        &self,
        cfg: &Args,
        entry: &Entry,
        now: Instant,
    ) -> Result<(), QueueError> {
        if self.draining {
            return Err(QueueError::Draining);
        }
        let pending = self.counts.pending();
        let retry_after = self.drained.retry_after(pending, now);
        if pending >= cfg.max_pending {
            return Err(QueueError::QueueFull {
                pending,
                limit: cfg.max_pending,
                retry_after,
            });
        }
        let reserved = cfg.reserved_slots();
        if entry.desc.priority <= cfg.shed_protect_priority
            && reserved > 0
            && pending >= cfg.max_pending - reserved
        {
            return Err(QueueError::Shed {
                retry_after,
                priority: entry.desc.priority,
                pending,
                reserved,
                limit: cfg.max_pending,
                protect: cfg.shed_protect_priority,
            });
        }
        let tenant_pending = self.counts.tenant_pending(&entry.desc.tenant);
        if tenant_pending >= cfg.max_pending_per_tenant {
            return Err(QueueError::TenantFull {
                tenant: entry.desc.tenant.clone(),
                pending: tenant_pending,
                limit: cfg.max_pending_per_tenant,
                retry_after: self.drained.retry_after(tenant_pending, now),
            });
        }
        if let Some(deadline) = entry.deadline
            && deadline <= now
        {
            return Err(QueueError::DeadlineExceeded {
                waited: now.saturating_duration_since(entry.arrival),
            });
        }
        Ok(())
    }

    /// Releases, per model, as many held requests as the hold rule allows.
    pub(super) fn release(&mut self, cfg: &Args, now: Instant, metrics: &QueueMetrics) -> Vec<Op> {
        let mut ops = Vec::new();
        if self.draining {
            return ops;
        }
        let refresh_after = cfg.refresh_interval();
        for (model_name, model) in &mut self.models {
            model.hold = None;
            while let Some(seq) = model.order.head() {
                let mut express = false;
                let priority = self
                    .slots
                    .get(&seq)
                    .map_or(i32::MIN, |s| s.entry.desc.priority);
                let load = LoadCheck {
                    load: &self.load,
                    starting: &self.starting_prefill,
                    priority,
                    held_elsewhere: &self.held_elsewhere,
                };
                if let Some(reason) = hold_reason(cfg, model, model_name, &load, self.replicas) {
                    if !model.express_head(reason) {
                        model.hold = Some(reason);
                        break;
                    }
                    express = true;
                }
                let Some(slot) = self.slots.get_mut(&seq) else {
                    // Unreachable by the invariants; drop the stray id.
                    tracing::error!(seq, "held id without a slot");
                    if let Some((_, Some(released))) = model.order.pop_head() {
                        model.order.finish(&released);
                    }
                    continue;
                };
                if slot.phase == Phase::Refreshing {
                    model.hold = Some(HoldReason::RefreshingOverlap);
                    break;
                }
                let stale = slot
                    .last_refresh
                    .is_some_and(|at| now.saturating_duration_since(at) >= refresh_after);
                if cfg.queue_policy == Policy::Wspt && stale {
                    // Stays in the order (and blocks this model's releases)
                    // until the fresh overlap is back.
                    ops.push(refresh(seq, slot, model, &mut self.counts, metrics));
                    continue;
                }
                if let Some((_, released)) = model.order.pop_head() {
                    if let Some(released) = &released {
                        *model
                            .starting
                            .entry(Arc::clone(&released.class))
                            .or_default() += 1;
                    }
                    slot.fair = released;
                }
                slot.express = express;
                if express {
                    model.express = true;
                    tracing::debug!(request_id = %slot.entry.desc.request_id, "released past the threshold: its tenant has nothing starting");
                }
                self.deadlines.remove(&(slot.expiry, seq));
                slot.released_at = Some(now);
                set_phase(
                    &mut self.counts,
                    Some(&mut *model),
                    slot,
                    Phase::Placing,
                    metrics,
                );
                model.placing += 1;
                model.run(slot.entry.desc.priority, 1);
                ops.push(Op::Place(seq, slot.entry.clone()));
            }
        }
        // Under wspt the overlap orders held requests: read a first estimate
        // for each newly held one, without blocking releases.
        for seq in std::mem::take(&mut self.unread) {
            if cfg.queue_policy != Policy::Wspt {
                break;
            }
            let Some(slot) = self.slots.get_mut(&seq) else {
                continue;
            };
            if slot.phase != Phase::Held || slot.last_refresh.is_some() {
                continue;
            }
            if let Some(model) = self.models.get_mut(&slot.entry.desc.model) {
                ops.push(refresh(seq, slot, model, &mut self.counts, metrics));
            }
        }
        ops
    }

    /// What this queue holds unplaced, when it changed since the last
    /// report and [`HELD_REPORT_INTERVAL`] has passed since; otherwise when
    /// the next report falls due (if one is waiting). A queue alone reports
    /// nothing (nobody reads it), except once, nothing, after it had
    /// company.
    pub(super) fn held_report(&mut self, now: Instant) -> (Option<HeldByModel>, Option<Instant>) {
        if !self.held_changed {
            return (None, None);
        }
        if self.replicas <= 1 {
            self.held_changed = false;
            return match self.held_reported.take() {
                Some(_) => (Some(HeldByModel::new()), None),
                None => (None, None),
            };
        }
        if let Some(at) = self.held_reported
            && now < at + HELD_REPORT_INTERVAL
        {
            return (None, Some(at + HELD_REPORT_INTERVAL));
        }
        self.held_changed = false;
        self.held_reported = Some(now);
        let held = self
            .models
            .iter()
            .filter(|(_, m)| !m.held_by_priority.is_empty())
            .map(|(name, m)| (name.clone(), m.held_by_priority.clone()))
            .collect();
        (Some(held), None)
    }

    /// Sends held requests their status when it changed: the head at once,
    /// everyone else in a full pass at most once per [`POSITION_INTERVAL`]
    /// per model (at once when the reason changed). Returns when a
    /// held-back pass falls due.
    pub(super) fn publish_positions(&mut self, now: Instant) -> Option<Instant> {
        let mut due_next: Option<Instant> = None;
        for model in self.models.values_mut() {
            let Some(reason) = model.hold else {
                model.published = None;
                continue;
            };
            let pending = u32::try_from(model.order.len()).unwrap_or(u32::MAX);
            let full_due = match model.published {
                Some((at, published)) if published == reason && now < at + POSITION_INTERVAL => {
                    let due = at + POSITION_INTERVAL;
                    due_next = Some(due_next.map_or(due, |d| d.min(due)));
                    false
                }
                _ => true,
            };
            let order = if full_due {
                model.published = Some((now, reason));
                model.order.sequence()
            } else {
                model.order.head().into_iter().collect()
            };
            for (position, seq) in order.into_iter().enumerate() {
                let Some(slot) = self.slots.get_mut(&seq) else {
                    continue;
                };
                let status = HeldStatus {
                    position: u32::try_from(position).unwrap_or(u32::MAX),
                    pending,
                    reason,
                };
                if slot.sent.as_ref() != Some(&status) {
                    slot.tx.send_replace(TicketState::Held(status.clone()));
                    slot.sent = Some(status);
                }
            }
        }
        due_next
    }

    /// Fails held requests whose deadline passed.
    pub(super) fn expire(
        &mut self,
        cfg: &Args,
        epoch: Instant,
        now: Instant,
        metrics: &QueueMetrics,
    ) {
        while let Some(&(deadline, seq)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            let Some(slot) = self.slots.remove(&seq) else {
                continue;
            };
            let mut behind = 0;
            if let Some(model) = self.models.get_mut(&slot.entry.desc.model) {
                model.order.remove(cfg, epoch, seq, &slot.entry);
                model.count_held(slot.entry.desc.priority, -1);
                self.held_changed = true;
                behind = model.order.len();
            }
            self.left(&slot, metrics);
            self.retire(&slot, false, now);
            let desc = &slot.entry.desc;
            let waited = now.saturating_duration_since(slot.entry.arrival);
            let target = slot.target;
            let err = if slot.entry.deadline.is_none_or(|d| d > now) {
                // Still held when it had to start to meet its TTFT target
                // (the target less the start lead: the mean time from
                // release to first token and four of its mean deviations):
                // it would be served late, so it leaves now, told
                // when the backlog will have drained.
                let err = QueueError::TargetMissed {
                    waited,
                    target,
                    retry_after: self.drained.retry_after(behind, now),
                };
                metrics.rejected(desc.priority, &desc.tenant, err.reason().label());
                err
            } else {
                metrics.expired(desc.priority, &desc.tenant);
                QueueError::DeadlineExceeded { waited }
            };
            slot.entry.span.record("outcome", err.reason().label());
            tracing::debug!(request_id = %desc.request_id, error = %err, "left unplaced");
            slot.tx.send_replace(TicketState::Failed(err));
        }
    }

    /// Applies a placement's or refresh's result.
    pub(super) fn complete(
        &mut self,
        outcome: Outcome,
        cfg: &Args,
        epoch: Instant,
        metrics: &QueueMetrics,
        now: Instant,
    ) {
        match outcome {
            Outcome::Refreshed(refreshed) => {
                self.refreshed(refreshed, cfg, epoch, metrics, now);
            }
            Outcome::Placed {
                seq,
                model,
                priority,
                result,
            } => {
                let Some(queue) = self.models.get_mut(&model) else {
                    return;
                };
                queue.placing -= 1;
                // A granted request runs on (`granted` counts it again).
                queue.run(priority, -1);
                // Placed (the router counts it now) or gone: no longer
                // unplaced.
                queue.count_held(priority, -1);
                self.held_changed = true;
                if !self.slots.contains_key(&seq) {
                    tracing::debug!(seq, "request cancelled during placement");
                    return;
                }
                match result {
                    Ok(placed) => self.granted(seq, &model, placed, cfg, metrics, now),
                    Err(err) => self.placement_failed(seq, err, metrics, now),
                }
            }
        }
    }

    /// An overlap refresh came back: under `wspt` the request is re-keyed
    /// by it, and held again.
    fn refreshed(
        &mut self,
        Refreshed { seq, model, result }: Refreshed,
        cfg: &Args,
        epoch: Instant,
        metrics: &QueueMetrics,
        now: Instant,
    ) {
        let Some(queue) = self.models.get_mut(&model) else {
            return;
        };
        queue.refreshing -= 1;
        let Some(slot) = self.slots.get_mut(&seq) else {
            return; // cancelled while refreshing
        };
        if slot.phase != Phase::Refreshing {
            return;
        }
        match result {
            Ok(overlap) => {
                // Re-key: under wspt the overlap moves the request.
                queue.order.remove(cfg, epoch, seq, &slot.entry);
                slot.entry.overlap_tokens = overlap.min(slot.entry.desc.prompt_tokens);
                queue
                    .order
                    .insert(cfg, epoch, seq, &slot.entry, slot.weight);
            }
            Err(err) => {
                tracing::debug!(request_id = %slot.entry.desc.request_id, error = %err, "overlap refresh failed; keeping the old estimate");
            }
        }
        slot.last_refresh = Some(now);
        set_phase(&mut self.counts, Some(queue), slot, Phase::Held, metrics);
    }

    /// The request was placed: it becomes active, its tenant is charged
    /// for the uncached prompt (the placement knows the cached prefix),
    /// the chosen worker's load grows by it until the next load view, and
    /// the ticket hears the grant.
    fn granted(
        &mut self,
        seq: u64,
        model: &str,
        Placed { placement, lease }: Placed,
        cfg: &Args,
        metrics: &QueueMetrics,
        now: Instant,
    ) {
        let Some(slot) = self.slots.get(&seq) else {
            return;
        };
        let entry = slot.entry.clone();
        let released = slot.fair.clone();
        let express = slot.express;
        let uncached = entry
            .desc
            .prompt_tokens
            .saturating_sub(placement.overlap_tokens);
        // The prompt was charged as uncached (less any overlap read before
        // release); the placement knows the cached prefix now.
        let cached = f64::from(placement.overlap_tokens.min(entry.desc.prompt_tokens))
            - f64::from(entry.overlap_tokens);
        if let Some(queue) = self.models.get_mut(model) {
            queue.run(entry.desc.priority, 1);
            queue.drained.grant(now);
            if let Some(released) = &released
                && tokens_cost(cfg)
            {
                queue.order.charge(released, -cached);
            }
        }
        self.quotas.charge(
            &entry.desc.tenant,
            -f64::from(placement.overlap_tokens.min(entry.desc.prompt_tokens)),
            now,
        );
        let busy = placement
            .prefill
            .as_ref()
            .unwrap_or(&placement.worker)
            .rank
            .clone();
        if let Some(load) = self.load.get_mut(&busy) {
            load.active_prefill_tokens += u64::from(uncached);
        }
        // A prompt cached whole adds nothing (and no empty entry).
        if uncached > 0 {
            *self
                .starting_prefill
                .entry(busy.clone())
                .or_default()
                .entry(entry.desc.priority)
                .or_default() += u64::from(uncached);
        }
        let waited = now.saturating_duration_since(entry.arrival);
        self.drained.grant(now);
        metrics.served(&entry.desc.tenant, "prompt", u64::from(uncached));
        metrics.granted(
            entry.desc.priority,
            &entry.desc.tenant,
            waited.as_secs_f64(),
            express,
        );
        tracing::debug!(
            request_id = %entry.desc.request_id,
            priority = entry.desc.priority,
            worker_id = %placement.worker.rank.worker_id,
            waited_ms = waited.as_secs_f64() * 1000.0,
            "granted"
        );
        if let Some(slot) = self.slots.get_mut(&seq) {
            set_phase(
                &mut self.counts,
                self.models.get_mut(model),
                slot,
                Phase::Active,
                metrics,
            );
            slot.prefill = Some((busy, u64::from(uncached)));
            slot.lease = lease;
            slot.granted_at = Some(now);
            slot.tx.send_replace(TicketState::Granted(Grant {
                placement,
                waited,
                express,
                ttft_target: slot.target,
                tpot_target_ms: slot.entry.desc.tpot_target_ms,
                predicted_wait: slot.predicted,
            }));
        }
    }

    /// No placement: the request leaves with the error.
    fn placement_failed(
        &mut self,
        seq: u64,
        err: QueueError,
        metrics: &QueueMetrics,
        now: Instant,
    ) {
        if let Some(slot) = self.slots.remove(&seq) {
            tracing::debug!(request_id = %slot.entry.desc.request_id, error = %err, "placement failed");
            self.left(&slot, metrics);
            self.retire(&slot, false, now);
            metrics.rejected(
                slot.entry.desc.priority,
                &slot.entry.desc.tenant,
                err.reason().label(),
            );
            slot.tx.send_replace(TicketState::Failed(err));
        }
    }

    /// The ticket was dropped: leave at once, or end the lease.
    pub(super) fn leave(&mut self, seq: u64, cfg: &Args, epoch: Instant, metrics: &QueueMetrics) {
        let Some(slot) = self.slots.remove(&seq) else {
            return;
        };
        self.retire(&slot, slot.phase == Phase::Active, Instant::now());
        self.left(&slot, metrics);
        match slot.phase {
            Phase::Held | Phase::Refreshing => {
                if let Some(model) = self.models.get_mut(&slot.entry.desc.model) {
                    model.order.remove(cfg, epoch, seq, &slot.entry);
                    model.count_held(slot.entry.desc.priority, -1);
                    self.held_changed = true;
                }
                self.deadlines.remove(&(slot.expiry, seq));
                metrics.cancelled();
            }
            Phase::Placing => metrics.cancelled(),
            Phase::Active => {
                if let Some(model) = self.models.get_mut(&slot.entry.desc.model) {
                    model.run(slot.entry.desc.priority, -1);
                    if let Some(at) = slot.granted_at {
                        model.lease_ended(
                            slot.entry.desc.priority,
                            Instant::now().saturating_duration_since(at),
                        );
                    }
                }
            }
        }
    }

    /// Fails every request not yet granted; admits nothing more.
    pub(super) fn drain(&mut self, metrics: &QueueMetrics) {
        self.draining = true;
        let waiting: Vec<u64> = self
            .slots
            .iter()
            .filter(|(_, s)| s.phase != Phase::Active)
            .map(|(&seq, _)| seq)
            .collect();
        for model in self.models.values_mut() {
            model.order.clear();
            model.held_by_priority.clear();
        }
        self.held_changed = true;
        for seq in waiting {
            if let Some(slot) = self.slots.remove(&seq) {
                self.left(&slot, metrics);
                self.retire(&slot, false, Instant::now());
                metrics.rejected(
                    slot.entry.desc.priority,
                    &slot.entry.desc.tenant,
                    QueueError::Draining.reason().label(),
                );
                slot.tx
                    .send_replace(TicketState::Failed(QueueError::Draining));
            }
        }
        self.deadlines.clear();
    }

    /// The queue is full and `entry` outranks a held request: the held
    /// request of the lowest (strict tier, priority), the newest of them,
    /// leaves with [`QueueError::Displaced`] and a retry-after from the
    /// drain rate, making room. Whether one left.
    pub(super) fn displace(
        &mut self,
        cfg: &Args,
        epoch: Instant,
        entry: &Entry,
        metrics: &QueueMetrics,
        now: Instant,
    ) -> bool {
        let rank = |e: &Entry| (e.desc.strict_priority, e.desc.priority);
        let victim = self
            .slots
            .iter()
            .filter(|(_, s)| s.phase == Phase::Held && rank(&s.entry) < rank(entry))
            .min_by_key(|&(&seq, s)| (rank(&s.entry), Reverse(seq)))
            .map(|(&seq, _)| seq);
        let Some(slot) = victim.and_then(|seq| self.slots.remove(&seq).map(|s| (seq, s))) else {
            return false;
        };
        let (seq, slot) = slot;
        self.retire(&slot, false, now);
        if let Some(model) = self.models.get_mut(&slot.entry.desc.model) {
            model.order.remove(cfg, epoch, seq, &slot.entry);
            model.count_held(slot.entry.desc.priority, -1);
            self.held_changed = true;
        }
        self.deadlines.remove(&(slot.expiry, seq));
        self.left(&slot, metrics);
        let err = QueueError::Displaced {
            priority: slot.entry.desc.priority,
            by: entry.desc.priority,
            retry_after: self.drained.retry_after(self.counts.pending(), now),
        };
        tracing::debug!(request_id = %slot.entry.desc.request_id, by = %entry.desc.request_id, "displaced from the full queue");
        metrics.rejected(
            slot.entry.desc.priority,
            &slot.entry.desc.tenant,
            err.reason().label(),
        );
        slot.tx.send_replace(TicketState::Failed(err));
        true
    }

    /// A slot left the queue: its tenant's quota gets its in-flight count
    /// back, and, when it never ran (`granted` false), the prompt it was
    /// charged; a released request stops counting as running in its band
    /// (refunding its release cost when it never ran), and one that had no
    /// first token yet stops counting as starting, its prompt off this
    /// queue's load view.
    pub(super) fn retire(&mut self, slot: &Slot, granted: bool, now: Instant) {
        let entry = &slot.entry;
        if !granted {
            // Admission charged the whole prompt.
            self.quotas.charge(
                &entry.desc.tenant,
                -f64::from(entry.desc.prompt_tokens),
                now,
            );
        }
        self.quotas.release(&entry.desc.tenant, now);
        if slot.starting()
            && let Some(model) = self.models.get_mut(&entry.desc.model)
        {
            model.first_token(slot.fair.as_ref().map(|r| &*r.class), slot.express);
        }
        // Ended before its first token: its prefill is not coming.
        if let Some(prefill) = &slot.prefill {
            self.prefill_done(prefill, entry.desc.priority);
        }
        if let Some(released) = &slot.fair
            && let Some(model) = self.models.get_mut(&entry.desc.model)
        {
            if !granted {
                model.order.charge(released, -released.charged);
            }
            model.order.finish(released);
        }
    }

    /// The granted request produced its first token: the router hears it
    /// through the lease, and the uncached prompt this queue added to the
    /// worker's load at the grant comes off. Returns whether held requests
    /// should be looked at again.
    pub(super) fn started(&mut self, seq: u64) -> bool {
        let Some(slot) = self.slots.get_mut(&seq) else {
            return false;
        };
        if let Some(lease) = &slot.lease {
            lease.started();
        }
        let Some(prefill) = slot.prefill.take() else {
            return false;
        };
        if let Some(model) = self.models.get_mut(&slot.entry.desc.model) {
            model.first_token(slot.fair.as_ref().map(|r| &*r.class), slot.express);
            if let Some(at) = slot.released_at {
                let now = Instant::now();
                model.started_after(
                    slot.entry.desc.priority,
                    now.saturating_duration_since(at),
                    now,
                );
            }
        }
        let priority = slot.entry.desc.priority;
        self.prefill_done(&prefill, priority);
        true
    }

    /// Takes a granted prompt's uncached tokens off this queue's view of
    /// its worker's queued prefill (the grant added them).
    fn prefill_done(&mut self, (worker, tokens): &(WorkerRank, u64), priority: i32) {
        if let Some(load) = self.load.get_mut(worker) {
            load.active_prefill_tokens = load.active_prefill_tokens.saturating_sub(*tokens);
        }
        if let Some(by_priority) = self.starting_prefill.get_mut(worker) {
            if let Some(left) = by_priority.get_mut(&priority) {
                *left = left.saturating_sub(*tokens);
                if *left == 0 {
                    by_priority.remove(&priority);
                }
            }
            if by_priority.is_empty() {
                self.starting_prefill.remove(worker);
            }
        }
    }

    /// Charges the output tokens a granted request produced since the last
    /// report.
    pub(super) fn progress(
        &mut self,
        seq: u64,
        completion_tokens: u32,
        cfg: &Args,
        metrics: &QueueMetrics,
        now: Instant,
    ) {
        let Some(slot) = self.slots.get_mut(&seq) else {
            return;
        };
        if slot.phase != Phase::Active || completion_tokens <= slot.output {
            return;
        }
        let new = f64::from(completion_tokens - slot.output);
        slot.output = completion_tokens;
        let tenant = slot.entry.desc.tenant.clone();
        if let Some(released) = slot.fair.clone()
            && tokens_cost(cfg)
            && let Some(model) = self.models.get_mut(&slot.entry.desc.model)
        {
            model.order.charge(&released, new);
        }
        self.quotas.charge(&tenant, new, now);
        metrics.served(&tenant, "output", new as u64);
    }

    /// `slot` left the queue (already out of `slots`).
    fn left(&mut self, slot: &Slot, metrics: &QueueMetrics) {
        let model = self.models.get_mut(&slot.entry.desc.model);
        self.counts
            .moved(model, &slot.entry, Some(slot.phase), None, metrics);
    }
}

/// Starts reading a held request's overlap (`wspt`): the one place a
/// request enters `Refreshing`.
fn refresh(
    seq: u64,
    slot: &mut Slot,
    model: &mut ModelQueue,
    counts: &mut PhaseCounts,
    metrics: &QueueMetrics,
) -> Op {
    set_phase(counts, Some(&mut *model), slot, Phase::Refreshing, metrics);
    model.refreshing += 1;
    Op::Refresh(seq, slot.entry.clone())
}
