//! A candidate's predicted time to first token, from what its worker
//! measures and what the router placed there.
//!
//! ```text
//! waited   = queued prefill this request waits for + its uncached prompt
//! steps    = ⌈waited / max_num_batched_tokens⌉   (at least one)
//! computed = min(all prefill there + its uncached prompt, steps × max_num_batched_tokens)
//! ttft     = what is left of the step in progress
//!          + steps × (decode step + fixed prompt cost per step)
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
//! The worker's engine measures the times as it runs: the mean decode
//! step (`step_time_us`, what every step costs since each also carries the
//! running batch) and a line fitted over recent steps for what their prompt
//! tokens add to that (`prefill_step_us` + tokens × `prefill_ns_per_token`).
//! So the model follows the worker's own speed, batch and hardware without
//! constants of its own; a worker that has measured no decode step yet has
//! no prediction. A cached prefix enters as the prompt tokens it saves.
//!
//! A request's time per output token on a candidate is the worker's
//! decode step with one more sequence in its batch, from a line the engine
//! fits over its recent decode steps (`decode_base_us` + sequences ×
//! `decode_ns_per_seq`). The router keeps a request off a worker where
//! that step would exceed the request's TPOT target or the tightest target
//! of a request already running there, while another worker can take it.
//!
//! What the TTFT model leaves out, for now: the wait for a free sequence
//! slot on a worker whose batch is full, and decode steps slowing as the
//! batch grows between the report and this request's first token.

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
    /// The share of the worker's prompt steps that also decode (0 to 1):
    /// each pays a decode step on top.
    pub decoding_prompt_steps: f64,
    /// Seconds left of the step in progress there ([`StepInProgress`]).
    pub step_left: f64,
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
    // A prompt step's fixed cost, and a decode step in the share of
    // prompt steps that decode too.
    let per_step = f64::from(input.prefill_step_us)
        + input.decoding_prompt_steps * f64::from(input.step_time_us);
    Some(
        input.step_left
            + steps as f64 * per_step * 1e-6
            + computed as f64 * f64::from(input.prefill_ns_per_token) * 1e-9,
    )
}

/// The share of a worker's prompt steps that decode too, from its report.
pub fn decoding_prompt_steps(report: &LoadReport) -> f64 {
    (f64::from(report.decoding_prompt_steps_permille) * 1e-3).clamp(0.0, 1.0)
}

/// The step a worker is in, by its last report (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepInProgress {
    /// Prompt tokens it computes.
    pub prompt_tokens: u64,
    /// Seconds left of it.
    pub left: f64,
}

/// The step in progress on a worker whose last report is `report`, `age`
/// old (a worker that runs nothing, or has measured no step, is in none).
pub fn step_in_progress(report: &LoadReport, age: Duration) -> StepInProgress {
    let pending = report.pending_prefill_tokens;
    if report.step_time_us == 0 || (report.running == 0 && pending == 0) {
        return StepInProgress::default();
    }
    let prompt_tokens = match u64::from(report.max_num_batched_tokens) {
        0 => pending,
        per_step => pending.min(per_step),
    };
    // A prompt step lasts what a prompt of its tokens alone would take.
    let prompt_step = LatencyInput {
        uncached_tokens: prompt_tokens,
        step_time_us: report.step_time_us,
        prefill_ns_per_token: report.prefill_ns_per_token,
        prefill_step_us: report.prefill_step_us,
        decoding_prompt_steps: decoding_prompt_steps(report),
        ..LatencyInput::default()
    };
    let length = match prompt_tokens {
        0 => f64::from(report.step_time_us) * 1e-6,
        _ => predict_ttft(&prompt_step).unwrap_or_default(),
    };
    StepInProgress {
        prompt_tokens,
        left: (length - age.as_secs_f64()).max(0.0),
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
    /// |predicted − served| / served (0 when both are 0).
    pub fn relative_error(&self) -> f64 {
        let diff = (self.predicted - self.served).abs();
        if self.served > 0.0 {
            diff / self.served
        } else if diff > 0.0 {
            f64::INFINITY
        } else {
            0.0
        }
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
            decoding_prompt_steps: 1.0,
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
        let report = LoadReport {
            running: 4,
            pending_prefill_tokens: 3_000,
            max_num_batched_tokens: 1024,
            step_time_us: 20_000,
            prefill_step_us: 10_000,
            prefill_ns_per_token: 50_000,
            decoding_prompt_steps_permille: 1000,
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
        assert_eq!(
            step_in_progress(&idle, Duration::ZERO),
            StepInProgress::default()
        );
        let cold = LoadReport {
            step_time_us: 0,
            ..report
        };
        assert_eq!(
            step_in_progress(&cold, Duration::ZERO),
            StepInProgress::default()
        );
    }

    #[test]
    fn a_prompt_step_pays_a_decode_step_in_the_share_of_prompt_steps_that_decode() {
        let fixed = LatencyInput {
            queued_prefill_tokens: 2_000,
            prefill_step_us: 10_000,
            ..input()
        };
        let t = |share| {
            predict_ttft(&LatencyInput {
                decoding_prompt_steps: share,
                ..fixed
            })
            .expect("measured")
        };
        // Three steps of 10 ms, a 20 ms decode step in a quarter of them,
        // and 2,100 tokens' time.
        assert!((t(0.25) - (0.030 + 0.015 + 0.105)).abs() < 1e-9);
        // Prefill first leaving every decode row out: the prompt's own cost.
        assert!((t(0.0) - (0.030 + 0.105)).abs() < 1e-9);
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
    fn the_error_is_relative_to_what_was_served() {
        let check = |predicted, served| TtftCheck {
            target: sluice_runtime::discovery::WorkerRank::new("w", 0),
            priority: 0,
            predicted,
            served,
        };
        assert!((check(1.5, 1.0).relative_error() - 0.5).abs() < 1e-12);
        assert!((check(0.5, 1.0).relative_error() - 0.5).abs() < 1e-12);
        assert_eq!(check(0.0, 0.0).relative_error(), 0.0);
    }
}
