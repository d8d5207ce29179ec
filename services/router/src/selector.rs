//! Placement cost and choice, as pure functions over candidates' figures.
//!
//! Cost per candidate, in Dynamo's form so results compare:
//!
//! ```text
//! prefill_blocks = (queued prefill tokens + uncached prompt tokens) / block_size
//! prefill_cost   = prefill_load_scale × (prefill_blocks − overlap_credit × overlap_blocks)
//! decode_cost    = decode_load_scale × active decode blocks
//! total          = prefill_cost + decode_cost + active_request_weight × active_requests
//! ```
//!
//! Queued prefill tokens are the prefill placed (or admitted) there and not
//! yet computed, as the worker's engine would make this request wait for it:
//! where the engine prefills long prompts one at a time and lets a short one
//! go next to them (its `long_prefill_token_threshold` T > 0), a request
//! with at most T uncached tokens waits for the short prefills queued there
//! and one chunk of the long ones (T tokens at most), not for their whole
//! length; a longer request waits for all of it.
//!
//! With `prefill_load_scale` 1, `decode_load_scale` 1, `overlap_credit` 0
//! and `active_request_weight` 0 this is exactly Dynamo's
//! `overlap_score_weight × prefill_blocks + decode_blocks`. `overlap_credit`
//! adds an extra reward for cached blocks beyond the prefill they save: a
//! miss adds its uncached blocks to the mesh's work for good (and scatters a
//! conversation's prefix over workers), while a queue ahead of this request
//! delays only it; with credit c, a worker holding k more blocks of the
//! prompt wins unless its queued prefill is more than (1 + c)·k blocks
//! longer. The credit is not clamped, so a larger overlap always counts (a
//! candidate's prefill cost may be negative).
//!
//! Prefix fetch: where another candidate (the holder) has more of the
//! prompt cached, a candidate may fetch the difference from it instead of
//! computing it. The fetch counts where the first token there is predicted
//! sooner with it (its blocks' bytes at the candidate's measured fetch
//! rate, plus the mean waits for the holder's engine and twice for the
//! candidate's to take the fetch between steps, then the prefill left)
//! than without (computing those blocks too, in the steps the engine
//! chunks them into, each step's fixed cost included): the fetched blocks leave the
//! uncached prompt, the fetch's time enters the prefill blocks as the
//! blocks of prefill it equals there, and the credit counts fetched blocks
//! like cached ones (neither is computed again).
//!
//! Second tier: a cached block the candidate keeps in its second tier (its
//! `Moved` events say so) is a hit that costs a copy: its bytes at the
//! worker's reported restore rate enter the prefill blocks and the
//! predicted time to first token like a fetch's time.
//!
//! Choice: temperature 0 takes the lowest cost; ties go to the candidate
//! holding the smaller share of the index (spreading cache), then at random.
//! A new prompt (no candidate holds more of it than another) instead goes,
//! among the candidates within its own prefill blocks of the lowest cost, to
//! the one that stored the fewest blocks lately (its cache turns over
//! slowest, so what the prompt evicts there is oldest; the workers that just
//! stored a lot keep it for their conversations' next turns), then to the
//! cheapest of those, then at random. In time (`latency`), candidates
//! within the predictions' own error of the lowest cost (the pool passes
//! that tolerance) go to the fewest live requests, then the cheapest.
//! Temperature > 0 samples a softmax over costs min-max normalised to
//! [0, 1].
//!
//! Balance bound: with `balance_bound` B > 0, only candidates whose active
//! requests are at most `B × mean + 1` (the mean over every candidate) may
//! be chosen, so however strongly a cached prefix pulls, no worker carries
//! more than about B times its share of the live requests.
//!
//! Prefill queue bound: with `prefill_queue_bound` S > 0, only candidates
//! whose queued prefill tokens exceed the shortest queue by at most S of
//! their steps (`max_num_batched_tokens`) may be chosen. The overlap credit
//! grows with the cached prefix, so without it a request with a long cached
//! prefix waits behind any queue up to `(1 + credit)` times that prefix
//! (seconds, at a mocker's 0.125 speed) to save a recompute of a fraction
//! of that; the bound caps the wait a cache hit may cost at S steps.
//! Owns no state: the pool supplies loads, overlaps and the random source.

use rand::Rng;

use crate::latency::{LatencyInput, StepInProgress, predict_step, predict_ttft};

/// How the router chooses among candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum RouterMode {
    /// Prefix overlap from workers' KV events against load.
    Kv,
    /// Each candidate in turn.
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// Lowest load cost, ignoring cached blocks.
    LeastLoaded,
    /// Like `kv`, with each worker's cache predicted from the router's own
    /// placements (for workers that publish no events).
    Approx,
    /// Like `kv`, in time: the predicted time to first token (`latency`),
    /// less the overlap credit as the prefill time the cached prefix saves
    /// the mesh; `kv`'s cost where a candidate has no prediction yet.
    Latency,
}

impl RouterMode {
    /// The mode's flag spelling (`kv`, `round-robin`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            RouterMode::Kv => "kv",
            RouterMode::RoundRobin => "round-robin",
            RouterMode::Random => "random",
            RouterMode::LeastLoaded => "least-loaded",
            RouterMode::Approx => "approx",
            RouterMode::Latency => "latency",
        }
    }

    /// The wire enum (`RouteResponse.mode`).
    pub fn to_pb(self) -> sluice_proto::router::v1::RouterMode {
        use sluice_proto::router::v1::RouterMode as Pb;
        match self {
            RouterMode::Kv => Pb::Kv,
            RouterMode::RoundRobin => Pb::RoundRobin,
            RouterMode::Random => Pb::Random,
            RouterMode::LeastLoaded => Pb::LeastLoaded,
            RouterMode::Approx => Pb::Approx,
            RouterMode::Latency => Pb::Latency,
        }
    }
}

impl std::fmt::Display for RouterMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Weights of the cost function and the choice temperature.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostParams {
    /// Multiplies prefill blocks (Dynamo's `overlap_score_weight`).
    pub prefill_load_scale: f64,
    /// Multiplies active decode blocks.
    pub decode_load_scale: f64,
    /// Extra prefill blocks credited per cached block.
    pub overlap_credit: f64,
    /// Cost per active request.
    pub active_request_weight: f64,
    /// Candidates above this many times the mean active requests (plus one)
    /// are not chosen; 0 = no bound.
    pub balance_bound: f64,
    /// Candidates whose queued prefill exceeds the shortest queue by more
    /// than this many of their steps are not chosen; 0 = no bound.
    pub prefill_queue_bound: f64,
    /// 0 = lowest cost; > 0 = softmax sampling.
    pub temperature: f64,
}

impl Default for CostParams {
    fn default() -> Self {
        Self {
            prefill_load_scale: 1.0,
            decode_load_scale: 1.0,
            overlap_credit: 0.0,
            active_request_weight: 0.0,
            balance_bound: 0.0,
            prefill_queue_bound: 0.0,
            temperature: 0.0,
        }
    }
}

/// Fetching the part of a prompt's cached prefix a candidate lacks from
/// the worker that holds the most of it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FetchInput {
    /// Prompt blocks the holder has beyond the candidate's own.
    pub blocks: u32,
    /// Predicted seconds to fetch them: their bytes at the candidate's
    /// measured fetch rate, and the holder's step before it sends.
    pub seconds: f64,
}

/// What the cost of one candidate is computed from.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CostInput {
    /// Prompt blocks cached on the candidate.
    pub overlap_blocks: u32,
    /// Fetching more of the prefix from a peer, where one holds more.
    pub fetch: Option<FetchInput>,
    /// Seconds to restore the part of the cached prefix the candidate keeps
    /// in its second tier (0: none there).
    pub restore_seconds: f64,
    /// Prefill tokens admitted or placed there, not yet computed.
    pub active_prefill_tokens: u64,
    /// The part of them in prompts longer than `long_prefill_threshold`.
    pub long_prefill_tokens: u64,
    /// The engine's `long_prefill_token_threshold` there (0 = none).
    pub long_prefill_threshold: u32,
    /// Decode blocks in use or placed there.
    pub active_decode_blocks: u64,
    /// Active requests there.
    pub active_requests: u32,
    /// Tokens one engine step there may take (`max_num_batched_tokens`;
    /// 0 = not reported).
    pub step_tokens: u32,
    /// The worker's mean decode step in µs (0 = none measured).
    pub step_time_us: u32,
    /// The worker's mean prompt-token cost in ns beyond the decode step.
    pub prefill_ns_per_token: u32,
    /// Its fixed part per step with prompt tokens, in µs.
    pub prefill_step_us: u32,
    /// The prompt-token cost the overlap credit is counted at, in ns: the
    /// same for every candidate of a request (the median of theirs), so
    /// the same cached prefix earns the same credit wherever it lies
    /// (0 = the candidate's own).
    pub credit_ns_per_token: u32,
    /// Prompt tokens left there by the worker's last report plus those
    /// placed since (`None` before a report).
    pub reported_prefill_tokens: Option<u64>,
    /// The worker's decode step line: fixed µs, and ns per sequence.
    pub decode_base_us: u32,
    pub decode_ns_per_seq: u32,
    /// The tightest TPOT target among the requests running there (ms).
    pub tightest_tpot_ms: Option<u32>,
    /// This request's TPOT target in ms (0 = none).
    pub request_tpot_ms: u32,
    /// The step the worker is in, by its last report (none before one).
    pub step_in_progress: StepInProgress,
}

/// One candidate's cost terms (the proto `Candidate` without its target).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CostTerms {
    /// Prompt blocks cached on the candidate.
    pub overlap_blocks: u32,
    /// Prompt blocks it would fetch from a peer instead of computing (the
    /// fetch is predicted faster than the compute it saves there).
    pub fetch_blocks: u32,
    /// Predicted seconds that fetch takes (`None`: no fetch).
    pub fetch_seconds: Option<f64>,
    /// Seconds restoring the candidate's second-tier blocks of the prompt
    /// takes (0: none there).
    pub restore_seconds: f64,
    /// `prefill_load_scale × (prefill_blocks − overlap_credit × overlap)`.
    pub prefill_cost: f64,
    /// `decode_load_scale × active decode blocks`.
    pub decode_cost: f64,
    /// The sum the choice minimises.
    pub total_cost: f64,
    /// Active requests.
    pub active_requests: u32,
    /// Prefill tokens queued there that this request waits for (see the
    /// module docs).
    pub queued_prefill_tokens: u64,
    /// Tokens one engine step there may take (0 = not reported).
    pub step_tokens: u32,
    /// Above the balance or prefill queue bound: not eligible for this
    /// request.
    pub over_bound: bool,
    /// Predicted seconds to the first token there (see `latency`); `None`
    /// before the worker measured a step.
    pub predicted_ttft: Option<f64>,
    /// Seconds of prefill the cached prefix saves, at the credit's rate
    /// (`None` likewise).
    pub saved_prefill: Option<f64>,
    /// Predicted seconds per decode step there with this request added
    /// (`None` before the worker measured a decode step).
    pub predicted_tpot: Option<f64>,
    /// That step exceeds this request's TPOT target or one of a request
    /// running there.
    pub over_tpot: bool,
}

/// Prompt tokens not served from `overlap_blocks` cached blocks.
pub fn uncached_tokens(prompt_tokens: u32, overlap_blocks: u32, block_size: u32) -> u64 {
    u64::from(prompt_tokens).saturating_sub(u64::from(overlap_blocks) * u64::from(block_size))
}

/// The cost terms of one candidate for a prompt of `prompt_tokens`.
pub fn cost(
    params: &CostParams,
    input: &CostInput,
    prompt_tokens: u32,
    block_size: u32,
) -> CostTerms {
    let bs = f64::from(block_size.max(1));
    let per_token = f64::from(input.prefill_ns_per_token) * 1e-9;
    // A fetch counts only where the first token is predicted sooner with
    // it than computing what it brings, in the steps the engine would take
    // (and so never before the candidate measured its steps).
    let fetch = input.fetch.filter(|f| {
        let ttft = |blocks| {
            predict_ttft(&latency_input(
                input,
                uncached_tokens(prompt_tokens, blocks, block_size),
            ))
        };
        let with = ttft(input.overlap_blocks + f.blocks);
        let without = ttft(input.overlap_blocks);
        f.blocks > 0 && with.zip(without).is_some_and(|(w, wo)| w + f.seconds < wo)
    });
    let fetch_blocks = fetch.map_or(0, |f| f.blocks);
    let uncached = uncached_tokens(
        prompt_tokens,
        input.overlap_blocks + fetch_blocks,
        block_size,
    );
    let queued = queued_prefill_tokens(input, uncached);
    // The fetch's time, in the blocks of prefill it equals there.
    // The copies a fetch and a second-tier restore take, in the blocks of
    // prefill they equal there (none before the candidate measured its
    // prompts).
    let copy_seconds = fetch.map_or(0.0, |f| f.seconds) + input.restore_seconds;
    let copy_cost_blocks = if per_token > 0.0 {
        copy_seconds / (bs * per_token)
    } else {
        0.0
    };
    let prefill_blocks = (queued + uncached) as f64 / bs + copy_cost_blocks;
    // The credit rewards every block the mesh need not compute again, a
    // fetched one as a cached one (the fetch's own time is in the prefill
    // blocks above): with a fetch a conversation's next turn is no longer
    // pinned to the one worker holding its prefix.
    let served = input.overlap_blocks + fetch_blocks;
    let credited = prefill_blocks - params.overlap_credit * f64::from(served);
    let prefill_cost = params.prefill_load_scale * credited;
    let decode_cost = params.decode_load_scale * input.active_decode_blocks as f64;
    let total_cost = prefill_cost
        + decode_cost
        + params.active_request_weight * f64::from(input.active_requests);
    let predicted_ttft = predict_ttft(&latency_input(input, uncached)).map(|t| t + copy_seconds);
    let cached = u64::from(prompt_tokens) - uncached;
    let predicted_tpot = predict_step(
        input.decode_base_us,
        input.decode_ns_per_seq,
        input.active_requests.saturating_add(1),
    );
    let tpot_limit = [
        Some(input.request_tpot_ms).filter(|&ms| ms > 0),
        input.tightest_tpot_ms,
    ]
    .into_iter()
    .flatten()
    .min();
    let over_tpot = predicted_tpot
        .zip(tpot_limit)
        .is_some_and(|(step, ms)| step * 1e3 > f64::from(ms));
    let credit_per_token = match input.credit_ns_per_token {
        0 => per_token,
        ns => f64::from(ns) * 1e-9,
    };
    let saved_prefill = predicted_ttft.map(|_| cached as f64 * credit_per_token);
    CostTerms {
        overlap_blocks: input.overlap_blocks,
        fetch_blocks,
        fetch_seconds: fetch.map(|f| f.seconds),
        restore_seconds: input.restore_seconds,
        prefill_cost,
        decode_cost,
        total_cost,
        active_requests: input.active_requests,
        queued_prefill_tokens: queued,
        step_tokens: input.step_tokens,
        over_bound: false,
        predicted_ttft,
        saved_prefill,
        predicted_tpot,
        over_tpot,
    }
}

/// What the candidate's time to first token is predicted from, for a
/// request with `uncached` prompt tokens to compute there.
fn latency_input(input: &CostInput, uncached: u64) -> LatencyInput {
    // The prefill the step in progress computes is no longer queued: the
    // short prompts first (each goes next to the long ones), the long ones
    // the rest of the step.
    let done = input.step_in_progress.prompt_tokens;
    let short = input
        .active_prefill_tokens
        .saturating_sub(input.long_prefill_tokens);
    let after = CostInput {
        active_prefill_tokens: input.active_prefill_tokens.saturating_sub(done),
        long_prefill_tokens: input
            .long_prefill_tokens
            .saturating_sub(done.saturating_sub(short)),
        ..*input
    };
    let queued = queued_prefill_tokens(&after, uncached);
    // What is left of prompts being prefilled, where the report says.
    let reported = input
        .reported_prefill_tokens
        .map(|r| r.saturating_sub(done));
    let left = |tokens: u64| reported.map_or(tokens, |r| r.min(tokens));
    LatencyInput {
        queued_prefill_tokens: left(queued),
        pending_prefill_tokens: left(after.active_prefill_tokens),
        uncached_tokens: uncached,
        step_tokens: input.step_tokens,
        step_time_us: input.step_time_us,
        prefill_ns_per_token: input.prefill_ns_per_token,
        prefill_step_us: input.prefill_step_us,
        prefill_first: input.step_in_progress.prefill_first,
        step_left: input.step_in_progress.left,
    }
}

/// The `latency` mode's cost of a candidate: its predicted time to first
/// token less `overlap_credit` times the prefill its cached prefix saves
/// the mesh (what `kv` credits in blocks, in seconds, at one rate for all
/// candidates: `CostInput::credit_ns_per_token`); `None` without a
/// prediction.
pub fn latency_cost(params: &CostParams, terms: &CostTerms) -> Option<f64> {
    Some(terms.predicted_ttft? - params.overlap_credit * terms.saved_prefill?)
}

/// The queued prefill a request with `uncached` tokens to prefill waits for
/// on the candidate (see the module docs).
fn queued_prefill_tokens(input: &CostInput, uncached: u64) -> u64 {
    let threshold = u64::from(input.long_prefill_threshold);
    let long = input.long_prefill_tokens.min(input.active_prefill_tokens);
    if threshold > 0 && uncached <= threshold {
        input.active_prefill_tokens - long + long.min(threshold)
    } else {
        input.active_prefill_tokens
    }
}

/// Marks the candidates above the balance bound and the prefill queue
/// bound (see the module docs); neither marks anything when it is 0. The
/// least loaded candidate (fewest requests, shortest queue) is never marked.
pub fn apply_bounds(terms: &mut [CostTerms], balance_bound: f64, prefill_queue_bound: f64) {
    if terms.is_empty() {
        return;
    }
    if balance_bound > 0.0 {
        let mean = terms
            .iter()
            .map(|t| f64::from(t.active_requests))
            .sum::<f64>()
            / terms.len() as f64;
        let limit = balance_bound * mean + 1.0;
        for t in terms.iter_mut() {
            t.over_bound |= f64::from(t.active_requests) > limit;
        }
    }
    if prefill_queue_bound > 0.0 {
        let shortest = terms
            .iter()
            .map(|t| t.queued_prefill_tokens)
            .min()
            .unwrap_or(0);
        for t in terms.iter_mut().filter(|t| t.step_tokens > 0) {
            let extra = t.queued_prefill_tokens.saturating_sub(shortest) as f64;
            t.over_bound |= extra > prefill_queue_bound * f64::from(t.step_tokens);
        }
    }
}

/// Which of `eligible` are predicted to give the first token within
/// `target` seconds.
#[derive(Debug, Clone, PartialEq)]
pub enum Within {
    /// These are (the others are not).
    Some(Vec<usize>),
    /// None is; this one is predicted soonest.
    None(usize),
    /// A candidate has no prediction: the target cannot be judged.
    Unknown,
}

/// Sorts `eligible` (indices into `terms`) by whether each is predicted
/// to meet a TTFT target of `target` seconds.
pub fn within_target(terms: &[CostTerms], eligible: &[usize], target: f64) -> Within {
    let mut predicted = Vec::with_capacity(eligible.len());
    for &i in eligible {
        match terms[i].predicted_ttft {
            Some(p) => predicted.push((i, p)),
            None => return Within::Unknown,
        }
    }
    let within: Vec<usize> = predicted
        .iter()
        .filter(|&&(_, p)| p <= target)
        .map(|&(i, _)| i)
        .collect();
    if !within.is_empty() {
        return Within::Some(within);
    }
    match predicted.iter().min_by(|a, b| a.1.total_cmp(&b.1)) {
        Some(&(i, _)) => Within::None(i),
        None => Within::Unknown,
    }
}

/// Costs closer than this are a tie.
const TIE_EPSILON: f64 = 1e-9;

/// Chooses an index into `costs` (non-empty) per the module docs: among
/// the candidates within `tolerance` of the lowest cost, the one with the
/// lowest `spread` (each one's share of the index, or for a new prompt the
/// blocks it stored lately), then at random.
pub fn choose<R: Rng + ?Sized>(
    costs: &[f64],
    spread: &[f64],
    tolerance: f64,
    temperature: f64,
    rng: &mut R,
) -> usize {
    if costs.len() <= 1 {
        return 0;
    }
    if temperature > 0.0 {
        softmax_sample(costs, temperature, rng)
    } else {
        lowest(costs, spread, tolerance, rng)
    }
}

fn lowest<R: Rng + ?Sized>(costs: &[f64], spread: &[f64], tolerance: f64, rng: &mut R) -> usize {
    let cost = |i: usize| costs[i];
    let spread = |i: usize| spread.get(i).copied().unwrap_or(0.0);
    let near = near_lowest((0..costs.len()).collect(), cost, tolerance.max(TIE_EPSILON));
    let least = near_lowest(near, spread, TIE_EPSILON);
    // Equal spread (a burst before any of it is stored): the cheapest.
    let tied = near_lowest(least, cost, TIE_EPSILON);
    match tied.len() {
        0 => 0,
        1 => tied[0],
        n => tied[rng.random_range(0..n)],
    }
}

/// The indices in `ids` whose `key` is within `within` of the lowest among them.
fn near_lowest(ids: Vec<usize>, key: impl Fn(usize) -> f64, within: f64) -> Vec<usize> {
    let min = ids.iter().map(|&i| key(i)).fold(f64::INFINITY, f64::min);
    ids.into_iter()
        .filter(|&i| key(i) - min <= within)
        .collect()
}

fn softmax_sample<R: Rng + ?Sized>(costs: &[f64], temperature: f64, rng: &mut R) -> usize {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max - min <= TIE_EPSILON {
        return rng.random_range(0..costs.len());
    }
    // Lower cost = higher weight; the best has weight 1, so no overflow.
    let weights: Vec<f64> = costs
        .iter()
        .map(|c| (-((c - min) / (max - min)) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut x = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    costs.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::latency::PrefillFirst;

    #[test]
    fn within_target_keeps_those_predicted_to_meet_it_or_names_the_soonest() {
        let terms: Vec<CostTerms> = [Some(0.2), Some(0.05), Some(0.08), None]
            .into_iter()
            .map(|predicted_ttft| CostTerms {
                predicted_ttft,
                ..CostTerms::default()
            })
            .collect();
        assert_eq!(
            within_target(&terms, &[0, 1, 2], 0.1),
            Within::Some(vec![1, 2])
        );
        assert_eq!(within_target(&terms, &[0, 2], 0.01), Within::None(2));
        assert_eq!(within_target(&terms, &[0, 3], 0.1), Within::Unknown);
    }
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn default_cost_is_dynamos_prefill_plus_decode_blocks() {
        let p = CostParams::default();
        let c = cost(
            &p,
            &CostInput {
                overlap_blocks: 2,
                active_prefill_tokens: 32,
                active_decode_blocks: 7,
                active_requests: 3,
                ..CostInput::default()
            },
            100,
            16,
        );
        // (32 + (100 − 32)) / 16 = 6.25 prefill blocks.
        assert_eq!(c.prefill_cost, 6.25);
        assert_eq!(c.decode_cost, 7.0);
        assert_eq!(c.total_cost, 13.25);
    }

    #[test]
    fn overlap_credit_and_request_weight_apply_and_a_larger_overlap_always_counts() {
        let p = CostParams {
            prefill_load_scale: 2.0,
            decode_load_scale: 1.0,
            overlap_credit: 1.0,
            active_request_weight: 0.5,
            ..CostParams::default()
        };
        let c = cost(
            &p,
            &CostInput {
                overlap_blocks: 6,
                active_prefill_tokens: 0,
                active_decode_blocks: 1,
                active_requests: 4,
                ..CostInput::default()
            },
            100,
            16,
        );
        // 2 × ((100 − 96) / 16 − 1 × 6) = −11.5: below what any smaller
        // overlap costs, however short the queues.
        assert_eq!(c.prefill_cost, -11.5);
        assert_eq!(c.total_cost, -11.5 + 1.0 + 2.0);
        let less = cost(
            &p,
            &CostInput {
                overlap_blocks: 5,
                ..CostInput::default()
            },
            100,
            16,
        );
        assert!(less.prefill_cost > c.prefill_cost);
    }

    #[test]
    fn lowest_cost_wins_and_ties_go_to_the_smaller_index_share() {
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(choose(&[3.0, 1.0, 2.0], &[0.0; 3], 0.0, 0.0, &mut rng), 1);
        for _ in 0..50 {
            assert_eq!(
                choose(&[1.0, 1.0, 1.0], &[0.5, 0.1, 0.4], 0.0, 0.0, &mut rng),
                1
            );
        }
    }

    #[test]
    fn full_ties_are_broken_at_random() {
        let mut rng = StdRng::seed_from_u64(2);
        let mut seen = [0usize; 4];
        for _ in 0..400 {
            seen[choose(&[5.0; 4], &[0.0; 4], 0.0, 0.0, &mut rng)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
    }

    #[test]
    fn softmax_prefers_cheap_candidates_but_samples_others() {
        let mut rng = StdRng::seed_from_u64(3);
        let mut seen = [0usize; 3];
        for _ in 0..3000 {
            seen[choose(&[0.0, 10.0, 20.0], &[0.0; 3], 0.0, 0.5, &mut rng)] += 1;
        }
        assert!(
            seen[0] > seen[1] && seen[1] > seen[2] && seen[2] > 0,
            "{seen:?}"
        );
    }

    #[test]
    fn the_balance_bound_marks_only_workers_far_above_the_mean() {
        let mut terms: Vec<CostTerms> = [0u32, 2, 3, 11]
            .iter()
            .map(|&a| CostTerms {
                active_requests: a,
                ..CostTerms::default()
            })
            .collect();
        apply_bounds(&mut terms, 1.5, 0.0);
        // mean 4: limit 1.5 × 4 + 1 = 7.
        let over: Vec<bool> = terms.iter().map(|t| t.over_bound).collect();
        assert_eq!(over, [false, false, false, true]);
        apply_bounds(&mut terms, 0.0, 0.0);
        assert_eq!(
            terms.iter().filter(|t| t.over_bound).count(),
            1,
            "0 leaves marks alone"
        );
    }

    #[test]
    fn the_prefill_queue_bound_marks_queues_more_than_s_steps_longer_than_the_shortest() {
        let mut terms: Vec<CostTerms> = [(500u64, 1024u32), (2500, 1024), (4700, 1024), (9000, 0)]
            .iter()
            .map(|&(queued, step)| CostTerms {
                queued_prefill_tokens: queued,
                step_tokens: step,
                ..CostTerms::default()
            })
            .collect();
        apply_bounds(&mut terms, 0.0, 4.0);
        // Shortest 500: up to 500 + 4 × 1024 = 4596 may be chosen; a worker
        // that does not report its step size is not bounded.
        let over: Vec<bool> = terms.iter().map(|t| t.over_bound).collect();
        assert_eq!(over, [false, false, true, false]);
    }

    #[test]
    fn a_long_cached_prefix_behind_a_long_queue_loses_to_a_short_queue_under_the_bound() {
        let p = CostParams {
            overlap_credit: 8.0,
            prefill_queue_bound: 4.0,
            ..CostParams::default()
        };
        // 1,811-token prompt, 27 blocks of 64 cached on a worker with
        // 15,000 tokens queued; nothing cached on an idle one.
        let cached = CostInput {
            overlap_blocks: 27,
            active_prefill_tokens: 15_000,
            step_tokens: 1024,
            ..CostInput::default()
        };
        let idle = CostInput {
            step_tokens: 1024,
            ..CostInput::default()
        };
        let mut terms = vec![cost(&p, &cached, 1811, 64), cost(&p, &idle, 1811, 64)];
        assert!(
            terms[0].total_cost < terms[1].total_cost,
            "the credit alone prefers the queue"
        );
        apply_bounds(&mut terms, p.balance_bound, p.prefill_queue_bound);
        assert!(terms[0].over_bound && !terms[1].over_bound);
    }

    #[test]
    fn a_short_prompt_waits_for_one_chunk_of_a_long_prefill_and_a_long_one_for_all_of_it() {
        let p = CostParams::default();
        // 15,000 tokens of one long prompt and 300 of short ones queued on
        // an engine that lets prompts of at most 256 tokens pass long ones.
        let busy = CostInput {
            active_prefill_tokens: 15_300,
            long_prefill_tokens: 15_000,
            long_prefill_threshold: 256,
            ..CostInput::default()
        };
        // A 200-token prompt: the short ones and one 256-token chunk.
        assert_eq!(cost(&p, &busy, 200, 64).queued_prefill_tokens, 556);
        // Its 200 uncached of 1,000 (800 cached) are short too.
        let cached = CostInput {
            overlap_blocks: 12,
            ..busy
        };
        assert_eq!(cost(&p, &cached, 1000, 64).queued_prefill_tokens, 556);
        // A 1,000-token prompt waits for all of it.
        assert_eq!(cost(&p, &busy, 1000, 64).queued_prefill_tokens, 15_300);
        // Without the rule every prompt waits for all of it.
        let fcfs = CostInput {
            long_prefill_threshold: 0,
            ..busy
        };
        assert_eq!(cost(&p, &fcfs, 200, 64).queued_prefill_tokens, 15_300);
        // A follow-up whose prefix sits behind a long prefill goes there:
        // 13 blocks of a 14-block prompt cached behind 15,000 queued tokens
        // against an idle worker holding nothing.
        let p = CostParams {
            overlap_credit: 8.0,
            ..CostParams::default()
        };
        let holder = CostInput {
            overlap_blocks: 13,
            ..busy
        };
        let idle = CostInput {
            long_prefill_threshold: 256,
            ..CostInput::default()
        };
        assert!(cost(&p, &holder, 896, 64).total_cost < cost(&p, &idle, 896, 64).total_cost);
        let no_rule = CostInput {
            long_prefill_threshold: 0,
            ..holder
        };
        assert!(cost(&p, &no_rule, 896, 64).total_cost > cost(&p, &idle, 896, 64).total_cost);
    }

    #[test]
    fn a_short_prompt_is_predicted_slower_behind_a_long_prefill_in_progress() {
        // Measured steps: 80 ms decode, 130 ms more a prompt step, 120 µs a
        // prompt token; 1,024 tokens a step, prompts of at most 256 pass
        // long ones.
        let worker = CostInput {
            step_tokens: 1024,
            long_prefill_threshold: 256,
            step_time_us: 80_000,
            prefill_step_us: 130_000,
            prefill_ns_per_token: 120_000,
            ..CostInput::default()
        };
        // One worker decodes, its step 40 ms old ...
        let decoding = CostInput {
            reported_prefill_tokens: Some(0),
            step_in_progress: StepInProgress {
                prompt_tokens: 0,
                left: 0.040,
                prefill_first: PrefillFirst::ALWAYS_DECODES,
            },
            ..worker
        };
        // ... the other is 100 ms into a step of a 5,000-token prompt and
        // holds one more block of this one.
        let prefilling = CostInput {
            overlap_blocks: 1,
            active_prefill_tokens: 5_000,
            long_prefill_tokens: 5_000,
            reported_prefill_tokens: Some(5_000),
            step_in_progress: StepInProgress {
                prompt_tokens: 1024,
                left: 0.210 + 1024.0 * 120e-6 - 0.100,
                prefill_first: PrefillFirst::ALWAYS_DECODES,
            },
            ..worker
        };
        let p = CostParams::default();
        let t = |input: &CostInput| cost(&p, input, 100, 64).predicted_ttft.expect("measured");
        // Decoding: 40 ms left, then one step of its 100 tokens.
        assert!((t(&decoding) - (0.040 + 0.210 + 0.012)).abs() < 1e-9);
        // Prefilling: what is left of the step in progress, then a step the
        // long prompt fills: 1,024 tokens, not the 256 it passes before it.
        let left = 0.110 + 1024.0 * 120e-6;
        assert!((t(&prefilling) - (left + 0.210 + 1024.0 * 120e-6)).abs() < 1e-9);
        assert!(t(&prefilling) > t(&decoding) + 0.2);
        // In `latency` mode the block it holds does not outweigh that.
        let credit = CostParams {
            overlap_credit: 1.0,
            ..p
        };
        let lat = |input: &CostInput| {
            latency_cost(&credit, &cost(&credit, input, 100, 64)).expect("measured")
        };
        assert!(lat(&decoding) < lat(&prefilling));
    }

    #[test]
    fn within_the_tolerance_the_least_spread_wins_then_the_cheapest() {
        let mut rng = StdRng::seed_from_u64(3);
        let costs = [10.0, 14.0, 30.0, 10.0];
        let stored = [80.0, 20.0, 0.0, 80.0];
        // Within 8 of the cheapest: 0, 1 and 3; 1 stored least.
        assert_eq!(choose(&costs, &stored, 8.0, 0.0, &mut rng), 1);
        // No tolerance: the cheapest two tie on spread too, at random.
        let mut seen = [0; 4];
        for _ in 0..64 {
            seen[choose(&costs, &stored, 0.0, 0.0, &mut rng)] += 1;
        }
        assert!(seen[0] > 0 && seen[3] > 0 && seen[1] == 0, "{seen:?}");
        // Equal spread (nothing stored yet): the cheapest within it.
        assert_eq!(
            choose(&[12.0, 10.0, 11.0], &[0.0; 3], 8.0, 0.0, &mut rng),
            1
        );
    }

    #[test]
    fn mode_names_match_the_command_line() {
        use clap::ValueEnum;
        for m in RouterMode::value_variants() {
            let parsed = RouterMode::from_str(m.as_str(), false).expect("parses");
            assert_eq!(parsed, *m);
        }
    }
}
