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
//! Work is split over output features (weight rows) on the backend's team;
//! every
//! activation row is dotted with a weight row while that row is in cache.

use sluice_gguf::GgmlType;
use sluice_gguf::quant::{QK, QK_K, dequantize, f16_at};

use super::team;
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
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::detect() == Isa::Avx2 {
            // SAFETY: the CPU has the features `quantize_avx2` is compiled for.
            unsafe { quantize_avx2(x, out) };
            return;
        }
    }
    quantize_blocks(x, out);
}

/// [`quantize_blocks`] in AVX2, a block per iteration: the same values
/// (`cvtps_epi32` rounds to nearest even, as `round_ties_even`; ggml's
/// AVX2 `quantize_row_q8_1` is the same sequence).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_avx2(x: &[f32], out: &mut [Q8Block]) {
    use std::arch::x86_64::*;
    let abs_mask = _mm256_set1_ps(-0.0);
    for (block, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        // SAFETY: `xs` is 32 f32s (four unaligned loads), `block.q` 32
        // bytes; register arithmetic otherwise.
        unsafe {
            let p = xs.as_ptr();
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let m = v.iter().fold(_mm256_setzero_ps(), |m, v| {
                _mm256_max_ps(m, _mm256_andnot_ps(abs_mask, *v))
            });
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let d = amax / 127.0;
            let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let [a, b, c, e] = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, inv)));
            let sum = _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, e));
            let sum = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256(sum, 1),
            );
            let sum = _mm_hadd_epi32(sum, sum);
            let sum = _mm_cvtsi128_si32(_mm_hadd_epi32(sum, sum));
            // packs interleave 128-bit lanes; the permute puts them back.
            let q = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
            let q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(block.q.as_mut_ptr() as *mut __m256i, q);
            block.d = half::f16::from_f32(d).to_f32();
            block.s = half::f16::from_f32(d * sum as f32).to_f32();
        }
    }
}

#[inline(always)]
fn quantize_blocks(x: &[f32], out: &mut [Q8Block]) {
    for (block, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in block.q.iter_mut().zip(xs) {
            // Nearest, ties to even, as ggml's AVX quantizer rounds.
            *q = (v * inv).round_ties_even() as i8;
            sum += *q as i32;
        }
        // Scales rounded to f16 as ggml stores them (`block_q8_1`), so the
        // products round as llama.cpp's do.
        block.d = half::f16::from_f32(d).to_f32();
        block.s = half::f16::from_f32(d * sum as f32).to_f32();
    }
}

/// Whether `ty`'s products run on quantized activations.
pub(crate) fn uses_q8(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// `out = x · wᵀ` (or `+=` when `accumulate`) for weights stacked along
/// the output (q/k/v, gate/up): part `j`'s rows are columns from the sum
/// of the earlier parts' rows. `x` is `m` rows of the parts' common
/// `cols`, `out` `m` rows of `n`; `xq` is `x` quantized by
/// [`quantize_rows`] when any part [`uses_q8`]. One parallel section for
/// all the parts: each is a synchronisation of the team fewer.
pub(crate) fn matmul(
    out: &mut [f32],
    n: usize,
    x: &[f32],
    xq: &[Q8Block],
    parts: &[QuantTensor],
    accumulate: bool,
) {
    let Some(k) = parts.first().map(|w| w.cols) else {
        return;
    };
    let m = x.len() / k;
    debug_assert_eq!(out.len(), m * n);
    debug_assert!(parts.iter().all(|w| w.cols == k));
    let total: usize = parts.iter().map(|w| w.rows).sum();
    if m == 0 || total == 0 {
        return;
    }
    debug_assert!(total <= n);
    // The activation blocks' scales side by side, for the batched kernels
    // that scale eight blocks at once (a single row goes through `gemv`).
    let scales = if m > 1 {
        XScales {
            d: xq.iter().map(|b| b.d).collect(),
            s: xq.iter().map(|b| b.s).collect(),
        }
    } else {
        XScales::default()
    };
    let threads = team::threads();
    let parallel = threads > 1 && m * k * total >= PARALLEL_MIN_WORK;
    // Each task: part `p`, its rows `first..first + len`, into a private
    // `[m, len]` tile added into `out` afterwards (a few KB: rows are
    // outputs, not weights).
    struct Task {
        part: usize,
        col: usize,
        first: usize,
        tile: Vec<f32>,
    }
    // About four tasks per thread over all the parts together.
    let per_task = if parallel {
        total.div_ceil(threads * 4).max(MIN_ROWS_PER_TASK)
    } else {
        total
    };
    let mut tasks = Vec::new();
    let mut col = 0;
    for (part, w) in parts.iter().enumerate() {
        for first in (0..w.rows).step_by(per_task) {
            let len = per_task.min(w.rows - first);
            tasks.push(Task {
                part,
                col,
                first,
                tile: vec![0.0; m * len],
            });
        }
        col += w.rows;
    }
    team::for_each_mut(&mut tasks, |_, t| {
        product(&parts[t.part], t.first, x, xq, &scales, m, &mut t.tile)
    });
    for t in tasks {
        let len = t.tile.len() / m;
        let at = t.col + t.first;
        for i in 0..m {
            let dst = &mut out[i * n + at..i * n + at + len];
            let src = &t.tile[i * len..(i + 1) * len];
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

/// `outs` (`[m, len]`) = the `m` activation rows against `w`'s rows
/// `first..first + len`.
fn product(
    w: &QuantTensor,
    first: usize,
    x: &[f32],
    xq: &[Q8Block],
    scales: &XScales,
    m: usize,
    outs: &mut [f32],
) {
    let kernel = Kernel::pick(w.ty);
    let k = w.cols;
    let len = outs.len() / m;
    if m == 1 && !matches!(kernel, Kernel::Blocks(_)) {
        let n = w.row_bytes();
        return kernel.gemv(&w.bytes[first * n..(first + len) * n], n, xq, outs);
    }
    #[cfg(target_arch = "x86_64")]
    if kernel.isa() == Isa::Avx2 {
        let n = w.row_bytes();
        return kernel.tile(
            &w.bytes[first * n..(first + len) * n],
            n,
            xq,
            scales,
            k,
            outs,
        );
    }
    let _ = scales;
    let mut buf = [0.0f32; QK_K];
    let mut dots = vec![0.0f32; m];
    for r in 0..len {
        kernel.dot_rows(w.row(first + r), x, xq, k, &mut dots, &mut buf);
        for (i, d) in dots.iter().enumerate() {
            outs[i * len + r] = *d;
        }
    }
}

fn xq_row<T>(xq: &[T], i: usize, k: usize) -> &[T] {
    let per_row = k / QK;
    xq.get(i * per_row..(i + 1) * per_row).unwrap_or(&[])
}

/// Each activation block's `d` and `s` ([`Q8Block`]), contiguous.
#[derive(Default)]
struct XScales {
    d: Vec<f32>,
    s: Vec<f32>,
}

/// Activation rows handled per pass over a weight row by the SIMD kernels.
const ROWS: usize = 4;

/// The dot-product kernel for one weight type on this CPU.
#[derive(Debug, Clone, Copy)]
enum Kernel {
    Q4_0(Isa),
    Q4_1(Isa),
    Q8_0(Isa),
    /// De-quantize 256 at a time, then an f32 dot.
    Blocks(GgmlType),
}

/// Whether the CPU has AVX-VNNI (`vpdpbusd` on 256-bit registers).
#[cfg(target_arch = "x86_64")]
fn vnni() -> bool {
    static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VNNI.get_or_init(|| std::is_x86_feature_detected!("avxvnni"))
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

    /// `out[i] = Σ w · x_i` for every activation row `i` (`x` is rows of
    /// `k`, `xq` the same rows quantized); `buf` is scratch for
    /// de-quantized blocks. (The SIMD kernels go through [`Kernel::tile`].)
    fn dot_rows(
        self,
        w: &[u8],
        x: &[f32],
        xq: &[Q8Block],
        k: usize,
        out: &mut [f32],
        buf: &mut [f32; QK_K],
    ) {
        if let Kernel::Blocks(ty) = self {
            return dot_blocks(ty, w, x, k, out, buf);
        }
        for (i, o) in out.iter_mut().enumerate() {
            *o = self.dot(w, xq_row(xq, i, k));
        }
    }

    /// `out[r] = Σ w_r · x` for consecutive weight rows of `row_bytes` and
    /// one quantized activation row (decode at batch 1).
    fn gemv(self, w: &[u8], row_bytes: usize, xq: &[Q8Block], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self.isa() == Isa::Avx2 {
            // SAFETY: `Isa::Avx2` is only picked when the CPU has avx2, fma
            // and f16c; the kernels read whole blocks within each row and
            // `xq`.
            unsafe {
                match self {
                    Kernel::Q4_0(_) => avx2::gemv_q4::<false>(w, row_bytes, xq, out),
                    Kernel::Q4_1(_) => avx2::gemv_q4::<true>(w, row_bytes, xq, out),
                    _ => avx2::gemv_q8_0(w, row_bytes, xq, out),
                }
            }
            return;
        }
        for (o, row) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
            *o = self.dot(row, xq);
        }
    }

    /// `outs[i][r] = Σ w_r · x_i` for consecutive weight rows of
    /// `row_bytes` and every activation row (`outs` is `[m, rows]`): groups
    /// of [`ROWS`] activation rows through the batched kernels, the weight
    /// row loop inside the SIMD build, and the rows left over one at a time
    /// through [`Kernel::gemv`].
    #[cfg(target_arch = "x86_64")]
    fn tile(
        self,
        w: &[u8],
        row_bytes: usize,
        xq: &[Q8Block],
        scales: &XScales,
        k: usize,
        outs: &mut [f32],
    ) {
        let rows = w.len() / row_bytes;
        let m = outs.len() / rows;
        let groups: Vec<avx2::Group<'_>> = (0..m / ROWS)
            .map(|g| {
                let i = g * ROWS;
                avx2::Group {
                    xs: std::array::from_fn(|r| xq_row(xq, i + r, k)),
                    ds: std::array::from_fn(|r| xq_row(&scales.d, i + r, k)),
                    ss: std::array::from_fn(|r| xq_row(&scales.s, i + r, k)),
                }
            })
            .collect();
        let grouped = &mut outs[..groups.len() * ROWS * rows];
        // SAFETY: `Isa::Avx2` is only picked when the CPU has avx2, fma and
        // f16c (and `vnni()` says whether it has avxvnni); the kernels read
        // whole blocks within each weight row, each group's rows and the
        // scales of those blocks.
        unsafe {
            match (self, vnni()) {
                (Kernel::Q4_0(_), false) => avx2::tile_q4::<false>(w, row_bytes, &groups, grouped),
                (Kernel::Q4_1(_), false) => avx2::tile_q4::<true>(w, row_bytes, &groups, grouped),
                (Kernel::Q4_0(_), true) => {
                    avx2::tile_q4_vnni::<false>(w, row_bytes, &groups, grouped)
                }
                (Kernel::Q4_1(_), true) => {
                    avx2::tile_q4_vnni::<true>(w, row_bytes, &groups, grouped)
                }
                (_, false) => avx2::tile_q8_0(w, row_bytes, &groups, grouped),
                (_, true) => avx2::tile_q8_0_vnni(w, row_bytes, &groups, grouped),
            }
        }
        for i in groups.len() * ROWS..m {
            self.gemv(
                w,
                row_bytes,
                xq_row(xq, i, k),
                &mut outs[i * rows..(i + 1) * rows],
            );
        }
    }

    fn isa(self) -> Isa {
        match self {
            Kernel::Q4_0(isa) | Kernel::Q4_1(isa) | Kernel::Q8_0(isa) => isa,
            Kernel::Blocks(_) => Isa::Portable,
        }
    }

    /// `Σ w · x` over one row for the q8 kernels.
    #[inline]
    fn dot(self, w: &[u8], xq: &[Q8Block]) -> f32 {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Q4_0(Isa::Avx2) | Kernel::Q4_1(Isa::Avx2) | Kernel::Q8_0(Isa::Avx2) => {
                let mut out = [0.0];
                self.gemv(w, w.len(), xq, &mut out);
                out[0]
            }
            Kernel::Q4_0(_) => portable::dot_q4_0(w, xq),
            Kernel::Q4_1(_) => portable::dot_q4_1(w, xq),
            Kernel::Q8_0(_) => portable::dot_q8_0(w, xq),
            Kernel::Blocks(_) => unreachable!("block types dot through dot_blocks"),
        }
    }
}

/// De-quantizes each block of `w` once into `buf` and dots it with every
/// activation row.
fn dot_blocks(ty: GgmlType, w: &[u8], x: &[f32], k: usize, out: &mut [f32], buf: &mut [f32; QK_K]) {
    let n = ty.block_elements();
    out.fill(0.0);
    for (b, block) in w.chunks_exact(ty.block_bytes()).enumerate() {
        let vals = &mut buf[..n];
        dequantize(ty, block, vals);
        for (i, o) in out.iter_mut().enumerate() {
            let xs = &x[i * k + b * n..i * k + (b + 1) * n];
            let mut acc = [0.0f32; 8];
            for (a, c) in vals.chunks_exact(8).zip(xs.chunks_exact(8)) {
                for l in 0..8 {
                    acc[l] += a[l] * c[l];
                }
            }
            *o += acc.iter().sum::<f32>();
        }
    }
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
    //! Per block: the nibbles (or bytes) against the activations' i8 with
    //! `maddubs` + `madd` (8 i32 lanes), scaled by `d_w · d_x` into an f32
    //! accumulator; the weight offset (`m`, or `-8 d` for Q4_0) times the
    //! activations' `d_x Σ q` goes to a second accumulator. Scales are
    //! converted with zeroing loads (`vmovd`/`vpbroadcastw` + `vcvtph2ps`)
    //! so no loop-carried false dependency forms through a merged register.

    use std::arch::x86_64::*;

    use super::{Q8Block, ROWS};

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: register arithmetic on an avx CPU.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    /// `[d, m | d, 0, 0]` of a Q4 block at `b`: for Q4_1 its two f16 scales,
    /// for Q4_0 its scale twice (the offset is `-8 d`, applied at the end).
    #[inline(always)]
    unsafe fn q4_scales<const MIN: bool>(b: *const u8) -> __m128 {
        // SAFETY: the caller passes a block (at least 4 readable bytes).
        unsafe {
            if MIN {
                _mm_cvtph_ps(_mm_cvtsi32_si128((b as *const i32).read_unaligned()))
            } else {
                _mm_cvtph_ps(_mm_set1_epi16((b as *const i16).read_unaligned()))
            }
        }
    }

    /// `[d_x, s_x, 0, 0]` of an activation block.
    #[inline(always)]
    unsafe fn x_scales(x: &Q8Block) -> __m128 {
        // SAFETY: `d` and `s` are adjacent f32s (`repr(C)`).
        unsafe { _mm_castpd_ps(_mm_load_sd(&x.d as *const f32 as *const f64)) }
    }

    /// The 32 nibbles of a Q4 block at `q` as bytes, low nibbles first.
    #[inline(always)]
    unsafe fn nibbles(q: *const u8) -> __m256i {
        // SAFETY: the caller passes 16 readable bytes.
        unsafe {
            let q = _mm_loadu_si128(q as *const __m128i);
            _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16(q, 4), q),
                _mm256_set1_epi8(0x0F),
            )
        }
    }

    #[inline(always)]
    unsafe fn finish<const MIN: bool>(acc: __m256, offs: __m128) -> f32 {
        // SAFETY: register arithmetic.
        unsafe {
            // Lane 1 of `offs` holds Σ m s_x (Q4_1) or Σ d s_x (Q4_0).
            let o = _mm_cvtss_f32(_mm_movehdup_ps(offs));
            hsum(acc) + if MIN { o } else { -8.0 * o }
        }
    }

    /// One Q4 block against one activation block, into `acc`/`offs`.
    #[inline(always)]
    unsafe fn q4_block<const MIN: bool>(
        b: *const u8,
        x: &Q8Block,
        acc: &mut __m256,
        offs: &mut __m128,
    ) {
        let at = if MIN { 4 } else { 2 };
        // SAFETY: the caller passes a whole block at `b`; register
        // arithmetic otherwise.
        unsafe {
            let p = _mm256_madd_epi16(
                _mm256_maddubs_epi16(
                    nibbles(b.add(at)),
                    _mm256_loadu_si256(x.q.as_ptr() as *const __m256i),
                ),
                _mm256_set1_epi16(1),
            );
            let prod = _mm_mul_ps(q4_scales::<MIN>(b), x_scales(x));
            *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), _mm256_cvtepi32_ps(p), *acc);
            *offs = _mm_add_ps(*offs, prod);
        }
    }

    /// Bytes ahead of the current block that a weight stream prefetches.
    const PREFETCH: usize = 640;

    /// Weight rows a [`gemv_q4`] / [`gemv_q8_0`] pass shares each
    /// activation block among.
    const GEMV_ROWS: usize = 4;

    /// One activation row against consecutive weight rows of `row_bytes`
    /// each: `out[r] = Σ w_r · x`, the row loop inside the SIMD build so
    /// nothing is dispatched per row (decode steps, batch 1). Rows go four
    /// at a time: each activation block is loaded once for four weight
    /// blocks, and the four accumulator chains are independent.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_q4<const MIN: bool>(
        w: &[u8],
        row_bytes: usize,
        xq: &[Q8Block],
        out: &mut [f32],
    ) {
        let (bytes, at) = if MIN { (20, 4) } else { (18, 2) };
        let blocks = (row_bytes / bytes).min(xq.len());
        let ones = _mm256_set1_epi16(1);
        let mut rows = out.chunks_exact_mut(GEMV_ROWS);
        let mut r0 = 0;
        for o in &mut rows {
            let mut acc = [_mm256_setzero_ps(); GEMV_ROWS];
            let mut offs = [_mm_setzero_ps(); GEMV_ROWS];
            let base = w[r0 * row_bytes..(r0 + GEMV_ROWS) * row_bytes].as_ptr();
            for i in 0..blocks {
                // SAFETY: block i of each of the four rows lies within the
                // slice `base` starts (blocks * bytes <= row_bytes), and
                // block i of `xq` exists; a prefetch of any address is
                // harmless.
                unsafe {
                    let x = xq.get_unchecked(i);
                    let xv = _mm256_loadu_si256(x.q.as_ptr() as *const __m256i);
                    let xs = x_scales(x);
                    for r in 0..GEMV_ROWS {
                        let b = base.add(r * row_bytes + i * bytes);
                        _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
                        let p =
                            _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles(b.add(at)), xv), ones);
                        let prod = _mm_mul_ps(q4_scales::<MIN>(b), xs);
                        acc[r] = _mm256_fmadd_ps(
                            _mm256_broadcastss_ps(prod),
                            _mm256_cvtepi32_ps(p),
                            acc[r],
                        );
                        offs[r] = _mm_add_ps(offs[r], prod);
                    }
                }
            }
            for ((o, acc), offs) in o.iter_mut().zip(acc).zip(offs) {
                // SAFETY: register arithmetic.
                *o = unsafe { finish::<MIN>(acc, offs) };
            }
            r0 += GEMV_ROWS;
        }
        for (j, o) in rows.into_remainder().iter_mut().enumerate() {
            let row = &w[(r0 + j) * row_bytes..(r0 + j + 1) * row_bytes];
            // SAFETY: as `dot_q4`; the features are enabled here.
            *o = unsafe { dot_q4::<MIN>(row, xq) };
        }
    }

    /// [`gemv_q4`] for Q8_0 weights.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv_q8_0(w: &[u8], row_bytes: usize, xq: &[Q8Block], out: &mut [f32]) {
        let blocks = (row_bytes / 34).min(xq.len());
        let ones = _mm256_set1_epi16(1);
        let mut rows = out.chunks_exact_mut(GEMV_ROWS);
        let mut r0 = 0;
        for o in &mut rows {
            let mut acc = [_mm256_setzero_ps(); GEMV_ROWS];
            let base = w[r0 * row_bytes..(r0 + GEMV_ROWS) * row_bytes].as_ptr();
            for i in 0..blocks {
                // SAFETY: as in `gemv_q4`.
                unsafe {
                    let x = xq.get_unchecked(i);
                    let x8 = _mm256_loadu_si256(x.q.as_ptr() as *const __m256i);
                    let xs = x_scales(x);
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let b = base.add(r * row_bytes + i * 34);
                        _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
                        let w8 = _mm256_loadu_si256(b.add(2) as *const __m256i);
                        // |w| against x with w's sign: maddubs needs one
                        // unsigned side.
                        let p = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(
                                _mm256_sign_epi8(w8, w8),
                                _mm256_sign_epi8(x8, w8),
                            ),
                            ones,
                        );
                        let d = _mm_cvtph_ps(_mm_set1_epi16((b as *const i16).read_unaligned()));
                        let scale = _mm256_broadcastss_ps(_mm_mul_ps(d, xs));
                        *acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), *acc);
                    }
                }
            }
            for (o, acc) in o.iter_mut().zip(acc) {
                // SAFETY: register arithmetic.
                *o = unsafe { hsum(acc) };
            }
            r0 += GEMV_ROWS;
        }
        for (j, o) in rows.into_remainder().iter_mut().enumerate() {
            let row = &w[(r0 + j) * row_bytes..(r0 + j + 1) * row_bytes];
            // SAFETY: as `dot_q8_0`.
            *o = unsafe { dot_q8_0(row, xq) };
        }
    }

    /// One Q8_0 row against one activation row, two blocks per iteration.
    #[inline(always)]
    unsafe fn dot_q8_0(w: &[u8], xq: &[Q8Block]) -> f32 {
        let blocks = (w.len() / 34).min(xq.len());
        // SAFETY: register arithmetic (the caller runs on an avx2 CPU).
        let (mut a0, mut a1) = unsafe { (_mm256_setzero_ps(), _mm256_setzero_ps()) };
        let mut i = 0;
        while i + 2 <= blocks {
            // SAFETY: blocks i and i+1 of `w` and `xq` exist; a prefetch of
            // any address is harmless.
            unsafe {
                let b = w.as_ptr().add(i * 34);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
                a0 = q8_0_block(b, xq.get_unchecked(i), a0);
                a1 = q8_0_block(b.add(34), xq.get_unchecked(i + 1), a1);
            }
            i += 2;
        }
        if i < blocks {
            // SAFETY: block i exists.
            a0 = unsafe { q8_0_block(w.as_ptr().add(i * 34), xq.get_unchecked(i), a0) };
        }
        // SAFETY: register arithmetic.
        unsafe { hsum(_mm256_add_ps(a0, a1)) }
    }

    /// One Q8_0 block at `b` against one activation block, into `acc`.
    #[inline(always)]
    unsafe fn q8_0_block(b: *const u8, x: &Q8Block, acc: __m256) -> __m256 {
        // SAFETY: the caller passes a whole block at `b`.
        unsafe {
            let w8 = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let x8 = _mm256_loadu_si256(x.q.as_ptr() as *const __m256i);
            // |w| against x with w's sign: maddubs needs one unsigned side.
            let p = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_sign_epi8(w8, w8), _mm256_sign_epi8(x8, w8)),
                _mm256_set1_epi16(1),
            );
            let d = _mm_cvtph_ps(_mm_set1_epi16((b as *const i16).read_unaligned()));
            let scale = _mm256_broadcastss_ps(_mm_mul_ps(d, x_scales(x)));
            _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc)
        }
    }

    /// One activation row, two blocks per iteration (two accumulator
    /// chains), the weight stream prefetched ahead.
    #[inline(always)]
    pub(super) unsafe fn dot_q4<const MIN: bool>(w: &[u8], xq: &[Q8Block]) -> f32 {
        let bytes = if MIN { 20 } else { 18 };
        let blocks = (w.len() / bytes).min(xq.len());
        // SAFETY: register arithmetic (the caller runs on an avx2 CPU).
        let (mut a0, mut a1, mut o0, mut o1) = unsafe {
            (
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
                _mm_setzero_ps(),
                _mm_setzero_ps(),
            )
        };
        let mut i = 0;
        while i + 2 <= blocks {
            // SAFETY: blocks i and i+1 of `w` and `xq` exist (i + 2 <=
            // blocks); a prefetch of any address is harmless.
            unsafe {
                let b = w.as_ptr().add(i * bytes);
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH) as *const i8);
                q4_block::<MIN>(b, xq.get_unchecked(i), &mut a0, &mut o0);
                q4_block::<MIN>(b.add(bytes), xq.get_unchecked(i + 1), &mut a1, &mut o1);
            }
            i += 2;
        }
        if i < blocks {
            // SAFETY: block i exists.
            unsafe {
                q4_block::<MIN>(
                    w.as_ptr().add(i * bytes),
                    xq.get_unchecked(i),
                    &mut a0,
                    &mut o0,
                )
            };
        }
        // SAFETY: register arithmetic.
        unsafe { finish::<MIN>(_mm256_add_ps(a0, a1), _mm_add_ps(o0, o1)) }
    }

    /// Blocks whose integer dot products are reduced and scaled together.
    const GROUP: usize = 8;

    /// Lane `j` of the result is the sum of `v[j]`'s eight lanes.
    #[inline(always)]
    unsafe fn reduce8(v: [__m256i; GROUP]) -> __m256i {
        // SAFETY: register arithmetic.
        unsafe {
            // Per 128-bit lane, hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3].
            let ab =
                _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let cd =
                _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
            // Each now holds [low-half sums of 4 vectors | high-half sums].
            _mm256_add_epi32(
                _mm256_permute2x128_si256(ab, cd, 0x20),
                _mm256_permute2x128_si256(ab, cd, 0x31),
            )
        }
    }

    /// Eight f16 values, one in the low half of each 32-bit lane, as f32.
    #[inline(always)]
    unsafe fn f16_lanes(v: __m256i) -> __m256 {
        // SAFETY: register arithmetic.
        unsafe {
            let packed = _mm256_packus_epi32(v, v); // [l0..l3 x2 | l4..l7 x2]
            let packed = _mm256_permute4x64_epi64(packed, 0b1000); // l0..l7 low
            _mm256_cvtph_ps(_mm256_castsi256_si128(packed))
        }
    }

    /// [`ROWS`] activation rows against one weight row. Eight blocks at a
    /// time: each block's nibbles are unpacked once for all rows; each
    /// row's eight integer block dots are reduced to one vector (a lane per
    /// block) and scaled by eight `d_w · d_x` with one multiply-add, its
    /// offsets (`m_w · s_x`, or `d_w · s_x` times -8) with another. The
    /// blocks after the last whole group go one at a time.
    #[inline(always)]
    unsafe fn dot_q4_rows_body<const MIN: bool, const VNNI: bool>(
        w: &[u8],
        xs: [&[Q8Block]; ROWS],
        ds: [&[f32]; ROWS],
        ss: [&[f32]; ROWS],
    ) -> [f32; ROWS] {
        let (bytes, at) = if MIN { (20, 4) } else { (18, 2) };
        let blocks = xs.iter().fold(w.len() / bytes, |n, x| n.min(x.len()));
        let blocks = ds.iter().chain(&ss).fold(blocks, |n, x| n.min(x.len()));
        let groups = blocks / GROUP;
        // SAFETY: register arithmetic (the caller runs on an avx2 CPU).
        let (ones, mask16, offsets) = unsafe {
            (
                _mm256_set1_epi16(1),
                _mm256_set1_epi32(0xFFFF),
                _mm256_setr_epi32(
                    0,
                    bytes as i32,
                    2 * bytes as i32,
                    3 * bytes as i32,
                    4 * bytes as i32,
                    5 * bytes as i32,
                    6 * bytes as i32,
                    7 * bytes as i32,
                ),
            )
        };
        let mut acc = [unsafe { _mm256_setzero_ps() }; ROWS];
        let mut offs = [unsafe { _mm256_setzero_ps() }; ROWS];
        for g in 0..groups {
            let first = g * GROUP;
            // SAFETY: blocks first..first + 8 of `w`, of every `xs` row and
            // of every scale row exist (first + 8 <= blocks); the gather
            // reads 4 bytes at the start of each of those weight blocks.
            unsafe {
                let base = w.as_ptr().add(first * bytes);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH + 64) as *const i8);
                let heads = _mm256_i32gather_epi32::<1>(base as *const i32, offsets);
                let dw = f16_lanes(_mm256_and_si256(heads, mask16));
                // Q4_1: the offsets' scale is m; Q4_0: d (times -8 at the end).
                let mw = if MIN {
                    f16_lanes(_mm256_srli_epi32(heads, 16))
                } else {
                    dw
                };
                let mut w8 = [_mm256_setzero_si256(); GROUP];
                for (j, w8) in w8.iter_mut().enumerate() {
                    *w8 = nibbles(base.add(j * bytes + at));
                }
                for r in 0..ROWS {
                    let x = xs[r].as_ptr().add(first);
                    let mut dots = [_mm256_setzero_si256(); GROUP];
                    for (j, dot) in dots.iter_mut().enumerate() {
                        let xv = _mm256_loadu_si256((*x.add(j)).q.as_ptr() as *const __m256i);
                        *dot = if VNNI {
                            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w8[j], xv)
                        } else {
                            _mm256_madd_epi16(_mm256_maddubs_epi16(w8[j], xv), ones)
                        };
                    }
                    let dx = _mm256_loadu_ps(ds[r].as_ptr().add(first));
                    let sx = _mm256_loadu_ps(ss[r].as_ptr().add(first));
                    acc[r] = _mm256_fmadd_ps(
                        _mm256_mul_ps(dw, dx),
                        _mm256_cvtepi32_ps(reduce8(dots)),
                        acc[r],
                    );
                    offs[r] = _mm256_fmadd_ps(mw, sx, offs[r]);
                }
            }
        }
        let mut tail = [unsafe { _mm256_setzero_ps() }; ROWS];
        let mut tail_offs = [unsafe { _mm_setzero_ps() }; ROWS];
        for i in groups * GROUP..blocks {
            // SAFETY: block i of `w` and of every row exists.
            unsafe {
                let b = w.as_ptr().add(i * bytes);
                for r in 0..ROWS {
                    q4_block::<MIN>(b, xs[r].get_unchecked(i), &mut tail[r], &mut tail_offs[r]);
                }
            }
        }
        let mut out = [0.0; ROWS];
        for (r, out) in out.iter_mut().enumerate() {
            // SAFETY: register arithmetic.
            unsafe {
                let o = hsum(offs[r]);
                *out = hsum(acc[r])
                    + if MIN { o } else { -8.0 * o }
                    + finish::<MIN>(tail[r], tail_offs[r]);
            }
        }
        out
    }

    /// [`ROWS`] activation rows, their blocks' `d` and their blocks' `s`.
    #[derive(Clone, Copy)]
    pub(super) struct Group<'a> {
        pub(super) xs: [&'a [Q8Block]; ROWS],
        pub(super) ds: [&'a [f32]; ROWS],
        pub(super) ss: [&'a [f32]; ROWS],
    }

    /// The block formats [`tile`] runs.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Format {
        Q4_0,
        Q4_1,
        Q8_0,
    }

    /// `out[i * rows + r] = Σ w_r · x_i` for every activation row `i` of
    /// `groups` and every weight row `r` of `w`: each weight row is taken
    /// once, for every group while it is in L1. No closures: a closure
    /// does not get its enclosing function's target features, and the
    /// intrinsics would not inline into it.
    #[inline(always)]
    unsafe fn tile<const VNNI: bool>(
        format: Format,
        w: &[u8],
        row_bytes: usize,
        groups: &[Group<'_>],
        out: &mut [f32],
    ) {
        let rows = w.len() / row_bytes;
        for (r, row) in w.chunks_exact(row_bytes).enumerate() {
            for (g, group) in groups.iter().enumerate() {
                // SAFETY: as the bodies'.
                let dots = unsafe {
                    match format {
                        Format::Q4_0 => {
                            dot_q4_rows_body::<false, VNNI>(row, group.xs, group.ds, group.ss)
                        }
                        Format::Q4_1 => {
                            dot_q4_rows_body::<true, VNNI>(row, group.xs, group.ds, group.ss)
                        }
                        Format::Q8_0 => dot_q8_0_rows_body::<VNNI>(row, group.xs, group.ds),
                    }
                };
                for (j, d) in dots.into_iter().enumerate() {
                    out[(g * ROWS + j) * rows + r] = d;
                }
            }
        }
    }

    /// [`tile`] with `maddubs` block dots.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_q4<const MIN: bool>(
        w: &[u8],
        row_bytes: usize,
        groups: &[Group<'_>],
        out: &mut [f32],
    ) {
        let format = if MIN { Format::Q4_1 } else { Format::Q4_0 };
        // SAFETY: as `tile`'s; the features are enabled here.
        unsafe { tile::<false>(format, w, row_bytes, groups, out) }
    }

    /// [`tile`] with `vpdpbusd` block dots.
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    pub(super) unsafe fn tile_q4_vnni<const MIN: bool>(
        w: &[u8],
        row_bytes: usize,
        groups: &[Group<'_>],
        out: &mut [f32],
    ) {
        let format = if MIN { Format::Q4_1 } else { Format::Q4_0 };
        // SAFETY: as `tile`'s; the features are enabled here.
        unsafe { tile::<true>(format, w, row_bytes, groups, out) }
    }

    /// [`tile`] of Q8_0 with `maddubs` block dots.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_q8_0(
        w: &[u8],
        row_bytes: usize,
        groups: &[Group<'_>],
        out: &mut [f32],
    ) {
        // SAFETY: as `tile`'s; the features are enabled here.
        unsafe { tile::<false>(Format::Q8_0, w, row_bytes, groups, out) }
    }

    /// [`tile`] of Q8_0 with `vpdpbusd` block dots.
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    pub(super) unsafe fn tile_q8_0_vnni(
        w: &[u8],
        row_bytes: usize,
        groups: &[Group<'_>],
        out: &mut [f32],
    ) {
        // SAFETY: as `tile`'s; the features are enabled here.
        unsafe { tile::<true>(Format::Q8_0, w, row_bytes, groups, out) }
    }

    /// [`ROWS`] activation rows against one Q8_0 weight row, eight blocks
    /// at a time as [`dot_q4_rows_body`] (no offsets: Q8_0 has none).
    #[inline(always)]
    unsafe fn dot_q8_0_rows_body<const VNNI: bool>(
        w: &[u8],
        xs: [&[Q8Block]; ROWS],
        ds: [&[f32]; ROWS],
    ) -> [f32; ROWS] {
        const BYTES: usize = 34;
        let blocks = xs.iter().fold(w.len() / BYTES, |n, x| n.min(x.len()));
        let blocks = ds.iter().fold(blocks, |n, x| n.min(x.len()));
        let groups = blocks / GROUP;
        // SAFETY: register arithmetic (the caller runs on an avx2 CPU).
        let (ones, mask16, offsets) = unsafe {
            (
                _mm256_set1_epi16(1),
                _mm256_set1_epi32(0xFFFF),
                _mm256_setr_epi32(0, 34, 68, 102, 136, 170, 204, 238),
            )
        };
        let mut acc = [unsafe { _mm256_setzero_ps() }; ROWS];
        for g in 0..groups {
            let first = g * GROUP;
            // SAFETY: as in `dot_q4_rows_body`.
            unsafe {
                let base = w.as_ptr().add(first * BYTES);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH + 64) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH + 128) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(PREFETCH + 192) as *const i8);
                let heads = _mm256_i32gather_epi32::<1>(base as *const i32, offsets);
                let dw = f16_lanes(_mm256_and_si256(heads, mask16));
                let (mut w8, mut aw) = (
                    [_mm256_setzero_si256(); GROUP],
                    [_mm256_setzero_si256(); GROUP],
                );
                for j in 0..GROUP {
                    w8[j] = _mm256_loadu_si256(base.add(j * BYTES + 2) as *const __m256i);
                    // |w|: maddubs and vpdpbusd need one unsigned side.
                    aw[j] = _mm256_sign_epi8(w8[j], w8[j]);
                }
                for r in 0..ROWS {
                    let x = xs[r].as_ptr().add(first);
                    let mut dots = [_mm256_setzero_si256(); GROUP];
                    for (j, dot) in dots.iter_mut().enumerate() {
                        let xv = _mm256_loadu_si256((*x.add(j)).q.as_ptr() as *const __m256i);
                        let sx = _mm256_sign_epi8(xv, w8[j]);
                        *dot = if VNNI {
                            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw[j], sx)
                        } else {
                            _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], sx), ones)
                        };
                    }
                    let dx = _mm256_loadu_ps(ds[r].as_ptr().add(first));
                    acc[r] = _mm256_fmadd_ps(
                        _mm256_mul_ps(dw, dx),
                        _mm256_cvtepi32_ps(reduce8(dots)),
                        acc[r],
                    );
                }
            }
        }
        for i in groups * GROUP..blocks {
            // SAFETY: block i of `w` and of every row exists.
            unsafe {
                let b = w.as_ptr().add(i * BYTES);
                for r in 0..ROWS {
                    acc[r] = q8_0_block(b, xs[r].get_unchecked(i), acc[r]);
                }
            }
        }
        let mut out = [0.0; ROWS];
        for (out, acc) in out.iter_mut().zip(acc) {
            // SAFETY: register arithmetic.
            *out = unsafe { hsum(acc) };
        }
        out
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
    /// as the kernel rounds it: 8-bit values times the block scale, and
    /// the weight offset (Q4_1's `m`, Q4_0's `-8 d`) multiplying the block
    /// sum as stored (`s`, rounded to f16 like ggml's). The kernels must
    /// match this to f32 rounding.
    fn reference(w: &QuantTensor, x: &[f32], m: usize) -> Vec<f32> {
        let dense = w.dequantize().data;
        let k = w.cols;
        let mut q = Vec::new();
        let xs: Vec<f32> = if uses_q8(w.ty) {
            quantize_rows(x, k, &mut q);
            q.iter()
                .flat_map(|b| b.q.iter().map(move |&v| v as f32 * b.d))
                .collect()
        } else {
            x.to_vec()
        };
        let per_row = k / QK;
        let mut out = vec![0.0; m * w.rows];
        for i in 0..m {
            for j in 0..w.rows {
                let mut sum: f64 = (0..k)
                    .map(|p| f64::from(xs[i * k + p]) * f64::from(dense[j * k + p]))
                    .sum();
                for (b, block) in w.row(j).chunks_exact(w.ty.block_bytes()).enumerate() {
                    let offset = match w.ty {
                        GgmlType::Q4_1 => f16_at(block, 2),
                        GgmlType::Q4_0 => -8.0 * f16_at(block, 0),
                        _ => continue,
                    };
                    let xb = &q[i * per_row + b];
                    let exact = xb.d * xb.q.iter().map(|&v| v as f32).sum::<f32>();
                    sum += f64::from(offset) * f64::from(xb.s - exact);
                }
                out[i * w.rows + j] = sum as f32;
            }
        }
        out
    }

    #[test]
    fn every_type_matches_its_dequantized_product() {
        check_every_type();
        // Split over a team: tasks of whole row ranges, gemv remainders.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        let team =
            super::team::Team::new(2, "quant-test", std::sync::Arc::new(pool)).expect("team");
        team.install(check_every_type);
    }

    fn check_every_type() {
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ] {
            let ks: &[usize] = if uses_q8(ty) { &[512, 576] } else { &[512] };
            for (m, rows, &k) in [(1, 300), (1, 301), (1, 3), (5, 40), (17, 64)]
                .into_iter()
                .flat_map(|(m, rows)| ks.iter().map(move |k| (m, rows, k)))
            {
                let w = random_blocks(ty, rows, k, m as u64);
                let x = data(m * k, 7 + m as u64);
                let mut xq = Vec::new();
                quantize_rows(&x, k, &mut xq);
                let n = rows + 3;
                let mut out = vec![1.0; m * n];
                // Columns 0..2 come from a part of two rows before `w`.
                let pad = random_blocks(GgmlType::Q8_0, 2, k, 99);
                let want_pad = reference(&pad, &x, m);
                matmul(&mut out, n, &x, &xq, &[pad, w.clone()], true);
                let want = reference(&w, &x, m);
                let scale = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                for i in 0..m {
                    assert_eq!(
                        out[i * n + n - 1],
                        1.0,
                        "{ty:?}: columns after the parts untouched"
                    );
                    for j in 0..2 {
                        let (got, want) = (out[i * n + j] - 1.0, want_pad[i * 2 + j]);
                        assert!(
                            (got - want).abs() <= 1e-3 * scale.max(1.0),
                            "{ty:?} pad [{i},{j}]"
                        );
                    }
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
    fn simd_quantization_equals_the_scalar_one_bit_for_bit() {
        if Isa::detect() == Isa::Portable {
            return;
        }
        let mut x = data(32 * 40, 5);
        // A zero block, and a block whose values land on .5 steps (ties).
        x[..32].fill(0.0);
        for (i, v) in x[32..64].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.5 * (127.0 / 8.0) / 127.0 * 8.0;
        }
        let (mut fast, mut slow) = (vec![Q8Block::ZERO; 40], vec![Q8Block::ZERO; 40]);
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { quantize_avx2(&x, &mut fast) };
        quantize_blocks(&x, &mut slow);
        for (i, (f, s)) in fast.iter().zip(&slow).enumerate() {
            assert_eq!((f.d, f.s, f.q), (s.d, s.s, s.q), "block {i}");
        }
    }

    #[test]
    fn vnni_block_dots_equal_the_avx2_ones() {
        if Isa::detect() == Isa::Portable || !vnni() {
            return;
        }
        // 18 blocks: two groups of eight and a tail of two.
        let k = 576;
        let x = data(ROWS * k, 9);
        let mut xq = Vec::new();
        quantize_rows(&x, k, &mut xq);
        let d: Vec<f32> = xq.iter().map(|b| b.d).collect();
        let s: Vec<f32> = xq.iter().map(|b| b.s).collect();
        let groups = [avx2::Group {
            xs: std::array::from_fn(|r| xq_row(&xq, r, k)),
            ds: std::array::from_fn(|r| xq_row(&d, r, k)),
            ss: std::array::from_fn(|r| xq_row(&s, r, k)),
        }];
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let w = random_blocks(ty, 3, k, 13);
            let n = w.row_bytes();
            let (mut plain, mut vnni) = (vec![0.0; ROWS * 3], vec![0.0; ROWS * 3]);
            // SAFETY: the CPU has avx2 and avxvnni (checked above).
            unsafe {
                match ty {
                    GgmlType::Q8_0 => {
                        avx2::tile_q8_0(&w.bytes, n, &groups, &mut plain);
                        avx2::tile_q8_0_vnni(&w.bytes, n, &groups, &mut vnni);
                    }
                    GgmlType::Q4_0 => {
                        avx2::tile_q4::<false>(&w.bytes, n, &groups, &mut plain);
                        avx2::tile_q4_vnni::<false>(&w.bytes, n, &groups, &mut vnni);
                    }
                    _ => {
                        avx2::tile_q4::<true>(&w.bytes, n, &groups, &mut plain);
                        avx2::tile_q4_vnni::<true>(&w.bytes, n, &groups, &mut vnni);
                    }
                }
            };
            assert_eq!(plain, vnni, "{ty:?}");
        }
    }

    #[test]
    fn portable_kernels_match_the_simd_ones() {
        let k = 256;
        let x = data(k, 3);
        let mut xq = Vec::new();
        quantize_rows(&x, k, &mut xq);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let w = random_blocks(ty, 1, k, 11);
            let fast = Kernel::pick(ty).dot(w.row(0), &xq);
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
