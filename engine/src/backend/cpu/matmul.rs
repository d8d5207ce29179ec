//! Matrix products of activations by weights.
//!
//! One shape only: `out[m, n] (+)= x[m, k] · w[k, n]`, all row-major f32,
//! with weights stored input-major (`[in_features, out_features]`, the
//! transpose of Hugging Face's layout; [`transpose`] converts at load).
//!
//! Many rows go through the `gemm` crate with its rayon parallelism; this
//! layout is the one its packing favours. Up to [`SKINNY_MAX_ROWS`] rows
//! (decode steps) run [`skinny`] instead: gemm's matrix-vector path is
//! single-threaded and 2-3x slower here, and for a few rows the one pass over
//! the weights that `skinny` makes matches gemm. It is split over output
//! columns on the backend's team and compiled for AVX2+FMA when the CPU has
//! them.

use gemm::Parallelism;

use super::team;

/// Multiply-adds below which a product stays on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 16;
/// Products with at most this many rows use [`skinny`] rather than gemm.
const SKINNY_MAX_ROWS: usize = 16;
/// Output columns per task of a split skinny product.
const SKINNY_MIN_COLUMNS: usize = 128;
/// Output columns kept hot while four weight rows stream by.
const SKINNY_TILE: usize = 256;

/// `out = x · w`, or `out += x · w` when `accumulate`.
///
/// `x` is `[m, k]`, `w` is `[k, n]`, `out` is `[m, n]`, all row-major.
pub(crate) fn matmul(
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    assert_eq!(x.len(), m * k, "x must be [m, k]");
    assert_eq!(w.len(), k * n, "w must be [k, n]");
    assert_eq!(out.len(), m * n, "out must be [m, n]");
    if m == 0 || n == 0 {
        return;
    }
    let big = m * n * k >= PARALLEL_MIN_WORK;
    if m <= SKINNY_MAX_ROWS {
        let threads = team::threads();
        let tasks = if big && threads > 1 { threads * 2 } else { 1 };
        let per_task = n.div_ceil(tasks).max(SKINNY_MIN_COLUMNS);
        let mut parts: Vec<Vec<&mut [f32]>> = Vec::with_capacity(n.div_ceil(per_task));
        for row in out.chunks_mut(n) {
            for (t, piece) in row.chunks_mut(per_task).enumerate() {
                if t == parts.len() {
                    parts.push(Vec::with_capacity(m));
                }
                parts[t].push(piece);
            }
        }
        if parts.len() == 1 {
            skinny(&mut parts[0], x, w, n, 0, accumulate);
        } else {
            team::for_each_mut(&mut parts, |t, rows| {
                skinny(rows, x, w, n, t * per_task, accumulate)
            });
        }
        return;
    }
    // SAFETY: every pointer comes from a slice holding the whole matrix it
    // describes (lengths asserted above): dst is [m, n] with row stride n,
    // lhs is [m, k] with row stride k, rhs is [k, n] with row stride n, all
    // with column stride 1. `out` is borrowed mutably, so it aliases neither
    // input.
    let mut product = move |parallelism| unsafe {
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
            1,
            n as isize,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        )
    };
    if big {
        // gemm splits over the backend's rayon pool.
        team::on_pool(move || {
            let threads = rayon::current_num_threads();
            product(if threads > 1 {
                Parallelism::Rayon(threads)
            } else {
                Parallelism::None
            })
        });
    } else {
        // Too small to split: here, without a hop to the pool.
        product(Parallelism::None);
    }
}

/// Columns `first..first + rows[i].len()` of each row `i` of `x · w`
/// (`x` is `[rows.len(), k]`), for a few rows.
fn skinny(rows: &mut [&mut [f32]], x: &[f32], w: &[f32], n: usize, first: usize, accumulate: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports the features `skinny_avx2` is compiled for.
            unsafe { skinny_avx2(rows, x, w, n, first, accumulate) };
            return;
        }
    }
    skinny_portable(rows, x, w, n, first, accumulate);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn skinny_avx2(
    rows: &mut [&mut [f32]],
    x: &[f32],
    w: &[f32],
    n: usize,
    first: usize,
    accumulate: bool,
) {
    skinny_portable(rows, x, w, n, first, accumulate);
}

/// Streams the weights once: for each tile of columns and each group of four
/// weight rows (kept in L1), every activation row accumulates into its tile
/// of the output, so outputs are loaded and stored once per four rows.
#[inline(always)]
fn skinny_portable(
    rows: &mut [&mut [f32]],
    x: &[f32],
    w: &[f32],
    n: usize,
    first: usize,
    accumulate: bool,
) {
    let m = rows.len();
    let k = x.len() / m;
    let cols = rows[0].len();
    if !accumulate {
        for row in rows.iter_mut() {
            row.fill(0.0);
        }
    }
    let quads = k / 4;
    for t0 in (0..cols).step_by(SKINNY_TILE) {
        let t1 = (t0 + SKINNY_TILE).min(cols);
        let w_row = |p: usize| &w[p * n + first + t0..p * n + first + t1];
        for q in 0..quads {
            let p = 4 * q;
            let (w0, w1, w2, w3) = (w_row(p), w_row(p + 1), w_row(p + 2), w_row(p + 3));
            for (i, row) in rows.iter_mut().enumerate() {
                let xi = &x[i * k + p..i * k + p + 4];
                let (x0, x1, x2, x3) = (xi[0], xi[1], xi[2], xi[3]);
                let ws = w0.iter().zip(w1).zip(w2).zip(w3);
                for (o, (((a, b), c), d)) in row[t0..t1].iter_mut().zip(ws) {
                    *o += x0 * a + x1 * b + x2 * c + x3 * d;
                }
            }
        }
        for p in 4 * quads..k {
            let wp = w_row(p);
            for (i, row) in rows.iter_mut().enumerate() {
                let xp = x[i * k + p];
                for (o, a) in row[t0..t1].iter_mut().zip(wp) {
                    *o += xp * a;
                }
            }
        }
    }
}

/// Transposes row-major `[rows, cols]` `src` into columns
/// `col_offset..col_offset + rows` of row-major `dst` with `dst_cols` columns
/// (`dst` has `cols` rows). Used to turn HF `[out, in]` weights input-major
/// and to stack several projections side by side.
pub(crate) fn transpose(
    dst: &mut [f32],
    dst_cols: usize,
    col_offset: usize,
    src: &[f32],
    rows: usize,
    cols: usize,
) {
    debug_assert_eq!(src.len(), rows * cols);
    debug_assert!(dst.len() >= cols * dst_cols && col_offset + rows <= dst_cols);
    const TILE: usize = 32;
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    dst[c * dst_cols + col_offset + r] = src[r * cols + c];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum();
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
            (1, 257, 1000),
            (1, 64, 64),
            (3, 17, 9),
            (37, 128, 300),
            (64, 256, 257),
        ] {
            let (x, w) = (data(m * k, 1), data(k * n, 2));
            let mut out = vec![0.0; m * n];
            matmul(&mut out, &x, &w, m, k, n, false);
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
        for m in [1, 2, 40] {
            let (k, n) = (300, 400);
            let (x, w) = (data(m * k, 3), data(k * n, 4));
            let mut out = vec![1.5; m * n];
            matmul(&mut out, &x, &w, m, k, n, true);
            let want = naive(&x, &w, m, k, n);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - (b + 1.5)).abs() <= 1e-4 * b.abs().max(1.0));
            }
        }
    }

    #[test]
    fn portable_skinny_kernel_matches_naive() {
        // The AVX2 build runs on this CPU through `matmul`; check the
        // portable one that other CPUs run, on the same shapes.
        let (m, k, n) = (3, 37, 300);
        let (x, w) = (data(m * k, 5), data(k * n, 6));
        let mut out = vec![0.0; m * n];
        let mut rows: Vec<&mut [f32]> = out.chunks_mut(n).collect();
        skinny_portable(&mut rows, &x, &w, n, 0, false);
        let want = naive(&x, &w, m, k, n);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-4 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    #[test]
    fn transpose_places_blocks_side_by_side() {
        // Two [2, 3] matrices side by side become one [3, 4] matrix.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
        let mut dst = vec![0.0; 12];
        transpose(&mut dst, 4, 0, &a, 2, 3);
        transpose(&mut dst, 4, 2, &b, 2, 3);
        assert_eq!(
            dst,
            [
                1.0, 4.0, 7.0, 10.0, 2.0, 5.0, 8.0, 11.0, 3.0, 6.0, 9.0, 12.0
            ]
        );
    }
}
