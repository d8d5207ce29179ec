//! Matrix products on quantized weights, without de-quantizing the matrix.
//!
//! Weights stay in ggml's blocks (one row per output feature, see
//! `sluice_gguf::quant`). For the 32-weight types (`Q4_0`, `Q4_1`, `Q8_0`)
//! the activations are quantized once per product to 8-bit blocks of 32
//! with an f32 scale ([`Q8Block`], ggml's `Q8_1`), and each block's dot
//! product is an integer one (AVX2 `maddubs`, or AVX-VNNI `dpbusd` where the
//! CPU has it, detected at run time), scaled once per block: as llama.cpp
//! computes them, so a decode step reads 4.5–8.5 bits per weight. K-quant
//! super-blocks are de-quantized 256 values at a time into a buffer that
//! stays in L1 and dotted with the f32 activations.
//!
//! Work is split over output features (weight rows) with rayon; every
//! activation row is dotted with a weight row while that row is in cache.

use rayon::prelude::*;
use sluice_gguf::GgmlType;
use sluice_gguf::quant::{QK, QK_K, dequantize, f16_at};

use crate::model::QuantTensor;

/// Multiply-adds below which a product stays on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 16;
/// Weight rows per parallel task, at least.
const MIN_ROWS_PER_TASK: usize = 16;

/// 32 activations quantized to i8 with scale `d`; `s` is `d * Σ q` (the
/// term a weight block's offset multiplies).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(8))]
pub(crate) struct Q8Block {
    d: f32,
    s: f32,
    q: [i8; QK],
}

impl Q8Block {
    const ZERO: Q8Block = Q8Block {
        d: 0.0,
        s: 0.0,
        q: [0; QK],
    };
}

/// Quantizes `x` (`m` rows of `k`, `k` a multiple of 32) into `out`.
pub(crate) fn quantize_rows(x: &[f32], k: usize, out: &mut Vec<Q8Block>) {
    debug_assert_eq!(k % QK, 0);
    out.clear();
    out.resize(x.len() / QK, Q8Block::ZERO);
    for (block, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in block.q.iter_mut().zip(xs) {
            // Round half away from zero, as ggml's roundf.
            *q = (v * inv).round() as i8;
            sum += *q as i32;
        }
        block.d = d;
        block.s = d * sum as f32;
    }
}

/// Whether `ty`'s products run on quantized activations.
pub(crate) fn uses_q8(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// Columns `col..col + w.rows` of `out = x · wᵀ` (or `+=` when
/// `accumulate`), `x` being `m` rows of `w.cols` and `out` `m` rows of
/// `n`. `xq` is `x` quantized by [`quantize_rows`] when [`uses_q8`].
pub(crate) fn matmul(
    out: &mut [f32],
    n: usize,
    col: usize,
    x: &[f32],
    xq: &[Q8Block],
    w: &QuantTensor,
    accumulate: bool,
) {
    let (k, rows) = (w.cols, w.rows);
    let m = x.len() / k;
    debug_assert_eq!(out.len(), m * n);
    debug_assert!(col + rows <= n);
    let kernel = Kernel::pick(w.ty);
    let task = |first: usize, outs: &mut [f32]| {
        // `outs` is `[m, len]` for weight rows first..first + len.
        let len = outs.len() / m;
        let mut buf = [0.0f32; QK_K];
        for r in 0..len {
            let row = w.row(first + r);
            for i in 0..m {
                let v = kernel.dot(row, &x[i * k..(i + 1) * k], xq_row(xq, i, k), &mut buf);
                outs[i * len + r] = v;
            }
        }
    };
    let threads = rayon::current_num_threads();
    let parallel = threads > 1 && m * k * rows >= PARALLEL_MIN_WORK;
    let per_task = if parallel {
        rows.div_ceil(threads * 4).max(MIN_ROWS_PER_TASK)
    } else {
        rows
    };
    // Each task writes a private `[m, len]` tile; tiles are added into
    // `out` afterwards (a few KB: rows are outputs, not weights).
    let tiles: Vec<(usize, Vec<f32>)> = (0..rows)
        .step_by(per_task.max(1))
        .collect::<Vec<_>>()
        .into_par_iter()
        .with_max_len(1)
        .map(|first| {
            let len = per_task.min(rows - first);
            let mut tile = vec![0.0; m * len];
            task(first, &mut tile);
            (first, tile)
        })
        .collect();
    for (first, tile) in tiles {
        let len = tile.len() / m;
        for i in 0..m {
            let dst = &mut out[i * n + col + first..i * n + col + first + len];
            let src = &tile[i * len..(i + 1) * len];
            if accumulate {
                for (d, s) in dst.iter_mut().zip(src) {
                    *d += s;
                }
            } else {
                dst.copy_from_slice(src);
            }
        }
    }
}

fn xq_row(xq: &[Q8Block], i: usize, k: usize) -> &[Q8Block] {
    let per_row = k / QK;
    xq.get(i * per_row..(i + 1) * per_row).unwrap_or(&[])
}

/// The dot-product kernel for one weight type on this CPU.
#[derive(Debug, Clone, Copy)]
enum Kernel {
    Q4_0(Isa),
    Q4_1(Isa),
    Q8_0(Isa),
    /// De-quantize 256 at a time, then an f32 dot.
    Blocks(GgmlType),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }
}

impl Kernel {
    fn pick(ty: GgmlType) -> Kernel {
        let isa = Isa::detect();
        match ty {
            GgmlType::Q4_0 => Kernel::Q4_0(isa),
            GgmlType::Q4_1 => Kernel::Q4_1(isa),
            GgmlType::Q8_0 => Kernel::Q8_0(isa),
            other => Kernel::Blocks(other),
        }
    }

    /// `Σ w · x` over one row; `buf` is scratch for de-quantized blocks.
    #[inline]
    fn dot(self, w: &[u8], x: &[f32], xq: &[Q8Block], buf: &mut [f32; QK_K]) -> f32 {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx2` is only picked when the CPU has avx2, fma
            // and f16c; the kernels read whole blocks within `w` and `xq`.
            Kernel::Q4_0(Isa::Avx2) => unsafe { avx2::dot_q4(w, xq, 18, 2, false) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Kernel::Q4_1(Isa::Avx2) => unsafe { avx2::dot_q4(w, xq, 20, 4, true) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            Kernel::Q8_0(Isa::Avx2) => unsafe { avx2::dot_q8_0(w, xq) },
            Kernel::Q4_0(_) => portable::dot_q4_0(w, xq),
            Kernel::Q4_1(_) => portable::dot_q4_1(w, xq),
            Kernel::Q8_0(_) => portable::dot_q8_0(w, xq),
            Kernel::Blocks(ty) => dot_blocks(ty, w, x, buf),
        }
    }
}

/// De-quantizes each block of `w` into `buf` and dots it with `x`.
fn dot_blocks(ty: GgmlType, w: &[u8], x: &[f32], buf: &mut [f32; QK_K]) -> f32 {
    let n = ty.block_elements();
    let mut acc = [0.0f32; 8];
    for (block, xs) in w.chunks_exact(ty.block_bytes()).zip(x.chunks_exact(n)) {
        let vals = &mut buf[..n];
        dequantize(ty, block, vals);
        for (a, b) in vals.chunks_exact(8).zip(xs.chunks_exact(8)) {
            for l in 0..8 {
                acc[l] += a[l] * b[l];
            }
        }
    }
    acc.iter().sum()
}

/// Scalar kernels: the reference the SIMD ones are tested against, and
/// what other CPUs run.
mod portable {
    use super::{Q8Block, f16_at};

    fn nibbles(qs: &[u8], x: &[i8; 32]) -> i32 {
        let mut sum = 0i32;
        for (j, &q) in qs.iter().enumerate() {
            sum += (q & 0xF) as i32 * x[j] as i32 + (q >> 4) as i32 * x[j + 16] as i32;
        }
        sum
    }

    pub(super) fn dot_q4_0(w: &[u8], xq: &[Q8Block]) -> f32 {
        w.chunks_exact(18)
            .zip(xq)
            .map(|(b, x)| f16_at(b, 0) * (x.d * nibbles(&b[2..], &x.q) as f32 - 8.0 * x.s))
            .sum()
    }

    pub(super) fn dot_q4_1(w: &[u8], xq: &[Q8Block]) -> f32 {
        w.chunks_exact(20)
            .zip(xq)
            .map(|(b, x)| f16_at(b, 0) * x.d * nibbles(&b[4..], &x.q) as f32 + f16_at(b, 2) * x.s)
            .sum()
    }

    pub(super) fn dot_q8_0(w: &[u8], xq: &[Q8Block]) -> f32 {
        w.chunks_exact(34)
            .zip(xq)
            .map(|(b, x)| {
                let dot: i32 = b[2..]
                    .iter()
                    .zip(&x.q)
                    .map(|(&q, &v)| q as i8 as i32 * v as i32)
                    .sum();
                f16_at(b, 0) * x.d * dot as f32
            })
            .sum()
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::Q8Block;

    #[inline(always)]
    unsafe fn f16(b: *const u8) -> f32 {
        // SAFETY: the caller passes a pointer to two readable bytes and
        // runs on a CPU with f16c.
        unsafe {
            let bits = (b as *const u16).read_unaligned();
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
        }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: pure register arithmetic on an avx CPU.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    /// Q4_0 (`bytes` 18, nibbles at 2, `w = (q - 8) d`) or Q4_1 (`bytes`
    /// 20, nibbles at 4, `w = q d + m`, `with_min`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4(
        w: &[u8],
        xq: &[Q8Block],
        bytes: usize,
        at: usize,
        with_min: bool,
    ) -> f32 {
        let blocks = (w.len() / bytes).min(xq.len());
        let mask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        let mut offsets = 0.0f32;
        for i in 0..blocks {
            // SAFETY: block i of `w` spans bytes i*bytes..(i+1)*bytes and
            // block i of `xq` exists (i < blocks); loads are unaligned.
            unsafe {
                let b = w.as_ptr().add(i * bytes);
                let x = xq.get_unchecked(i);
                let d = f16(b);
                let q = _mm_loadu_si128(b.add(at) as *const __m128i);
                let w8 = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), mask);
                let x8 = _mm256_loadu_si256(x.q.as_ptr() as *const __m256i);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w8, x8), ones);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), _mm256_cvtepi32_ps(p), acc);
                offsets += if with_min { f16(b.add(2)) } else { -8.0 * d } * x.s;
            }
        }
        // SAFETY: register arithmetic.
        unsafe { hsum(acc) + offsets }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0(w: &[u8], xq: &[Q8Block]) -> f32 {
        let blocks = (w.len() / 34).min(xq.len());
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        for i in 0..blocks {
            // SAFETY: as in `dot_q4`.
            unsafe {
                let b = w.as_ptr().add(i * 34);
                let x = xq.get_unchecked(i);
                let w8 = _mm256_loadu_si256(b.add(2) as *const __m256i);
                let x8 = _mm256_loadu_si256(x.q.as_ptr() as *const __m256i);
                // |w| · (x with w's sign): maddubs needs one unsigned side.
                let p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w8, w8), _mm256_sign_epi8(x8, w8));
                let p = _mm256_madd_epi16(p16, ones);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(b) * x.d), _mm256_cvtepi32_ps(p), acc);
            }
        }
        // SAFETY: register arithmetic.
        unsafe { hsum(acc) }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn data(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Random but valid blocks of `ty`: scales small and finite.
    fn random_blocks(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> QuantTensor {
        let len = rows * ty.row_bytes(cols);
        let mut bytes: Vec<u8> = data(len, seed)
            .iter()
            .map(|v| ((v + 1.0) * 127.5) as u8)
            .collect();
        let scale = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
        for (i, block) in bytes.chunks_exact_mut(ty.block_bytes()).enumerate() {
            let d = scale(0.01 + (i % 7) as f32 * 0.003);
            let m = scale(-0.02 + (i % 5) as f32 * 0.004);
            match ty {
                GgmlType::Q4_0 | GgmlType::Q8_0 => block[..2].copy_from_slice(&d),
                GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K => {
                    block[..2].copy_from_slice(&d);
                    block[2..4].copy_from_slice(&m);
                }
                GgmlType::Q6_K => block[208..210].copy_from_slice(&d),
                _ => unreachable!("float types are not quantized"),
            }
        }
        QuantTensor {
            ty,
            rows,
            cols,
            bytes: Arc::from(bytes),
        }
    }

    /// `x · wᵀ` with `w` de-quantized and, for the q8 kernels, `x` rounded
    /// as the kernel rounds it: the kernels must match this to f32 rounding.
    fn reference(w: &QuantTensor, x: &[f32], m: usize) -> Vec<f32> {
        let dense = w.dequantize().data;
        let k = w.cols;
        let xs: Vec<f32> = if uses_q8(w.ty) {
            let mut q = Vec::new();
            quantize_rows(x, k, &mut q);
            q.iter()
                .flat_map(|b| b.q.iter().map(move |&v| v as f32 * b.d))
                .collect()
        } else {
            x.to_vec()
        };
        let mut out = vec![0.0; m * w.rows];
        for i in 0..m {
            for j in 0..w.rows {
                out[i * w.rows + j] = (0..k)
                    .map(|p| f64::from(xs[i * k + p]) * f64::from(dense[j * k + p]))
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn every_type_matches_its_dequantized_product() {
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ] {
            for (m, rows) in [(1, 300), (5, 40), (17, 64)] {
                let k = 512;
                let w = random_blocks(ty, rows, k, m as u64);
                let x = data(m * k, 7 + m as u64);
                let mut xq = Vec::new();
                quantize_rows(&x, k, &mut xq);
                let n = rows + 3;
                let mut out = vec![1.0; m * n];
                matmul(&mut out, n, 2, &x, &xq, &w, true);
                let want = reference(&w, &x, m);
                let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                for i in 0..m {
                    assert_eq!(out[i * n], 1.0, "{ty:?}: columns before `col` untouched");
                    for j in 0..rows {
                        let (got, want) = (out[i * n + 2 + j] - 1.0, want[i * rows + j]);
                        assert!(
                            (got - want).abs() <= 1e-4 * scale,
                            "{ty:?} m={m} [{i},{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn portable_kernels_match_the_simd_ones() {
        let k = 256;
        let x = data(k, 3);
        let mut xq = Vec::new();
        quantize_rows(&x, k, &mut xq);
        let mut buf = [0.0; QK_K];
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let w = random_blocks(ty, 1, k, 11);
            let fast = Kernel::pick(ty).dot(w.row(0), &x, &xq, &mut buf);
            let slow = match ty {
                GgmlType::Q4_0 => portable::dot_q4_0(w.row(0), &xq),
                GgmlType::Q4_1 => portable::dot_q4_1(w.row(0), &xq),
                _ => portable::dot_q8_0(w.row(0), &xq),
            };
            assert!(
                (fast - slow).abs() <= 1e-4 * slow.abs().max(1.0),
                "{ty:?}: {fast} vs {slow}"
            );
        }
    }
}
