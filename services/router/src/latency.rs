//! A candidate's predicted time to first token, from what its worker
//! measures and what the router placed there.
//!
//! ```text
//! waited   = queued prefill this request waits for + its uncached prompt
//! steps    = ⌈waited / max_num_batched_tokens⌉   (at least one)
//! computed = min(all prefill there + its uncached prompt, steps × max_num_batched_tokens)
//! ttft     = what is left of the step in progress
//!          + steps × fixed prompt cost per step
//!          + a decode step for each of those steps that decodes
//!          + computed × prompt cost per token
//! ```
//!
//! The queued prefill is the selector's (chunking and the engine's
//! long-prefill rule included, see `selector`), or, where less, what the
//! worker's last report says it has left to compute plus what was placed
//! there since (a prompt prefilled in chunks counts only what is left of
//! it). A short prompt that passes a long one still shares its steps with
//! it: the engine gives the rest of each step back to the long prompt, so
//! the steps this request waits for are full where prefill is left there
//! (`computed`).
//!
//! The step in progress: a worker reports its load between steps, as each
//! ends, so its last report is as old as the step that began then. That
//! step computes the reported prefill up to a step's tokens (a prompt
//! step, at the measured cost of one) or, with none, decodes (a decode
//! step); what is left of it is its predicted length less the report's
//! age, and the prefill it computes is no longer queued.
//!
//! Which prompt steps decode follows the engine's prefill-first rule, from
//! the state it reports ([`PrefillFirst`]): a prompt step leaves the decode
//! rows out while fewer than `prefill_first_steps` steps in a row have, and
//! after one that has, only for a prefill in progress; prompts that arrived
//! since join the next step with the rows. So a short prompt placed on a
//! worker in the middle of a long prefill, or just after another prompt's
//! step, pays a decode step that it would not on a worker that only
//! decodes. The rule is followed from the step in progress through the
//! request's own steps.
//!
//! The worker's engine measures the times as it runs: the mean decode
//! step (`step_time_us`, what every step costs since each also carries the
//! running batch) and a line fitted over recent steps for what their prompt
//! tokens add to that (`prefill_step_us` + tokens × `prefill_ns_per_token`).
//! So the model follows the worker's own speed, batch and hardware without
//! constants of its own; a worker that has measured no decode step yet has
//! no prediction of its own (the pool predicts it at its measured peers'
//! timing until it has). A cached prefix enters as the prompt tokens it
//! saves.
//!
//! A request's time per output token on a candidate is the worker's
//! decode step with one more sequence in its batch, from a line the engine
//! fits over its recent decode steps (`decode_base_us` + sequences ×
//! `decode_ns_per_seq`). The router keeps a request off a worker where
//! that step would exceed the request's TPOT target or the tightest target
//! of a request already running there, while another worker can take it.
//!
//! What the TTFT model leaves out, for now: the wait for a free sequence
//! slot on a worker whose batch is full, decode steps slowing as the
//! batch grows between the report and this request's first token, and
//! decode rows above the request's priority, which never sit out for it.

use std::time::Duration;

use crate::load::LoadReport;

/// What one candidate's prediction is computed from.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencyInput {
    /// Prefill tokens queued there that this request waits for.
    pub queued_prefill_tokens: u64,
    /// Prefill tokens there in all (at least the queued ones): what is left
    /// of them fills the steps this request waits for.
    pub pending_prefill_tokens: u64,
    /// The request's prompt tokens not cached there.
    pub uncached_tokens: u64,
    /// Tokens one engine step there may take (`max_num_batched_tokens`;
    /// 0 = not reported: one step).
    pub step_tokens: u32,
    /// The worker's mean decode step in µs (0 = none measured).
    pub step_time_us: u32,
    /// The worker's mean cost of a prompt token in ns beyond the decode
    /// step (0 = none measured).
    pub prefill_ns_per_token: u32,
    /// The fixed part of a step's prompt cost in µs (0 = none measured).
    pub prefill_step_us: u32,
    /// Which of the prompt steps ahead decode (each pays a decode step on
    /// top): prefill first as it will stand when the first of them begins.
    pub prefill_first: PrefillFirst,
    /// Seconds left of the step in progress there ([`StepInProgress`]).
    pub step_left: f64,
}

/// The engine's prefill-first rule and where it stands on a worker (see
/// the module docs): which of its prompt steps leave the decode rows out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefillFirst {
    /// Steps in a row a prompt step may leave the rows out (0: none may).
    pub steps: u32,
    /// Steps in a row that have.
    pub stalled: u32,
    /// A prompt is in the middle of its prefill, so it continues in the
    /// next step (one that just arrived does not count).
    pub in_progress: bool,
    /// Requests decode there: without, no step pays a decode step.
    pub decode_rows: bool,
}

impl PrefillFirst {
    /// Every prompt step decodes (as without prefill first, in vLLM).
    pub const ALWAYS_DECODES: Self = Self {
        steps: 0,
        stalled: 0,
        in_progress: false,
        decode_rows: true,
    };

    /// As the worker's last report says it stands (the engine reports no
    /// steps where none may leave the rows out, at capacity for one).
    pub fn reported(report: &LoadReport) -> Self {
        Self {
            steps: report.prefill_first_steps,
            stalled: report.stalled_in_a_row,
            in_progress: report.prefilling > 0,
            decode_rows: report.running > report.prefilling,
        }
    }

    /// Whether the next prompt step decodes; the rule then stands after it,
    /// with a prefill in progress or not after that step.
    fn step(&mut self, continues: bool) -> bool {
        let stalls = self.decode_rows
            && self.stalled < self.steps
            && (self.stalled == 0 || self.in_progress);
        self.stalled = if stalls { self.stalled + 1 } else { 0 };
        self.in_progress = continues;
        self.decode_rows && !stalls
    }
}

/// The predicted seconds to the first token, or `None` before the worker
/// measured a decode step.
pub fn predict_ttft(input: &LatencyInput) -> Option<f64> {
    if input.step_time_us == 0 {
        return None;
    }
    let waited = input.queued_prefill_tokens + input.uncached_tokens;
    let all = input
        .pending_prefill_tokens
        .max(input.queued_prefill_tokens)
        + input.uncached_tokens;
    let (steps, computed) = match u64::from(input.step_tokens) {
        0 => (1, waited),
        per_step => {
            let steps = waited.div_ceil(per_step).max(1);
            (steps, all.min(steps * per_step).max(waited))
        }
    };
    // Every step but the last leaves a prompt in the middle of its prefill.
    let mut rule = input.prefill_first;
    let mut decoding = 0u64;
    for i in 1..=steps {
        if rule.step(i < steps) {
            decoding += 1;
        }
    }
    Some(
        input.step_left
            + steps as f64 * f64::from(input.prefill_step_us) * 1e-6
            + decoding as f64 * f64::from(input.step_time_us) * 1e-6
            + computed as f64 * f64::from(input.prefill_ns_per_token) * 1e-9,
    )
}

/// The step a worker is in, by its last report (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepInProgress {
    /// Prompt tokens it computes.
    pub prompt_tokens: u64,
    /// Seconds left of it.
    pub left: f64,
    /// Prefill first as it will stand after it.
    pub prefill_first: PrefillFirst,
}

/// The step in progress on a worker whose last report is `report`, `age`
/// old (a worker that runs nothing, or has measured no step, is in none).
pub fn step_in_progress(report: &LoadReport, age: Duration) -> StepInProgress {
    let pending = report.pending_prefill_tokens;
    let rule = PrefillFirst::reported(report);
    if report.step_time_us == 0 || (report.running == 0 && pending == 0) {
        return StepInProgress {
            prefill_first: rule,
            ..StepInProgress::default()
        };
    }
    let prompt_tokens = match u64::from(report.max_num_batched_tokens) {
        0 => pending,
        per_step => pending.min(per_step),
    };
    let (length, prefill_first) = if prompt_tokens == 0 {
        // A decode step: the next prompt step is the first in a row.
        let after = PrefillFirst {
            stalled: 0,
            in_progress: false,
            ..rule
        };
        (f64::from(report.step_time_us) * 1e-6, after)
    } else {
        // A prompt step lasts what a prompt of its tokens alone would
        // take, under the rule as it stood when it began; a prompt
        // continues after it where it leaves prefill.
        let prompt_step = LatencyInput {
            uncached_tokens: prompt_tokens,
            step_time_us: report.step_time_us,
            prefill_ns_per_token: report.prefill_ns_per_token,
            prefill_step_us: report.prefill_step_us,
            prefill_first: rule,
            ..LatencyInput::default()
        };
        let mut after = rule;
        after.step(pending > prompt_tokens);
        (predict_ttft(&prompt_step).unwrap_or_default(), after)
    };
    StepInProgress {
        prompt_tokens,
        left: (length - age.as_secs_f64()).max(0.0),
        prefill_first,
    }
}

/// The predicted decode step in seconds with `batch` sequences, from the
/// worker's fitted line (`decode_base_us` + `decode_ns_per_seq` per
/// sequence); `None` before it measured one.
pub fn predict_step(decode_base_us: u32, decode_ns_per_seq: u32, batch: u32) -> Option<f64> {
    if decode_base_us == 0 && decode_ns_per_seq == 0 {
        return None;
    }
    Some(f64::from(decode_base_us) * 1e-6 + f64::from(batch) * f64::from(decode_ns_per_seq) * 1e-9)
}

/// A placement's predicted time to first token beside the one it got: the
/// router hears the first token through the placement's `started` update.
#[derive(Debug, Clone, PartialEq)]
pub struct TtftCheck {
    /// The worker the request ran on.
    pub target: sluice_runtime::discovery::WorkerRank,
    /// The request's priority.
    pub priority: i32,
    /// Predicted at placement, in seconds.
    pub predicted: f64,
    /// From placement to the first token, in seconds.
    pub served: f64,
}

impl TtftCheck {
    /// |predicted − served| / served (0 when both are 0): how far off the
    /// prediction was, as the served time's share (the metric).
    pub fn relative_error(&self) -> f64 {
        ratio(self.predicted - self.served, self.served)
    }

    /// |predicted − served| / predicted (0 when both are 0): how far from
    /// a prediction the time served may lie, as the prediction's share
    /// (the router's band of predictions it does not tell apart). Unlike
    /// [`TtftCheck::relative_error`] it is not capped at 1 for a
    /// prediction that falls short: one of 20 ms served in 80 reads 3, not
    /// 0.75.
    pub fn error_of_prediction(&self) -> f64 {
        ratio(self.predicted - self.served, self.predicted)
    }
}

/// |diff| / of, 0 when both are 0 and infinite when only `of` is.
fn ratio(diff: f64, of: f64) -> f64 {
    let diff = diff.abs();
    if of > 0.0 {
        diff / of
    } else if diff > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> LatencyInput {
        LatencyInput {
            queued_prefill_tokens: 0,
            pending_prefill_tokens: 0,
            uncached_tokens: 100,
            step_tokens: 1024,
            step_time_us: 20_000,
            prefill_ns_per_token: 50_000,
            prefill_step_us: 0,
            prefill_first: PrefillFirst::ALWAYS_DECODES,
            step_left: 0.0,
        }
    }

    #[test]
    fn nothing_measured_predicts_nothing() {
        let none = LatencyInput {
            step_time_us: 0,
            ..input()
        };
        assert_eq!(predict_ttft(&none), None);
    }

    #[test]
    fn a_short_prompt_on_an_idle_worker_takes_one_step_and_its_tokens() {
        // 20 ms for the step, 100 × 50 µs for the prompt.
        let t = predict_ttft(&input()).expect("measured");
        assert!((t - 0.025).abs() < 1e-9, "{t}");
    }

    #[test]
    fn queued_prefill_and_chunking_add_steps() {
        let behind = LatencyInput {
            queued_prefill_tokens: 2_000,
            ..input()
        };
        // 2,100 tokens: three steps of 1,024, and 2,100 tokens' time.
        let t = predict_ttft(&behind).expect("measured");
        assert!((t - (0.060 + 0.105)).abs() < 1e-9, "{t}");
    }

    #[test]
    fn the_fixed_prompt_cost_is_paid_once_a_step() {
        let fixed = LatencyInput {
            queued_prefill_tokens: 2_000,
            prefill_step_us: 10_000,
            ..input()
        };
        // Three steps of 20 + 10 ms, and 2,100 tokens' time.
        let t = predict_ttft(&fixed).expect("measured");
        assert!((t - (0.090 + 0.105)).abs() < 1e-9, "{t}");
    }

    #[test]
    fn a_short_prompt_passing_a_long_one_waits_for_a_full_step() {
        // 256 tokens of a 5,000-token prompt go first, the 100 of this
        // request next, and the long prompt takes the rest of the step.
        let passing = LatencyInput {
            queued_prefill_tokens: 256,
            pending_prefill_tokens: 5_000,
            ..input()
        };
        let t = predict_ttft(&passing).expect("measured");
        assert!((t - (0.020 + 1024.0 * 50e-6)).abs() < 1e-9, "{t}");
        // With the step in progress 30 ms from its end.
        let later = LatencyInput {
            step_left: 0.030,
            ..passing
        };
        let t2 = predict_ttft(&later).expect("measured");
        assert!((t2 - t - 0.030).abs() < 1e-9, "{t2}");
        // Less pending than a step: only that much.
        let little = LatencyInput {
            queued_prefill_tokens: 256,
            pending_prefill_tokens: 400,
            ..input()
        };
        let t3 = predict_ttft(&little).expect("measured");
        assert!((t3 - (0.020 + 500.0 * 50e-6)).abs() < 1e-9, "{t3}");
    }

    #[test]
    fn the_step_in_progress_is_the_last_report_s_age_into_a_prompt_or_decode_step() {
        // No prefill first: every prompt step decodes.
        let report = LoadReport {
            running: 4,
            pending_prefill_tokens: 3_000,
            max_num_batched_tokens: 1024,
            step_time_us: 20_000,
            prefill_step_us: 10_000,
            prefill_ns_per_token: 50_000,
            ..LoadReport::default()
        };
        // A prompt step of 1,024 tokens: 30 ms + 51.2 ms, 40 ms gone.
        let s = step_in_progress(&report, Duration::from_millis(40));
        assert_eq!(s.prompt_tokens, 1024);
        assert!((s.left - 0.0412).abs() < 1e-9, "{s:?}");
        // Nothing to prefill: a decode step.
        let decoding = LoadReport {
            pending_prefill_tokens: 0,
            ..report
        };
        let s = step_in_progress(&decoding, Duration::from_millis(5));
        assert_eq!(s.prompt_tokens, 0);
        assert!((s.left - 0.015).abs() < 1e-9, "{s:?}");
        // Past its predicted end nothing is left; an idle worker, or one
        // that measured no step, is in none.
        assert_eq!(
            step_in_progress(&decoding, Duration::from_secs(1)).left,
            0.0
        );
        let idle = LoadReport {
            running: 0,
            ..decoding
        };
        let none = |report| StepInProgress {
            prefill_first: PrefillFirst::reported(report),
            ..StepInProgress::default()
        };
        assert_eq!(step_in_progress(&idle, Duration::ZERO), none(&idle));
        let cold = LoadReport {
            step_time_us: 0,
            ..report
        };
        assert_eq!(step_in_progress(&cold, Duration::ZERO), none(&cold));
    }

    #[test]
    fn prefill_first_leaves_decode_steps_out_of_prompt_steps_as_the_engine_does() {
        // Three steps of a 10 ms fixed cost and 2,100 tokens' time, and a
        // 20 ms decode step in those that decode.
        let fixed = LatencyInput {
            queued_prefill_tokens: 2_000,
            prefill_step_us: 10_000,
            ..input()
        };
        let t = |prefill_first| {
            predict_ttft(&LatencyInput {
                prefill_first,
                ..fixed
            })
            .expect("measured")
        };
        let base = 0.030 + 0.105;
        let rule = PrefillFirst {
            steps: 2,
            stalled: 0,
            in_progress: false,
            decode_rows: true,
        };
        // Two steps in a row leave the rows out, the third carries them.
        assert!((t(rule) - (base + 0.020)).abs() < 1e-9);
        // Every step decodes without the rule ...
        assert!((t(PrefillFirst::ALWAYS_DECODES) - (base + 0.060)).abs() < 1e-9);
        // ... none where nothing decodes.
        let idle = PrefillFirst {
            decode_rows: false,
            ..PrefillFirst::ALWAYS_DECODES
        };
        assert!((t(idle) - base).abs() < 1e-9);
        // After a step that left them out, a prompt that just arrived joins
        // the rows' step, and the two after it leave them out again ...
        let after_one = PrefillFirst { stalled: 1, ..rule };
        assert!((t(after_one) - (base + 0.020)).abs() < 1e-9);
        // ... while a prefill in progress leaves them out once more first.
        let continuing = PrefillFirst {
            in_progress: true,
            ..after_one
        };
        assert!((t(continuing) - (base + 0.020)).abs() < 1e-9);
        let one_step = |prefill_first| {
            predict_ttft(&LatencyInput {
                prefill_first,
                ..input()
            })
            .expect("measured")
        };
        // A short prompt alone: its step leaves the rows out, except just
        // after such a step, unless a prefill in progress shares it.
        assert!((one_step(rule) - 0.005).abs() < 1e-9);
        assert!((one_step(after_one) - 0.025).abs() < 1e-9);
        assert!((one_step(continuing) - 0.005).abs() < 1e-9);
        // Two in a row already: it decodes.
        let spent = PrefillFirst {
            stalled: 2,
            ..continuing
        };
        assert!((one_step(spent) - 0.025).abs() < 1e-9);
    }

    #[test]
    fn the_reported_rule_stands_after_the_step_in_progress() {
        // Prefill first, two steps in a row; one has left the rows out, a
        // prompt of 1,500 tokens is in the middle of its prefill.
        let report = LoadReport {
            running: 4,
            prefilling: 1,
            pending_prefill_tokens: 1_500,
            max_num_batched_tokens: 1024,
            max_num_seqs: 64,
            step_time_us: 20_000,
            prefill_step_us: 10_000,
            prefill_ns_per_token: 50_000,
            prefill_first_steps: 2,
            stalled_in_a_row: 1,
            ..LoadReport::default()
        };
        // The step in progress leaves the rows out (10 + 51.2 ms); then the
        // rule is spent, with the prompt's rest still to compute.
        let s = step_in_progress(&report, Duration::ZERO);
        assert!((s.left - 0.0612).abs() < 1e-9, "{s:?}");
        let spent = PrefillFirst {
            steps: 2,
            stalled: 2,
            in_progress: true,
            decode_rows: true,
        };
        assert_eq!(s.prefill_first, spent);
        // A prompt that only arrived is not in progress: the step carries
        // the rows, and the next prompt step may leave them out again.
        let arrived = LoadReport {
            prefilling: 0,
            waiting: 1,
            ..report
        };
        let s = step_in_progress(&arrived, Duration::ZERO);
        assert!((s.left - 0.0812).abs() < 1e-9, "{s:?}");
        assert_eq!(s.prefill_first.stalled, 0);
        // A decode step: the next prompt step is the first in a row.
        let decoding = LoadReport {
            pending_prefill_tokens: 0,
            prefilling: 0,
            ..report
        };
        let s = step_in_progress(&decoding, Duration::ZERO);
        assert_eq!(
            s.prefill_first,
            PrefillFirst {
                stalled: 0,
                in_progress: false,
                ..spent
            }
        );
        // Every running request prefills: nothing to leave out.
        let prefilling = LoadReport {
            running: 1,
            ..report
        };
        assert!(!PrefillFirst::reported(&prefilling).decode_rows);
    }

    #[test]
    fn a_cheaper_recompute_beats_a_congested_hit() {
        // All of the prompt cached, behind 8,000 queued tokens ...
        let hit = LatencyInput {
            queued_prefill_tokens: 8_000,
            uncached_tokens: 0,
            ..input()
        };
        // ... or all 1,000 of it computed on an idle worker.
        let miss = LatencyInput {
            uncached_tokens: 1_000,
            ..input()
        };
        let (hit, miss) = (predict_ttft(&hit), predict_ttft(&miss));
        assert!(miss < hit, "miss {miss:?} hit {hit:?}");
    }

    #[test]
    fn a_decode_step_grows_with_the_batch_along_the_measured_line() {
        assert_eq!(predict_step(0, 0, 8), None);
        // 5 ms, and 0.5 ms a sequence: 9 sequences, 9.5 ms.
        let step = predict_step(5_000, 500_000, 9).expect("measured");
        assert!((step - 0.0095).abs() < 1e-12, "{step}");
    }

    #[test]
    fn the_error_is_relative_to_what_was_served_or_to_the_prediction() {
        let check = |predicted, served| TtftCheck {
            target: sluice_runtime::discovery::WorkerRank::new("w", 0),
            priority: 0,
            predicted,
            served,
        };
        assert!((check(1.5, 1.0).relative_error() - 0.5).abs() < 1e-12);
        assert!((check(0.5, 1.0).relative_error() - 0.5).abs() < 1e-12);
        assert_eq!(check(0.0, 0.0).relative_error(), 0.0);
        // Relative to the prediction: a prediction four times short is off
        // by three of itself.
        assert!((check(0.02, 0.08).error_of_prediction() - 3.0).abs() < 1e-12);
        assert!((check(1.5, 1.0).error_of_prediction() - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(check(0.0, 0.0).error_of_prediction(), 0.0);
        assert_eq!(check(0.0, 0.1).error_of_prediction(), f64::INFINITY);
    }
}
