//! Matrix products of activations by weights, through the `gemm` crate.
//!
//! One shape only: `out[m, n] (+)= x[m, k] · wᵀ` with `w` row-major `[n, k]`
//! (Hugging Face's `[out_features, in_features]`), all row-major f32. Several
//! rows use gemm's own rayon parallelism; a single row (batch-1 decode) is a
//! matrix-vector product, which gemm runs on one thread, so it is split over
//! output columns here instead.

use gemm::Parallelism;
use rayon::prelude::*;

/// Work (multiply-adds) below which a product stays on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 16;
/// Output columns per task for a split matrix-vector product.
const GEMV_MIN_COLUMNS: usize = 64;

/// `out = x · wᵀ`, or `out += x · wᵀ` when `accumulate`.
///
/// `x` is `[m, k]`, `w` is `[n, k]`, `out` is `[m, n]`, all row-major.
pub(crate) fn matmul_t(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    assert_eq!(x.len(), m * k, "x must be [m, k]");
    assert_eq!(w.len(), n * k, "w must be [n, k]");
    assert_eq!(out.len(), m * n, "out must be [m, n]");
    if m == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    let work = m * n * k;
    if m == 1 && threads > 1 && work >= PARALLEL_MIN_WORK {
        let per_task = n.div_ceil(threads * 4).max(GEMV_MIN_COLUMNS);
        out.par_chunks_mut(per_task)
            .enumerate()
            .for_each(|(i, out)| {
                let j0 = i * per_task;
                let cols = out.len();
                gemm_rows(
                    out,
                    x,
                    &w[j0 * k..(j0 + cols) * k],
                    1,
                    k,
                    cols,
                    accumulate,
                    Parallelism::None,
                );
            });
        return;
    }
    let parallelism = if threads > 1 && work >= PARALLEL_MIN_WORK {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    gemm_rows(out, x, w, m, k, n, accumulate, parallelism);
}

#[expect(clippy::too_many_arguments, reason = "mirrors gemm's own signature")]
fn gemm_rows(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
    parallelism: Parallelism,
) {
    debug_assert!(out.len() >= m * n && x.len() >= m * k && w.len() >= n * k);
    // SAFETY: every pointer comes from a slice holding the whole matrix
    // it describes (checked above): dst is [m, n] with row stride n, lhs is
    // [m, k] with row stride k, rhs = wᵀ is [k, n] read from w with row
    // stride 1 and column stride k. `out` is borrowed mutably, so it
    // aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum();
            }
        }
        out
    }

    fn data(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0) - 1.0)
            .collect()
    }

    #[test]
    fn matmul_matches_naive_for_gemv_and_gemm_shapes() {
        for (m, k, n) in [
            (1, 3, 5),
            (1, 256, 1000),
            (3, 17, 9),
            (37, 128, 300),
            (64, 256, 257),
        ] {
            let (x, w) = (data(m * k, 1), data(n * k, 2));
            let mut out = vec![0.0; m * n];
            matmul_t(&mut out, &x, &w, m, k, n, false);
            let want = naive(&x, &w, m, k, n);
            for (a, b) in out.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                    "{m}x{k}x{n}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn accumulate_adds_to_existing_output() {
        let (m, k, n) = (2, 300, 400);
        let (x, w) = (data(m * k, 3), data(n * k, 4));
        let mut out = vec![1.5; m * n];
        matmul_t(&mut out, &x, &w, m, k, n, true);
        let want = naive(&x, &w, m, k, n);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - (b + 1.5)).abs() <= 1e-4 * b.abs().max(1.0));
        }
    }
}
