//! The cuda backend: a Llama/Qwen2 forward pass on an NVIDIA GPU, through
//! cudarc (driver, NVRTC, cuBLAS, all loaded at run time, so the crate
//! builds and links without a CUDA toolkit or driver).
//!
//! Behind the same [`Backend`] seam as the CPU backend, so the scheduler,
//! block pool, prefix cache, KV events, preemption and KV transfer run
//! unchanged. One [`Backend::forward`] runs a flattened batch mixing prefill
//! chunks and decode tokens:
//!
//! - weights on the device in bf16 (from f32/f16/bf16 safetensors), q/k/v
//!   and gate/up fused; projections are cuBLAS GEMMs with bf16 inputs and
//!   f32 outputs; the residual stream stays f32 and the o/down projections
//!   add into it (the GEMM's `beta = 1` is the residual add);
//! - NVRTC kernels (`cuda/kernels.cu`, compiled for the device's
//!   architecture at start-up): embedding gather, RMSNorm, bias + RoPE + KV
//!   store, paged GQA attention over the block tables (prefill chunks and
//!   decode alike; a few tokens with long contexts are split along the
//!   context and combined, so batch-1 decoding fills the GPU), SwiGLU,
//!   bias adds, KV block pack/unpack;
//! - RoPE tables come from the CPU backend's own [`Rope`] (every scaling it
//!   supports): computed once for every position the model takes and read
//!   by position, or per chunk for a chunk past them (dynamic NTK past
//!   `max_position_embeddings`), uploaded with the step's metadata
//!   ([`plan::StepPlan`]);
//! - plain decode steps (one token per sequence) are captured once per
//!   batch size and block-table width as CUDA graphs and replayed: a small
//!   model's step is otherwise bound by ~10 launches per layer, not by
//!   reading its weights (`SLUICE_CUDA_GRAPHS=0` turns this off; a failed
//!   capture turns it off with a warning);
//! - logits only for the sequences that need them, copied back in f32
//!   through pinned memory and sampled by the engine's sampler (the seam
//!   returns logits: sampling parameters, penalties and logprobs stay in
//!   one place for every backend).
//!
//! KV memory is one device allocation of bf16 slabs in the CPU backend's
//! layout (`[num_blocks, block_size, num_kv_heads, head_dim]` per layer and
//! kind), indexed by the block pool's ids. Its [`KvBlockLayout`] — what
//! transfers carry — is the CPU backend's f32 form, so KV moves between GPU
//! and CPU workers of the same model: [`Backend::read_block`] packs a block
//! on the device (bf16 → f32), copies it through pinned staging;
//! [`Backend::write_block`] the reverse. There is no host [`KvArena`]:
//! `tcp` and `grpc` deliver into a GPU worker through `write_block`, a GPU
//! prefill worker sends over any transport (`shm` included) from
//! `read_block`, and a GPU decode worker does not offer `shm`.
//!
//! Host-side pieces ([`plan`], [`convert`], [`source`]) build without the
//! `cuda` feature and are unit-tested everywhere; the kernels are compiled
//! by the real NVRTC and assembled by `ptxas` in CI
//! (`engine/tests/cuda_kernels.rs`).
//!
//! [`KvArena`]: crate::backend::KvArena
//! [`Rope`]: crate::backend::cpu::kernels::Rope

pub mod convert;
pub mod plan;
pub mod source;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub mod libraries;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
mod weights;

#[cfg(feature = "cuda")]
pub use imp::CudaBackend;

#[cfg(feature = "cuda")]
mod imp {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::path::Path;

    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    use cudarc::driver::{CudaGraph, CudaSlice, PinnedHostSlice};

    use super::device::{Arg, Device, driver};
    use super::plan::{self, StepPlan};
    use super::source::KernelConfig;
    use super::weights::{DeviceLayer, DeviceLinear, DeviceWeights};
    use crate::backend::{Backend, ForwardBatch, ForwardOutput, KvBlockLayout, validate_batch};
    use crate::error::EngineError;
    use crate::model::{Model, ModelConfig};

    /// Activation and upload buffers, grown to the largest step seen.
    #[derive(Debug)]
    struct Scratch {
        tokens: usize,
        rows: usize,
        /// Residual stream `[tokens, hidden]` f32.
        x: CudaSlice<f32>,
        /// Normalised activations `[tokens, hidden]` bf16.
        h: CudaSlice<u16>,
        qkv: CudaSlice<f32>,
        /// Attention outputs `[tokens, heads · head_dim]` bf16.
        attn: CudaSlice<u16>,
        gate_up: CudaSlice<f32>,
        /// SwiGLU outputs `[tokens, intermediate]` bf16.
        act: CudaSlice<u16>,
        /// `[rows, vocab]` f32.
        logits: CudaSlice<f32>,
        logits_host: PinnedHostSlice<f32>,
        meta: CudaSlice<u32>,
        rope: CudaSlice<f32>,
        /// A split attention's partial sums `[tokens, heads, splits, head_dim]`.
        part_acc: CudaSlice<f32>,
        /// Its softmax state `[tokens, heads, splits, (max, sum)]`.
        part_ml: CudaSlice<f32>,
    }

    fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        device: &Device,
        len: usize,
    ) -> Result<CudaSlice<T>, EngineError> {
        device
            .stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(driver("allocating activations"))
    }

    fn pinned(device: &Device, len: usize) -> Result<PinnedHostSlice<f32>, EngineError> {
        // SAFETY: f32 accepts any bits; every read follows a copy into it.
        // Flags 0: cached (not write-combined) memory, read by the host.
        unsafe { device.ctx.alloc_pinned_with_flags::<f32>(len.max(1), 0) }
            .map_err(driver("allocating pinned host memory"))
    }

    impl Scratch {
        fn new(device: &Device, c: &ModelConfig) -> Result<Self, EngineError> {
            let mut s = Self {
                tokens: 0,
                rows: 0,
                x: alloc(device, 1)?,
                h: alloc(device, 1)?,
                qkv: alloc(device, 1)?,
                attn: alloc(device, 1)?,
                gate_up: alloc(device, 1)?,
                act: alloc(device, 1)?,
                logits: alloc(device, 1)?,
                logits_host: pinned(device, 1)?,
                meta: alloc(device, 1)?,
                rope: alloc(device, 1)?,
                part_acc: alloc(device, 1)?,
                part_ml: alloc(device, 1)?,
            };
            s.ensure(device, c, 16, 16, 1024, 1024, 1)?;
            Ok(s)
        }

        /// Room for `tokens` tokens, `rows` logits rows, the uploads and
        /// `splits` attention splits per (token, head); true when a buffer
        /// moved.
        #[expect(
            clippy::too_many_arguments,
            reason = "one size per kind of buffer a step needs"
        )]
        fn ensure(
            &mut self,
            device: &Device,
            c: &ModelConfig,
            tokens: usize,
            rows: usize,
            meta: usize,
            rope: usize,
            splits: usize,
        ) -> Result<bool, EngineError> {
            let before = (
                self.tokens,
                self.rows,
                self.meta.len(),
                self.rope.len(),
                self.part_acc.len(),
            );
            if tokens > self.tokens {
                let n = tokens.next_power_of_two();
                let q_dim = c.num_attention_heads * c.head_dim;
                self.x = alloc(device, n * c.hidden_size)?;
                self.h = alloc(device, n * c.hidden_size)?;
                self.qkv = alloc(device, n * c.qkv_dim())?;
                self.attn = alloc(device, n * q_dim)?;
                self.gate_up = alloc(device, n * 2 * c.intermediate_size)?;
                self.act = alloc(device, n * c.intermediate_size)?;
                self.tokens = n;
            }
            if rows > self.rows {
                let r = rows.next_power_of_two();
                self.logits = alloc(device, r * c.vocab_size)?;
                self.logits_host = pinned(device, r * c.vocab_size)?;
                self.rows = r;
            }
            if meta > self.meta.len() {
                self.meta = alloc(device, meta.next_power_of_two())?;
            }
            if rope > self.rope.len() {
                self.rope = alloc(device, rope.next_power_of_two())?;
            }
            if splits > 1 {
                let heads = tokens * c.num_attention_heads * splits;
                if heads * c.head_dim > self.part_acc.len() {
                    let heads = heads.next_power_of_two();
                    self.part_acc = alloc(device, heads * c.head_dim)?;
                    self.part_ml = alloc(device, heads * 2)?;
                }
            }
            Ok(before
                != (
                    self.tokens,
                    self.rows,
                    self.meta.len(),
                    self.rope.len(),
                    self.part_acc.len(),
                ))
        }
    }

    /// Positions the per-position RoPE table holds.
    fn c_positions(c: &ModelConfig) -> usize {
        c.max_position_embeddings
            .clamp(1, plan::MAX_ROPE_CACHE_POSITIONS)
    }

    /// `x[i] += bias[i % width]` over `total` elements.
    fn add_bias(
        d: &Device,
        x: u64,
        bias: u64,
        width: usize,
        total: usize,
    ) -> Result<(), EngineError> {
        d.launch(
            &d.kernels.add_bias,
            plan::grid_stride(total, d.max_blocks),
            &[
                Arg::Ptr(x),
                Arg::Ptr(bias),
                Arg::I32(width as i32),
                Arg::U64(total as u64),
            ],
        )
    }

    /// The device address of an optional bias, or 0 (none).
    fn optional_addr(d: &Device, b: &Option<CudaSlice<f32>>) -> u64 {
        b.as_ref().map_or(0, |b| d.addr(b, 0))
    }

    /// One block's way between the device and the host.
    #[derive(Debug)]
    struct Staging {
        /// The block's serialised form on the device, f32.
        device: CudaSlice<f32>,
        /// The same, pinned on the host.
        host: PinnedHostSlice<f32>,
    }

    /// Llama/Qwen2 on an NVIDIA GPU; see the module docs.
    #[derive(Debug)]
    pub struct CudaBackend {
        device: Device,
        weights: DeviceWeights,
        /// `[2 · layers, num_blocks, chunk]` bf16: slab `2·layer + kind`.
        kv: CudaSlice<u16>,
        /// The serialised (f32) block layout, the CPU backend's.
        layout: KvBlockLayout,
        num_blocks: usize,
        /// Elements of one block's part of one slab.
        chunk: usize,
        scratch: Scratch,
        plan: StepPlan,
        staging: RefCell<Staging>,
        /// Captured decode steps by (sequences, block-table width, RoPE
        /// from the per-position table); `None` when graphs are off
        /// (`SLUICE_CUDA_GRAPHS=0`, or a capture failed).
        graphs: Option<HashMap<(usize, usize, bool), Graph>>,
        /// cos/sin of every position below `rope_positions`:
        /// `[cos | sin]`, each `[rope_positions, head_dim / 2]`.
        rope_cache: CudaSlice<f32>,
        rope_positions: usize,
    }

    /// Decode-step graphs kept at most (a batch size and a table width each).
    const MAX_GRAPHS: usize = 64;

    /// A captured decode step.
    struct Graph(CudaGraph);

    impl std::fmt::Debug for Graph {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Graph")
        }
    }

    // SAFETY: a graph is only touched through `&mut CudaBackend` (launch,
    // drop), so by one thread at a time, which is what CUDA requires of
    // graph objects; the backend moves to the engine thread once.
    unsafe impl Send for Graph {}

    /// Device addresses (and sizes) of one planned step.
    #[derive(Debug, Clone, Copy)]
    struct StepAddrs {
        /// RoPE from the per-position table (`rope_rows` = positions).
        cached_rope: bool,
        rope_rows: u64,
        n: usize,
        r: usize,
        max_blocks: usize,
        tokens: u64,
        token_seq: u64,
        token_pos: u64,
        slots: u64,
        logit_rows: u64,
        tables: u64,
        cos: u64,
        sin: u64,
        x: u64,
        h: u64,
        qkv: u64,
        attn: u64,
        gate_up: u64,
        act: u64,
        logits: u64,
        split: plan::AttentionSplit,
        part_acc: u64,
        part_ml: u64,
    }

    impl CudaBackend {
        /// Loads the model at `dir` (a directory or GGUF file) onto device `ordinal` (modulo the
        /// visible devices) with `num_blocks` KV blocks of `block_size`
        /// tokens.
        pub fn from_path(
            dir: &Path,
            num_blocks: usize,
            block_size: usize,
            ordinal: usize,
        ) -> Result<Self, EngineError> {
            // Check the device before spending time reading weights.
            let config = ModelConfig::from_path(dir)?;
            let device = Device::open(ordinal, KernelConfig::for_model(&config)?)?;
            Self::on_device(device, Model::load(dir)?, num_blocks, block_size)
        }

        /// Takes a loaded model onto device `ordinal`.
        pub fn new(
            model: Model,
            num_blocks: usize,
            block_size: usize,
            ordinal: usize,
        ) -> Result<Self, EngineError> {
            let device = Device::open(ordinal, KernelConfig::for_model(&model.config)?)?;
            Self::on_device(device, model, num_blocks, block_size)
        }

        fn on_device(
            device: Device,
            model: Model,
            num_blocks: usize,
            block_size: usize,
        ) -> Result<Self, EngineError> {
            if num_blocks == 0 || block_size == 0 {
                return Err(EngineError::InvalidRequest(format!(
                    "the cuda backend needs at least one block of at least one token (got {num_blocks} blocks of {block_size})"
                )));
            }
            let c = &model.config;
            let v = &c.variant;
            if v.qk_norm || v.sliding_window.is_some() || v.gemma.is_some() {
                // Fused projections are split at load; q/k norms, sliding
                // windows and Gemma's block have no cuda kernels yet.
                return Err(EngineError::UnsupportedArchitecture(format!(
                    "{} on the cuda engine (q/k norms, sliding windows and Gemma run on the cpu engine)",
                    c.architecture.hf_name()
                )));
            }
            let layout = KvBlockLayout {
                num_layers: c.num_hidden_layers,
                num_kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                block_size,
                elem_bytes: 4,
            };
            let chunk = block_size * c.num_key_value_heads * c.head_dim;
            let slabs = 2 * c.num_hidden_layers;
            // Kernels index KV slots (`block · block_size + offset`) as u32
            // and a block's elements as i32.
            if i32::try_from(slabs * chunk).is_err()
                || u32::try_from(num_blocks * block_size).is_err()
            {
                return Err(EngineError::InvalidConfig(format!(
                    "{num_blocks} KV blocks of {block_size} tokens ({} bytes each) exceed the cuda backend's 32-bit slot and block indices",
                    layout.block_bytes()
                )));
            }
            device.bind()?;
            let kv_bytes = 2 * slabs * num_blocks * chunk;
            let (free, total) = device
                .ctx
                .mem_get_info()
                .map_err(driver("reading free device memory"))?;
            let weights = DeviceWeights::upload(model, &device)?;
            // RoPE of every position the model takes, computed once by the
            // CPU backend's Rope: a step then uploads no tables.
            let rope_positions = c_positions(&weights.config);
            let half = weights.config.head_dim / 2;
            let mut tables = vec![0f32; 2 * rope_positions * half];
            let (cos, sin) = tables.split_at_mut(rope_positions * half);
            weights.rope.fill(0..rope_positions, cos, sin);
            let rope_cache = device
                .stream
                .clone_htod(&tables)
                .map_err(driver("uploading RoPE tables"))?;
            drop(tables);
            let resident = weights.bytes + 4 * rope_cache.len();
            if kv_bytes > free.saturating_sub(resident) {
                return Err(EngineError::InvalidConfig(format!(
                    "{num_blocks} KV blocks need {} MiB of device memory; {} has {} MiB free of {} MiB after {} MiB of weights and tables (lower --num-gpu-blocks)",
                    kv_bytes >> 20,
                    device.description,
                    free.saturating_sub(resident) >> 20,
                    total >> 20,
                    resident >> 20
                )));
            }
            let kv = device
                .stream
                .alloc_zeros::<u16>(slabs * num_blocks * chunk)
                .map_err(driver("allocating KV memory"))?;
            let staging = Staging {
                device: alloc(&device, slabs * chunk)?,
                host: pinned(&device, slabs * chunk)?,
            };
            let scratch = Scratch::new(&device, &weights.config)?;
            device.sync("allocating KV memory")?;
            tracing::info!(
                device = %device.description,
                weights_mib = weights.bytes >> 20,
                kv_mib = kv_bytes >> 20,
                num_blocks,
                "cuda backend ready"
            );
            Ok(Self {
                device,
                weights,
                kv,
                layout,
                num_blocks,
                chunk,
                scratch,
                plan: StepPlan::default(),
                staging: RefCell::new(staging),
                graphs: (std::env::var("SLUICE_CUDA_GRAPHS").as_deref() != Ok("0"))
                    .then(HashMap::new),
                rope_cache,
                rope_positions,
            })
        }

        /// The model's configuration.
        pub fn config(&self) -> &ModelConfig {
            &self.weights.config
        }

        /// The device, as `name (sm_XY)`.
        pub fn device_description(&self) -> &str {
            &self.device.description
        }

        /// Turns capturing and replaying decode steps as CUDA graphs on or
        /// off (on by default unless `SLUICE_CUDA_GRAPHS=0`).
        pub fn set_graphs(&mut self, on: bool) {
            self.graphs = on.then(HashMap::new);
        }

        /// Whether decode steps run as CUDA graphs (false after a failed
        /// capture turned them off).
        pub fn graphs_enabled(&self) -> bool {
            self.graphs.is_some()
        }

        /// Bytes of the weights on the device.
        pub fn weight_bytes(&self) -> usize {
            self.weights.bytes
        }

        /// Bytes of weights one decode step must read (the memory-bandwidth
        /// roofline's numerator, with the KV read).
        pub fn decode_weight_bytes(&self) -> usize {
            self.weights.decode_read_bytes()
        }

        /// Bytes of KV one token of context holds on the device (bf16, every
        /// layer, K and V).
        pub fn kv_bytes_per_token(&self) -> usize {
            2 * 2 * self.layout.num_layers * self.layout.num_kv_heads * self.layout.head_dim
        }

        /// Device memory bandwidth (bytes read + written per second) of
        /// device-to-device copies of `bytes`: the roofline's denominator,
        /// measured on the device at hand.
        pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64, EngineError> {
            const REPS: usize = 10;
            let d = &self.device;
            d.bind()?;
            let n = (bytes / 4).max(1);
            let src = alloc::<f32>(d, n)?;
            let mut dst = alloc::<f32>(d, n)?;
            d.stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(driver("copying on the device"))?;
            d.sync("copying on the device")?;
            let start = std::time::Instant::now();
            for _ in 0..REPS {
                d.stream
                    .memcpy_dtod(&src, &mut dst)
                    .map_err(driver("copying on the device"))?;
            }
            d.sync("copying on the device")?;
            let secs = start.elapsed().as_secs_f64().max(1e-9);
            Ok((2 * 4 * n * REPS) as f64 / secs)
        }

        /// Address of slab `slab` (`2·layer + kind`) of the KV memory.
        fn slab(&self, slab: usize) -> u64 {
            self.device
                .addr(&self.kv, slab * self.num_blocks * self.chunk)
        }

        fn check_block(&self, id: u32, len: usize) -> Result<(), EngineError> {
            if id as usize >= self.num_blocks {
                return Err(EngineError::BlockOutOfRange {
                    id,
                    num_blocks: self.num_blocks,
                });
            }
            let expected = self.layout.block_bytes();
            if len != expected {
                return Err(EngineError::BlockSize {
                    expected,
                    actual: len,
                });
            }
            Ok(())
        }

        /// Runs the step and returns its logits rows: uploads the plan,
        /// enqueues every kernel (or replays the decode step's CUDA graph),
        /// copies the logits back.
        fn run(&mut self, batch: &ForwardBatch) -> Result<Vec<f32>, EngineError> {
            let c = &self.weights.config;
            let decode = self.graphs.is_some() && plan::is_decode_step(batch);
            let bs = self.layout.block_size;
            let width = if decode {
                let needed = batch
                    .seqs
                    .iter()
                    .map(|s| (s.start_pos + s.tokens.len()).div_ceil(bs))
                    .max()
                    .unwrap_or(0);
                plan::graph_width(needed)
            } else {
                0
            };
            let cached_rope = plan::rope_cache_covers(batch, self.rope_positions);
            self.plan.fill(
                batch,
                bs,
                c.head_dim,
                (!cached_rope).then_some(&self.weights.rope),
                width,
            );
            let p = &self.plan;
            let (n, r) = (p.num_tokens, p.num_logit_rows);
            // A captured step serves every context up to its table width.
            let max_context = if decode {
                p.max_blocks * bs
            } else {
                batch
                    .seqs
                    .iter()
                    .map(|s| s.start_pos + s.tokens.len())
                    .max()
                    .unwrap_or(0)
            };
            let split =
                plan::attention_split(n, c.num_key_value_heads, max_context, self.device.sms);
            let moved = self.scratch.ensure(
                &self.device,
                c,
                n,
                r,
                p.meta.len(),
                p.rope.len(),
                split.splits as usize,
            )?;
            if moved && let Some(graphs) = &mut self.graphs {
                // Captured steps point into the buffers that just moved.
                graphs.clear();
            }
            let d = &self.device;
            let s = &mut self.scratch;
            d.stream
                .memcpy_htod(p.meta.as_slice(), &mut s.meta)
                .map_err(driver("uploading step metadata"))?;
            if !p.rope.is_empty() {
                d.stream
                    .memcpy_htod(p.rope.as_slice(), &mut s.rope)
                    .map_err(driver("uploading RoPE tables"))?;
            }
            let a = self.addrs(split, cached_rope);
            if decode {
                self.replay_or_capture(&a)?;
            } else {
                self.enqueue(&a)?;
            }
            let d = &self.device;
            let s = &mut self.scratch;
            if r == 0 {
                d.sync("running a step")?;
                return Ok(Vec::new());
            }
            let vocab = self.weights.config.vocab_size;
            d.stream
                .memcpy_dtoh(&s.logits.slice(..r * vocab), &mut s.logits_host)
                .map_err(driver("copying logits"))?;
            d.sync("running a step")?;
            let host = s.logits_host.as_slice().map_err(driver("reading logits"))?;
            Ok(host[..r * vocab].to_vec())
        }

        /// The device addresses the current plan's step uses.
        fn addrs(&self, split: plan::AttentionSplit, cached_rope: bool) -> StepAddrs {
            let (d, s, p) = (&self.device, &self.scratch, &self.plan);
            let l = p.layout();
            let meta = |range: &std::ops::Range<usize>| d.addr(&s.meta, range.start);
            let half = self.weights.config.head_dim / 2;
            let (cos, sin, rope_rows) = if cached_rope {
                (
                    d.addr(&self.rope_cache, 0),
                    d.addr(&self.rope_cache, self.rope_positions * half),
                    meta(&l.token_pos),
                )
            } else {
                (
                    d.addr(&s.rope, p.cos().start),
                    d.addr(&s.rope, p.sin().start),
                    0,
                )
            };
            StepAddrs {
                cached_rope,
                rope_rows,
                n: p.num_tokens,
                r: p.num_logit_rows,
                max_blocks: p.max_blocks,
                tokens: meta(&l.tokens),
                token_seq: meta(&l.token_seq),
                token_pos: meta(&l.token_pos),
                slots: meta(&l.slots),
                logit_rows: meta(&l.logit_rows),
                tables: meta(&l.block_tables),
                cos,
                sin,
                x: d.addr(&s.x, 0),
                h: d.addr(&s.h, 0),
                qkv: d.addr(&s.qkv, 0),
                attn: d.addr(&s.attn, 0),
                gate_up: d.addr(&s.gate_up, 0),
                act: d.addr(&s.act, 0),
                logits: d.addr(&s.logits, 0),
                split,
                part_acc: d.addr(&s.part_acc, 0),
                part_ml: d.addr(&s.part_ml, 0),
            }
        }

        /// Replays the captured graph of a decode step of this shape, or
        /// captures one (and launches it). A failed capture turns graphs off
        /// for this backend and runs the step eagerly: slower, never wrong.
        fn replay_or_capture(&mut self, a: &StepAddrs) -> Result<(), EngineError> {
            let key = (a.n, a.max_blocks, a.cached_rope);
            if let Some(g) = self.graphs.as_ref().and_then(|m| m.get(&key)) {
                return g.0.launch().map_err(driver("replaying a decode step"));
            }
            let stream = &self.device.stream;
            let captured = stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(driver("beginning a capture"))
                .and_then(|()| {
                    let enqueued = self.enqueue(a);
                    let graph = stream
                        .end_capture(CUgraphInstantiate_flags(0))
                        .map_err(driver("capturing a decode step"));
                    enqueued?;
                    graph?.ok_or_else(|| {
                        EngineError::StepFailed("capturing a decode step gave no graph".into())
                    })
                });
            match captured {
                Ok(graph) => {
                    graph.launch().map_err(driver("launching a decode step"))?;
                    if let Some(graphs) = &mut self.graphs {
                        if graphs.len() >= MAX_GRAPHS {
                            graphs.clear();
                        }
                        graphs.insert(key, Graph(graph));
                    }
                    Ok(())
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot capture decode steps as CUDA graphs; running them eagerly");
                    self.graphs = None;
                    // Errors a failed capture left recorded on the context.
                    let _ = self.device.ctx.check_err();
                    self.enqueue(a)
                }
            }
        }

        /// Enqueues the whole forward pass of the planned step (up to the
        /// logits GEMM) on the stream: embed, every layer's attention and
        /// MLP blocks, then the final norm and lm_head for the logit rows.
        fn enqueue(&self, a: &StepAddrs) -> Result<(), EngineError> {
            let d = &self.device;
            let hidden = self.weights.config.hidden_size;
            d.launch(
                &d.kernels.embed_gather,
                plan::per_row(a.n, hidden),
                &[
                    Arg::Ptr(a.x),
                    Arg::Ptr(d.addr(&self.weights.embed, 0)),
                    Arg::Ptr(a.tokens),
                    Arg::I32(hidden as i32),
                ],
            )?;
            for (li, layer) in self.weights.layers.iter().enumerate() {
                self.enqueue_attention(li, layer, a)?;
                self.enqueue_mlp(layer, a)?;
            }
            self.enqueue_logits(a)
        }

        /// Normalises the rows of `x` (or the rows `rows` names, when not
        /// 0) into `h` with the norm weight `norm`.
        fn enqueue_rms_norm(
            &self,
            a: &StepAddrs,
            count: usize,
            norm: &CudaSlice<f32>,
            rows: u64,
        ) -> Result<(), EngineError> {
            let (d, c) = (&self.device, &self.weights.config);
            d.launch(
                &d.kernels.rms_norm,
                plan::per_row(count, c.hidden_size),
                &[
                    Arg::Ptr(a.h),
                    Arg::Ptr(a.x),
                    Arg::Ptr(d.addr(norm, 0)),
                    Arg::Ptr(rows),
                    Arg::I32(c.hidden_size as i32),
                    Arg::F32(c.rms_norm_eps),
                ],
            )
        }

        /// Layer `li`'s attention block: norm, QKV projection, RoPE and
        /// the store of K/V into the paged cache, paged attention (split
        /// and combined when the plan says so), output projection added
        /// into the residual `x`.
        fn enqueue_attention(
            &self,
            li: usize,
            layer: &DeviceLayer,
            a: &StepAddrs,
        ) -> Result<(), EngineError> {
            let c = &self.weights.config;
            let (hidden, head_dim) = (c.hidden_size, c.head_dim);
            let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
            let (q_dim, qkv_dim) = (nh * head_dim, c.qkv_dim());
            let (d, n, split) = (&self.device, a.n, a.split);
            let k = &d.kernels;
            let k_slab = d.addr(&self.kv, 2 * li * self.num_blocks * self.chunk);
            let v_slab = d.addr(&self.kv, (2 * li + 1) * self.num_blocks * self.chunk);
            self.enqueue_rms_norm(a, n, &layer.input_norm, 0)?;
            // SAFETY: h is [n, hidden] bf16, the weight [qkv_dim, hidden], qkv [n, qkv_dim] f32.
            unsafe {
                d.linear(
                    a.qkv,
                    a.h,
                    d.addr(&layer.qkv.weight, 0),
                    n,
                    hidden,
                    qkv_dim,
                    false,
                )
            }?;
            d.launch(
                &k.qkv_rope_store,
                plan::per_row(n, qkv_dim),
                &[
                    Arg::Ptr(a.qkv),
                    Arg::Ptr(optional_addr(d, &layer.qkv.bias)),
                    Arg::Ptr(a.cos),
                    Arg::Ptr(a.sin),
                    Arg::Ptr(a.rope_rows),
                    Arg::Ptr(a.slots),
                    Arg::Ptr(k_slab),
                    Arg::Ptr(v_slab),
                    Arg::I32(nh as i32),
                    Arg::I32(nkv as i32),
                    Arg::I32(head_dim as i32),
                ],
            )?;
            d.launch(
                &k.paged_attention,
                plan::attention(n, nkv, split),
                &[
                    Arg::Ptr(a.attn),
                    Arg::Ptr(a.qkv),
                    Arg::Ptr(k_slab),
                    Arg::Ptr(v_slab),
                    Arg::Ptr(a.tables),
                    Arg::Ptr(a.token_seq),
                    Arg::Ptr(a.token_pos),
                    Arg::I32(a.max_blocks as i32),
                    Arg::I32(qkv_dim as i32),
                    Arg::I32(nkv as i32),
                    Arg::I32(self.layout.block_size as i32),
                    Arg::F32(1.0 / (head_dim as f32).sqrt()),
                    Arg::I32(split.part_len as i32),
                    Arg::Ptr(a.part_acc),
                    Arg::Ptr(a.part_ml),
                ],
            )?;
            if split.splits > 1 {
                d.launch(
                    &k.attention_combine,
                    plan::attention_combine(n, nkv),
                    &[
                        Arg::Ptr(a.attn),
                        Arg::Ptr(a.part_acc),
                        Arg::Ptr(a.part_ml),
                        Arg::I32(nkv as i32),
                        Arg::I32(split.splits as i32),
                    ],
                )?;
            }
            // SAFETY: attn is [n, q_dim] bf16, o is [hidden, q_dim], x is [n, hidden] f32.
            unsafe { self.add_linear(a, a.attn, &layer.o, q_dim) }
        }

        /// A layer's MLP block: norm, gate/up projection, SwiGLU, down
        /// projection added into the residual `x`.
        fn enqueue_mlp(&self, layer: &DeviceLayer, a: &StepAddrs) -> Result<(), EngineError> {
            let c = &self.weights.config;
            let (hidden, inter) = (c.hidden_size, c.intermediate_size);
            let (d, n) = (&self.device, a.n);
            self.enqueue_rms_norm(a, n, &layer.post_norm, 0)?;
            // SAFETY: h is [n, hidden], gate_up [2·inter, hidden], out [n, 2·inter] f32.
            unsafe {
                d.linear(
                    a.gate_up,
                    a.h,
                    d.addr(&layer.gate_up.weight, 0),
                    n,
                    hidden,
                    2 * inter,
                    false,
                )
            }?;
            d.launch(
                &d.kernels.swiglu,
                plan::grid_stride(n * inter, d.max_blocks),
                &[
                    Arg::Ptr(a.act),
                    Arg::Ptr(a.gate_up),
                    Arg::Ptr(optional_addr(d, &layer.gate_up.bias)),
                    Arg::I32(inter as i32),
                    Arg::I32(n as i32),
                ],
            )?;
            // SAFETY: act is [n, inter] bf16, down [hidden, inter], x [n, hidden] f32.
            unsafe { self.add_linear(a, a.act, &layer.down, inter) }
        }

        /// `x[n, hidden] += input[n, inputs] · lin.weightᵀ (+ lin.bias)`:
        /// a projection back into the residual stream.
        ///
        /// # Safety
        /// `input` must hold `[n, inputs]` bf16 and `lin.weight`
        /// `[hidden, inputs]` on this device.
        unsafe fn add_linear(
            &self,
            a: &StepAddrs,
            input: u64,
            lin: &DeviceLinear,
            inputs: usize,
        ) -> Result<(), EngineError> {
            let (d, hidden, n) = (&self.device, self.weights.config.hidden_size, a.n);
            // SAFETY: the caller's shapes; `a.x` is the [n, hidden] f32 residual.
            unsafe { d.linear(a.x, input, d.addr(&lin.weight, 0), n, inputs, hidden, true) }?;
            if let Some(b) = &lin.bias {
                add_bias(d, a.x, d.addr(b, 0), hidden, n * hidden)?;
            }
            Ok(())
        }

        /// The final norm of the rows that need logits, then lm_head into
        /// `logits`; nothing when no row does.
        fn enqueue_logits(&self, a: &StepAddrs) -> Result<(), EngineError> {
            if a.r == 0 {
                return Ok(());
            }
            let (d, w) = (&self.device, &self.weights);
            let (hidden, vocab) = (w.config.hidden_size, w.config.vocab_size);
            self.enqueue_rms_norm(a, a.r, &w.final_norm, a.logit_rows)?;
            // SAFETY: h holds r normalised rows, lm_head is [vocab, hidden], logits [r, vocab] f32.
            unsafe {
                d.linear(
                    a.logits,
                    a.h,
                    d.addr(w.lm_head(), 0),
                    a.r,
                    hidden,
                    vocab,
                    false,
                )
            }
        }

        /// The arguments of `kv_pack`/`kv_unpack` for block `id`.
        fn block_args(&self, staging: u64, id: u32) -> [Arg; 6] {
            [
                Arg::Ptr(staging),
                Arg::Ptr(self.slab(0)),
                Arg::U32(id),
                Arg::U32(self.num_blocks as u32),
                Arg::I32((2 * self.layout.num_layers) as i32),
                Arg::I32(self.chunk as i32),
            ]
        }
    }

    impl Backend for CudaBackend {
        fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput, EngineError> {
            validate_batch(
                batch,
                self.weights.config.vocab_size,
                self.layout.block_size,
                self.num_blocks,
            )?;
            let data = if batch.seqs.is_empty() {
                Vec::new()
            } else {
                self.device.bind()?;
                self.run(batch)?
            };
            Ok(ForwardOutput::Logits {
                vocab_size: self.weights.config.vocab_size,
                data,
            })
        }

        fn kv_layout(&self) -> KvBlockLayout {
            self.layout
        }

        fn num_blocks(&self) -> usize {
            self.num_blocks
        }

        /// The CPU backend's serialised form (f32, layer by layer, K then
        /// V), converted from the device's bf16 on the device.
        fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError> {
            self.check_block(id, out.len())?;
            let d = &self.device;
            d.bind()?;
            let mut staging = self.staging.borrow_mut();
            let Staging { device, host } = &mut *staging;
            let elems = device.len();
            let args = self.block_args(d.addr(device, 0), id);
            // kv_pack(dst, cache, ...): the staging buffer is the destination.
            d.launch(
                &d.kernels.kv_pack,
                plan::grid_stride(elems, d.max_blocks),
                &args,
            )?;
            d.stream
                .memcpy_dtoh(&*device, host)
                .map_err(driver("copying a KV block to the host"))?;
            d.sync("reading a KV block")?;
            let values = host.as_slice().map_err(driver("reading a KV block"))?;
            for (o, v) in out.chunks_exact_mut(4).zip(&values[..elems]) {
                o.copy_from_slice(&v.to_le_bytes());
            }
            Ok(())
        }

        /// Same form as [`CudaBackend::read_block`], rounded to bf16 on the device.
        fn write_block(&mut self, id: u32, data: &[u8]) -> Result<(), EngineError> {
            self.check_block(id, data.len())?;
            let d = &self.device;
            d.bind()?;
            let mut staging = self.staging.borrow_mut();
            let Staging { device, host } = &mut *staging;
            let elems = device.len();
            let values = host.as_mut_slice().map_err(driver("staging a KV block"))?;
            for (v, b) in values[..elems].iter_mut().zip(data.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            d.stream
                .memcpy_htod(&*host, device)
                .map_err(driver("copying a KV block to the device"))?;
            // kv_unpack(cache, src, ...): same argument order, roles swapped.
            let [staging_arg, cache_arg, rest @ ..] = self.block_args(d.addr(device, 0), id);
            let mut args = vec![cache_arg, staging_arg];
            args.extend(rest);
            d.launch(
                &d.kernels.kv_unpack,
                plan::grid_stride(elems, d.max_blocks),
                &args,
            )?;
            d.sync("writing a KV block")
        }

        fn vocab_size(&self) -> usize {
            self.weights.config.vocab_size
        }

        fn name(&self) -> &'static str {
            "cuda"
        }
    }
}
