//! One request's path through the mesh, shared by the HTTP and gRPC APIs:
//! template and tokenize once, hash the blocks once, take an admission lease
//! from the queue, call `Generate` on the granted worker, and detokenize the
//! tokens as they stream back.
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
use crate::generation::{GenerateSessions, WorkerStream};
use crate::lease::{LeaseEvent, LeaseSessions, QueueLease};
use crate::mesh::{Channels, Members};
use crate::metrics::Metrics;
use crate::openai::{GenerateParams, Prompt, ToolChoice, Tools};

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
    /// Moves to another worker after a worker failed mid-stream.
    #[serde(skip_serializing_if = "is_zero")]
    pub migrations: u32,
    /// The TTFT target the queue held the request to (its own, or the
    /// default for its priority).
    pub ttft_target_ms: u32,
    /// The queue wait predicted at admission (absent: no prediction).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_queue_wait_ms: Option<f64>,
    /// Time to the first token, as the frontend measured it.
    pub ttft_ms: f64,
    /// Whether the first token came within the target.
    pub ttft_target_met: bool,
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

    /// A request's `response_format` compiles for this model, or a 400
    /// naming what is wrong with it.
    fn check_structured_output(&self, params: &GenerateParams) -> Result<(), FrontendError> {
        use sluice_proto::common::v1::structured_output::Kind;
        let Some(kind) = params
            .sampling
            .structured_output
            .as_ref()
            .and_then(|s| s.kind.as_ref())
        else {
            return Ok(());
        };
        let param = "response_format";
        let spec = match kind {
            Kind::JsonObject(false) => return Ok(()),
            Kind::JsonObject(true) => GrammarSpec::JsonObject,
            Kind::JsonSchema(text) => {
                GrammarSpec::JsonSchema(serde_json::from_str(text).map_err(|e| {
                    FrontendError::invalid(param, format!("the JSON schema is not valid JSON: {e}"))
                })?)
            }
            Kind::Regex(rx) => GrammarSpec::Regex(rx.clone()),
            Kind::Lark(lark) => GrammarSpec::Lark(lark.clone()),
        };
        let grammars = self
            .grammars
            .get_or_init(|| {
                Grammars::new(&self.tokenizer, self.tokenizer.vocab_size())
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| FrontendError::invalid(param, e.clone()))?;
        grammars.constrain(&spec).map(drop).map_err(|e| {
            FrontendError::invalid(param, format!("the schema cannot be enforced: {e}"))
        })
    }

    /// The context a prompt must fit, output included (see
    /// [`crate::prompt::PromptLimits::context`]).
    fn context_len(&self) -> Option<usize> {
        self.prompt_limits.context(
            self.workers
                .worker_facts(&self.model, |w| Some(w.max_model_len? as usize)),
        )
    }

    /// Checks the model and the prompt's size, renders the template,
    /// tokenizes (on the tokenization pool, off the async runtime) and
    /// hashes, once.
    pub(crate) async fn prepare(
        &self,
        mut params: GenerateParams,
        received: Instant,
    ) -> Result<Prepared, FrontendError> {
        if params.n > 1 && params.tools.is_some() {
            return Err(FrontendError::invalid(
                "n",
                "n > 1 is not supported with tools; send one request per choice",
            ));
        }
        if params.model != self.model {
            return Err(FrontendError::UnknownModel {
                model: params.model,
                served: self.model.clone(),
            });
        }
        sluice_runtime::limits::check_token_ids(
            "sampling.stop_token_ids",
            &params.sampling.stop_token_ids,
            self.tokenizer.vocab_size(),
        )
        .map_err(|e| FrontendError::invalid(e.field, e.message))?;
        if let Some(tools) = &params.tools {
            use sluice_proto::common::v1::{StructuredOutput, structured_output::Kind};
            // The answer's shape when the model may answer instead of
            // calling (`auto` beside a `response_format`).
            let answer = match params
                .sampling
                .structured_output
                .as_ref()
                .and_then(|s| s.kind.as_ref())
            {
                Some(Kind::JsonSchema(text)) => Some(serde_json::from_str(text).map_err(|e| {
                    FrontendError::invalid(
                        "response_format",
                        format!("the JSON schema is not valid JSON: {e}"),
                    )
                })?),
                Some(Kind::JsonObject(true)) => Some(serde_json::json!({"type": "object"})),
                _ => None,
            };
            let grammar = match &tools.choice {
                ToolChoice::Auto => answer.as_ref().map(|a| {
                    self.tool_format
                        .grammar(&tools.defs, None, tools.parallel, Some(a))
                }),
                // A required or named call is made well-formed by grammar.
                ToolChoice::Required => {
                    Some(
                        self.tool_format
                            .grammar(&tools.defs, None, tools.parallel, None),
                    )
                }
                ToolChoice::Named(name) => {
                    Some(
                        self.tool_format
                            .grammar(&tools.defs, Some(name), tools.parallel, None),
                    )
                }
            };
            if let Some(grammar) = grammar {
                let GrammarSpec::Lark(lark) =
                    grammar.map_err(|e| FrontendError::invalid("tool_choice", e))?
                else {
                    return Err(FrontendError::internal("a tool grammar is Lark"));
                };
                params.sampling.structured_output = Some(StructuredOutput {
                    kind: Some(Kind::Lark(lark)),
                });
            }
        }
        self.check_structured_output(&params)?;
        let context = self.context_len();
        let (param, bytes) = match &params.prompt {
            Prompt::Text(t) => ("prompt", t.len()),
            Prompt::Chat(m) => (
                "messages",
                m.iter().map(|m| m.role.len() + m.content.len()).sum(),
            ),
            Prompt::Tokens(_) => ("prompt", 0),
        };
        if let Some(context) = context
            && bytes > self.prompt_limits.max_bytes(context)
        {
            return Err(FrontendError::PromptTooLong {
                param,
                message: format!(
                    "the prompt is {bytes} bytes, more than a context of {context} tokens can hold \
                     (at most {} bytes); shorten it",
                    self.prompt_limits.max_bytes(context)
                ),
            });
        }
        let prompt_ids = self
            .tokenize(&params.prompt, params.tools.clone())
            .instrument(tracing::info_span!("tokenize"))
            .await?;
        if prompt_ids.is_empty() {
            return Err(FrontendError::invalid(
                "prompt",
                "the prompt tokenizes to nothing",
            ));
        }
        if let Some(context) = context
            && prompt_ids.len() >= context
        {
            return Err(FrontendError::PromptTooLong {
                param,
                message: format!(
                    "the prompt is {} tokens; this model's context is {context} tokens, output included; shorten it",
                    prompt_ids.len()
                ),
            });
        }
        let room = context.map(|c| c - prompt_ids.len());
        if params.sampling.max_tokens == 0 {
            // Unset: the default, within what the context leaves.
            params.sampling.max_tokens = room.map_or(self.default_max_tokens, |r| {
                self.default_max_tokens
                    .min(u32::try_from(r).unwrap_or(u32::MAX))
            });
        } else if let Some(room) = room
            && params.sampling.max_tokens as usize > room
        {
            // Asked for: more than fits is the client's mistake, as OpenAI
            // answers it, not a silent clamp.
            return Err(FrontendError::invalid(
                "max_tokens",
                format!(
                    "max_tokens (or max_completion_tokens) is {}, but this model's context is {} \
                     tokens and the prompt takes {}: at most {room} can be generated; lower it",
                    params.sampling.max_tokens,
                    context.unwrap_or_default(),
                    prompt_ids.len()
                ),
            ));
        }
        if params.timeout.is_none() {
            params.timeout = Some(self.request_timeout);
        }
        let desc = Prepared::describe(&self.model, &params, &prompt_ids, self.block_size());
        Ok(Prepared {
            params,
            prompt_ids,
            desc,
            received,
        })
    }

    /// The prompt's token ids. Templating and tokenizing run on the blocking
    /// pool, at most `--tokenize-concurrency` at once, so a long prompt
    /// costs its own request time, never the runtime's. A prompt of at most
    /// [`INLINE_TOKENIZE_BYTES`] is tokenized where it is (tens of
    /// microseconds, less than the hand-off to the pool and back costs).
    async fn tokenize(
        &self,
        prompt: &Prompt,
        tools: Option<Arc<Tools>>,
    ) -> Result<Vec<u32>, FrontendError> {
        // Token ids count 0 bytes: they are only checked.
        if prompt_bytes(prompt) <= INLINE_TOKENIZE_BYTES && tools.is_none() {
            return tokenize_now(&self.tokenizer, &self.template, prompt, None);
        }
        let _slot = self
            .tokenize_slots
            .acquire()
            .await
            .map_err(FrontendError::broken("the tokenization pool is closed"))?;
        let (tokenizer, template, prompt) = (
            self.tokenizer.clone(),
            self.template.clone(),
            prompt.clone(),
        );
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || {
            let _entered = span.enter();
            tokenize_now(&tokenizer, &template, &prompt, tools.as_deref())
        })
        .await
        .map_err(FrontendError::broken("the tokenization task"))?
    }

    /// Takes the admission lease and opens the worker stream. Errors before
    /// the first token surface here, so the HTTP layer can still pick a status.
    /// `n` continuations of one prompt (`n` > 1): the first is started and
    /// its first event awaited, by when its prompt's full blocks are cached
    /// on its worker; then the others, each with its own id (and seed + i),
    /// which the router places where that prefix is cached, so they compute
    /// only the prompt's last partial block. The first choice's first event
    /// comes back beside the generations, to be read before its next.
    pub(crate) async fn start_n(
        self: &Arc<Self>,
        p: Prepared,
        n: u32,
    ) -> Result<(Vec<Generation>, Option<Event>), FrontendError> {
        let mut first = self.start(p.clone()).await?;
        let event = first.next().await.transpose()?;
        let others = (1..n).map(|i| {
            let mut q = p.clone();
            q.desc.request_id = format!("{}-{i}", p.desc.request_id);
            q.params.request_id.clone_from(&q.desc.request_id);
            q.params.sampling.seed = p.params.sampling.seed.map(|s| s.wrapping_add(u64::from(i)));
            self.start(q)
        });
        let mut generations = vec![first];
        generations.extend(futures::future::try_join_all(others).await?);
        Ok((generations, event))
    }

    pub(crate) async fn start(self: &Arc<Self>, p: Prepared) -> Result<Generation, FrontendError> {
        let deadline = p.received + p.params.timeout.unwrap_or(self.request_timeout);
        let priority_label = p.desc.priority.to_string();
        let mut failed = Vec::new();
        let opened = self
            .open(&p, deadline, &mut failed, self.migration_limit)
            .await;
        if !failed.is_empty() {
            let outcome = if opened.is_ok() { "ok" } else { "failed" };
            self.metrics.migrations.with_label_values(&[outcome]).inc();
        }
        let opened = opened.inspect_err(|e| {
            if let Some(reason) = e.refusal_reason() {
                self.metrics
                    .refused(p.desc.priority, &p.desc.tenant, reason);
            }
        })?;
        let grant = &opened.grant;
        Span::current().record("worker_id", grant.worker_id.as_str());
        let detok =
            IncrementalDetokenizer::new(self.tokenizer.clone(), p.params.stop.clone(), true)
                .with_prompt(&p.prompt_ids);
        self.metrics.inflight.inc();
        Ok(Generation {
            pipeline: Arc::clone(self),
            serving: Serving {
                worker_id: grant.worker_id.clone(),
                dp_rank: grant.dp_rank,
                // Set from the worker's answer: the grant only offers a
                // prefill worker; the decode worker decides whether to use it.
                prefill_worker_id: String::new(),
                priority: p.desc.priority,
                tenant: p.desc.tenant.clone(),
                queue_wait_ms: grant.queue_wait_ms,
                routed_overlap_tokens: grant.overlap_tokens,
                migrations: failed.len() as u32,
                ttft_target_ms: grant.ttft_target_ms,
                predicted_queue_wait_ms: grant.predicted_wait_ms,
                ttft_ms: 0.0,
                ttft_target_met: false,
            },
            lease: Some(opened.lease),
            stream: Some(opened.stream),
            detok,
            usage: common::Usage {
                prompt_tokens: p.prompt_ids.len() as u32,
                completion_tokens: 0,
                cached_tokens: 0,
            },
            want_logprobs: p.params.sampling.logprobs,
            priority_label,
            received: p.received,
            last_token: None,
            deadline,
            pending: VecDeque::new(),
            finished: false,
            failed: None,
            span: opened.span,
            generated: Vec::new(),
            lease_base: 0,
            reported: 0,
            failed_workers: failed,
            request: p,
        })
    }

    /// Admission, then `Generate` on the granted worker, never one of
    /// `failed`, both within `deadline`. A granted worker that is dead but
    /// still registered (refused connection, reset) joins `failed` and the
    /// request is placed again, at most `retries` times.
    async fn open(
        &self,
        p: &Prepared,
        deadline: Instant,
        failed: &mut Vec<String>,
        retries: u32,
    ) -> Result<Opened, FrontendError> {
        let mut left = retries;
        loop {
            match self.open_once(p, deadline, failed).await {
                Ok(opened) => return Ok(opened),
                Err(Failure::Worker { worker_id, error })
                    if left > 0 && Instant::now() < deadline =>
                {
                    tracing::warn!(%worker_id, error = ?error, "granted worker failed the request; placing it again");
                    failed.push(worker_id);
                    left -= 1;
                }
                Err(failure) => return Err(failure.into_error()),
            }
        }
    }

    async fn open_once(
        &self,
        p: &Prepared,
        deadline: Instant,
        exclude: &[String],
    ) -> Result<Opened, Failure> {
        let admit = self.admit(p, exclude).instrument(tracing::info_span!(
            "queue.admit",
            priority = p.desc.priority,
            tenant = %p.desc.tenant,
        ));
        let (lease, grant) = tokio::time::timeout_at(deadline.into(), admit)
            .await
            .map_err(|_| FrontendError::Deadline)??;
        self.metrics
            .queue_wait
            .with_label_values(&[&p.desc.priority.to_string()])
            .observe(grant.queue_wait_ms / 1000.0);

        let span = tracing::info_span!(
            "worker.generate",
            worker_id = %grant.worker_id,
            prefill_worker_id = %grant.prefill_worker_id,
            ttft_target_ms = grant.ttft_target_ms,
            predicted_queue_wait_ms = grant.predicted_wait_ms,
            ttft_ms = tracing::field::Empty,
            ttft_target_met = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
            cached_tokens = tracing::field::Empty,
        );
        let channel = self.channels.get(&grant.worker_endpoint)?;
        let req = wpb::GenerateRequest {
            request_id: p.desc.request_id.clone(),
            model: self.model.clone(),
            prompt_token_ids: p.prompt_ids.clone(),
            sampling: Some(p.params.sampling.clone()),
            priority: p.desc.priority,
            dp_rank: grant.dp_rank,
            prefill_worker_id: grant.prefill_worker_id.clone(),
            prefill_worker_endpoint: grant.prefill_worker_endpoint.clone(),
            // The router counts this request's load until its lease ends.
            placed: true,
        };
        let mut stream =
            span.in_scope(|| self.generations.start(&grant.worker_endpoint, channel, req));
        // The worker's first message (or its refusal) before the request
        // counts as started: a worker that cannot take it leaves the
        // request free to be placed again.
        let answer = tokio::time::timeout_at(deadline.into(), stream.first())
            .await
            .map_err(|_| FrontendError::Deadline)?;
        if let Err(s) = answer {
            lease.done(0);
            let failed = worker_failed(&s);
            let error = FrontendError::from_status("worker", s, &self.model);
            return Err(Failure::of_worker(&grant.worker_id, failed, error));
        }
        Ok(Opened {
            lease,
            grant,
            stream,
            span,
        })
    }

    /// An admission lease and its grant from one of the queues: a queue
    /// that fails (unreachable, reset, draining, its placement failed) is
    /// passed over for another, each tried once; nothing was sent to a
    /// worker yet, so trying again is safe.
    async fn admit(&self, p: &Prepared, exclude: &[String]) -> Result<Admitted, FrontendError> {
        if self.workers.count(&self.model) == 0 {
            return Err(FrontendError::NoWorkers {
                model: self.model.clone(),
            });
        }
        if self.routers.count("") == 0 {
            return Err(FrontendError::Unavailable {
                component: "router",
                message: "no router instance is registered".into(),
            });
        }
        let mut tried = Vec::new();
        let mut last = None;
        while let Some(queue) = self.queues.pick(&tried) {
            match self.admit_at(&queue, p, exclude).await {
                Ok(admitted) => {
                    self.queues.cleared(&queue.id);
                    return Ok(admitted);
                }
                Err(QueueFailure::Answer(e)) => return Err(e),
                Err(QueueFailure::Queue(e)) => {
                    tracing::warn!(queue = %queue.id, endpoint = %queue.endpoint, error = %e, "queue failed the admission; trying another");
                    self.queues.suspect(&queue.id);
                    self.metrics.failovers.with_label_values(&["queue"]).inc();
                    tried.push(queue.id);
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or(FrontendError::Unavailable {
            component: "queue",
            message: "no queue instance is registered".into(),
        }))
    }

    /// Admission at `queue`.
    async fn admit_at(
        &self,
        queue: &sluice_runtime::Instance,
        p: &Prepared,
        exclude: &[String],
    ) -> Result<Admitted, QueueFailure> {
        let channel = self.channels.get(&queue.endpoint)?;
        let remaining = p
            .params
            .timeout
            .map(|t| t.saturating_sub(p.received.elapsed()));
        let mut description = p.desc.to_wire();
        description.exclude_worker_ids = exclude.to_vec();
        let open = qpb::AdmitOpen {
            description: Some(description),
            deadline_ms: remaining
                .map(|d| d.as_millis().min(u128::from(u32::MAX)) as u32)
                .unwrap_or(0),
        };
        let mut lease = self.leases.open(&queue.endpoint, channel, open);
        // The queue answers as soon as it has the request, before any hold
        // (`opened` when nothing else is ready at once): one that does not
        // within the timeout is hung or frozen (its connection may still be
        // open) and another one may admit the request. A queue that hangs
        // later, while it holds the request, is found by the channel's
        // keepalive.
        let mut event = tokio::time::timeout(self.queue_answer_timeout, lease.next())
            .await
            .map_err(|_| {
                QueueFailure::Queue(FrontendError::Unavailable {
                    component: "queue",
                    message: format!(
                        "the queue did not answer the admission within {} ms",
                        self.queue_answer_timeout.as_millis()
                    ),
                })
            })?;
        loop {
            match event {
                Some(LeaseEvent::Grant(g)) => return Ok((lease, *g)),
                Some(LeaseEvent::Held(h)) => {
                    tracing::debug!(position = h.position, pending = h.pending, reason = %h.reason, "held by the queue");
                }
                Some(LeaseEvent::Opened) => {}
                Some(LeaseEvent::Failed(s)) => return Err(self.queue_failure(*s)),
                None => {
                    return Err(QueueFailure::Queue(FrontendError::Unavailable {
                        component: "queue",
                        message: "the queue closed the lease without a grant".into(),
                    }));
                }
            }
            event = lease.next().await;
        }
    }

    /// Whether a queue's error means the queue failed, so another one may
    /// admit the request: the queue itself names the reason on every
    /// answer (`sluice-reason`); an error without one came from the
    /// transport (refused, reset, gone mid-stream).
    fn queue_failure(&self, s: tonic::Status) -> QueueFailure {
        use tonic::Code;
        let reason = QueueReason::of_status(&s);
        let queue_failed = match reason {
            Some(reason) => reason.another_queue_may_admit(),
            None => worker_failed(&s),
        };
        let error = if reason == Some(QueueReason::NoRouter) {
            FrontendError::Unavailable {
                component: "router",
                message: s.message().to_string(),
            }
        } else if reason == Some(QueueReason::NoWorkers) || s.code() == Code::NotFound {
            FrontendError::NoWorkers {
                model: self.model.clone(),
            }
        } else {
            FrontendError::from_status("queue", s, &self.model)
        };
        if queue_failed {
            QueueFailure::Queue(error)
        } else {
            QueueFailure::Answer(error)
        }
    }

    fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
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
    usage: common::Usage,
    want_logprobs: bool,
    priority_label: String,
    received: Instant,
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
    /// `usage.completion_tokens` when the current lease began (a migrated
    /// request's new lease counts from there).
    lease_base: u32,
    /// Output tokens last reported on the current lease (`progress`).
    reported: u32,
    /// Workers that failed this request mid-stream.
    failed_workers: Vec<String>,
}

impl Generation {
    /// The next event; `None` after `Done` or an error.
    pub(crate) async fn next(&mut self) -> Option<Result<Event, FrontendError>> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(Ok(e));
            }
            if self.finished {
                return self.failed.take().map(Err);
            }
            if let Err(failure) = self.read().await {
                if let Failure::Worker { error, .. } = &failure
                    && self.migrate(error).await
                {
                    continue;
                }
                let e = failure.into_error();
                self.finished = true;
                self.record_end(&e);
                // What the failing message carried goes out first.
                self.failed = Some(e);
            }
        }
    }

    /// Moves the request to another worker after its worker failed with
    /// `cause`: a new lease that excludes every failed worker, and a
    /// `Generate` of the prompt plus the tokens already streamed for the
    /// tokens still to come. The client's stream goes on. `false` when the
    /// limit is reached, the deadline has passed or no worker takes it.
    async fn migrate(&mut self, cause: &FrontendError) -> bool {
        // Its own handle (a migration is rare): `self` ends the lease below.
        let p = Arc::clone(&self.pipeline);
        let done = self.generated.len() as u32;
        let wanted = self.request.params.sampling.max_tokens;
        if self.failed_workers.len() as u32 >= p.migration_limit
            || Instant::now() >= self.deadline
            || (wanted > 0 && done >= wanted)
        {
            return false;
        }
        self.failed_workers.push(self.serving.worker_id.clone());
        let mut next = self.request.clone();
        next.prompt_ids.extend_from_slice(&self.generated);
        if wanted > 0 {
            next.params.sampling.max_tokens = wanted - done;
        }
        next.desc = Prepared::describe(
            &next.desc.model,
            &next.params,
            &next.prompt_ids,
            next.desc.block_size as usize,
        );
        tracing::warn!(
            parent: &self.span,
            worker_id = %self.serving.worker_id,
            error = ?cause,
            streamed_tokens = done,
            "worker failed mid-stream; moving the request to another worker"
        );
        // The failed worker's stream is gone; its lease ends now.
        self.stream = None;
        self.end_lease();
        self.lease_base = self.usage.completion_tokens;
        self.reported = 0;
        let retries = p
            .migration_limit
            .saturating_sub(self.failed_workers.len() as u32);
        let outcome = match p
            .open(&next, self.deadline, &mut self.failed_workers, retries)
            .await
        {
            Ok(opened) => {
                self.serving.migrations = self.failed_workers.len() as u32;
                self.serving.worker_id = opened.grant.worker_id.clone();
                self.serving.dp_rank = opened.grant.dp_rank;
                self.serving.queue_wait_ms += opened.grant.queue_wait_ms;
                self.lease = Some(opened.lease);
                self.stream = Some(opened.stream);
                self.span = opened.span;
                "ok"
            }
            Err(e) => {
                tracing::warn!(parent: &self.span, error = ?e, "no worker took the migrating request");
                "failed"
            }
        };
        p.metrics.migrations.with_label_values(&[outcome]).inc();
        outcome == "ok"
    }

    /// Reads one worker message into `pending`. A failure of the worker
    /// itself (transport error, reset, unfinished end) is `Failure::Worker`.
    async fn read(&mut self) -> Result<(), Failure> {
        let msg = self.next_message().await?;
        self.note_usage(&msg);
        self.note_timing(&msg);
        let (mut delta, stopped) = self.take_tokens(&msg)?;
        let reason = match stopped {
            Some(r) => Ok(Some(r)),
            None => self.finish_reason(&msg),
        };
        match reason {
            Ok(Some(_)) if stopped.is_none() => {
                delta.text.push_str(&self.detok.flush()?.text);
            }
            Ok(None) => self.report_progress(),
            _ => {}
        }
        // Tokens that ride with a worker's failure (a worker sends what its
        // engine produced before the failing step in one message when its
        // reader fell behind) were produced and counted: the client gets
        // their text before the request moves on.
        if !delta.text.is_empty() || !delta.token_ids.is_empty() {
            self.pending.push_back(Event::Delta {
                text: delta.text,
                token_ids: delta.token_ids,
                logprobs: delta.logprobs,
            });
        }
        let reason = reason?;
        if let Some(r) = reason {
            self.finished = true;
            // The lease ends before the client hears of the end, so the
            // router has stopped counting this request by the time the
            // client's next one (a conversation's next turn) arrives.
            self.end_lease();
            self.pending.push_back(Event::Done {
                finish_reason: r,
                usage: self.usage,
                serving: self.serving.clone(),
            });
            self.record_end_ok();
        }
        Ok(())
    }

    /// The worker's next message, before the deadline; a failed or cut
    /// stream is a worker failure (the request may move).
    async fn next_message(&mut self) -> Result<wpb::GenerateResponse, Failure> {
        let Some(stream) = self.stream.as_mut() else {
            return Err(FrontendError::internal("worker stream already closed").into());
        };
        match tokio::time::timeout_at(self.deadline.into(), stream.message()).await {
            Err(_) => Err(FrontendError::Deadline.into()),
            Ok(Err(s)) => {
                let failed = worker_failed(&s);
                let error = FrontendError::from_status("worker", s, &self.pipeline.model);
                Err(Failure::of_worker(&self.serving.worker_id, failed, error))
            }
            Ok(Ok(None)) => {
                let error = FrontendError::Unavailable {
                    component: "worker",
                    message: "the worker ended the stream before finishing".into(),
                };
                Err(Failure::of_worker(&self.serving.worker_id, true, error))
            }
            Ok(Ok(Some(m))) => Ok(m),
        }
    }

    /// Usage and the prefill worker, as the worker reports them.
    fn note_usage(&mut self, msg: &wpb::GenerateResponse) {
        if let Some(u) = &msg.usage {
            if self.serving.migrations == 0 {
                self.usage.prompt_tokens = u.prompt_tokens.max(self.usage.prompt_tokens);
            }
            // After a move the worker's prompt holds the streamed tokens too.
            self.usage.cached_tokens = u.cached_tokens.min(self.usage.prompt_tokens);
        }
        if !msg.prefill_worker_id.is_empty() {
            self.serving.prefill_worker_id = msg.prefill_worker_id.clone();
        }
    }

    /// TTFT at the first tokens, inter-token latency after; the lease's
    /// `started` at its first tokens, so the queue and the router stop
    /// counting the prompt as prefill work.
    fn note_timing(&mut self, msg: &wpb::GenerateResponse) {
        if msg.token_ids.is_empty() {
            return;
        }
        // The first tokens on this lease (a migrated request's new lease
        // hears it at its first tokens from the new worker); `take_tokens`
        // counts them after this.
        if self.on_lease() == 0
            && let Some(lease) = &self.lease
        {
            lease.started();
        }
        let now = Instant::now();
        let m = &self.pipeline.metrics;
        match self.last_token {
            None => {
                let ttft = (now - self.received).as_secs_f64();
                m.ttft
                    .with_label_values(&[&self.priority_label])
                    .observe(ttft);
                m.tenant_ttft(&self.serving.tenant, self.usage.prompt_tokens, ttft);
                let serving = &mut self.serving;
                serving.ttft_ms = ttft * 1000.0;
                serving.ttft_target_met = serving.ttft_target_ms == 0
                    || serving.ttft_ms <= f64::from(serving.ttft_target_ms);
                m.slo(
                    serving.priority,
                    &serving.tenant,
                    if serving.ttft_target_met {
                        "met"
                    } else {
                        "missed"
                    },
                );
                self.span.record("ttft_ms", serving.ttft_ms);
                self.span.record("ttft_target_met", serving.ttft_target_met);
            }
            Some(prev) => {
                let per = (now - prev).as_secs_f64() / msg.token_ids.len() as f64;
                m.itl
                    .with_label_values(&[&self.priority_label])
                    .observe(per);
            }
        }
        self.last_token = Some(now);
    }

    /// Counts and detokenizes the message's tokens; `Some(Stop)` when a
    /// stop string ended the text (dropping the worker stream aborts it).
    fn take_tokens(
        &mut self,
        msg: &wpb::GenerateResponse,
    ) -> Result<(Delta, Option<common::FinishReason>), Failure> {
        let mut delta = Delta {
            text: String::new(),
            token_ids: Vec::with_capacity(msg.token_ids.len()),
            logprobs: Vec::new(),
        };
        for (i, &id) in msg.token_ids.iter().enumerate() {
            self.usage.completion_tokens += 1;
            self.generated.push(id);
            delta.token_ids.push(id);
            if self.want_logprobs
                && let Some(lp) = msg.logprobs.get(i)
            {
                delta.logprobs.push(self.pipeline.logprob_entry(lp));
            }
            delta.text.push_str(&self.detok.push(id)?.text);
            if self.detok.is_stopped() {
                return Ok((delta, Some(common::FinishReason::Stop)));
            }
        }
        Ok((delta, None))
    }

    /// Why the worker ended the request, if it did; a sequence the worker
    /// failed (its batch went on) moves elsewhere like a worker failure.
    fn finish_reason(
        &self,
        msg: &wpb::GenerateResponse,
    ) -> Result<Option<common::FinishReason>, Failure> {
        use common::FinishReason;
        match FinishReason::try_from(msg.finish_reason).unwrap_or(FinishReason::Unspecified) {
            FinishReason::Unspecified => Ok(None),
            FinishReason::Error => {
                let error = FrontendError::Unavailable {
                    component: "worker",
                    message: "the worker failed the request mid-stream".into(),
                };
                Err(Failure::of_worker(&self.serving.worker_id, true, error))
            }
            reason @ (FinishReason::Stop | FinishReason::Length | FinishReason::Abort) => {
                Ok(Some(reason))
            }
        }
    }

    /// Output tokens produced on the current lease.
    fn on_lease(&self) -> u32 {
        self.usage.completion_tokens.saturating_sub(self.lease_base)
    }

    /// Ends the admission lease (if still held), reporting the tokens
    /// produced under it.
    fn end_lease(&mut self) {
        let on_lease = self.on_lease();
        if let Some(lease) = self.lease.take() {
            lease.done(on_lease);
        }
    }

    /// Tells the queue the lease's output so far, at most once per
    /// [`PROGRESS_TOKENS`].
    fn report_progress(&mut self) {
        let on_lease = self.on_lease();
        if on_lease < self.reported + PROGRESS_TOKENS {
            return;
        }
        if let Some(lease) = &self.lease {
            lease.progress(on_lease);
            self.reported = on_lease;
        }
    }

    fn record_end_ok(&self) {
        let m = &self.pipeline.metrics;
        m.tenant_tokens(&self.serving.tenant, self.usage.completion_tokens);
        m.e2e
            .with_label_values(&[&self.priority_label])
            .observe(self.received.elapsed().as_secs_f64());
        self.span
            .record("completion_tokens", self.usage.completion_tokens);
        self.span.record("cached_tokens", self.usage.cached_tokens);
    }

    fn record_end(&self, e: &FrontendError) {
        tracing::warn!(parent: &self.span, error = ?e, "generation failed");
    }
}

impl Drop for Generation {
    /// Ends the lease with `done`. An unfinished worker stream (client
    /// gone, stop string, deadline) is dropped with it: that is the
    /// cancellation.
    fn drop(&mut self) {
        self.pipeline.metrics.inflight.dec();
        self.end_lease();
    }
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

impl Pipeline {
    /// The one wire → client conversion of a position's logprobs.
    fn logprob_entry(&self, lp: &common::PositionLogprobs) -> TokenLogprob {
        let chosen = lp.chosen.unwrap_or_default();
        TokenLogprob {
            wire: lp.clone(),
            token: self.token_text(chosen.token_id),
            logprob: chosen.logprob,
            top: lp
                .top
                .iter()
                .map(|t| (self.token_text(t.token_id), t.logprob))
                .collect(),
        }
    }
}

/// Prompts up to this many bytes of text are tokenized on the request's
/// own task instead of the blocking pool.
const INLINE_TOKENIZE_BYTES: usize = 128;

/// The prompt's text size in bytes (chat: the messages' roles and
/// contents, before the template); 0 for token ids.
fn prompt_bytes(prompt: &Prompt) -> usize {
    match prompt {
        Prompt::Text(t) => t.len(),
        Prompt::Chat(messages) => messages
            .iter()
            .map(|m| m.content.len() + m.role.len())
            .sum(),
        Prompt::Tokens(_) => 0,
    }
}

/// `messages` with the tools described in the system prompt (the first
/// message's, or a new one).
fn with_tool_prompt(messages: &[ChatMessage], defs: &[ToolDef]) -> Vec<ChatMessage> {
    let prompt = sluice_tokens::tools::system_prompt(defs);
    let mut out = messages.to_vec();
    match out.first_mut() {
        Some(first) if first.role == "system" => {
            first.content = format!("{}\n\n{prompt}", first.content);
        }
        _ => out.insert(0, ChatMessage::new("system", prompt)),
    }
    out
}

/// Templates (chat) and tokenizes a prompt on the calling thread; token
/// ids are checked against the vocabulary.
fn tokenize_now(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    prompt: &Prompt,
    tools: Option<&Tools>,
) -> Result<Vec<u32>, FrontendError> {
    match prompt {
        Prompt::Text(t) => Ok(tokenizer.encode(t, true)?),
        Prompt::Chat(messages) => {
            let mut options = ChatRenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            };
            let with_tools;
            let messages = match tools {
                Some(tools) if template.takes_tools() => {
                    options.tools = Some(tools.json.clone());
                    messages.as_slice()
                }
                // A template that does not render tools: they go in the
                // system prompt, in the Hermes wording.
                Some(tools) => {
                    with_tools = with_tool_prompt(messages, &tools.defs);
                    with_tools.as_slice()
                }
                None => messages.as_slice(),
            };
            let text = template
                .render_with(messages, &options)
                .map_err(|e| FrontendError::invalid("messages", format!("chat template: {e}")))?;
            Ok(tokenizer.encode(&text, false)?)
        }
        Prompt::Tokens(ids) => {
            sluice_runtime::limits::check_token_ids("prompt", ids, tokenizer.vocab_size())
                .map_err(|e| FrontendError::invalid(e.field, e.message))?;
            Ok(ids.clone())
        }
    }
}
