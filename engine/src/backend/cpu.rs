//! The CPU backend: a Llama/Qwen2 forward pass in f32 over paged KV memory.
//!
//! Owns the model's weights (rearranged for compute: input-major, q/k/v
//! fused into one matrix, gate/up into another), the per-layer KV slabs
//! (`[num_blocks, block_size, num_kv_heads, head_dim]` f32 for K and for V)
//! and reusable activation buffers. One [`Backend::forward`]
//! runs a flattened batch that mixes prefill chunks and decode tokens of
//! many sequences: every projection is one GEMM over all the step's tokens,
//! RoPE uses each token's absolute position, K/V go into the slots the block
//! tables name, and attention reads them back through the same tables.
//! It never allocates or frees block ids: the block pool does.

mod attention;
pub(crate) mod kernels;
mod linear;
mod matmul;
mod paged_kv;
mod quant;
mod team;

use std::path::Path;
use std::sync::Arc;

use crate::backend::{
    Backend, ForwardBatch, ForwardOutput, KvArena, KvBacking, KvBlockLayout, validate_batch,
};
use crate::error::EngineError;
use crate::model::{LayerWeights, Model, ModelConfig, ModelWeights};

use attention::{AttnShape, MAX_GROUP, TokenPos, paged_attention};
use kernels::{Rope, apply_rope, geglu_tanh, rms_norm, rms_norm_in_place, softcap, swiglu};
use linear::{CpuLinear, Embedding, LinearScratch};
use paged_kv::PagedKv;

/// One decoder layer, laid out for compute (see [`CpuLinear`]).
#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    /// q, k, v projections side by side.
    qkv: CpuLinear,
    /// Per-head RMSNorm of queries and keys before RoPE (Qwen3).
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    /// The attention window of a sliding layer.
    window: Option<usize>,
    /// Whether the layer uses the model's local RoPE (Gemma 3's sliding layers).
    local_rope: bool,
    /// Norms of the attention and MLP outputs before each residual add (Gemma).
    attn_out_norm: Option<Vec<f32>>,
    mlp_out_norm: Option<Vec<f32>>,
    /// `[heads * head_dim] → [hidden]`.
    o: CpuLinear,
    post_norm: Vec<f32>,
    /// Gate outputs, then up outputs.
    gate_up: CpuLinear,
    down: CpuLinear,
}

impl Layer {
    fn new(w: LayerWeights, window: Option<usize>, local_rope: bool) -> Self {
        Layer {
            local_rope,
            attn_out_norm: w.attn_out_norm,
            mlp_out_norm: w.mlp_out_norm,
            input_norm: w.input_layernorm,
            qkv: CpuLinear::stack(&[&w.q_proj, &w.k_proj, &w.v_proj]),
            q_norm: w.q_norm,
            k_norm: w.k_norm,
            window,
            o: CpuLinear::stack(&[&w.o_proj]),
            post_norm: w.post_attention_layernorm,
            gate_up: CpuLinear::stack(&[&w.gate_proj, &w.up_proj]),
            down: CpuLinear::stack(&[&w.down_proj]),
        }
    }
}

/// Activation buffers reused across steps (grown, never shrunk).
#[derive(Debug, Default)]
struct Scratch {
    /// Residual stream `[tokens, hidden]`.
    x: Vec<f32>,
    /// Normalised activations `[tokens, hidden]`.
    h: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// The local RoPE's tables (Gemma 3).
    cos_local: Vec<f32>,
    sin_local: Vec<f32>,
    tokens: Vec<TokenPos>,
    linear: LinearScratch,
}

fn resize(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    &mut buf[..len]
}

/// A model's weights prepared for the CPU backend (fused; f32 input-major
/// or quantized rows),
/// immutable, so several backends (workers in one process) can share one
/// copy through an `Arc`.
#[derive(Debug)]
pub struct CpuWeights {
    config: ModelConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// `[hidden] → [vocab]` (the embedding's rows when tied).
    lm_head: CpuLinear,
    rope: Rope,
    /// The sliding layers' RoPE when it differs (Gemma 3).
    local_rope: Option<Rope>,
}

impl CpuWeights {
    /// Rearranges a loaded model for compute (its HF-layout tensors are
    /// dropped as each is converted).
    pub fn new(model: Model) -> Result<Self, EngineError> {
        let Model { config, weights } = model;
        if config.num_attention_heads / config.num_key_value_heads > MAX_GROUP {
            return Err(EngineError::InvalidRequest(format!(
                "{} query heads per kv head; the CPU backend supports at most {MAX_GROUP}",
                config.num_attention_heads / config.num_key_value_heads
            )));
        }
        let ModelWeights {
            embed_tokens,
            layers,
            norm,
            lm_head,
        } = weights;
        let head = CpuLinear::head(lm_head.as_ref().unwrap_or(&embed_tokens));
        drop(lm_head);
        let local_rope = config
            .variant
            .gemma
            .as_ref()
            .and_then(|g| g.local_rope)
            .map(|(theta, scaling)| Rope::with(&config, theta, scaling));
        Ok(CpuWeights {
            rope: Rope::new(&config),
            embed: Embedding::new(embed_tokens),
            layers: layers
                .into_iter()
                .enumerate()
                .map(|(l, w)| {
                    let window = config.variant.window(l);
                    Layer::new(w, window, window.is_some() && local_rope.is_some())
                })
                .collect(),
            local_rope,
            final_norm: norm,
            lm_head: head,
            config,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
}

/// Llama/Qwen2 on the CPU, f32 compute over paged KV memory.
#[derive(Debug)]
pub struct CpuBackend {
    weights: Arc<CpuWeights>,
    kv: PagedKv,
    scratch: Scratch,
    /// This backend's own rayon threads, for gemm's prefill products and
    /// grammar masks. Not the global pool: a step's products never run
    /// nested inside another engine's (ranks of a lockstep group wait for
    /// each other).
    pool: Arc<rayon::ThreadPool>,
    /// The threads the step's ~150 small parallel sections (decode
    /// products, attention) split over; see [`team`].
    team: Arc<team::Team>,
}

impl CpuBackend {
    /// Loads the model at `dir` (a directory or GGUF file) and allocates `num_blocks` KV blocks of
    /// `block_size` tokens.
    pub fn from_path(
        dir: &Path,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        Self::new(Model::load(dir)?, num_blocks, block_size)
    }

    /// Takes a loaded model and allocates `num_blocks` KV blocks of
    /// `block_size` tokens (`2 · layers · block_size · kv_heads · head_dim · 4`
    /// bytes each).
    pub fn new(model: Model, num_blocks: usize, block_size: usize) -> Result<Self, EngineError> {
        Self::with_weights(Arc::new(CpuWeights::new(model)?), num_blocks, block_size)
    }

    /// A backend over shared prepared weights, with its own `num_blocks` KV
    /// blocks of `block_size` tokens.
    pub fn with_weights(
        weights: Arc<CpuWeights>,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        if num_blocks == 0 || block_size == 0 {
            return Err(EngineError::InvalidRequest(format!(
                "the CPU backend needs at least one block of at least one token (got {num_blocks} blocks of {block_size})"
            )));
        }
        let config = &weights.config;
        let layout = KvBlockLayout {
            num_layers: config.num_hidden_layers,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            block_size,
            elem_bytes: 4,
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("sluice-cpu-{i}"))
            .build()
            .map_err(|e| {
                EngineError::InvalidConfig(format!("starting the CPU backend's threads: {e}"))
            })?;
        let pool = Arc::new(pool);
        let team = team::Team::new(threads, "sluice-cpu-team", Arc::clone(&pool)).map_err(|e| {
            EngineError::InvalidConfig(format!("starting the CPU backend's threads: {e}"))
        })?;
        Ok(CpuBackend {
            kv: PagedKv::new(layout, num_blocks, &KvBacking::Private)?,
            scratch: Scratch::default(),
            weights,
            pool,
            team: Arc::new(team),
        })
    }

    /// The shared prepared weights (to build another backend over them).
    pub fn weights(&self) -> &Arc<CpuWeights> {
        &self.weights
    }

    /// The model's configuration (vocab, eos ids, geometry).
    pub fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    /// Checks the batch against the model and the KV pool before computing.
    fn validate(&self, batch: &ForwardBatch) -> Result<(), EngineError> {
        validate_batch(
            batch,
            self.weights.config.vocab_size,
            self.kv.layout.block_size,
            self.kv.num_blocks,
        )
    }

    /// The forward pass of a non-empty batch: embed, every layer's
    /// attention and MLP blocks, then the logits of the rows that need them.
    fn run(&mut self, batch: &ForwardBatch) -> Vec<f32> {
        let CpuBackend {
            weights,
            kv,
            scratch: s,
            ..
        } = self;
        let w = &**weights;
        let n = s.embed(w, batch);
        let tables: Vec<&[u32]> = batch
            .seqs
            .iter()
            .map(|s| s.block_table.as_slice())
            .collect();
        for (l, layer) in w.layers.iter().enumerate() {
            s.attention(w, layer, kv, l, &tables, n);
            s.mlp(w, layer, n);
        }
        s.logits(w, batch)
    }
}

/// `x += rms_norm(y)` row by row (`y` is overwritten).
fn add_normed(x: &mut [f32], y: &mut [f32], weight: &[f32], hidden: usize, eps: f32) {
    debug_assert_eq!(weight.len(), hidden);
    rms_norm_in_place(y, weight, eps);
    for (x, y) in x.iter_mut().zip(y.iter()) {
        *x += y;
    }
}

impl Scratch {
    /// Lays out the batch's new tokens: their positions, RoPE tables and
    /// embeddings into the residual stream. Returns the token count.
    fn embed(&mut self, w: &CpuWeights, batch: &ForwardBatch) -> usize {
        let hidden = w.config.hidden_size;
        let half = w.config.head_dim / 2;
        let n: usize = batch.seqs.iter().map(|s| s.tokens.len()).sum();
        self.tokens.clear();
        let cos = resize(&mut self.cos, n * half);
        let sin = resize(&mut self.sin, n * half);
        let x = resize(&mut self.x, n * hidden);
        let local = if w.local_rope.is_some() { n * half } else { 0 };
        let cos_local = resize(&mut self.cos_local, local);
        let sin_local = resize(&mut self.sin_local, local);
        let mut t = 0;
        for (i, seq) in batch.seqs.iter().enumerate() {
            let len = seq.tokens.len();
            let positions = seq.start_pos..seq.start_pos + len;
            self.tokens
                .extend(positions.clone().map(|pos| TokenPos { seq: i, pos }));
            w.rope.fill(
                positions.clone(),
                &mut cos[t * half..(t + len) * half],
                &mut sin[t * half..(t + len) * half],
            );
            if let Some(local) = &w.local_rope {
                local.fill(
                    positions,
                    &mut cos_local[t * half..(t + len) * half],
                    &mut sin_local[t * half..(t + len) * half],
                );
            }
            for (j, &tok) in seq.tokens.iter().enumerate() {
                w.embed
                    .row(tok as usize, &mut x[(t + j) * hidden..(t + j + 1) * hidden]);
            }
            t += len;
        }
        if let Some(g) = &w.config.variant.gemma {
            x.iter_mut().for_each(|v| *v *= g.embed_scale);
        }
        n
    }

    /// Layer `l`'s attention block over the `n` new tokens: norm, QKV
    /// projection, RoPE, K/V stored into the paged cache, paged attention,
    /// output projection added into the residual stream.
    fn attention(
        &mut self,
        w: &CpuWeights,
        layer: &Layer,
        kv: &mut PagedKv,
        l: usize,
        tables: &[&[u32]],
        n: usize,
    ) {
        let c = &w.config;
        let (hidden, head_dim) = (c.hidden_size, c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let (q_dim, kv_dim, qkv_dim) = (nh * head_dim, nkv * head_dim, c.qkv_dim());
        let half = head_dim / 2;
        let block_size = kv.layout.block_size;
        let x = &mut self.x[..n * hidden];
        let (cos, sin) = if layer.local_rope {
            (&self.cos_local[..n * half], &self.sin_local[..n * half])
        } else {
            (&self.cos[..n * half], &self.sin[..n * half])
        };
        let h = resize(&mut self.h, n * hidden);
        let qkv = resize(&mut self.qkv, n * qkv_dim);
        let attn = resize(&mut self.attn, n * q_dim);
        rms_norm(h, x, &layer.input_norm, hidden, c.rms_norm_eps);
        layer.qkv.forward(qkv, h, n, false, &mut self.linear);
        let (mut k_slab, mut v_slab) = kv.slabs_mut(l);
        for (t, tp) in self.tokens.iter().enumerate() {
            let row = &mut qkv[t * qkv_dim..(t + 1) * qkv_dim];
            let (cs, sn) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            if let Some(w) = &layer.q_norm {
                rms_norm_in_place(&mut row[..q_dim], w, c.rms_norm_eps);
            }
            if let Some(w) = &layer.k_norm {
                rms_norm_in_place(&mut row[q_dim..q_dim + kv_dim], w, c.rms_norm_eps);
            }
            apply_rope(&mut row[..q_dim + kv_dim], head_dim, cs, sn);
            let block = tables[tp.seq][tp.pos / block_size];
            let slot = (tp.pos % block_size) * kv_dim;
            k_slab.block_mut(block)[slot..slot + kv_dim]
                .copy_from_slice(&row[q_dim..q_dim + kv_dim]);
            v_slab.block_mut(block)[slot..slot + kv_dim].copy_from_slice(&row[q_dim + kv_dim..]);
        }
        let shape = AttnShape {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim,
            block_size,
            qkv_dim,
            window: layer.window,
            scale: c
                .variant
                .gemma
                .as_ref()
                .map_or(1.0 / (head_dim as f32).sqrt(), |g| g.attn_scale),
            softcap: c.variant.gemma.as_ref().and_then(|g| g.attn_softcap),
        };
        let (k_view, v_view) = (k_slab.view(), v_slab.view());
        paged_attention(attn, qkv, k_view, v_view, &self.tokens, tables, shape);
        match &layer.attn_out_norm {
            None => layer.o.forward(x, attn, n, true, &mut self.linear),
            Some(norm) => {
                // Gemma: the output is normalised before the residual add.
                layer.o.forward(h, attn, n, false, &mut self.linear);
                add_normed(x, h, norm, hidden, c.rms_norm_eps);
            }
        }
    }

    /// A layer's MLP block: norm, gate/up projection, SwiGLU, down
    /// projection added into the residual stream.
    fn mlp(&mut self, w: &CpuWeights, layer: &Layer, n: usize) {
        let c = &w.config;
        let (hidden, inter) = (c.hidden_size, c.intermediate_size);
        let x = &mut self.x[..n * hidden];
        let h = resize(&mut self.h, n * hidden);
        let gate_up = resize(&mut self.gate_up, n * 2 * inter);
        let act = resize(&mut self.act, n * inter);
        rms_norm(h, x, &layer.post_norm, hidden, c.rms_norm_eps);
        layer
            .gate_up
            .forward(gate_up, h, n, false, &mut self.linear);
        if c.variant.gemma.is_some() {
            geglu_tanh(act, gate_up, inter);
        } else {
            swiglu(act, gate_up, inter);
        }
        match &layer.mlp_out_norm {
            None => layer.down.forward(x, act, n, true, &mut self.linear),
            Some(norm) => {
                layer.down.forward(h, act, n, false, &mut self.linear);
                add_normed(x, h, norm, hidden, c.rms_norm_eps);
            }
        }
    }

    /// The final norm and lm_head, only for the rows that need logits.
    fn logits(&mut self, w: &CpuWeights, batch: &ForwardBatch) -> Vec<f32> {
        let c = &w.config;
        let hidden = c.hidden_size;
        let mut rows = Vec::new();
        let mut end = 0;
        for seq in &batch.seqs {
            end += seq.tokens.len();
            if seq.needs_logits {
                rows.extend_from_slice(&self.x[(end - 1) * hidden..end * hidden]);
            }
        }
        let r = rows.len() / hidden;
        let normed = resize(&mut self.h, r * hidden);
        rms_norm(normed, &rows, &w.final_norm, hidden, c.rms_norm_eps);
        let vocab = c.vocab_size;
        let mut logits = vec![0.0; r * vocab];
        w.lm_head
            .forward(&mut logits, normed, r, false, &mut self.linear);
        if let Some(cap) = c.variant.gemma.as_ref().and_then(|g| g.final_softcap) {
            softcap(&mut logits, cap);
        }
        logits
    }
}

impl Backend for CpuBackend {
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput, EngineError> {
        self.validate(batch)?;
        let data = if batch.seqs.is_empty() {
            Vec::new()
        } else {
            // The step runs on the calling (engine) thread; see `team`.
            let team = Arc::clone(&self.team);
            team.install(|| self.run(batch))
        };
        Ok(ForwardOutput::Logits {
            vocab_size: self.weights.config.vocab_size,
            data,
        })
    }

    fn kv_layout(&self) -> KvBlockLayout {
        self.kv.layout
    }

    fn num_blocks(&self) -> usize {
        self.kv.num_blocks
    }

    /// Layout: for each layer in order, the block's K then its V, each
    /// `[block_size, num_kv_heads, head_dim]` row-major little-endian f32
    /// (`KvBlockLayout::block_bytes()` in all).
    fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError> {
        self.kv.read_block(id, out)
    }

    /// Same layout as [`CpuBackend::read_block`].
    fn write_block(&mut self, id: u32, data: &[u8]) -> Result<(), EngineError> {
        self.kv.write_block(id, data)
    }

    fn kv_arena(&self) -> Option<Arc<KvArena>> {
        Some(Arc::clone(&self.kv.arena))
    }

    fn set_kv_backing(&mut self, backing: &KvBacking) -> Result<(), EngineError> {
        self.kv = PagedKv::new(self.kv.layout, self.kv.num_blocks, backing)?;
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.weights.config.vocab_size
    }

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn thread_pool(&self) -> Option<Arc<rayon::ThreadPool>> {
        Some(Arc::clone(&self.pool))
    }
}

#[cfg(test)]
mod tests;
