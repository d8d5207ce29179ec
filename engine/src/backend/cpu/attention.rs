//! Paged causal attention with grouped-query heads, on the CPU.
//!
//! Each new token attends to positions `0..=pos` of its own sequence, read
//! from the KV slabs through the sequence's block table (K/V of the step's
//! own tokens were written beforehand). Work is split over (token, kv head)
//! with rayon; a task computes every query head sharing that kv head, block
//! by block, with an online softmax, so K/V rows are read once per group and
//! nothing is allocated.

use rayon::prelude::*;

use super::kernels::{dot, scale_add};

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
/// layer's `[num_blocks, block_size, num_kv_heads, head_dim]` slabs.
pub(crate) fn paged_attention(
    out: &mut [f32],
    qkv: &[f32],
    k_slab: &[f32],
    v_slab: &[f32],
    tokens: &[TokenPos],
    tables: &[&[u32]],
    shape: AttnShape,
) {
    let AttnShape {
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        qkv_dim,
    } = shape;
    let group = num_heads / num_kv_heads;
    debug_assert!(group <= MAX_GROUP);
    debug_assert_eq!(out.len(), tokens.len() * num_heads * head_dim);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let token_stride = num_kv_heads * head_dim;
    out.par_chunks_mut(group * head_dim)
        .enumerate()
        .for_each(|(task, out)| {
            let (t, g) = (task / num_kv_heads, task % num_kv_heads);
            let TokenPos { seq, pos } = tokens[t];
            let table = tables[seq];
            let q_start = t * qkv_dim + g * group * head_dim;
            let q = &qkv[q_start..q_start + group * head_dim];
            let mut max = [f32::NEG_INFINITY; MAX_GROUP];
            let mut sum = [0f32; MAX_GROUP];
            let mut scores = [0f32; SCORE_CHUNK];
            out.fill(0.0);
            let context = pos + 1;
            for (b, &block) in table.iter().enumerate().take(context.div_ceil(block_size)) {
                let in_block = block_size.min(context - b * block_size);
                let block_start = block as usize * block_size * token_stride + g * head_dim;
                let mut first = 0;
                while first < in_block {
                    let count = SCORE_CHUNK.min(in_block - first);
                    let row = |j: usize| block_start + (first + j) * token_stride;
                    for h in 0..group {
                        let qh = &q[h * head_dim..(h + 1) * head_dim];
                        let mut new_max = max[h];
                        for (j, s) in scores[..count].iter_mut().enumerate() {
                            let r = row(j);
                            *s = dot(qh, &k_slab[r..r + head_dim]) * scale;
                            new_max = new_max.max(*s);
                        }
                        let correction = (max[h] - new_max).exp();
                        max[h] = new_max;
                        sum[h] *= correction;
                        let oh = &mut out[h * head_dim..(h + 1) * head_dim];
                        let mut rescale = correction;
                        for (j, s) in scores[..count].iter().enumerate() {
                            let w = (s - new_max).exp();
                            sum[h] += w;
                            let r = row(j);
                            scale_add(oh, rescale, w, &v_slab[r..r + head_dim]);
                            rescale = 1.0;
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
        });
}
