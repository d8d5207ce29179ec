//! One request's path through the mesh, shared by the HTTP and gRPC APIs:
//! template and tokenize once, hash the blocks once, take an admission lease
//! from the queue, call `Generate` on the granted worker, and detokenize the
//! tokens as they stream back. By stage: [`prepare`] (checks, template,
//! tokens, the request's description), [`admission`] (the lease, with
//! failover across queue replicas, and the worker stream it grants) and
//! [`generation`] (the stream back: detokenizing, usage, timing, migration).
//! This file holds the types they share.
//!
//! Resources ride with the [`Generation`]: it owns the lease's request side
//! and the worker stream, so dropping it (client gone, stop string, deadline)
//! releases the queue slot and aborts the sequence on the worker.
//!
//! A worker that fails mid-stream (dies, resets the stream, ends it
//! unfinished) does not fail the request: up to `--migration-limit` times,
//! the generation takes a new lease that excludes the failed workers and
//! asks another worker to go on from the prompt plus every token already
//! streamed; the client's stream continues where it was.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_proto::common::v1 as common;
use sluice_proto::queue::v1 as qpb;
use sluice_proto::worker::v1 as wpb;
use sluice_runtime::RequestDescription;
use sluice_tokens::grammar::{GrammarSpec, Grammars};
use sluice_tokens::tools::{ToolDef, ToolFormat};
use sluice_tokens::{
    ChatMessage, ChatRenderOptions, ChatTemplate, IncrementalDetokenizer, Tokenizer,
};
use tracing::{Instrument, Span};

use crate::auth::Identity;
use crate::error::FrontendError;
use crate::lease::{LeaseEvent, LeaseSessions, QueueLease};
use crate::mesh::{Channels, Members};
use crate::metrics::Metrics;
use crate::openai::{GenerateParams, Prompt, ToolChoice, Tools};
use crate::worker_session::{GenerateSessions, WorkerStream};

mod admission;
mod generation;
mod prepare;

/// Block size assumed until a worker reports its own.
const DEFAULT_BLOCK_SIZE: usize = 16;

/// Output tokens between two `progress` reports on a lease: the queue
/// charges the tenant as tokens are produced, at the cost of one message
/// per this many tokens (the final count goes with `done`).
const PROGRESS_TOKENS: u32 = 32;

/// Shared state of the frontend's request path.
#[derive(Debug)]
pub(crate) struct Pipeline {
    pub model: String,
    pub created: i64,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub queues: Arc<Members>,
    pub workers: Arc<Members>,
    pub routers: Arc<Members>,
    pub channels: Channels,
    pub metrics: Metrics,
    pub default_max_tokens: u32,
    pub request_timeout: Duration,
    /// Moves to another worker a request may make (`--migration-limit`).
    pub migration_limit: u32,
    /// How long a queue has to open an admission lease
    /// (`--queue-answer-timeout-ms`).
    pub queue_answer_timeout: Duration,
    /// Admission leases, one session per queue.
    pub leases: LeaseSessions,
    /// Generations, one session per worker.
    pub generations: GenerateSessions,
    /// `--api-key-file`'s keys; `None`: open.
    pub api_keys: Option<crate::auth::ApiKeys>,
    /// The model's context, for the prompt's size checks.
    pub prompt_limits: crate::prompt::PromptLimits,
    /// Prompts tokenized at once (`--tokenize-concurrency`).
    pub tokenize_slots: Arc<tokio::sync::Semaphore>,
    /// `--max-body-bytes`.
    pub max_body_bytes: usize,
    /// Compiles structured-output grammars to check them before a request
    /// is queued (built on first use; the worker compiles its own).
    pub grammars: std::sync::OnceLock<Result<Grammars, String>>,
    /// How the model writes tool calls (`--tool-call-parser`, else read
    /// from its chat template).
    pub tool_format: ToolFormat,
}

impl Pipeline {
    /// Checks an `Authorization` value against `--api-key-file`: the key's
    /// identity, or `None` when the frontend has no keys.
    pub(crate) fn authorize(
        &self,
        authorization: Option<&[u8]>,
    ) -> Result<Option<Identity>, FrontendError> {
        self.api_keys
            .as_ref()
            .map(|keys| keys.check(authorization))
            .transpose()
    }
}

/// Sets `params`' tenant: the key's (`identity`), else the claimed one
/// (`claimed`, from `claim_field`), else `params.user` (see
/// [`crate::auth::resolve_tenant`]).
pub(crate) fn assign_tenant(
    params: &mut GenerateParams,
    identity: Option<&Identity>,
    claimed: Option<&str>,
    claim_field: &str,
) -> Result<(), FrontendError> {
    let tenant =
        crate::auth::resolve_tenant(identity, claimed, claim_field, params.user.as_deref())?;
    params.tenant = tenant.name;
    params.tenant_weight = tenant.weight;
    Ok(())
}

/// A request ready for the mesh: tokenized and hashed.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    /// The parsed request: sampling, stop strings, timeout (its id, hints
    /// and tenant are in `desc`, which the rest of the path reads).
    pub params: GenerateParams,
    pub prompt_ids: Vec<u32>,
    /// What travels to the queue and the router: id, model, priority,
    /// tenant, the prompt's length and block hashes. Exclusions are added
    /// per admission (the workers that failed this request).
    pub desc: RequestDescription,
    pub received: Instant,
    /// The client had its first token (a migration continues the request):
    /// no TTFT target applies to the worker that goes on with it.
    pub first_token_sent: bool,
}

impl Prepared {
    /// The description of `params` with a prompt of `prompt_ids` hashed
    /// in blocks of `block_size` tokens, for `model`.
    fn describe(
        model: &str,
        params: &GenerateParams,
        prompt_ids: &[u32],
        block_size: usize,
    ) -> RequestDescription {
        RequestDescription {
            request_id: params.request_id.clone(),
            model: model.to_owned(),
            priority: params.hints.priority,
            strict_priority: params.hints.strict_priority,
            tenant: params.tenant.clone(),
            tenant_weight: params.tenant_weight,
            prompt_tokens: prompt_ids.len() as u32,
            expected_output_tokens: expected_output_tokens(params),
            ttft_target_ms: params.hints.ttft_target_ms,
            tpot_target_ms: params.hints.tpot_target_ms,
            block_hashes: sluice_tokens::sequence_block_hashes(prompt_ids, block_size).into(),
            block_size: block_size as u32,
            exclude_worker_ids: Arc::from([]),
        }
    }
}

/// The client's expected output length, else its `max_tokens`.
fn expected_output_tokens(params: &GenerateParams) -> u32 {
    if params.hints.osl > 0 {
        params.hints.osl
    } else {
        params.sampling.max_tokens
    }
}

/// One generated position's logprobs: as the worker sent them (the gRPC
/// API forwards `wire` unchanged) and with each token's text (the OpenAI
/// shape the HTTP API renders). Made once, by `Pipeline::logprob_entry`.
#[derive(Debug, Clone)]
pub(crate) struct TokenLogprob {
    pub wire: common::PositionLogprobs,
    /// The chosen token's text and logprob.
    pub token: String,
    pub logprob: f32,
    /// The alternatives' texts and logprobs, most likely first.
    pub top: Vec<(String, f32)>,
}

/// What a generation yields.
#[derive(Debug)]
pub(crate) enum Event {
    /// New text (possibly empty while a character is incomplete) and tokens.
    Delta {
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
    },
    /// The end: why, the usage and where it ran.
    Done {
        finish_reason: common::FinishReason,
        usage: common::Usage,
        serving: Serving,
    },
}

/// What one worker message adds to the output.
struct Delta {
    text: String,
    token_ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
}

/// Where a request ran and how long it waited (the API's `nvext`).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub(crate) struct Serving {
    pub worker_id: String,
    /// The worker's data-parallel engine rank that ran the request.
    pub dp_rank: u32,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub prefill_worker_id: String,
    pub priority: i32,
    /// The tenant the request was queued and counted as.
    pub tenant: String,
    pub queue_wait_ms: f64,
    /// Prompt tokens the router expected cached on the worker it chose
    /// (routing you can check against `usage.prompt_tokens_details`).
    pub routed_overlap_tokens: u32,
    /// Prompt tokens the worker fetched from a peer's cache instead of
    /// computing them (counted in `usage.cached_tokens` too).
    #[serde(skip_serializing_if = "is_zero")]
    pub fetched_tokens: u32,
    /// The peer the router named to fetch the prompt's prefix from.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub prefix_source_worker_id: String,
    /// Moves to another worker after a worker failed mid-stream.
    #[serde(skip_serializing_if = "is_zero")]
    pub migrations: u32,
    /// The TTFT target the queue held the request to (its own, or the
    /// default for its priority).
    pub ttft_target_ms: u32,
    /// The queue wait predicted at admission (absent: no prediction).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_queue_wait_ms: Option<f64>,
    /// The router's predicted time from placement to the first token on
    /// the worker it chose (absent: no prediction).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_ttft_ms: Option<f64>,
    /// Whether the router predicted that within what was left of the TTFT
    /// target (absent: no prediction).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_within_target: Option<bool>,
    /// Time to the first token, as the frontend measured it.
    pub ttft_ms: f64,
    /// Whether the first token came within the target.
    pub ttft_target_met: bool,
    /// The TPOT target the request asked for or got by default (0 = none).
    #[serde(skip_serializing_if = "is_zero")]
    pub tpot_target_ms: u32,
    /// Mean time per output token after the first (absent with fewer than
    /// two tokens).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    /// Whether it met the TPOT target (absent without a target or a
    /// measurement).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpot_target_met: Option<bool>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Why opening or reading a worker stream failed: the worker itself failed
/// (the request may go on elsewhere), or anything else.
enum Failure {
    Worker {
        worker_id: String,
        error: FrontendError,
    },
    Other(FrontendError),
}

impl Failure {
    /// `error` from `worker_id`, a worker failure when `failed`.
    fn of_worker(worker_id: &str, failed: bool, error: FrontendError) -> Self {
        if failed {
            Failure::Worker {
                worker_id: worker_id.to_string(),
                error,
            }
        } else {
            Failure::Other(error)
        }
    }

    fn into_error(self) -> FrontendError {
        match self {
            Failure::Worker { error, .. } | Failure::Other(error) => error,
        }
    }
}

impl From<FrontendError> for Failure {
    fn from(e: FrontendError) -> Self {
        Failure::Other(e)
    }
}

impl From<sluice_tokens::TokensError> for Failure {
    fn from(e: sluice_tokens::TokensError) -> Self {
        Failure::Other(e.into())
    }
}

use sluice_proto::queue::v1::QueueReason;

/// The lease and its grant.
type Admitted = (QueueLease, qpb::Grant);

/// Why admission at one queue failed: the queue failed (another may admit
/// the request), or it answered (no other would answer differently).
#[derive(Debug)]
enum QueueFailure {
    Queue(FrontendError),
    Answer(FrontendError),
}

impl From<FrontendError> for QueueFailure {
    fn from(e: FrontendError) -> Self {
        QueueFailure::Answer(e)
    }
}

/// A placed request: its lease, the worker's stream and the grant.
struct Opened {
    lease: QueueLease,
    grant: qpb::Grant,
    stream: WorkerStream,
    span: Span,
}

impl Pipeline {
    /// The block size the workers for this model use.
    fn block_size(&self) -> usize {
        self.workers
            .worker_fact(&self.model, |w| Some(w.block_size as usize))
            .unwrap_or(DEFAULT_BLOCK_SIZE)
    }

    /// Whether a request for the model can be admitted, placed and served
    /// end to end: a worker serving it, a queue and a router are all
    /// registered (`/ready`, and `/v1/models` lists the model only then).
    /// Each registers only once it can serve: a worker after loading its
    /// model, a router after its index holds every known worker, and a
    /// router answers for a worker still joining by waiting for it.
    pub(crate) fn ready(&self) -> bool {
        self.workers.count(&self.model) > 0
            && self.queues.count("") > 0
            && self.routers.count("") > 0
    }
}

/// A running request. Dropping it releases the lease and aborts the worker.
#[derive(Debug)]
pub(crate) struct Generation {
    pipeline: Arc<Pipeline>,
    /// The admission lease, ended with `done` on drop (see `Drop`).
    lease: Option<QueueLease>,
    /// The worker's stream; dropping it unfinished aborts the sequence.
    stream: Option<WorkerStream>,
    detok: IncrementalDetokenizer,
    serving: Serving,
    /// Prompt and cached tokens as the worker reports them; its completion
    /// count is `generated`'s.
    usage: common::Usage,
    want_logprobs: bool,
    priority_label: String,
    received: Instant,
    /// When the first and the latest output tokens arrived.
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    deadline: Instant,
    pending: VecDeque<Event>,
    finished: bool,
    /// The error the request ended in, given after the events still pending.
    failed: Option<FrontendError>,
    span: Span,
    /// The request as first placed (a migration continues it).
    request: Prepared,
    /// Tokens streamed so far, across workers.
    generated: Vec<u32>,
    /// Tokens generated when the current lease began (a migrated
    /// request's new lease counts from there).
    lease_base: u32,
    /// Output tokens last reported on the current lease (`progress`).
    reported: u32,
    /// Workers that failed this request mid-stream.
    failed_workers: Vec<String>,
}

/// Whether a worker stream's error means the worker failed (so the request
/// may go on elsewhere) rather than refusing the request.
fn worker_failed(s: &tonic::Status) -> bool {
    use tonic::Code;
    matches!(
        s.code(),
        Code::Unavailable
            | Code::Unknown
            | Code::Internal
            | Code::Cancelled
            | Code::Aborted
            | Code::DataLoss
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker that failed lets the request go on elsewhere (admission
    /// tries another, a running generation migrates); a worker that
    /// refused the request does not.
    #[test]
    fn only_a_failed_worker_sends_the_request_elsewhere() {
        use tonic::Code;
        for code in [
            Code::Unavailable,
            Code::Unknown,
            Code::Internal,
            Code::Cancelled,
            Code::Aborted,
            Code::DataLoss,
        ] {
            assert!(worker_failed(&tonic::Status::new(code, "")), "{code:?}");
        }
        for code in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::ResourceExhausted,
            Code::DeadlineExceeded,
            Code::Unimplemented,
            Code::PermissionDenied,
        ] {
            assert!(!worker_failed(&tonic::Status::new(code, "")), "{code:?}");
        }
    }
}
