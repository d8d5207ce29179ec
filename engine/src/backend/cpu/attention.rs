//! Paged causal attention with grouped-query heads, on the CPU.
//!
//! Each new token attends to positions `0..=pos` of its own sequence (the
//! last `window` of them on a sliding layer), read
//! from the KV slabs through the sequence's block table (K/V of the step's
//! own tokens were written beforehand). Work is split over (token, kv head)
//! on the backend's team; a task computes every query head sharing that kv head, block
//! by block, with an online softmax, so K/V rows are read once per group and
//! nothing is allocated.

use super::team;

use super::kernels::{axpy, dot_rows, fast_exp};
use super::paged_kv::Slab;

/// Query heads per kv head handled by one task without allocating.
pub(crate) const MAX_GROUP: usize = 64;
/// Scores computed per pass over a block.
const SCORE_CHUNK: usize = 64;

/// Geometry of the attention step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnShape {
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) block_size: usize,
    /// Row width of the fused q/k/v activations.
    pub(crate) qkv_dim: usize,
    /// A sliding layer's window: position `i` attends to `i - w < j <= i`.
    pub(crate) window: Option<usize>,
    /// Score scale (`head_dim^-1/2` unless the model says otherwise).
    pub(crate) scale: f32,
    /// `tanh(s / c) · c` on scores after scaling (Gemma 2).
    pub(crate) softcap: Option<f32>,
}

/// Where one new token sits: its sequence (index into `tables`) and position.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TokenPos {
    pub(crate) seq: usize,
    pub(crate) pos: usize,
}

/// Writes `[tokens, num_heads * head_dim]` attention outputs into `out`.
///
/// `qkv` rows start with the (rotated) queries; `k_slab`/`v_slab` are one
/// layer's `[num_blocks, block_size, num_kv_heads, head_dim]` slabs, read a
/// block at a time.
pub(crate) fn paged_attention(
    out: &mut [f32],
    qkv: &[f32],
    k_slab: Slab<'_>,
    v_slab: Slab<'_>,
    tokens: &[TokenPos],
    tables: &[&[u32]],
    shape: AttnShape,
) {
    let AttnShape {
        num_heads,
        num_kv_heads,
        head_dim,
        qkv_dim,
        ..
    } = shape;
    let group = num_heads / num_kv_heads;
    debug_assert!(group <= MAX_GROUP);
    debug_assert_eq!(out.len(), tokens.len() * num_heads * head_dim);
    let avx2 = has_avx2_fma();
    let mut chunks: Vec<&mut [f32]> = out.chunks_mut(group * head_dim).collect();
    team::for_each_mut(&mut chunks, |task, out| {
        let (t, g) = (task / num_kv_heads, task % num_kv_heads);
        let TokenPos { seq, pos } = tokens[t];
        let q_start = t * qkv_dim + g * group * head_dim;
        let q = &qkv[q_start..q_start + group * head_dim];
        let task = Task {
            out,
            q,
            k_slab,
            v_slab,
            table: tables[seq],
            start: shape.window.map_or(0, |w| (pos + 1).saturating_sub(w)),
            context: pos + 1,
            kv_head: g,
            shape,
        };
        dispatch(task, avx2);
    });
}

/// One (token, kv head) pair's share of the attention step.
struct Task<'a> {
    /// `[group, head_dim]` outputs of the query heads sharing `kv_head`.
    out: &'a mut [f32],
    /// `[group, head_dim]` rotated queries.
    q: &'a [f32],
    k_slab: Slab<'a>,
    v_slab: Slab<'a>,
    table: &'a [u32],
    /// Positions attended to: `start..context`.
    start: usize,
    context: usize,
    kv_head: usize,
    shape: AttnShape,
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs `task` with the AVX2+FMA build of [`attend`] when `avx2` says the
/// CPU has those features.
fn dispatch(task: Task<'_>, avx2: bool) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: `avx2` comes from `has_avx2_fma`, so the CPU supports the
        // features `attend_avx2` is compiled for.
        unsafe { attend_avx2(task) };
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = avx2;
    attend(task);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_avx2(task: Task<'_>) {
    attend(task);
}

/// Online-softmax attention of a group of query heads over one sequence's
/// paged K/V, a block (at most [`SCORE_CHUNK`] positions) at a time.
#[inline(always)]
fn attend(task: Task<'_>) {
    let Task {
        out,
        q,
        k_slab,
        v_slab,
        table,
        start,
        context,
        kv_head,
        shape,
    } = task;
    let AttnShape {
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        ..
    } = shape;
    let group = num_heads / num_kv_heads;
    let (scale, softcap) = (shape.scale, shape.softcap);
    let token_stride = num_kv_heads * head_dim;
    let mut max = [f32::NEG_INFINITY; MAX_GROUP];
    let mut sum = [0f32; MAX_GROUP];
    let mut scores = [0f32; SCORE_CHUNK];
    out.fill(0.0);
    let first_block = start / block_size;
    for (b, &block) in table
        .iter()
        .enumerate()
        .take(context.div_ceil(block_size))
        .skip(first_block)
    {
        let in_block = block_size.min(context - b * block_size);
        let (kb, vb) = (k_slab.block(block), v_slab.block(block));
        let block_start = kv_head * head_dim;
        let mut first = if b == first_block {
            start - b * block_size
        } else {
            0
        };
        while first < in_block {
            let count = SCORE_CHUNK.min(in_block - first);
            let rows = block_start + first * token_stride;
            for h in 0..group {
                let qh = &q[h * head_dim..(h + 1) * head_dim];
                let scores = &mut scores[..count];
                dot_rows(scores, qh, &kb[rows..], token_stride);
                let mut new_max = max[h];
                for s in scores.iter_mut() {
                    *s *= scale;
                    if let Some(c) = softcap {
                        *s = (*s / c).tanh() * c;
                    }
                    new_max = new_max.max(*s);
                }
                let oh = &mut out[h * head_dim..(h + 1) * head_dim];
                let correction = (max[h] - new_max).exp();
                if correction != 1.0 {
                    sum[h] *= correction;
                    for o in oh.iter_mut() {
                        *o *= correction;
                    }
                }
                max[h] = new_max;
                for s in scores.iter_mut() {
                    *s = fast_exp(*s - new_max);
                }
                for (j, &w) in scores.iter().enumerate() {
                    sum[h] += w;
                    let r = rows + j * token_stride;
                    axpy(oh, w, &vb[r..r + head_dim]);
                }
            }
            first += count;
        }
    }
    for h in 0..group {
        let inv = 1.0 / sum[h];
        for o in &mut out[h * head_dim..(h + 1) * head_dim] {
            *o *= inv;
        }
    }
}
