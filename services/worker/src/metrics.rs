//! Worker metrics: requests by finish reason, tokens, time to first token,
//! remote prefill outcomes and known prefill peers, prefix fetches (asked
//! and served), preemptions by request priority and the tokens
//! they made the engine compute again, and each rank's scheduler load.

use prometheus::{GaugeVec, Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};
use sluice_engine::LoadStats;
use sluice_runtime::metrics::Registrar;

/// Every metric one worker exports, in its own registry.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub generated_tokens: IntCounter,
    pub ttft: Histogram,
    pub remote_prefill: IntCounterVec,
    /// Prefill workers this worker knows from discovery (the only ones it
    /// will dial).
    pub prefill_peers: IntGauge,
    /// Per engine rank: running and waiting sequences.
    pub running: IntGaugeVec,
    pub waiting: IntGaugeVec,
    /// Per engine rank: fraction of KV blocks in use.
    pub kv_usage: GaugeVec,
    /// Per engine rank: steps where balance scheduling held admission back,
    /// and preemptions (both cumulative, as the engine counts them).
    pub balance_held_steps: IntGaugeVec,
    pub decode_stalled_steps: IntGaugeVec,
    pub admission_held_steps: IntGaugeVec,
    pub preemptions: IntGaugeVec,
    /// Per engine rank: blocks the second KV tier holds, and blocks restored
    /// from it (cumulative).
    pub tier_blocks: IntGaugeVec,
    pub tier_restored_blocks: IntGaugeVec,
    /// Preemptions of this worker's requests, by the request's priority;
    /// counted as the request's stream learns of them (its next token or
    /// its end), so a request dropped while preempted leaves its last one out.
    pub preemptions_total: IntCounterVec,
    /// Tokens computed again after a preemption (K/V computed once, lost, recomputed).
    pub recomputed_tokens: IntCounter,
    /// `GenerateSession` streams open (a frontend keeps one per worker).
    pub generate_sessions: IntGauge,
    /// Prefix fetches from a peer, by outcome (ok, or why it recomputed).
    pub prefix_fetch: IntCounterVec,
    /// Prompt tokens fetched from peers instead of computed.
    pub prefix_fetched_tokens: IntCounter,
    /// Blocks this worker sent to peers that fetched a prefix it held.
    pub prefix_served_blocks: IntCounter,
    /// Workers this worker may fetch prefixes from (discovery's).
    pub prefix_peers: IntGauge,
}

impl WorkerMetrics {
    /// The metrics of worker `worker_id`: every series carries it as a
    /// constant label, so several workers of one process (`sluice up`)
    /// render side by side on one `/metrics`.
    pub fn new(worker_id: &str) -> Result<Self, prometheus::Error> {
        let labels = [("worker_id".to_owned(), worker_id.to_owned())].into();
        let registry = Registry::new_custom(None, Some(labels))?;
        let r = Registrar(&registry);
        let rank = &["rank"];
        Ok(Self {
            preemptions_total: r.counter_vec(
                "sluice_worker_preemptions_total",
                "Preemptions of requests, by request priority",
                &["priority"],
            )?,
            recomputed_tokens: r.counter(
                "sluice_worker_recomputed_tokens_total",
                "Tokens computed again after a preemption",
            )?,
            running: r.gauge_vec(
                "sluice_worker_running_sequences",
                "Running sequences, by engine rank",
                rank,
            )?,
            waiting: r.gauge_vec(
                "sluice_worker_waiting_sequences",
                "Waiting sequences, by engine rank",
                rank,
            )?,
            balance_held_steps: r.gauge_vec(
                "sluice_worker_balance_held_steps",
                "Steps where balance scheduling held admission back (cumulative), by engine rank",
                rank,
            )?,
            decode_stalled_steps: r.gauge_vec(
                "sluice_worker_decode_stalled_steps",
                "Steps that left decoding sequences' rows out for prompts' prefill (cumulative; --prefill-first-steps), by engine rank",
                rank,
            )?,
            admission_held_steps: r.gauge_vec(
                "sluice_worker_admission_held_steps",
                "Steps where waiting prompts waited for slots about to free, to share a prefill step (cumulative), by engine rank",
                rank,
            )?,
            preemptions: r.gauge_vec(
                "sluice_worker_preemptions",
                "Preemptions so far, by engine rank",
                rank,
            )?,
            tier_blocks: r.gauge_vec(
                "sluice_worker_kv_tier_blocks",
                "KV blocks the second tier holds (evicted from KV memory, restorable), by engine rank",
                rank,
            )?,
            tier_restored_blocks: r.gauge_vec(
                "sluice_worker_kv_tier_restored_blocks",
                "KV blocks restored from the second tier instead of computed (cumulative), by engine rank",
                rank,
            )?,
            kv_usage: r.float_gauge_vec(
                "sluice_worker_kv_usage",
                "Fraction of KV blocks in use, by engine rank",
                rank,
            )?,
            requests: r.counter_vec(
                "sluice_worker_requests_total",
                "Finished requests by reason (stop, length, abort, error; ttft_target_missed: refused before any token, not started when its TTFT target passed)",
                &["reason"],
            )?,
            generated_tokens: r
                .counter("sluice_worker_generated_tokens_total", "Tokens generated")?,
            ttft: r.histogram(
                "sluice_worker_ttft_seconds",
                "Time from Generate to the first token on this worker",
                &[
                    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                ],
            )?,
            remote_prefill: r.counter_vec(
                "sluice_worker_remote_prefill_total",
                "Remote prefill attempts by outcome (ok, fallback reason)",
                &["outcome"],
            )?,
            generate_sessions: r.gauge(
                "sluice_worker_generate_sessions",
                "GenerateSession streams open (a frontend keeps one per worker)",
            )?,
            prefix_fetch: r.counter_vec(
                "sluice_worker_prefix_fetch_total",
                "Prefix fetches from a peer, by outcome (ok, or why the prefix was recomputed)",
                &["outcome"],
            )?,
            prefix_fetched_tokens: r.counter(
                "sluice_worker_prefix_fetched_tokens_total",
                "Prompt tokens fetched from peers instead of computed",
            )?,
            prefix_served_blocks: r.counter(
                "sluice_worker_prefix_served_blocks_total",
                "KV blocks sent to peers that fetched a prefix this worker held",
            )?,
            prefix_peers: r.gauge(
                "sluice_worker_prefix_peers",
                "Workers known from discovery that prefixes may be fetched from",
            )?,
            prefill_peers: r.gauge(
                "sluice_worker_prefill_peers",
                "Prefill workers known from discovery (the only ones this worker dials)",
            )?,
            registry,
        })
    }
}

impl WorkerMetrics {
    /// Adds what preemption cost one request since `seen` (its previous
    /// report) to the counters.
    pub fn record_preemption(
        &self,
        priority: &str,
        seen: sluice_engine::Preemption,
        now: sluice_engine::Preemption,
    ) {
        let count = now.count.saturating_sub(seen.count) as u64;
        if count > 0 {
            self.preemptions_total
                .with_label_values(&[priority])
                .inc_by(count);
        }
        let recomputed = now.recomputed_tokens.saturating_sub(seen.recomputed_tokens) as u64;
        if recomputed > 0 {
            self.recomputed_tokens.inc_by(recomputed);
        }
    }

    /// Records one rank's load report.
    pub fn record_load(&self, rank: usize, l: &LoadStats) {
        let r = rank.to_string();
        let r = [r.as_str()];
        self.running.with_label_values(&r).set(l.running as i64);
        self.waiting.with_label_values(&r).set(l.waiting as i64);
        self.kv_usage.with_label_values(&r).set(l.kv_usage);
        self.balance_held_steps
            .with_label_values(&r)
            .set(l.balance_held_steps as i64);
        self.admission_held_steps
            .with_label_values(&r)
            .set(l.admission_held_steps as i64);
        self.decode_stalled_steps
            .with_label_values(&r)
            .set(l.decode_stalled_steps as i64);
        self.preemptions
            .with_label_values(&r)
            .set(l.preemptions as i64);
        self.tier_blocks
            .with_label_values(&r)
            .set(l.tier_blocks as i64);
        self.tier_restored_blocks
            .with_label_values(&r)
            .set(l.tier_restored_blocks as i64);
    }
}
