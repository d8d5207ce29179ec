//! Turning one row of logits into the next token: repetition penalty,
//! `min_tokens` (EOS and stop ids suppressed before it), greedy or
//! temperature sampling with top-k and top-p, per-request seeded RNG, and
//! logprobs of the chosen and top tokens.
//!
//! Stop *strings* are matched by the frontend's detokenizer, not here; stop
//! *token ids*, EOS and `max_tokens` are checked by the scheduler after each
//! token. Logprobs are those of the model's raw distribution (log-softmax of
//! the unprocessed logits), as vLLM reports by default.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use sluice_tokens::grammar::Allowed;

use crate::error::EngineError;

/// How to pick tokens for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Tokens to generate at most; `None` = until `max_model_len`.
    pub max_tokens: Option<usize>,
    /// EOS and stop token ids cannot end generation before this many tokens.
    pub min_tokens: usize,
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Same seed, same prompt → same tokens. `None` = seeded from the OS.
    pub seed: Option<u64>,
    /// Penalty on tokens already in prompt or output; 1 = off.
    pub repetition_penalty: f32,
    /// Token ids that end generation (besides EOS).
    pub stop_token_ids: Vec<u32>,
    /// Generate past EOS until `max_tokens`.
    pub ignore_eos: bool,
    /// Return the chosen token's logprob.
    pub logprobs: bool,
    /// Also return this many most likely alternatives (implies `logprobs`).
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: None,
            min_tokens: 0,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            repetition_penalty: 1.0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding with everything else at its default.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Rejects values no sampler can honour, naming the field.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        if self.max_tokens == Some(0) {
            return bad("max_tokens must be at least 1".into());
        }
        if let Some(max) = self.max_tokens
            && self.min_tokens > max
        {
            return bad(format!(
                "min_tokens {} exceeds max_tokens {max}",
                self.min_tokens
            ));
        }
        Ok(())
    }

    fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }
}

/// Log probability of one token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    /// Natural-log probability.
    pub logprob: f32,
}

/// Logprobs for one generated position.
#[derive(Debug, Clone, PartialEq)]
pub struct PositionLogprobs {
    pub chosen: TokenLogprob,
    /// Most likely alternatives, most likely first.
    pub top: Vec<TokenLogprob>,
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprobs: Option<PositionLogprobs>,
}

/// What the sampler needs to know about the sequence besides its logits.
#[derive(Debug, Clone, Copy)]
pub struct SampleContext<'a> {
    /// Prompt and generated tokens so far (for the repetition penalty).
    pub history: &'a [u32],
    /// Tokens generated so far (for `min_tokens`).
    pub num_generated: usize,
    /// The model's EOS ids.
    pub eos_token_ids: &'a [u32],
    /// The tokens its grammar allows, if it has one: every other is masked.
    pub allowed: Option<&'a Allowed>,
}

/// A per-sequence sampler: owns the sequence's RNG, so one seed gives one
/// token stream no matter how the sequence is batched.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: StdRng,
}

impl Sampler {
    /// A sampler seeded with `seed`, or from the thread's generator (itself
    /// seeded and periodically reseeded from OS entropy; one system call per
    /// sequence cost a `getrandom` per request).
    pub fn new(seed: Option<u64>) -> Self {
        let rng = match seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_rng(&mut rand::rng()),
        };
        Self { rng }
    }

    /// Picks the next token from one row of logits.
    pub fn sample(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        ctx: SampleContext<'_>,
    ) -> Sampled {
        if logits.is_empty() {
            return Sampled {
                token: 0,
                logprobs: None,
            };
        }
        let mut work: Vec<f32> = logits
            .iter()
            .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x })
            .collect();
        apply_repetition_penalty(&mut work, ctx.history, params.repetition_penalty);
        if let Some(allowed) = ctx.allowed {
            allowed.mask(&mut work);
        }
        if ctx.num_generated < params.min_tokens {
            let ends: Vec<u32> = ctx
                .eos_token_ids
                .iter()
                .chain(&params.stop_token_ids)
                .copied()
                .collect();
            // A grammar that allows only an end keeps it: `min_tokens` does
            // not push the output past what the grammar accepts.
            let other_left = ctx.allowed.is_none()
                || work
                    .iter()
                    .enumerate()
                    .any(|(i, x)| x.is_finite() && !ends.contains(&(i as u32)));
            if other_left {
                for &t in &ends {
                    if let Some(x) = work.get_mut(t as usize) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
        let token = if params.temperature <= 1e-5 {
            argmax(&work)
        } else {
            self.sample_random(&mut work, params)
        };
        let logprobs = params
            .wants_logprobs()
            .then(|| logprobs_of(logits, token, params.top_logprobs));
        Sampled { token, logprobs }
    }

    fn sample_random(&mut self, work: &mut [f32], params: &SamplingParams) -> u32 {
        let inv_t = 1.0 / params.temperature;
        if (params.top_k == 0 || params.top_k >= work.len()) && params.top_p >= 1.0 {
            return self.sample_full(work, inv_t);
        }
        // Candidates sorted by logit, most likely first, cut by top-k.
        let mut cand: Vec<u32> = (0..work.len() as u32).collect();
        let by_logit_desc = |a: &u32, b: &u32| {
            work[*b as usize]
                .total_cmp(&work[*a as usize])
                .then(a.cmp(b))
        };
        if params.top_k > 0 && params.top_k < cand.len() {
            cand.select_nth_unstable_by(params.top_k - 1, by_logit_desc);
            cand.truncate(params.top_k);
        }
        cand.sort_unstable_by(by_logit_desc);
        let max = work[cand[0] as usize];
        if max == f32::NEG_INFINITY {
            return cand[0];
        }
        let mut probs: Vec<f32> = cand
            .iter()
            .map(|&t| ((work[t as usize] - max) * inv_t).exp())
            .collect();
        let sum: f32 = probs.iter().sum();
        let mut keep = probs.len();
        if params.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, p) in probs.iter().enumerate() {
                cum += p / sum;
                if cum >= params.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        probs.truncate(keep);
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, p) in probs.iter().enumerate() {
            if r < *p {
                return cand[i];
            }
            r -= p;
        }
        // Rounding left r just above the last mass: take the last kept token.
        cand[keep - 1]
    }
}

impl Sampler {
    /// Plain temperature sampling over the whole vocabulary: one pass for
    /// the normaliser, one for the draw; no sort.
    fn sample_full(&mut self, work: &[f32], inv_t: f32) -> u32 {
        let max = work.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return argmax(work);
        }
        let total: f32 = work.iter().map(|&x| ((x - max) * inv_t).exp()).sum();
        let mut r = self.rng.random::<f32>() * total;
        let mut last_possible = 0;
        for (i, &x) in work.iter().enumerate() {
            let p = ((x - max) * inv_t).exp();
            if p > 0.0 {
                last_possible = i;
                if r < p {
                    return i as u32;
                }
                r -= p;
            }
        }
        last_possible as u32
    }
}

fn apply_repetition_penalty(work: &mut [f32], history: &[u32], penalty: f32) {
    if (penalty - 1.0).abs() < f32::EPSILON {
        return;
    }
    let mut seen = vec![false; work.len()];
    for &t in history {
        if let Some(s) = seen.get_mut(t as usize)
            && !*s
        {
            *s = true;
            let x = &mut work[t as usize];
            *x = if *x > 0.0 { *x / penalty } else { *x * penalty };
        }
    }
}

/// Index of the largest value (lowest index among ties).
fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// Log-softmax of the raw logits at `token`, plus the `top_n` most likely.
fn logprobs_of(logits: &[f32], token: u32, top_n: usize) -> PositionLogprobs {
    let max = logits
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let lse = max
        + logits
            .iter()
            .filter(|x| !x.is_nan())
            .map(|&x| (x - max).exp())
            .sum::<f32>()
            .ln();
    let lp = |t: u32| {
        logits
            .get(t as usize)
            .map_or(f32::NEG_INFINITY, |&x| x - lse)
    };
    let mut top = Vec::new();
    if top_n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let desc = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let n = top_n.min(idx.len());
        if n < idx.len() {
            idx.select_nth_unstable_by(n - 1, desc);
            idx.truncate(n);
        }
        idx.sort_unstable_by(desc);
        top = idx
            .into_iter()
            .map(|t| TokenLogprob {
                token_id: t,
                logprob: lp(t),
            })
            .collect();
    }
    PositionLogprobs {
        chosen: TokenLogprob {
            token_id: token,
            logprob: lp(token),
        },
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(history: &[u32]) -> SampleContext<'_> {
        SampleContext {
            history,
            num_generated: 0,
            eos_token_ids: &[],
            allowed: None,
        }
    }

    fn logits() -> Vec<f32> {
        vec![0.1, 2.0, 1.9, -1.0, 0.5, 1.0, 0.0, 1.5]
    }

    #[test]
    fn greedy_picks_argmax() {
        let mut s = Sampler::new(Some(0));
        let out = s.sample(&logits(), &SamplingParams::greedy(), ctx(&[]));
        assert_eq!(out.token, 1);
        assert!(out.logprobs.is_none());
    }

    #[test]
    fn same_seed_gives_same_tokens_and_different_seeds_differ() {
        let p = SamplingParams {
            seed: Some(42),
            ..SamplingParams::default()
        };
        let run = |seed| {
            let mut s = Sampler::new(Some(seed));
            (0..64)
                .map(|_| s.sample(&logits(), &p, ctx(&[])).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let p = SamplingParams {
            top_k: 1,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(Some(1));
        for _ in 0..32 {
            assert_eq!(s.sample(&logits(), &p, ctx(&[])).token, 1);
        }
    }

    #[test]
    fn top_k_restricts_to_k_most_likely() {
        let p = SamplingParams {
            top_k: 2,
            temperature: 5.0,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(Some(3));
        for _ in 0..200 {
            let t = s.sample(&logits(), &p, ctx(&[])).token;
            assert!(t == 1 || t == 2, "token {t} outside top-2");
        }
    }

    #[test]
    fn top_p_keeps_smallest_set_reaching_mass() {
        // probs ≈ [0.9, 0.09, 0.01]: top_p 0.5 keeps only token 0.
        let l = vec![(0.9f32).ln(), (0.09f32).ln(), (0.01f32).ln()];
        let p = SamplingParams {
            top_p: 0.5,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(Some(9));
        for _ in 0..100 {
            assert_eq!(s.sample(&l, &p, ctx(&[])).token, 0);
        }
    }

    #[test]
    fn temperature_sampling_follows_distribution() {
        let l = vec![0.0f32, (3.0f32).ln()]; // p = [0.25, 0.75]
        let p = SamplingParams::default();
        let mut s = Sampler::new(Some(5));
        let ones = (0..4000)
            .filter(|_| s.sample(&l, &p, ctx(&[])).token == 1)
            .count();
        assert!((2800..3200).contains(&ones), "{ones} of 4000");
    }

    #[test]
    fn min_tokens_suppresses_eos_and_stop_ids() {
        let l = vec![5.0, 1.0, 4.0, 0.0];
        let p = SamplingParams {
            min_tokens: 2,
            stop_token_ids: vec![2],
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(None);
        let c = SampleContext {
            history: &[],
            num_generated: 1,
            eos_token_ids: &[0],
            allowed: None,
        };
        assert_eq!(s.sample(&l, &p, c).token, 1);
        let c = SampleContext {
            num_generated: 2,
            ..c
        };
        assert_eq!(s.sample(&l, &p, c).token, 0);
    }

    #[test]
    fn repetition_penalty_discourages_seen_tokens() {
        let l = vec![2.0, 1.9, -1.0];
        let p = SamplingParams {
            repetition_penalty: 1.5,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(None);
        assert_eq!(s.sample(&l, &p, ctx(&[0, 0])).token, 1);
    }

    #[test]
    fn logprobs_are_raw_log_softmax_with_top_alternatives() {
        let l = vec![0.0f32, (3.0f32).ln()];
        let p = SamplingParams {
            top_logprobs: 2,
            ..SamplingParams::greedy()
        };
        let out = Sampler::new(None).sample(&l, &p, ctx(&[]));
        let lp = out.logprobs.expect("requested");
        assert_eq!(lp.chosen.token_id, 1);
        assert!((lp.chosen.logprob - 0.75f32.ln()).abs() < 1e-5);
        assert_eq!(
            lp.top.iter().map(|t| t.token_id).collect::<Vec<_>>(),
            vec![1, 0]
        );
        assert!((lp.top[1].logprob - 0.25f32.ln()).abs() < 1e-5);
    }

    #[test]
    fn validate_names_bad_field() {
        let p = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        };
        let err = p.validate().expect_err("top_p 0 is invalid").to_string();
        assert!(err.contains("top_p"), "{err}");
        assert!(SamplingParams::default().validate().is_ok());
    }
}
