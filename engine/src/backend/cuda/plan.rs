//! One step's host-side plan for the cuda backend: what gets uploaded
//! (token ids, positions, KV slots, packed block tables, the rows that need
//! logits, RoPE tables) and the launch geometry of every kernel.
//!
//! Pure host code, compiled and tested without the `cuda` feature. It owns
//! the packing the kernels read (offsets into one `u32` buffer and one `f32`
//! buffer, so a step is two host-to-device copies); it never touches device
//! memory and never decides block ids (the block pool does).

use std::ops::Range;

use crate::backend::ForwardBatch;
use crate::backend::cpu::kernels::Rope;

/// Threads of an attention block (`ATTN_THREADS` in `kernels.cu`).
pub const ATTN_THREADS: u32 = 128;
/// Threads of the grid-stride element-wise kernels.
pub const ELEMENTWISE_THREADS: u32 = 256;
/// The largest `group · head_dim` the attention kernel holds (its shared
/// query tile and per-thread accumulators are sized from it).
pub const MAX_GROUP_HEAD_DIM: usize = 2048;
/// Static shared memory a block may use on every supported GPU.
pub const MAX_STATIC_SHARED: usize = 48 * 1024;

/// One kernel launch's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: u32,
}

/// Threads for a row-wise kernel over `width` elements (RMSNorm, embedding
/// gather, RoPE): a warp multiple, about four elements per thread, 32..=1024.
pub fn row_threads(width: usize) -> u32 {
    let want = width.div_ceil(4).div_ceil(32) * 32;
    want.clamp(32, 1024) as u32
}

/// One block per row.
pub fn per_row(rows: usize, width: usize) -> Launch {
    Launch {
        grid: (rows as u32, 1, 1),
        block: row_threads(width),
    }
}

/// A grid-stride kernel over `total` elements, at most `max_blocks` blocks
/// (a few waves of the device's SMs; more only adds scheduling).
pub fn grid_stride(total: usize, max_blocks: u32) -> Launch {
    let blocks = total
        .div_ceil(ELEMENTWISE_THREADS as usize)
        .clamp(1, max_blocks.max(1) as usize);
    Launch {
        grid: (blocks as u32, 1, 1),
        block: ELEMENTWISE_THREADS,
    }
}

/// Attention: one block per (token, kv head, split of the context).
pub fn attention(tokens: usize, num_kv_heads: usize, split: AttentionSplit) -> Launch {
    Launch {
        grid: (tokens as u32, num_kv_heads as u32, split.splits),
        block: ATTN_THREADS,
    }
}

/// Combining a split attention's partial results: one block per (token,
/// kv head).
pub fn attention_combine(tokens: usize, num_kv_heads: usize) -> Launch {
    Launch {
        grid: (tokens as u32, num_kv_heads as u32, 1),
        block: ATTN_THREADS,
    }
}

/// Most splits one (token, kv head)'s context is cut into.
pub const MAX_SPLITS: usize = 32;

/// How a step's attention is cut along the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionSplit {
    /// Blocks per (token, kv head); 1: no partial results to combine.
    pub splits: u32,
    /// Positions per split (a multiple of the attention tile).
    pub part_len: u32,
}

/// Splits for a step of `tokens` tokens whose longest context is
/// `max_context`, on a device with `sms` SMs: a few tokens with long
/// contexts (batch-1 decoding) would otherwise occupy one SM per kv head
/// and walk their whole context alone, so the context is cut until the
/// grid covers about two waves of SMs, never below one tile per split.
pub fn attention_split(
    tokens: usize,
    num_kv_heads: usize,
    max_context: usize,
    sms: u32,
) -> AttentionSplit {
    let tile = ATTN_THREADS as usize;
    let tiles = max_context.div_ceil(tile).max(1);
    let blocks = (tokens * num_kv_heads).max(1);
    let wanted = (2 * sms.max(1) as usize).div_ceil(blocks);
    let splits = wanted.clamp(1, tiles.min(MAX_SPLITS));
    let part_tiles = tiles.div_ceil(splits);
    AttentionSplit {
        splits: tiles.div_ceil(part_tiles) as u32,
        part_len: (part_tiles * tile) as u32,
    }
}

/// Warps of an attention block.
const ATTN_WARPS: usize = ATTN_THREADS as usize / 32;

/// Static shared memory of the attention kernel for this geometry: one
/// buffer holding the group's queries and a tile of weights per head while
/// scoring, then the warps' partial outputs; the tile's slots; three floats
/// of softmax state per head.
pub fn attention_shared_bytes(head_dim: usize, group: usize) -> usize {
    let scoring = group * head_dim + group * ATTN_THREADS as usize;
    let reducing = ATTN_WARPS * group * head_dim;
    4 * (scoring.max(reducing) + ATTN_THREADS as usize + 3 * group)
}

/// Why the attention kernel cannot run a model's heads, if it cannot.
pub fn attention_unsupported(head_dim: usize, group: usize) -> Option<String> {
    // V rows are read 8 values per thread by head_dim / 8 threads, which
    // must tile a warp.
    let per_row = head_dim / 8;
    if !head_dim.is_multiple_of(8) || !per_row.is_power_of_two() || per_row > 32 {
        return Some(format!(
            "head_dim {head_dim} is not one the attention kernel runs (8, 16, 32, 64, 128 or 256)"
        ));
    }
    if group == 0 || group * head_dim > MAX_GROUP_HEAD_DIM {
        return Some(format!(
            "{group} query heads per kv head of dimension {head_dim} exceed the attention kernel's {MAX_GROUP_HEAD_DIM} (heads · head_dim)"
        ));
    }
    let shared = attention_shared_bytes(head_dim, group);
    if shared > MAX_STATIC_SHARED {
        return Some(format!(
            "the attention kernel would need {shared} bytes of shared memory (at most {MAX_STATIC_SHARED})"
        ));
    }
    None
}

/// Block-table width of a captured decode step for sequences needing
/// `blocks` blocks: a power of two (at least 4), so a graph captured for a
/// batch size serves while its sequences grow to twice the blocks.
pub fn graph_width(blocks: usize) -> usize {
    blocks.next_power_of_two().max(4)
}

/// Positions a per-position RoPE table holds at most (the model's
/// `max_position_embeddings` otherwise): 2^18 positions of head_dim 128 are
/// 128 MiB of f32.
pub const MAX_ROPE_CACHE_POSITIONS: usize = 1 << 18;

/// Whether a per-position RoPE table of `len` positions serves `batch`:
/// every chunk ends within it. The table holds what [`Rope`] computes for
/// positions `0..len`; below `max_position_embeddings` that is every
/// chunk's own table (dynamic NTK changes the base only past it).
pub fn rope_cache_covers(batch: &ForwardBatch, len: usize) -> bool {
    batch
        .seqs
        .iter()
        .all(|s| s.start_pos + s.tokens.len() <= len)
}

/// Whether a step is plain decoding (one token per sequence, every one
/// needing logits): the steps the cuda backend captures as CUDA graphs.
pub fn is_decode_step(batch: &ForwardBatch) -> bool {
    !batch.seqs.is_empty()
        && batch
            .seqs
            .iter()
            .all(|s| s.tokens.len() == 1 && s.needs_logits)
}

/// Where each array lies in [`StepPlan::meta`] (element ranges).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaLayout {
    pub tokens: Range<usize>,
    /// Index of each token's sequence in the batch (its block-table row).
    pub token_seq: Range<usize>,
    /// Absolute position of each token.
    pub token_pos: Range<usize>,
    /// KV slot of each token: `block · block_size + pos % block_size`.
    pub slots: Range<usize>,
    /// Token index whose logits each output row holds.
    pub logit_rows: Range<usize>,
    /// `[num_seqs, max_blocks]` block tables, rows padded with zeros.
    pub block_tables: Range<usize>,
}

/// Everything one step uploads, packed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub num_tokens: usize,
    pub num_seqs: usize,
    /// Width of a block-table row: the most blocks any sequence needs.
    pub max_blocks: usize,
    /// Rows of logits the step returns.
    pub num_logit_rows: usize,
    /// `u32` arrays, see [`StepPlan::layout`].
    pub meta: Vec<u32>,
    /// `[cos | sin]`, each `[num_tokens, head_dim / 2]`.
    pub rope: Vec<f32>,
    half: usize,
}

impl StepPlan {
    /// Plans `batch` (already validated: tables cover every position) for
    /// KV blocks of `block_size` tokens and heads of `head_dim`. RoPE
    /// tables come from `rope` per sequence chunk, exactly as the CPU
    /// backend computes them (every scaling, dynamic NTK included).
    #[cfg(test)]
    pub(crate) fn build(
        batch: &ForwardBatch,
        block_size: usize,
        head_dim: usize,
        rope: &Rope,
    ) -> Self {
        let mut plan = Self::default();
        plan.fill(batch, block_size, head_dim, Some(rope), 0);
        plan
    }

    /// [`StepPlan::build`] into this plan's buffers (kept across steps),
    /// block-table rows at least `min_width` wide (a captured decode step's
    /// fixed stride, see [`graph_width`]); no RoPE tables when `rope` is
    /// `None` (the kernels read a per-position table, [`rope_cache_covers`]).
    #[cfg_attr(
        not(any(feature = "cuda", test)),
        expect(
            dead_code,
            reason = "the cuda backend (feature `cuda`) plans its steps with it"
        )
    )]
    pub(crate) fn fill(
        &mut self,
        batch: &ForwardBatch,
        block_size: usize,
        head_dim: usize,
        rope: Option<&Rope>,
        min_width: usize,
    ) {
        let half = head_dim / 2;
        let n: usize = batch.seqs.iter().map(|s| s.tokens.len()).sum();
        let num_seqs = batch.seqs.len();
        let max_blocks = batch
            .seqs
            .iter()
            .map(|s| (s.start_pos + s.tokens.len()).div_ceil(block_size))
            .max()
            .unwrap_or(0)
            .max(min_width);
        let logit_rows = batch.seqs.iter().filter(|s| s.needs_logits).count();
        self.num_tokens = n;
        self.num_seqs = num_seqs;
        self.max_blocks = max_blocks;
        self.num_logit_rows = logit_rows;
        self.half = half;
        let layout = self.layout();
        self.meta.clear();
        self.meta.resize(layout.block_tables.end, 0);
        let tables = if rope.is_some() { n * half } else { 0 };
        self.rope.clear();
        self.rope.resize(2 * tables, 0.0);
        let (cos, sin) = self.rope.split_at_mut(tables);
        let mut t = 0;
        let mut row = 0;
        for (i, seq) in batch.seqs.iter().enumerate() {
            let len = seq.tokens.len();
            let table = &seq.block_table[..(seq.start_pos + len).div_ceil(block_size)];
            let dst = layout.block_tables.start + i * max_blocks;
            self.meta[dst..dst + table.len()].copy_from_slice(table);
            for (j, &tok) in seq.tokens.iter().enumerate() {
                let pos = seq.start_pos + j;
                self.meta[layout.tokens.start + t + j] = tok;
                self.meta[layout.token_seq.start + t + j] = i as u32;
                self.meta[layout.token_pos.start + t + j] = pos as u32;
                self.meta[layout.slots.start + t + j] =
                    table[pos / block_size] * block_size as u32 + (pos % block_size) as u32;
            }
            if let Some(rope) = rope {
                rope.fill(
                    seq.start_pos..seq.start_pos + len,
                    &mut cos[t * half..(t + len) * half],
                    &mut sin[t * half..(t + len) * half],
                );
            }
            t += len;
            if seq.needs_logits {
                self.meta[layout.logit_rows.start + row] = (t - 1) as u32;
                row += 1;
            }
        }
    }

    /// Where each array lies in [`StepPlan::meta`].
    pub fn layout(&self) -> MetaLayout {
        let n = self.num_tokens;
        let tokens = 0..n;
        let token_seq = n..2 * n;
        let token_pos = 2 * n..3 * n;
        let slots = 3 * n..4 * n;
        let logit_rows = 4 * n..4 * n + self.num_logit_rows;
        let block_tables = logit_rows.end..logit_rows.end + self.num_seqs * self.max_blocks;
        MetaLayout {
            tokens,
            token_seq,
            token_pos,
            slots,
            logit_rows,
            block_tables,
        }
    }

    /// The cos table's range in [`StepPlan::rope`] (empty without tables).
    pub fn cos(&self) -> Range<usize> {
        0..self.rope.len() / 2
    }

    /// The sin table's range in [`StepPlan::rope`] (empty without tables).
    pub fn sin(&self) -> Range<usize> {
        self.rope.len() / 2..self.rope.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqChunk;
    use crate::model::test_support::tiny_config;

    fn batch() -> ForwardBatch {
        ForwardBatch {
            seqs: vec![
                // A prefill chunk crossing a block boundary, no logits.
                SeqChunk {
                    tokens: vec![5, 6, 7],
                    start_pos: 2,
                    block_table: vec![9, 4],
                    needs_logits: false,
                },
                // A decode token in its third block.
                SeqChunk {
                    tokens: vec![11],
                    start_pos: 8,
                    block_table: vec![1, 2, 7, 8],
                    needs_logits: true,
                },
                // A whole prompt, last chunk.
                SeqChunk {
                    tokens: vec![3, 4],
                    start_pos: 0,
                    block_table: vec![6],
                    needs_logits: true,
                },
            ],
            ..ForwardBatch::default()
        }
    }

    #[test]
    fn tokens_positions_and_slots_follow_the_block_tables() {
        let config = tiny_config(true);
        let plan = StepPlan::build(&batch(), 4, config.head_dim, &Rope::new(&config));
        let l = plan.layout();
        assert_eq!(plan.num_tokens, 6);
        assert_eq!(&plan.meta[l.tokens], &[5, 6, 7, 11, 3, 4]);
        assert_eq!(&plan.meta[l.token_seq], &[0, 0, 0, 1, 2, 2]);
        assert_eq!(&plan.meta[l.token_pos], &[2, 3, 4, 8, 0, 1]);
        // Positions 2, 3 in block 9, position 4 in block 4; position 8 is
        // slot 0 of the sequence's third block (7).
        assert_eq!(
            &plan.meta[l.slots],
            &[9 * 4 + 2, 9 * 4 + 3, 4 * 4, 7 * 4, 6 * 4, 6 * 4 + 1]
        );
        // Logits for the decode token (index 3) and the prompt's last (5).
        assert_eq!(&plan.meta[l.logit_rows], &[3, 5]);
    }

    #[test]
    fn block_tables_are_packed_to_the_widest_needed_and_padded() {
        let config = tiny_config(true);
        let plan = StepPlan::build(&batch(), 4, config.head_dim, &Rope::new(&config));
        // Sequence 1 covers 9 positions: 3 blocks of 4 (its fourth is not
        // needed yet and is left out).
        assert_eq!(plan.max_blocks, 3);
        let l = plan.layout();
        assert_eq!(
            &plan.meta[l.block_tables.clone()],
            &[9, 4, 0, 1, 2, 7, 6, 0, 0]
        );
        assert_eq!(l.block_tables.end, plan.meta.len());
    }

    #[test]
    fn rope_tables_match_the_cpu_backend_per_token() {
        let config = tiny_config(true);
        let rope = Rope::new(&config);
        let plan = StepPlan::build(&batch(), 4, config.head_dim, &rope);
        let half = config.head_dim / 2;
        let (cos, sin) = (&plan.rope[plan.cos()], &plan.rope[plan.sin()]);
        assert_eq!(cos.len(), 6 * half);
        // Token 3 is position 8 of its sequence.
        let (mut c, mut s) = (vec![0.0; half], vec![0.0; half]);
        rope.fill(8..9, &mut c, &mut s);
        assert_eq!(&cos[3 * half..4 * half], c.as_slice());
        assert_eq!(&sin[3 * half..4 * half], s.as_slice());
        // Position 0 does not rotate.
        assert!(cos[4 * half..5 * half].iter().all(|&x| x == 1.0));
        assert!(sin[4 * half..5 * half].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn without_tables_the_plan_carries_no_rope_and_the_cache_covers_short_chunks() {
        let config = tiny_config(true);
        let mut plan = StepPlan::default();
        plan.fill(&batch(), 4, config.head_dim, None, 0);
        assert!(plan.rope.is_empty() && plan.cos().is_empty() && plan.sin().is_empty());
        assert_eq!(plan.num_tokens, 6, "metadata as with tables");
        // The longest chunk ends at position 9 (8 + 1 token).
        assert!(rope_cache_covers(&batch(), 9));
        assert!(!rope_cache_covers(&batch(), 8));
        // A per-position table equals the per-chunk ones (the kernels index
        // it by position).
        let rope = Rope::new(&config);
        let half = config.head_dim / 2;
        let (mut c, mut s) = (vec![0.0; 10 * half], vec![0.0; 10 * half]);
        rope.fill(0..10, &mut c, &mut s);
        let with = StepPlan::build(&batch(), 4, config.head_dim, &rope);
        let pos = with.layout().token_pos;
        for (t, &p) in with.meta[pos].iter().enumerate() {
            let p = p as usize;
            assert_eq!(
                &with.rope[t * half..(t + 1) * half],
                &c[p * half..(p + 1) * half]
            );
        }
    }

    #[test]
    fn an_empty_batch_plans_nothing() {
        let config = tiny_config(true);
        let plan = StepPlan::build(
            &ForwardBatch::default(),
            4,
            config.head_dim,
            &Rope::new(&config),
        );
        assert_eq!((plan.num_tokens, plan.max_blocks), (0, 0));
        assert!(plan.meta.is_empty() && plan.rope.is_empty());
    }

    #[test]
    fn a_wider_table_stride_pads_every_row() {
        let config = tiny_config(true);
        let mut plan = StepPlan::default();
        plan.fill(
            &batch(),
            4,
            config.head_dim,
            Some(&Rope::new(&config)),
            graph_width(3),
        );
        assert_eq!(plan.max_blocks, 4);
        let l = plan.layout();
        assert_eq!(
            &plan.meta[l.block_tables],
            &[9, 4, 0, 0, 1, 2, 7, 0, 6, 0, 0, 0]
        );
        assert_eq!(graph_width(1), 4);
        assert_eq!(graph_width(5), 8);
        assert_eq!(graph_width(16), 16);
    }

    #[test]
    fn only_single_token_steps_with_logits_are_decode_steps() {
        assert!(!is_decode_step(&batch()));
        let mut decode = batch();
        decode.seqs.remove(0);
        decode.seqs[1].tokens.truncate(1);
        assert!(is_decode_step(&decode));
        decode.seqs[0].needs_logits = false;
        assert!(!is_decode_step(&decode));
        assert!(!is_decode_step(&ForwardBatch::default()));
    }

    #[test]
    fn launch_geometry() {
        assert_eq!(row_threads(1), 32);
        assert_eq!(row_threads(256), 64);
        assert_eq!(row_threads(4096), 1024);
        assert_eq!(row_threads(100_000), 1024);
        assert_eq!(per_row(7, 768).grid, (7, 1, 1));
        assert_eq!(per_row(7, 768).block, 192);
        let g = grid_stride(1000, 264);
        assert_eq!((g.grid.0, g.block), (4, 256));
        assert_eq!(grid_stride(10_000_000, 264).grid.0, 264);
        assert_eq!(grid_stride(0, 264).grid.0, 1);
        let one = AttentionSplit {
            splits: 1,
            part_len: 128,
        };
        assert_eq!(attention(5, 8, one).grid, (5, 8, 1));
        assert_eq!(attention(5, 8, one).block, ATTN_THREADS);
        assert_eq!(attention_combine(5, 8).grid, (5, 8, 1));
    }

    #[test]
    fn long_contexts_of_few_tokens_are_split_and_busy_grids_are_not() {
        // Batch-1 decode, 4 kv heads, 132 SMs, 4096 positions: 32 tiles
        // cut into 32 splits of one tile (4 · 32 blocks ≈ a wave).
        let s = attention_split(1, 4, 4096, 132);
        assert_eq!((s.splits, s.part_len), (32, 128));
        // Short context: never more splits than tiles.
        assert_eq!(attention_split(1, 4, 200, 132).splits, 2);
        assert_eq!(attention_split(1, 8, 1, 132).splits, 1);
        // Enough blocks already (a prefill chunk, a big batch): one split.
        assert_eq!(attention_split(512, 8, 4096, 132).splits, 1);
        assert_eq!(attention_split(128, 4, 300, 132).splits, 1);
        // Every position is in a split, the last one non-empty.
        for (tokens, ctx) in [(1, 1000), (3, 777), (16, 5000), (1, 128 * 40)] {
            let s = attention_split(tokens, 4, ctx, 108);
            assert_eq!(s.part_len % ATTN_THREADS, 0);
            assert!(s.splits as usize <= MAX_SPLITS);
            assert!(
                (s.splits * s.part_len) as usize >= ctx,
                "{s:?} covers {ctx}"
            );
            assert!(
                (s.splits - 1) * s.part_len < ctx as u32,
                "{s:?}: no empty split at {ctx}"
            );
        }
        let g = attention(3, 4, attention_split(3, 4, 1000, 132));
        assert_eq!(g.grid, (3, 4, 8));
    }

    #[test]
    fn attention_limits_name_the_reason() {
        assert_eq!(attention_unsupported(128, 8), None);
        assert_eq!(attention_unsupported(32, 2), None);
        assert_eq!(attention_unsupported(256, 8), None);
        assert!(
            attention_unsupported(100, 1)
                .expect("not /8")
                .contains("head_dim 100")
        );
        assert!(
            attention_unsupported(96, 1).is_some(),
            "12 threads do not tile a warp"
        );
        assert_eq!(attention_unsupported(128, 16), None);
        assert!(
            attention_unsupported(128, 32)
                .expect("too wide")
                .contains("2048")
        );
        assert!(attention_shared_bytes(256, 8) <= MAX_STATIC_SHARED);
        // What ptxas reports for the kernel (static shared memory).
        assert_eq!(attention_shared_bytes(32, 2), 1816);
        assert_eq!(attention_shared_bytes(128, 8), 16992);
        assert_eq!(attention_shared_bytes(128, 16), 33472);
    }
}
