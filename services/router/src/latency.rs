//! A candidate's predicted time to first token, from what its worker
//! measures and what the router placed there.
//!
//! ```text
//! tokens = queued prefill this request waits for + its uncached prompt
//! steps  = ⌈tokens / max_num_batched_tokens⌉   (at least one)
//! ttft   = steps × (decode step + fixed prompt cost per step)
//!        + tokens × prompt cost per token
//! ```
//!
//! The queued prefill is the selector's (chunking and the engine's
//! long-prefill rule included, see `selector`), or, where less, what the
//! worker's last report says it has left to compute plus what was placed
//! there since (a prompt prefilled in chunks counts only what is left of
//! it). The worker's engine measures the times as it runs: the mean decode
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

/// What one candidate's prediction is computed from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencyInput {
    /// Prefill tokens queued there that this request waits for.
    pub queued_prefill_tokens: u64,
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
}

/// The predicted seconds to the first token, or `None` before the worker
/// measured a decode step.
pub fn predict_ttft(input: &LatencyInput) -> Option<f64> {
    if input.step_time_us == 0 {
        return None;
    }
    let tokens = input.queued_prefill_tokens + input.uncached_tokens;
    let steps = match u64::from(input.step_tokens) {
        0 => 1,
        per_step => tokens.div_ceil(per_step).max(1),
    };
    let per_step = f64::from(input.step_time_us) + f64::from(input.prefill_step_us);
    Some(
        steps as f64 * per_step * 1e-6
            + tokens as f64 * f64::from(input.prefill_ns_per_token) * 1e-9,
    )
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
            uncached_tokens: 100,
            step_tokens: 1024,
            step_time_us: 20_000,
            prefill_ns_per_token: 50_000,
            prefill_step_us: 0,
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
