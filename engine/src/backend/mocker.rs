//! The mocker backend: the real scheduler and KV cache run unchanged, compute
//! is replaced by a timing model and deterministic tokens. For routing,
//! priority and scale experiments where real compute on a few cores would
//! drown the signal.
//!
//! Timing (Dynamo's mocker polynomial, every duration divided by
//! `speedup_ratio`): a step with prefill rows costs
//! `4.209989e-7·T² + 1.518344e-2·T + 16.50142` ms, `T` = new (uncached)
//! prompt tokens computed in the step; a step with decode rows costs
//! `max(1, −25.74·a² + 54.01·a + 5.74)` ms, `a` = active KV tokens ÷ total
//! KV tokens. A mixed step lasts the *sum* of the two, as Dynamo's mocker
//! charges a pass (prefill plus decode; a prefill's first token adds no
//! decode time).
//!
//! Tokens depend only on the previous token and its position, so runs,
//! batchings and preemption-recomputes agree. The KV "memory" stores only
//! blocks written through [`Backend::write_block`] (lazily, so a large
//! simulated pool costs nothing); unwritten blocks read as zeros.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{Backend, ForwardBatch, ForwardOutput, KvArena, KvBacking, KvBlockLayout};
use crate::error::EngineError;
use crate::model::ModelConfig;

/// What the mocker's forward returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MockerOutput {
    /// Token ids chosen by the mocker (the engine's sampler is bypassed).
    #[default]
    Tokens,
    /// Deterministic logits peaked at the same token, so the engine's sampler
    /// (seed, temperature, logprobs) runs as with a real model.
    Logits,
}

/// Step timing model.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum MockerTiming {
    /// Dynamo's polynomial (see the module docs).
    #[default]
    Polynomial,
    /// No sleeping at all (unit tests).
    Instant,
}

/// Shape and behaviour of a mocker; only the model's config, no weights.
#[derive(Debug, Clone, PartialEq)]
pub struct MockerConfig {
    pub vocab_size: usize,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Bytes per KV element in the advertised layout (4 = f32, as the CPU backend).
    pub elem_bytes: usize,
    /// Every duration is divided by this.
    pub speedup_ratio: f64,
    pub timing: MockerTiming,
    pub output: MockerOutput,
    /// Token ids never emitted: typically the EOS ids, so requests run to
    /// `max_tokens` (like a benchmark with `ignore_eos`), and the tokens
    /// that render no text alone (a byte of a multi-byte character, a
    /// special token), so the first token, like a model's, is text a
    /// client sees.
    pub avoid_token_ids: Vec<u32>,
    /// KV bytes per token of the modelled model: what a KV transfer between
    /// workers moves (the blocks themselves have the advertised layout).
    pub kv_bytes_per_token: u64,
    /// Bytes per second a modelled KV transfer between workers moves.
    pub kv_transfer_bytes_per_sec: f64,
    /// Bytes per second a block restored from the second tier moves at.
    pub kv_tier_bytes_per_sec: f64,
}

/// KV bytes per token of the model the timing polynomial was measured on
/// (Llama-3-8B in bf16: 2 × 32 layers × 8 KV heads × 128 dims × 2 bytes).
pub const MODELLED_KV_BYTES_PER_TOKEN: u64 = 131_072;
/// A modelled KV link: 25 GB/s, a 200 Gb/s RDMA NIC's worth.
pub const MODELLED_KV_TRANSFER_BYTES_PER_SEC: f64 = 25e9;
/// A modelled second tier: host memory 50 GB/s from the GPU (PCIe 5 x16).
pub const MODELLED_KV_TIER_BYTES_PER_SEC: f64 = 50e9;

impl Default for MockerConfig {
    fn default() -> Self {
        Self {
            vocab_size: 32_000,
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            block_size: 16,
            num_blocks: 1024,
            elem_bytes: 4,
            speedup_ratio: 1.0,
            timing: MockerTiming::Polynomial,
            output: MockerOutput::Tokens,
            avoid_token_ids: Vec::new(),
            kv_bytes_per_token: MODELLED_KV_BYTES_PER_TOKEN,
            kv_transfer_bytes_per_sec: MODELLED_KV_TRANSFER_BYTES_PER_SEC,
            kv_tier_bytes_per_sec: MODELLED_KV_TIER_BYTES_PER_SEC,
        }
    }
}

impl MockerConfig {
    /// A mocker shaped like `model` (vocab, layers, KV heads, head dim) that
    /// never emits the model's EOS ids; only `config.json` is needed.
    pub fn for_model(model: &ModelConfig, block_size: usize, num_blocks: usize) -> Self {
        Self {
            vocab_size: model.vocab_size,
            num_layers: model.num_hidden_layers,
            num_kv_heads: model.num_key_value_heads,
            head_dim: model.head_dim,
            block_size,
            num_blocks,
            avoid_token_ids: model.eos_token_ids.clone(),
            ..Self::default()
        }
    }
}

/// Prefill time in ms for `t` new tokens (before `speedup_ratio`).
pub fn prefill_ms(t: usize) -> f64 {
    let t = t as f64;
    4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142
}

/// Decode step time in ms at KV utilisation `a` in 0..=1 (before `speedup_ratio`).
pub fn decode_ms(a: f64) -> f64 {
    (-25.74 * a * a + 54.01 * a + 5.74).max(1.0)
}

/// A backend that sleeps instead of computing.
#[derive(Debug)]
pub struct MockerBackend {
    cfg: MockerConfig,
    memory: Memory,
    pacer: Pacer,
}

/// Keeps the mocker's steps on the timing model's clock without sleeping
/// for each one.
///
/// A sleep shorter than the kernel's timer slack (50 µs for a normal
/// thread) lasts about the slack, not what was asked: at a high
/// `speedup_ratio` a 6 ns decode step slept ~55 µs, parked the engine
/// thread once per step and woke it by a timer (about three context
/// switches per request in `sluice up` at 16 streams), and at a low one
/// every step overslept by the same ~50 µs. The pacer keeps the model's
/// clock: each step ends `d` after the previous step's modelled end (or
/// after now, when the engine was idle longer than [`Pacer::IDLE_GAP`]),
/// and the thread sleeps only once it is [`Pacer::MIN_SLEEP`] ahead of that
/// clock. Short steps then cost no sleep until they add up, and a late
/// wake-up is made good on the next step instead of adding to the run.
/// Real time spent between steps (the scheduler's own work) counts against
/// the next step's modelled length the same way, up to the gap, as in an
/// engine that schedules the next step while the current one computes.
#[derive(Debug, Clone, Copy, Default)]
struct Pacer {
    /// Where the model's clock stands: the end of the last step.
    clock: Option<std::time::Instant>,
}

impl Pacer {
    /// The engine may run this far ahead of the model's clock unslept.
    const MIN_SLEEP: Duration = Duration::from_micros(200);
    /// A gap longer than this since the last step's modelled end is idle
    /// time (no step was due), not a late wake-up to make good.
    const IDLE_GAP: Duration = Duration::from_micros(200);

    /// A step of modelled length `d` starts at `now`: how long to sleep.
    fn step(&mut self, now: std::time::Instant, d: Duration) -> Option<Duration> {
        let start = match self.clock {
            Some(clock) if clock + Self::IDLE_GAP >= now => clock,
            _ => now,
        };
        let end = start + d;
        self.clock = Some(end);
        let ahead = end.saturating_duration_since(now);
        (ahead >= Self::MIN_SLEEP).then_some(ahead)
    }
}

/// Where the mocker keeps written blocks.
#[derive(Debug)]
enum Memory {
    /// Only blocks written so far (a huge simulated pool costs nothing).
    Sparse(HashMap<u32, Box<[u8]>>),
    /// Real KV memory transports can write into (see [`Backend::set_kv_backing`]).
    Arena(Arc<KvArena>),
}

impl MockerBackend {
    /// A mocker of the given shape; rejects zero sizes and a non-positive speedup.
    pub fn new(mut cfg: MockerConfig) -> Result<Self, EngineError> {
        let bad = |m: &str| Err(EngineError::InvalidConfig(format!("mocker: {m}")));
        if cfg.vocab_size == 0 || cfg.vocab_size > u32::MAX as usize {
            return bad("vocab_size must be in 1..=u32::MAX");
        }
        // Sorted, for `next_token`'s lookups.
        cfg.avoid_token_ids.sort_unstable();
        cfg.avoid_token_ids.dedup();
        if cfg.avoid_token_ids.len() >= cfg.vocab_size {
            return bad("avoid_token_ids leaves no token to emit");
        }
        if cfg.block_size == 0 || cfg.num_blocks == 0 {
            return bad("block_size and num_blocks must be at least 1");
        }
        if !(cfg.kv_transfer_bytes_per_sec.is_finite() && cfg.kv_transfer_bytes_per_sec > 0.0) {
            return bad("kv_transfer_bytes_per_sec must be > 0");
        }
        if !(cfg.kv_tier_bytes_per_sec.is_finite() && cfg.kv_tier_bytes_per_sec > 0.0) {
            return bad("kv_tier_bytes_per_sec must be > 0");
        }
        if !(cfg.speedup_ratio.is_finite() && cfg.speedup_ratio > 0.0) {
            return bad("speedup_ratio must be > 0");
        }
        Ok(Self {
            cfg,
            memory: Memory::Sparse(HashMap::new()),
            pacer: Pacer::default(),
        })
    }

    /// The mocker's configuration.
    pub fn config(&self) -> &MockerConfig {
        &self.cfg
    }

    /// How long the timing model says `batch` takes (after `speedup_ratio`).
    pub fn step_duration(&self, batch: &ForwardBatch) -> Duration {
        if self.cfg.timing == MockerTiming::Instant || batch.seqs.is_empty() {
            return Duration::ZERO;
        }
        // A row whose chunk is one token at the end of the sequence decodes;
        // anything else (prompt chunks, recomputes) is prefill.
        let mut prefill_tokens = 0;
        let mut decoding = false;
        for s in &batch.seqs {
            if s.tokens.len() == 1 && s.start_pos > 0 && s.needs_logits {
                decoding = true;
            } else {
                prefill_tokens += s.tokens.len();
            }
        }
        let mut ms = 0.0;
        if prefill_tokens > 0 {
            ms += prefill_ms(prefill_tokens);
        }
        if decoding {
            let total = batch.total_kv_tokens.max(1) as f64;
            ms += decode_ms((batch.active_kv_tokens as f64 / total).clamp(0.0, 1.0));
        }
        // Blocks copied back from the second tier before the step.
        let restored_bytes = (batch.restored_blocks * self.cfg.block_size) as f64
            * self.cfg.kv_bytes_per_token as f64;
        ms += restored_bytes / self.cfg.kv_tier_bytes_per_sec * 1000.0;
        Duration::from_secs_f64(ms / 1000.0 / self.cfg.speedup_ratio)
    }

    /// The token the mocker emits after `last` at position `pos`.
    pub fn next_token(&self, last: u32, pos: usize) -> u32 {
        let vocab = self.cfg.vocab_size as u64;
        let mut t = (mix(u64::from(last) ^ mix(pos as u64)) % vocab) as u32;
        while self.cfg.avoid_token_ids.binary_search(&t).is_ok() {
            t = ((u64::from(t) + 1) % vocab) as u32;
        }
        t
    }

    fn check_id(&self, id: u32) -> Result<(), EngineError> {
        if id as usize >= self.cfg.num_blocks {
            return Err(EngineError::BlockOutOfRange {
                id,
                num_blocks: self.cfg.num_blocks,
            });
        }
        Ok(())
    }
}

impl Backend for MockerBackend {
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput, EngineError> {
        let step = self.step_duration(batch);
        if !step.is_zero()
            && let Some(pause) = self.pacer.step(std::time::Instant::now(), step)
        {
            std::thread::sleep(pause);
        }
        let tokens: Vec<u32> = batch
            .seqs
            .iter()
            .filter(|s| s.needs_logits)
            .map(|s| {
                let last = s.tokens.last().copied().unwrap_or(0);
                self.next_token(last, s.start_pos + s.tokens.len().saturating_sub(1))
            })
            .collect();
        Ok(match self.cfg.output {
            MockerOutput::Tokens => ForwardOutput::Tokens(tokens),
            MockerOutput::Logits => {
                let v = self.cfg.vocab_size;
                let mut data = Vec::with_capacity(tokens.len() * v);
                for &t in &tokens {
                    let salt = mix(u64::from(t));
                    // Noise in [-2, 2); the chosen token stands 8 above it.
                    data.extend((0..v as u64).map(|i| {
                        let noise = (mix(salt ^ i) >> 40) as f32 / (1u64 << 24) as f32;
                        4.0 * noise - 2.0
                    }));
                    let row = data.len() - v;
                    data[row + t as usize] = 8.0;
                    for &a in &self.cfg.avoid_token_ids {
                        if let Some(x) = data.get_mut(row + a as usize) {
                            *x = -30.0;
                        }
                    }
                }
                ForwardOutput::Logits {
                    vocab_size: v,
                    data,
                }
            }
        })
    }

    fn kv_layout(&self) -> KvBlockLayout {
        KvBlockLayout {
            num_layers: self.cfg.num_layers,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            block_size: self.cfg.block_size,
            elem_bytes: self.cfg.elem_bytes,
        }
    }

    fn num_blocks(&self) -> usize {
        self.cfg.num_blocks
    }

    fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError> {
        self.check_id(id)?;
        let expected = self.kv_layout().block_bytes();
        if out.len() != expected {
            return Err(EngineError::BlockSize {
                expected,
                actual: out.len(),
            });
        }
        match &self.memory {
            Memory::Sparse(m) => match m.get(&id) {
                Some(data) => out.copy_from_slice(data),
                None => out.fill(0),
            },
            // SAFETY: the engine thread owns the blocks it serialises.
            Memory::Arena(a) => unsafe { a.read_block(id, out) }?,
        }
        Ok(())
    }

    fn write_block(&mut self, id: u32, data: &[u8]) -> Result<(), EngineError> {
        self.check_id(id)?;
        let expected = self.kv_layout().block_bytes();
        if data.len() != expected {
            return Err(EngineError::BlockSize {
                expected,
                actual: data.len(),
            });
        }
        match &mut self.memory {
            Memory::Sparse(m) => {
                m.insert(id, data.into());
            }
            // SAFETY: called on the engine thread for a block the engine owns.
            Memory::Arena(a) => unsafe { a.write_block(id, data)? },
        }
        Ok(())
    }

    fn kv_arena(&self) -> Option<Arc<KvArena>> {
        match &self.memory {
            Memory::Arena(a) => Some(Arc::clone(a)),
            Memory::Sparse(_) => None,
        }
    }

    /// Holds the KV in real memory laid out as a [`KvArena`] in `backing`
    /// (for KV transfers that write into it directly), instead of only the
    /// blocks written so far.
    fn set_kv_backing(&mut self, backing: &KvBacking) -> Result<(), EngineError> {
        let arena = KvArena::new(self.kv_layout(), self.cfg.num_blocks, backing)?;
        self.memory = Memory::Arena(Arc::new(arena));
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn kv_transfer_model(&self) -> Option<crate::backend::KvTransferModel> {
        (self.cfg.timing == MockerTiming::Polynomial).then(|| crate::backend::KvTransferModel {
            block_bytes: self.cfg.kv_bytes_per_token * self.cfg.block_size as u64,
            bytes_per_sec: self.cfg.kv_transfer_bytes_per_sec * self.cfg.speedup_ratio,
            tier_bytes_per_sec: self.cfg.kv_tier_bytes_per_sec * self.cfg.speedup_ratio,
        })
    }

    fn name(&self) -> &'static str {
        "mocker"
    }
}

/// SplitMix64 finaliser: a fixed, well-mixed hash (stable across runs and versions).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqChunk;

    fn mocker(output: MockerOutput) -> MockerBackend {
        MockerBackend::new(MockerConfig {
            vocab_size: 50,
            timing: MockerTiming::Instant,
            output,
            avoid_token_ids: vec![0],
            ..MockerConfig::default()
        })
        .expect("valid config")
    }

    fn chunk(tokens: Vec<u32>, start_pos: usize) -> SeqChunk {
        SeqChunk {
            tokens,
            start_pos,
            block_table: vec![0],
            needs_logits: true,
        }
    }

    #[test]
    fn the_pacer_sleeps_once_short_steps_add_up_and_keeps_the_model_clock() {
        let t0 = std::time::Instant::now();
        let us = Duration::from_micros;
        let mut p = Pacer::default();
        // 1 µs steps run back to back: no sleep until 200 µs are owed.
        for i in 0..199 {
            assert_eq!(p.step(t0, us(1)), None, "step {i}");
        }
        assert_eq!(p.step(t0, us(1)), Some(us(200)));
        // Woken 50 µs late (timer slack): the next 3 ms step sleeps 50 µs
        // less, so the run's length stays the model's.
        let mut p = Pacer::default();
        assert_eq!(p.step(t0, us(3000)), Some(us(3000)));
        assert_eq!(p.step(t0 + us(3050), us(3000)), Some(us(2950)));
        // Idle for longer than the gap: the next step starts from now.
        let later = t0 + us(6000) + us(10_000);
        assert_eq!(p.step(later, us(3000)), Some(us(3000)));
        // Real time past the model's clock (within the gap) is made good:
        // the engine runs on unslept until it is ahead again.
        let mut p = Pacer::default();
        assert_eq!(p.step(t0, us(100)), None);
        assert_eq!(p.step(t0 + us(150), us(100)), None);
        assert_eq!(p.step(t0 + us(150), us(200)), Some(us(250)));
    }

    #[test]
    fn polynomials_match_dynamo_values() {
        assert!((prefill_ms(1000) - 32.105_858_9).abs() < 1e-6);
        assert!((decode_ms(0.5) - 26.31).abs() < 1e-9);
        assert_eq!(decode_ms(0.0), 5.74);
        assert_eq!(decode_ms(-1.0), 1.0);
    }

    #[test]
    fn mixed_step_costs_prefill_plus_decode_divided_by_speedup() {
        let m = MockerBackend::new(MockerConfig {
            speedup_ratio: 10.0,
            ..MockerConfig::default()
        })
        .expect("valid");
        let batch = ForwardBatch {
            seqs: vec![chunk(vec![1; 100], 0), chunk(vec![2], 40)],
            active_kv_tokens: 141,
            total_kv_tokens: 282,
            restored_blocks: 0,
        };
        let want = (prefill_ms(100) + decode_ms(0.5)) / 10.0;
        let got = m.step_duration(&batch).as_secs_f64() * 1000.0;
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        // Blocks restored from the second tier add their copy: 2 blocks of
        // 16 tokens × 128 KiB at 50 GB/s, then the speed-up.
        let restoring = ForwardBatch {
            restored_blocks: 2,
            ..batch
        };
        let copy_ms = 2.0 * 16.0 * 131_072.0 / 50e9 * 1000.0 / 10.0;
        let got = m.step_duration(&restoring).as_secs_f64() * 1000.0;
        assert!(
            (got - want - copy_ms).abs() < 1e-6,
            "{got} vs {want} + {copy_ms}"
        );
    }

    #[test]
    fn tokens_are_deterministic_and_avoid_listed_ids() {
        let mut a = mocker(MockerOutput::Tokens);
        let mut b = mocker(MockerOutput::Tokens);
        let batch = ForwardBatch {
            seqs: vec![chunk(vec![3, 4, 5], 0)],
            ..ForwardBatch::default()
        };
        let ta = a.forward(&batch).expect("forward");
        let tb = b.forward(&batch).expect("forward");
        let (ForwardOutput::Tokens(ta), ForwardOutput::Tokens(tb)) = (ta, tb) else {
            panic!("token output expected")
        };
        assert_eq!(ta, tb);
        for last in 0..200 {
            assert_ne!(a.next_token(last, 7), 0);
        }
    }

    #[test]
    fn logits_mode_peaks_at_the_token_mode_token() {
        let mut t = mocker(MockerOutput::Tokens);
        let mut l = mocker(MockerOutput::Logits);
        let batch = ForwardBatch {
            seqs: vec![chunk(vec![9], 12)],
            ..ForwardBatch::default()
        };
        let Ok(ForwardOutput::Tokens(tok)) = t.forward(&batch) else {
            panic!("tokens")
        };
        let Ok(ForwardOutput::Logits { vocab_size, data }) = l.forward(&batch) else {
            panic!("logits")
        };
        assert_eq!(vocab_size, 50);
        let argmax = data
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i);
        assert_eq!(argmax, Some(tok[0] as usize));
    }

    #[test]
    fn for_model_takes_shape_and_eos_from_config_json() {
        let json = r#"{
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 256, "eos_token_id": [2, 7]
        }"#;
        let model = ModelConfig::from_json_str(json, std::path::Path::new("config.json"))
            .expect("valid config");
        let m = MockerBackend::new(MockerConfig::for_model(&model, 16, 100)).expect("valid");
        let layout = m.kv_layout();
        assert_eq!(
            (layout.num_layers, layout.num_kv_heads, layout.head_dim),
            (3, 2, 16)
        );
        assert_eq!((m.vocab_size(), m.num_blocks()), (256, 100));
        assert_eq!(m.config().avoid_token_ids, vec![2, 7]);
    }

    #[test]
    fn written_blocks_read_back_and_unwritten_read_zero() {
        let mut m = mocker(MockerOutput::Tokens);
        let n = m.kv_layout().block_bytes();
        let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
        m.write_block(3, &data).expect("in range");
        let mut out = vec![1u8; n];
        m.read_block(3, &mut out).expect("in range");
        assert_eq!(out, data);
        m.read_block(4, &mut out).expect("in range");
        assert!(out.iter().all(|&b| b == 0));
        assert!(matches!(
            m.write_block(3, &data[1..]),
            Err(EngineError::BlockSize { .. })
        ));
        assert!(matches!(
            m.read_block(5000, &mut out),
            Err(EngineError::BlockOutOfRange { .. })
        ));
    }
}
