//! The flags every worker takes (decode and prefill alike; `sluice up`
//! flattens them once), and building the engine they describe.

use std::path::Path;
use std::sync::Arc;

use sluice_engine::backend::KvBacking;
use sluice_engine::backend::cpu::CpuBackend;
use sluice_engine::model::ModelConfig;
use sluice_engine::{
    BalanceGroup, EngineConfig, EngineHandle, MockerBackend, MockerConfig, SchedulerConfig,
    SchedulingPolicy,
};
use sluice_tokens::Tokenizer;
use sluice_tokens::grammar::Grammars;

use crate::error::WorkerError;

/// How long a lockstep rank waits for its peers before stepping alone.
const LOCKSTEP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
use sluice_kv_transfer::TransportKind;

/// Which compute backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    /// The real transformer on CPU.
    Cpu,
    /// The real scheduler and KV cache with compute replaced by Dynamo's
    /// timing model; needs only config.json and the tokenizer.
    Mocker,
    /// The real transformer on an NVIDIA GPU (builds with the cargo
    /// feature `cuda`; needs the driver, NVRTC and cuBLAS of CUDA 13).
    Cuda,
}

impl EngineKind {
    /// The default second KV tier, in KV memories: twice on a GPU (host
    /// memory is the larger; SGLang HiCache's `--hicache-ratio` 2) and the
    /// mocker that models one, once on the CPU engine, whose KV memory is
    /// host memory already.
    pub fn kv_tier_ratio(self) -> u64 {
        match self {
            EngineKind::Cpu => 1,
            EngineKind::Mocker | EngineKind::Cuda => 2,
        }
    }

    /// The backend its discovery entry publishes.
    pub fn backend(self) -> sluice_runtime::discovery::EngineBackend {
        use sluice_runtime::discovery::EngineBackend;
        match self {
            EngineKind::Cpu => EngineBackend::Cpu,
            EngineKind::Mocker => EngineBackend::Mocker,
            EngineKind::Cuda => EngineBackend::Cuda,
        }
    }
}

/// A cuda backend on the GPU of data-parallel `rank` (ranks spread over the
/// visible devices).
#[cfg(feature = "cuda")]
fn cuda_backend(
    dir: &Path,
    num_blocks: usize,
    block_size: usize,
    rank: usize,
) -> Result<Box<dyn sluice_engine::backend::Backend>, WorkerError> {
    use sluice_engine::EngineError;
    match sluice_engine::backend::cuda::CudaBackend::from_path(dir, num_blocks, block_size, rank) {
        Ok(b) => Ok(Box::new(b)),
        // A host that cannot run the engine at all: one line naming what is
        // missing, against the flag that asked for it.
        Err(e @ (EngineError::CudaLibraryMissing { .. } | EngineError::NoCudaDevice { .. })) => {
            Err(WorkerError::InvalidArgument {
                field: "--engine",
                message: e.to_string(),
            })
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(
    _dir: &Path,
    _num_blocks: usize,
    _block_size: usize,
    _rank: usize,
) -> Result<Box<dyn sluice_engine::backend::Backend>, WorkerError> {
    Err(WorkerError::InvalidArgument {
        field: "--engine",
        message: "this build has no cuda engine: rebuild with `cargo build --features cuda`".into(),
    })
}

/// Engine and worker flags.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Worker")]
pub struct WorkerArgs {
    /// Compute backend.
    #[arg(long, env = "SLUICE_ENGINE", value_enum, default_value_t = EngineKind::Cpu)]
    pub engine: EngineKind,

    /// Tokens per KV block.
    #[arg(long, env = "SLUICE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,

    /// KV blocks per engine rank.
    #[arg(long, env = "SLUICE_NUM_GPU_BLOCKS", default_value_t = 2048)]
    pub num_gpu_blocks: usize,

    /// Sequences running at once per rank.
    #[arg(long, env = "SLUICE_MAX_NUM_SEQS", default_value_t = 64)]
    pub max_num_seqs: usize,

    /// Tokens computed per step (prefill chunks and decode tokens together).
    #[arg(long, env = "SLUICE_MAX_NUM_BATCHED_TOKENS", default_value_t = 2048)]
    pub max_num_batched_tokens: usize,

    /// With chunked prefill, the most tokens one prompt's prefill chunk takes
    /// before the other sequences of the step (and waiting short prompts)
    /// have had theirs; what is left of the step then goes back to it, so a
    /// long prompt alone still fills the step while a short one arriving
    /// behind it is not held up for the whole prefill. Prompts longer than
    /// this prefill one at a time. Default: a quarter of
    /// --max-num-batched-tokens; 0 = off (vLLM's behaviour).
    #[arg(long, env = "SLUICE_LONG_PREFILL_TOKEN_THRESHOLD")]
    pub long_prefill_token_threshold: Option<usize>,

    /// Steps waiting prompts may wait, when more of them wait than slots are
    /// free (or the engine is nearly full) and
    /// running sequences reach their `max_tokens` within that many steps, to
    /// be admitted together with the slots those free: one prefill step (and
    /// its fixed cost) for all of them instead of one each. Prompts that
    /// outrank a running sequence never wait. Default: 4 with
    /// `--scheduling-policy priority`, whose preemptions put slots out of
    /// step with the others, else 0 = off (vLLM's behaviour).
    #[arg(long, env = "SLUICE_ADMISSION_WAIT_STEPS")]
    pub admission_wait_steps: Option<usize>,

    /// Prefill first: while prompts wait or are mid-prefill, up to this many
    /// steps in a row leave decode rows out, so a prompt's first token comes
    /// sooner where decode rows lengthen a step (the mocker's timing, as
    /// Dynamo's; attention over long contexts). Only rows of sequences at or
    /// below the prompts' priority and without a TPOT target sit out (when
    /// every decoding row is such), one step each time (a second in a row
    /// only for a prefill in progress), and only while the free slots take
    /// every waiting sequence (an engine at capacity mixes every step).
    /// 0 = off (vLLM's behaviour: every step carries every decode row).
    #[arg(long, env = "SLUICE_PREFILL_FIRST_STEPS", default_value_t = PREFILL_FIRST_STEPS)]
    pub prefill_first_steps: usize,

    /// Longest sequence (prompt + output); default: the model's limit. The
    /// mocker, which computes no positions, may go past that limit (to
    /// simulate a long-context deployment of a small model's config).
    #[arg(long, env = "SLUICE_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,

    /// Engine scheduling policy: `priority` (the default) admits higher
    /// priority first and preempts the lowest-priority running sequence
    /// under pressure, keeping its KV; equal priorities are first come,
    /// first served. `fcfs` turns priority off in the engine.
    #[arg(long, env = "SLUICE_SCHEDULING_POLICY", default_value = "priority", value_parser = ["fcfs", "priority"])]
    pub scheduling_policy: String,

    /// With `--scheduling-policy priority`: never preempt a running sequence
    /// only because `--max-num-seqs` is reached (a waiting higher-priority
    /// request then waits for a slot; KV pressure still preempts).
    #[arg(long, env = "SLUICE_NO_PREEMPT_ON_SEQ_LIMIT")]
    pub no_preempt_on_seq_limit: bool,

    /// Turn off prefix caching.
    #[arg(long, env = "SLUICE_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,

    /// Mocker only: divide every modelled duration by this.
    #[arg(long, env = "SLUICE_SPEEDUP_RATIO", default_value_t = 1.0)]
    pub speedup_ratio: f64,

    /// Bytes of the second KV tier: full blocks evicted from KV memory are
    /// kept there (host memory), most reused longest, and restored on a
    /// prefix hit instead of being computed again. Default: twice the KV
    /// memory on a GPU (and the mocker, which models one; SGLang HiCache's
    /// ratio: a GPU host's memory is several times its GPUs'), as much
    /// again on the CPU engine, whose KV memory is host memory already; 0
    /// turns it off.
    #[arg(long, env = "SLUICE_KV_TIER_BYTES")]
    pub kv_tier_bytes: Option<u64>,

    /// Mocker only: GB/s a block restored from the second tier moves at.
    #[arg(long, env = "SLUICE_MOCKER_KV_TIER_GBPS", default_value_t = 50.0)]
    pub mocker_kv_tier_gbps: f64,

    /// Mocker only: KV bytes per token of the modelled model, what a KV
    /// transfer between workers is timed by (default: Llama-3-8B in bf16,
    /// the model the timing polynomial describes).
    #[arg(long, env = "SLUICE_MOCKER_KV_BYTES_PER_TOKEN", default_value_t = sluice_engine::backend::mocker::MODELLED_KV_BYTES_PER_TOKEN)]
    pub mocker_kv_bytes_per_token: u64,

    /// Mocker only: GB/s of the modelled KV link between workers.
    #[arg(long, env = "SLUICE_MOCKER_KV_TRANSFER_GBPS", default_value_t = 25.0)]
    pub mocker_kv_transfer_gbps: f64,

    /// KV events kept for late subscribers.
    #[arg(long, env = "SLUICE_EVENT_RING_CAPACITY", default_value_t = 10_000)]
    pub event_ring_capacity: usize,

    /// Decode workers: prefill remotely when the uncached prompt is longer
    /// than this many tokens (and a prefill worker is available).
    #[arg(long, env = "SLUICE_MAX_LOCAL_PREFILL_LENGTH", default_value_t = 512)]
    pub max_local_prefill_length: usize,

    /// Decode workers: prefill locally while this many remote prefills are
    /// already in flight from this worker.
    #[arg(long, env = "SLUICE_MAX_PREFILL_QUEUE_SIZE", default_value_t = 8)]
    pub max_prefill_queue_size: usize,

    /// Milliseconds a decode worker waits for a remote prefill before
    /// prefilling locally.
    #[arg(
        long,
        env = "SLUICE_REMOTE_PREFILL_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub remote_prefill_timeout_ms: u64,

    /// Engine ranks (data parallel) in this worker. Ranks step in lockstep,
    /// as the data-parallel ranks of an MoE model do; the router places on
    /// (worker, rank).
    #[arg(long, env = "SLUICE_DATA_PARALLEL_SIZE", default_value_t = 1)]
    pub data_parallel_size: usize,

    /// Admit waiting requests on a rank only while the largest running count
    /// across ranks is below `max_num_seqs - 1` (vLLM-Ascend patch 5212).
    #[arg(long, env = "SLUICE_BALANCE_SCHEDULING")]
    pub balance_scheduling: bool,

    /// KV transports this worker offers (decode) or accepts (prefill),
    /// preferred first; ones this build or machine cannot run are skipped.
    #[arg(
        long,
        env = "SLUICE_KV_TRANSPORTS",
        value_enum,
        value_delimiter = ',',
        default_values_t = TransportKind::ALL
    )]
    pub kv_transports: Vec<TransportKind>,

    /// Decode workers: where the `tcp` KV listener binds (default: the gRPC
    /// listener's host, a free port).
    #[arg(long, env = "SLUICE_KV_TCP_LISTEN")]
    pub kv_tcp_listen: Option<std::net::SocketAddr>,

    /// Decode workers: `shm` senders record a per-block XXH3 checksum and
    /// completion verifies it (a pass over the blocks on each side; off by
    /// default: a memory-to-memory copy is as safe as the memory, as with
    /// RDMA). `tcp` and `grpc` always checksum.
    #[arg(long, env = "SLUICE_KV_SHM_CHECKSUMS")]
    pub kv_shm_checksums: bool,

    /// Tests only (feature `fault-injection`; no flag): a step failure the
    /// test arms, shared by every engine built from these arguments.
    #[cfg(feature = "fault-injection")]
    #[arg(skip)]
    pub step_fault: Option<Arc<crate::fault::StepFault>>,

    /// Tests only (feature `fault-injection`; no flag): every `Generate`
    /// reply stream waits this long before each read of the engine, so the
    /// engine's outputs pile up and go out merged, as behind a busy runtime.
    #[cfg(feature = "fault-injection")]
    #[arg(skip)]
    pub reply_lag: Option<std::time::Duration>,
}

/// `--admission-wait-steps` under `--scheduling-policy priority` unless set:
/// in the queue bench's burst, priority with it kept output throughput at or
/// above priority off in every run, and without it fell 2-3% in two of three.
const PRIORITY_ADMISSION_WAIT_STEPS: usize = 4;

/// `--prefill-first-steps` unless set. On the routing bench's Mooncake slice
/// (`tests/bench/results/routing.md`) 2 cuts TTFT mean by a third at the
/// same mean TPOT, and 3 the p90 another 10% (prompts of 2-3k uncached
/// tokens, three steps, no longer pay a decode pass in their last), at
/// 1.5% of token gaps over 1 s against 0.06% for rows without a TPOT
/// target (SGLang's default leaves decode out of every chunk of a long
/// prefill). Under sustained overload (`tests/bench/overload/run.sh`)
/// the engine mixes every step, since more wait than slots are free: before
/// that rule, prompts trickling into freed slots took 34% more prompt steps,
/// each paying the fixed cost, and goodput fell to 93.5-94.4% of capacity
/// (99.2% with it).
const PREFILL_FIRST_STEPS: usize = 3;

impl Default for WorkerArgs {
    fn default() -> Self {
        Self {
            engine: EngineKind::Cpu,
            block_size: 16,
            num_gpu_blocks: 2048,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            long_prefill_token_threshold: None,
            admission_wait_steps: None,
            prefill_first_steps: PREFILL_FIRST_STEPS,
            max_model_len: None,
            scheduling_policy: "priority".into(),
            no_preempt_on_seq_limit: false,
            no_prefix_caching: false,
            speedup_ratio: 1.0,
            mocker_kv_bytes_per_token: sluice_engine::backend::mocker::MODELLED_KV_BYTES_PER_TOKEN,
            mocker_kv_transfer_gbps: 25.0,
            kv_tier_bytes: None,
            mocker_kv_tier_gbps: 50.0,
            event_ring_capacity: 10_000,
            max_local_prefill_length: 512,
            max_prefill_queue_size: 8,
            remote_prefill_timeout_ms: 10_000,
            data_parallel_size: 1,
            balance_scheduling: false,
            kv_transports: TransportKind::ALL.to_vec(),
            kv_tcp_listen: None,
            kv_shm_checksums: false,
            #[cfg(feature = "fault-injection")]
            step_fault: None,
            #[cfg(feature = "fault-injection")]
            reply_lag: None,
        }
    }
}

impl WorkerArgs {
    /// Checks the flags; errors name the flag.
    pub fn validate(&self) -> Result<(), WorkerError> {
        let bad = |field: &'static str, message: &str| {
            Err(WorkerError::InvalidArgument {
                field,
                message: message.into(),
            })
        };
        if self.block_size == 0 || self.block_size > 1024 {
            return bad("--block-size", "must be in 1..=1024");
        }
        if self.num_gpu_blocks == 0 {
            return bad("--num-gpu-blocks", "must be at least 1");
        }
        if self.max_num_seqs == 0 {
            return bad("--max-num-seqs", "must be at least 1");
        }
        if self.max_num_batched_tokens == 0 {
            return bad("--max-num-batched-tokens", "must be at least 1");
        }
        if !(self.speedup_ratio.is_finite() && self.speedup_ratio > 0.0) {
            return bad("--speedup-ratio", "must be a positive number");
        }
        if !(self.mocker_kv_transfer_gbps.is_finite() && self.mocker_kv_transfer_gbps > 0.0) {
            return bad("--mocker-kv-transfer-gbps", "must be a positive number");
        }
        if !(self.mocker_kv_tier_gbps.is_finite() && self.mocker_kv_tier_gbps > 0.0) {
            return bad("--mocker-kv-tier-gbps", "must be a positive number");
        }
        if self.data_parallel_size == 0 || self.data_parallel_size > 64 {
            return bad("--data-parallel-size", "must be in 1..=64");
        }
        if self.kv_transports.is_empty() {
            return bad(
                "--kv-transports",
                "name at least one of shm, rdma, tcp, grpc",
            );
        }
        Ok(())
    }

    /// `--admission-wait-steps`, or its default for `policy`.
    fn admission_wait_steps(&self, policy: SchedulingPolicy) -> usize {
        let default = match policy {
            SchedulingPolicy::Priority => PRIORITY_ADMISSION_WAIT_STEPS,
            SchedulingPolicy::Fcfs => 0,
        };
        self.admission_wait_steps.unwrap_or(default)
    }

    fn policy(&self) -> Result<SchedulingPolicy, WorkerError> {
        self.scheduling_policy
            .parse()
            .map_err(
                |e: sluice_engine::EngineError| WorkerError::InvalidArgument {
                    field: "--scheduling-policy",
                    message: e.to_string(),
                },
            )
    }

    /// Starts every engine rank for the model in `dir`; ranks of one worker
    /// share a balance group (and step in lockstep when there are several).
    /// Their KV memory lives in `backing` (see [`WorkerArgs::start_engine`]).
    pub fn start_engines(
        &self,
        dir: &Path,
        backing: &KvBacking,
    ) -> Result<Vec<EngineHandle>, WorkerError> {
        self.validate()?;
        let n = self.data_parallel_size;
        let group = if n > 1 {
            Some(BalanceGroup::lockstep(n, LOCKSTEP_TIMEOUT))
        } else if self.balance_scheduling {
            Some(BalanceGroup::new(1))
        } else {
            None
        };
        (0..n)
            .map(|rank| self.start_engine(dir, group.clone().map(|g| (g, rank)), backing))
            .collect()
    }

    /// Starts one engine rank for the model in `dir`.
    ///
    /// Its KV memory lives in `backing`; when shared memory cannot be had
    /// (e.g. the memory limit is too low to reserve it), in private memory,
    /// and `shm` is then not offered for this rank.
    pub fn start_engine(
        &self,
        dir: &Path,
        balance_group: Option<(Arc<BalanceGroup>, usize)>,
        backing: &KvBacking,
    ) -> Result<EngineHandle, WorkerError> {
        self.validate()?;
        let model = ModelConfig::from_path(dir)?;
        let tokenizer =
            Tokenizer::from_path(dir).map_err(WorkerError::startup("loading the tokenizer"))?;
        let mut eos: Vec<u32> = model.eos_token_ids.clone();
        for &id in tokenizer.eos_token_ids() {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        // Structured outputs need every token's bytes; a tokenizer that
        // cannot give them leaves the model without (requests asking for
        // one are refused, naming why).
        let grammars = match Grammars::new(&tokenizer, model.vocab_size) {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::warn!(error = %e, "structured outputs are off for this model");
                None
            }
        };
        let positions = match self.engine {
            EngineKind::Mocker => usize::MAX,
            _ => model.max_position_embeddings,
        };
        let max_model_len = self
            .max_model_len
            .unwrap_or(model.max_position_embeddings)
            .min(positions)
            .min(self.num_gpu_blocks * self.block_size);
        let mut backend: Box<dyn sluice_engine::backend::Backend> = match self.engine {
            EngineKind::Cpu => Box::new(CpuBackend::from_path(
                dir,
                self.num_gpu_blocks,
                self.block_size,
            )?),
            EngineKind::Cuda => cuda_backend(
                dir,
                self.num_gpu_blocks,
                self.block_size,
                balance_group.as_ref().map_or(0, |(_, rank)| *rank),
            )?,
            EngineKind::Mocker => Box::new(MockerBackend::new(MockerConfig {
                vocab_size: model.vocab_size,
                num_layers: model.num_hidden_layers,
                num_kv_heads: model.num_key_value_heads,
                head_dim: model.head_dim,
                block_size: self.block_size,
                num_blocks: self.num_gpu_blocks,
                speedup_ratio: self.speedup_ratio,
                avoid_token_ids: mocker_avoids(&eos, &tokenizer, model.vocab_size),
                kv_bytes_per_token: self.mocker_kv_bytes_per_token,
                kv_transfer_bytes_per_sec: self.mocker_kv_transfer_gbps * 1e9,
                kv_tier_bytes_per_sec: self.mocker_kv_tier_gbps * 1e9,
                ..MockerConfig::default()
            })?),
        };
        // A mocker keeps real KV memory too (private pages are committed
        // only as blocks are written): KV transfers and prefix fetches then
        // move its blocks straight in and out of that memory instead of
        // one engine step per block.
        let real_memory = *backing != KvBacking::Private || self.engine == EngineKind::Mocker;
        if real_memory && let Err(e) = backend.set_kv_backing(backing) {
            tracing::warn!(error = %e, "KV memory stays private; shm is not offered");
        }
        #[cfg(feature = "fault-injection")]
        if let Some(fault) = &self.step_fault {
            backend = crate::fault::faulty(backend, Arc::clone(fault));
        }
        let policy = self.policy()?;
        let cfg = EngineConfig {
            block_size: self.block_size,
            num_blocks: Some(self.num_gpu_blocks),
            scheduler: SchedulerConfig {
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_model_len,
                policy,
                balance_scheduling: self.balance_scheduling,
                preempt_on_seq_limit: !self.no_preempt_on_seq_limit,
                long_prefill_token_threshold: self
                    .long_prefill_token_threshold
                    .unwrap_or(self.max_num_batched_tokens / 4),
                admission_wait_steps: self.admission_wait_steps(policy),
                prefill_first_steps: self.prefill_first_steps,
                ..SchedulerConfig::default()
            },
            enable_prefix_caching: !self.no_prefix_caching,
            event_ring_capacity: self.event_ring_capacity,
            eos_token_ids: eos,
            balance_group,
            grammars,
            kv_tier_bytes: self.kv_tier_bytes.unwrap_or_else(|| {
                // A multiple of the KV memory (the modelled model's on a
                // timing backend, which keeps no bytes).
                let block = backend
                    .kv_transfer_model()
                    .map_or(backend.kv_layout().block_bytes() as u64, |m| m.block_bytes);
                block * self.num_gpu_blocks as u64 * self.engine.kv_tier_ratio()
            }),
        };
        Ok(EngineHandle::spawn(backend, cfg)?)
    }
}

/// The tokens a mocker never emits: the EOS ids, and those of the model's
/// `vocab_size` that render no text on their own (a byte of a multi-byte
/// character, a special token, an id the tokenizer lacks). A client's
/// first content waits for the token after such a one, so a mocker that
/// emitted them at random (6% of the built-in model's small vocabulary)
/// would hold a request's first token back a decode step now and then,
/// which a model's text does not. A vocabulary that renders nothing
/// alone keeps only the EOS ids out.
fn mocker_avoids(eos: &[u32], tokenizer: &Tokenizer, vocab_size: usize) -> Vec<u32> {
    let silent: Vec<u32> = (0..u32::try_from(vocab_size).unwrap_or(u32::MAX))
        .filter(|&id| {
            tokenizer
                .decode(&[id], true)
                .map_or(true, |text| text.is_empty() || text.contains('\u{fffd}'))
        })
        .filter(|id| !eos.contains(id))
        .collect();
    if silent.len() + eos.len() >= vocab_size {
        return eos.to_vec();
    }
    eos.iter().copied().chain(silent).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_wait_defaults_on_with_priority_scheduling_only() {
        let mut args = WorkerArgs::default();
        let policy = |a: &WorkerArgs| a.policy().expect("a known policy");
        assert_eq!(args.scheduling_policy, "priority", "priority by default");
        args.scheduling_policy = "fcfs".into();
        assert_eq!(args.admission_wait_steps(policy(&args)), 0);
        args.scheduling_policy = "priority".into();
        assert_eq!(
            args.admission_wait_steps(policy(&args)),
            PRIORITY_ADMISSION_WAIT_STEPS
        );
        args.admission_wait_steps = Some(0);
        assert_eq!(args.admission_wait_steps(policy(&args)), 0);
    }

    #[test]
    fn a_mocker_emits_only_tokens_that_render_text() {
        let tokenizer = sluice_engine::builtin::builtin_tokenizer().expect("built-in tokenizer");
        let vocab = tokenizer.vocab_size();
        let eos = tokenizer.eos_token_ids().to_vec();
        let avoided = mocker_avoids(&eos, &tokenizer, vocab + 8);
        // The EOS ids, the byte pieces and specials, and the ids past the
        // tokenizer's vocabulary: every other token renders text alone.
        assert!(eos.iter().all(|id| avoided.contains(id)));
        assert!((vocab as u32..vocab as u32 + 8).all(|id| avoided.contains(&id)));
        let rendered = (0..vocab as u32).filter(|id| !avoided.contains(id));
        let mut n = 0;
        for id in rendered {
            let text = tokenizer.decode(&[id], true).expect("decodes");
            assert!(
                !text.is_empty() && !text.contains('\u{fffd}'),
                "{id}: {text:?}"
            );
            n += 1;
        }
        // Most of the vocabulary is left (the 128 bytes above ASCII are not).
        assert!(n > vocab * 9 / 10, "{n} of {vocab}");
        assert!(avoided.len() > 128, "{}", avoided.len());
        // A tokenizer that renders nothing alone leaves only the EOS ids out.
        assert_eq!(mocker_avoids(&eos, &tokenizer, 2), eos);
    }
}
