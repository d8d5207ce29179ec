//! The compute contract between the scheduler and a backend.
//!
//! The scheduler decides *what* runs in a step (which sequences, which new
//! tokens, which physical KV blocks); a backend computes it. A backend owns
//! the KV memory (one slab per layer, indexed by physical block id) but never
//! allocates or frees block ids: the block pool does. This is the one seam
//! every backend (cpu, mocker, cuda) implements.

pub mod arena;
pub mod cpu;
pub mod cuda;
pub mod mocker;

use std::sync::Arc;

pub use arena::{ArenaGeometry, KvArena, KvBacking};

use crate::error::EngineError;

/// One sequence's share of a forward step.
#[derive(Debug, Clone)]
pub struct SeqChunk {
    /// Token ids to compute this step: a prefill chunk, or one decode token.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]` in the sequence (= tokens already in the KV cache).
    pub start_pos: usize,
    /// Physical block ids holding positions `0..start_pos + tokens.len()`,
    /// in order; block `i` holds positions `i*block_size..(i+1)*block_size`.
    pub block_table: Vec<u32>,
    /// Whether the step must return logits for this sequence's last token
    /// (false for a prefill chunk that is not the prompt's last).
    pub needs_logits: bool,
}

/// Everything a backend needs for one step.
#[derive(Debug, Clone, Default)]
pub struct ForwardBatch {
    pub seqs: Vec<SeqChunk>,
    /// Tokens held in KV by all running sequences (for timing models).
    pub active_kv_tokens: usize,
    /// Tokens the whole KV pool can hold (for timing models).
    pub total_kv_tokens: usize,
    /// Blocks moved back from the second tier into KV memory for this step
    /// (for timing models: the copies a real backend has already made).
    pub restored_blocks: usize,
}

/// What a step produced, one row per sequence with `needs_logits`, in batch order.
#[derive(Debug, Clone)]
pub enum ForwardOutput {
    /// Row-major `[rows, vocab_size]` logits, sampled by the engine's sampler.
    Logits { vocab_size: usize, data: Vec<f32> },
    /// Token ids chosen by the backend itself (the mocker's deterministic tokens).
    Tokens(Vec<u32>),
}

/// Memory layout of one KV block, as it travels in a KV transfer descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBlockLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Bytes per element (4 for f32).
    pub elem_bytes: usize,
}

impl KvBlockLayout {
    /// Bytes of one block across all layers, K and V.
    pub fn block_bytes(&self) -> usize {
        2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.elem_bytes
    }
}

/// Checks a batch against a model's vocabulary and a KV pool of
/// `num_blocks` blocks of `block_size` tokens before any backend computes it:
/// every sequence has tokens, every token is in the vocabulary, every block
/// table covers its positions with blocks of the pool.
pub(crate) fn validate_batch(
    batch: &ForwardBatch,
    vocab_size: usize,
    block_size: usize,
    num_blocks: usize,
) -> Result<(), EngineError> {
    batch
        .seqs
        .iter()
        .enumerate()
        .try_for_each(|(i, seq)| validate_seq(i, seq, vocab_size, block_size, num_blocks))
}

/// [`validate_batch`] for the `i`-th sequence of a batch alone.
pub(crate) fn validate_seq(
    i: usize,
    seq: &SeqChunk,
    vocab_size: usize,
    block_size: usize,
    num_blocks: usize,
) -> Result<(), EngineError> {
    if seq.tokens.is_empty() {
        return Err(EngineError::InvalidRequest(format!(
            "sequence {i} of the batch has no tokens"
        )));
    }
    if let Some(t) = seq.tokens.iter().find(|t| **t as usize >= vocab_size) {
        return Err(EngineError::InvalidRequest(format!(
            "token id {t} is outside the vocabulary ({vocab_size})"
        )));
    }
    let end = seq.start_pos + seq.tokens.len();
    let needed = end.div_ceil(block_size);
    if seq.block_table.len() < needed {
        return Err(EngineError::InvalidRequest(format!(
            "sequence {i} covers {end} positions but its block table holds {} blocks of {block_size}",
            seq.block_table.len()
        )));
    }
    if let Some(&id) = seq.block_table[..needed]
        .iter()
        .find(|id| **id as usize >= num_blocks)
    {
        return Err(EngineError::BlockOutOfRange { id, num_blocks });
    }
    Ok(())
}

/// A backend that runs a hook before each step (which may fail the step)
/// and is otherwise the backend it wraps: fault injection, step timing,
/// poisoned prompts in tests and benches.
pub struct BeforeStep<B, F> {
    /// The backend doing the work.
    pub inner: B,
    /// Called with the wrapped backend and the batch before each step.
    pub hook: F,
}

impl<B, F> Backend for BeforeStep<B, F>
where
    B: Backend,
    F: FnMut(&B, &ForwardBatch) -> Result<(), EngineError> + Send,
{
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput, EngineError> {
        (self.hook)(&self.inner, batch)?;
        self.inner.forward(batch)
    }
    fn kv_layout(&self) -> KvBlockLayout {
        self.inner.kv_layout()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError> {
        self.inner.read_block(id, out)
    }
    fn write_block(&mut self, id: u32, data: &[u8]) -> Result<(), EngineError> {
        self.inner.write_block(id, data)
    }
    fn kv_arena(&self) -> Option<Arc<KvArena>> {
        self.inner.kv_arena()
    }
    fn set_kv_backing(&mut self, backing: &KvBacking) -> Result<(), EngineError> {
        self.inner.set_kv_backing(backing)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn thread_pool(&self) -> Option<Arc<rayon::ThreadPool>> {
        self.inner.thread_pool()
    }
    fn kv_transfer_model(&self) -> Option<KvTransferModel> {
        self.inner.kv_transfer_model()
    }
}

impl Backend for Box<dyn Backend> {
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput, EngineError> {
        (**self).forward(batch)
    }
    fn kv_layout(&self) -> KvBlockLayout {
        (**self).kv_layout()
    }
    fn num_blocks(&self) -> usize {
        (**self).num_blocks()
    }
    fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError> {
        (**self).read_block(id, out)
    }
    fn write_block(&mut self, id: u32, data: &[u8]) -> Result<(), EngineError> {
        (**self).write_block(id, data)
    }
    fn kv_arena(&self) -> Option<Arc<KvArena>> {
        (**self).kv_arena()
    }
    fn set_kv_backing(&mut self, backing: &KvBacking) -> Result<(), EngineError> {
        (**self).set_kv_backing(backing)
    }
    fn vocab_size(&self) -> usize {
        (**self).vocab_size()
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn thread_pool(&self) -> Option<Arc<rayon::ThreadPool>> {
        (**self).thread_pool()
    }
    fn kv_transfer_model(&self) -> Option<KvTransferModel> {
        (**self).kv_transfer_model()
    }
}

/// A compute backend.
pub trait Backend: Send {
    /// Runs one step and writes the new tokens' K/V into their blocks.
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput, EngineError>;
    /// Layout of one KV block.
    fn kv_layout(&self) -> KvBlockLayout;
    /// Number of physical KV blocks this backend holds memory for.
    fn num_blocks(&self) -> usize;
    /// Copies block `id`'s bytes (layout of [`KvBlockLayout`]) into `out`,
    /// which is exactly `block_bytes()` long.
    fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError>;
    /// Overwrites block `id` with `data` (exactly `block_bytes()` long).
    fn write_block(&mut self, id: u32, data: &[u8]) -> Result<(), EngineError>;
    /// The backend's KV memory when transports may write into it directly
    /// (host memory laid out as [`KvArena`]); `None`: blocks go through
    /// [`Backend::write_block`] on the engine thread.
    fn kv_arena(&self) -> Option<Arc<KvArena>> {
        None
    }
    /// Moves the (still empty) KV memory to `backing`, e.g. shared memory a
    /// same-host prefill worker writes into; on error nothing changed.
    fn set_kv_backing(&mut self, backing: &KvBacking) -> Result<(), EngineError> {
        let _ = backing;
        Err(EngineError::InvalidConfig(format!(
            "the {} backend keeps its own KV memory",
            self.name()
        )))
    }
    /// Vocabulary size of the model.
    fn vocab_size(&self) -> usize;
    /// Short name for logs and metrics ("cpu", "mocker", "cuda").
    fn name(&self) -> &'static str;
    /// The thread pool this backend computes on, if it has its own: work
    /// that overlaps its steps (grammar masks) runs there, on threads warm
    /// from the step, instead of waking rayon's global pool. `None`: the
    /// global pool.
    fn thread_pool(&self) -> Option<Arc<rayon::ThreadPool>> {
        None
    }
    /// What moving KV blocks between workers costs in the model a timing
    /// backend (the mocker) runs instead of compute; `None`: the bytes
    /// really move, at whatever speed the transport has.
    fn kv_transfer_model(&self) -> Option<KvTransferModel> {
        None
    }
}

/// A modelled KV transfer: the bytes a block of the modelled model holds and
/// the modelled link's speed (both after the timing model's speed-up).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvTransferModel {
    /// Bytes of one block of the modelled model.
    pub block_bytes: u64,
    /// Bytes per second the modelled link moves.
    pub bytes_per_sec: f64,
    /// Bytes per second a block restored from the second tier moves at.
    pub tier_bytes_per_sec: f64,
}

/// This host's memory copy bandwidth in bytes copied per second: the best
/// of `reps` copies of a `bytes` buffer (each byte is read once and written
/// once).
pub fn copy_bandwidth(bytes: usize, reps: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut best = f64::MAX;
    for _ in 0..reps.max(1) {
        let t = std::time::Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best.max(1e-9)
}

impl KvTransferModel {
    /// How long moving `blocks` blocks takes.
    pub fn duration(&self, blocks: usize) -> std::time::Duration {
        std::time::Duration::from_secs_f64(
            blocks as f64 * self.block_bytes as f64 / self.bytes_per_sec.max(1.0),
        )
    }
}
