//! Element-wise and row-wise kernels of the CPU forward pass: RMSNorm, RoPE,
//! SwiGLU, dot products and bias adds, all f32.
//!
//! Loops are written so the compiler vectorises them (independent lanes for
//! reductions); none allocates.

use crate::model::{ModelConfig, RopeScaling};

/// Lanes of the independent accumulators in reductions.
const LANES: usize = 8;

/// `Σ a[i]·b[i]` with independent lane accumulators (vectorisable).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut sum = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for (x, y) in ra.iter().zip(rb) {
        sum += x * y;
    }
    sum
}

/// `out[j] = dot(q, k[j·stride..j·stride + q.len()])` for each `j`, four
/// rows at a time so the four reductions overlap.
#[inline(always)]
pub(crate) fn dot_rows(out: &mut [f32], q: &[f32], k: &[f32], stride: usize) {
    let d = q.len();
    let mut quads = out.chunks_exact_mut(4);
    let mut j = 0;
    for o in &mut quads {
        let rows: [&[f32]; 4] = std::array::from_fn(|i| &k[(j + i) * stride..(j + i) * stride + d]);
        let mut acc = [[0f32; LANES]; 4];
        let chunks = d / LANES;
        for c in 0..chunks {
            let qs = &q[c * LANES..(c + 1) * LANES];
            for (a, row) in acc.iter_mut().zip(&rows) {
                let ks = &row[c * LANES..(c + 1) * LANES];
                for l in 0..LANES {
                    a[l] += qs[l] * ks[l];
                }
            }
        }
        for ((o, a), row) in o.iter_mut().zip(&acc).zip(&rows) {
            let mut sum = (a[0] + a[4]) + (a[1] + a[5]) + (a[2] + a[6]) + (a[3] + a[7]);
            for p in chunks * LANES..d {
                sum += q[p] * row[p];
            }
            *o = sum;
        }
        j += 4;
    }
    for o in quads.into_remainder() {
        *o = dot(q, &k[j * stride..j * stride + d]);
        j += 1;
    }
}

/// `acc[i] += w·v[i]`.
#[inline(always)]
pub(crate) fn axpy(acc: &mut [f32], w: f32, v: &[f32]) {
    for (a, x) in acc.iter_mut().zip(v) {
        *a += w * x;
    }
}

/// `e^x` to within about 2 ulp (Cephes' `expf`: range reduction by ln 2 and
/// a degree-5 polynomial), written with float and integer bit operations only
/// so loops over it vectorise, unlike libm's. Inputs are clamped to
/// `[-87.3, 88.7]`, so results stay finite and normal.
#[inline(always)]
pub(crate) fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5·2^23 rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.7);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n through the exponent bits: n = t.bits - ROUND.bits, in [-126, 128).
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits());
    y * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// RMSNorm of each `dim`-wide row of `x` into `out`, times `weight`.
pub(crate) fn rms_norm(out: &mut [f32], x: &[f32], weight: &[f32], dim: usize, eps: f32) {
    for (o, row) in out.chunks_exact_mut(dim).zip(x.chunks_exact(dim)) {
        let mean_sq = dot(row, row) / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for ((o, x), w) in o.iter_mut().zip(row).zip(weight) {
            *o = w * (x * inv);
        }
    }
}

/// [`rms_norm`] in place: every `weight.len()`-wide row of `x` (per-head
/// q/k norms).
pub(crate) fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for row in x.chunks_exact_mut(dim) {
        let inv = 1.0 / (dot(row, row) / dim as f32 + eps).sqrt();
        for (x, w) in row.iter_mut().zip(weight) {
            *x = w * (*x * inv);
        }
    }
}

/// Adds `bias` to every `bias.len()`-wide row of `x`.
pub(crate) fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (x, b) in row.iter_mut().zip(bias) {
            *x += b;
        }
    }
}

/// GeGLU with the tanh GELU (Gemma's `gelu_pytorch_tanh`): as [`swiglu`]
/// with `gelu(g) = g/2 · (1 + tanh(sqrt(2/π) · (g + 0.044715 g³)))`.
pub(crate) fn geglu_tanh(out: &mut [f32], gate_up: &[f32], inter: usize) {
    const C: f32 = 0.797_884_6; // sqrt(2 / π)
    for (o, row) in out
        .chunks_exact_mut(inter)
        .zip(gate_up.chunks_exact(2 * inter))
    {
        let (gate, up) = row.split_at(inter);
        for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
            *o = 0.5 * g * (1.0 + (C * (g + 0.044_715 * g * g * g)).tanh()) * u;
        }
    }
}

/// `tanh(x / cap) · cap` on every value (Gemma's soft-capping).
pub(crate) fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = (*v / cap).tanh() * cap;
    }
}

/// SwiGLU: each row of `gate_up` is `[gate (inter) | up (inter)]`; writes
/// `silu(gate)·up` into the matching `inter`-wide row of `out`.
pub(crate) fn swiglu(out: &mut [f32], gate_up: &[f32], inter: usize) {
    for (o, row) in out
        .chunks_exact_mut(inter)
        .zip(gate_up.chunks_exact(2 * inter))
    {
        let (gate, up) = row.split_at(inter);
        for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + fast_exp(-g)) * u;
        }
    }
}

/// Rotary embedding frequencies for one model, with its scaling.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    /// `head_dim / 2` inverse frequencies (scaling applied, except dynamic).
    inv_freq: Vec<f64>,
    head_dim: usize,
    theta: f64,
    scaling: Option<RopeScaling>,
    max_position_embeddings: usize,
}

impl Rope {
    pub(crate) fn new(config: &ModelConfig) -> Self {
        let mut rope = Self::with(config, config.rope_theta, config.rope_scaling);
        if let Some(factors) = &config.variant.rope_freq_factors {
            // llama.cpp: theta_i = p · base^(-2i/d) / factor_i.
            for (f, d) in rope.inv_freq.iter_mut().zip(factors) {
                *f /= f64::from(*d);
            }
        }
        rope
    }

    /// The model's RoPE with another base and scaling (Gemma 3's local one).
    pub(crate) fn with(config: &ModelConfig, theta: f32, scaling: Option<RopeScaling>) -> Self {
        let head_dim = config.head_dim;
        let theta = f64::from(theta);
        let mut inv_freq = base_inv_freq(theta, head_dim);
        match scaling {
            None | Some(RopeScaling::Dynamic { .. }) => {}
            Some(RopeScaling::Linear { factor }) => {
                for f in &mut inv_freq {
                    *f /= f64::from(factor);
                }
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                // transformers' `_compute_llama3_parameters`.
                let (factor, low, high) = (
                    f64::from(factor),
                    f64::from(low_freq_factor),
                    f64::from(high_freq_factor),
                );
                let old_len = original_max_position_embeddings as f64;
                let low_freq_wavelen = old_len / low;
                let high_freq_wavelen = old_len / high;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen > low_freq_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_freq_wavelen {
                        let smooth = (old_len / wavelen - low) / (high - low);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        Rope {
            inv_freq,
            head_dim,
            theta,
            scaling,
            max_position_embeddings: config.max_position_embeddings,
        }
    }

    /// Fills `cos`/`sin` (`head_dim / 2` each per position) for `positions`
    /// of one sequence whose longest position is `seq_len - 1`.
    ///
    /// Dynamic NTK scaling picks its base from `seq_len` per chunk, as
    /// transformers does from the positions of a forward call.
    pub(crate) fn fill(&self, positions: std::ops::Range<usize>, cos: &mut [f32], sin: &mut [f32]) {
        let half = self.head_dim / 2;
        let dynamic;
        let inv_freq = match self.scaling {
            Some(RopeScaling::Dynamic { factor })
                if positions.end > self.max_position_embeddings =>
            {
                // transformers' `_compute_dynamic_ntk_parameters`.
                let factor = f64::from(factor);
                let dim = self.head_dim as f64;
                let ratio = factor * positions.end as f64 / self.max_position_embeddings as f64
                    - (factor - 1.0);
                let base = self.theta * ratio.powf(dim / (dim - 2.0));
                dynamic = base_inv_freq(base, self.head_dim);
                &dynamic
            }
            _ => &self.inv_freq,
        };
        for (p, (c, s)) in positions.zip(cos.chunks_exact_mut(half).zip(sin.chunks_exact_mut(half)))
        {
            for ((c, s), f) in c.iter_mut().zip(s.iter_mut()).zip(inv_freq) {
                // transformers computes the angle in f32; f64 keeps long
                // positions accurate and agrees to well below the tolerance.
                let (sn, cs) = (p as f64 * f).sin_cos();
                *c = cs as f32;
                *s = sn as f32;
            }
        }
    }
}

fn base_inv_freq(theta: f64, head_dim: usize) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect()
}

/// Rotates every `head_dim`-wide head in `x` (HF's rotate-half convention:
/// dimension `i` pairs with `i + head_dim/2`).
pub(crate) fn apply_rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (a, b) = head.split_at_mut(half);
        for (((x1, x2), c), s) in a.iter_mut().zip(b.iter_mut()).zip(cos).zip(sin) {
            let (u, v) = (*x1, *x2);
            *x1 = u * c - v * s;
            *x2 = v * c + u * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_support::tiny_config;

    #[test]
    fn dot_matches_naive_sum_for_odd_lengths() {
        let a: Vec<f32> = (0..19).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..19).map(|i| 1.0 - i as f32 * 0.1).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }

    #[test]
    fn dot_rows_matches_dot_per_row() {
        let q: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
        let k: Vec<f32> = (0..7 * 20).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
        let mut out = [0.0; 7];
        dot_rows(&mut out, &q, &k, 20);
        for (j, o) in out.iter().enumerate() {
            assert!((o - dot(&q, &k[j * 20..j * 20 + 12])).abs() < 1e-4);
        }
    }

    #[test]
    fn fast_exp_matches_std_exp() {
        for i in -8700..=8800 {
            let x = i as f32 * 0.01;
            let (got, want) = (fast_exp(x), x.exp());
            assert!(
                (got - want).abs() <= 4.0 * f32::EPSILON * want,
                "exp({x}): {got} vs {want}"
            );
        }
        assert_eq!(fast_exp(0.0), 1.0);
        assert!(fast_exp(-1000.0) >= 0.0 && fast_exp(-1000.0) < 1e-37);
    }

    #[test]
    fn rms_norm_gives_unit_rms_times_weight() {
        let x = [3.0, -4.0, 0.0, 1.0];
        let mut out = [0.0; 4];
        rms_norm(&mut out, &x, &[2.0; 4], 4, 0.0);
        let rms = (out.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 2.0).abs() < 1e-5);
    }

    #[test]
    fn rope_preserves_norm_and_is_identity_at_position_zero() {
        let rope = Rope::new(&tiny_config(true));
        let (mut cos, mut sin) = (vec![0.0; 8], vec![0.0; 8]);
        rope.fill(0..2, &mut cos, &mut sin);
        let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        let mut at0 = x.clone();
        apply_rope(&mut at0, 8, &cos[..4], &sin[..4]);
        assert_eq!(at0, x);
        let mut at1 = x.clone();
        apply_rope(&mut at1, 8, &cos[4..], &sin[4..]);
        assert_ne!(at1, x);
        assert!((dot(&at1, &at1) - dot(&x, &x)).abs() < 1e-3);
    }

    #[test]
    fn linear_rope_scaling_divides_positions() {
        let mut config = tiny_config(true);
        let plain = Rope::new(&config);
        config.rope_scaling = Some(RopeScaling::Linear { factor: 4.0 });
        let scaled = Rope::new(&config);
        let (mut c1, mut s1, mut c2, mut s2) =
            (vec![0.0; 4], vec![0.0; 4], vec![0.0; 4], vec![0.0; 4]);
        plain.fill(3..4, &mut c1, &mut s1);
        scaled.fill(12..13, &mut c2, &mut s2);
        for (a, b) in c1.iter().zip(&c2).chain(s1.iter().zip(&s2)) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let mut config = tiny_config(true);
        config.head_dim = 64;
        config.rope_theta = 500_000.0;
        let plain = Rope::new(&config);
        config.rope_scaling = Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        });
        let scaled = Rope::new(&config);
        assert_eq!(scaled.inv_freq[0], plain.inv_freq[0]);
        let last = plain.inv_freq.len() - 1;
        assert!((scaled.inv_freq[last] - plain.inv_freq[last] / 8.0).abs() < 1e-15);
    }
}
