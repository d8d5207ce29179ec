//! One request's path through the mesh, shared by the HTTP and gRPC APIs:
//! template and tokenize once, hash the blocks once, take an admission lease
//! from the queue, call `Generate` on the granted worker, and detokenize the
//! tokens as they stream back.
//!
//! Resources ride with the [`Generation`]: it owns the lease's request side
//! and the worker stream, so dropping it (client gone, stop string, deadline)
//! releases the queue slot and aborts the sequence on the worker.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_proto::common::v1 as common;
use sluice_proto::queue::v1 as qpb;
use sluice_proto::worker::v1 as wpb;
use sluice_tokens::{ChatTemplate, IncrementalDetokenizer, Tokenizer};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tracing::{Instrument, Span};

use crate::error::FrontendError;
use crate::mesh::{Channels, Members};
use crate::metrics::Metrics;
use crate::openai::{GenerateParams, Prompt};

/// Block size assumed until a worker reports its own.
const DEFAULT_BLOCK_SIZE: usize = 16;

/// Shared state of the frontend's request path.
#[derive(Debug)]
pub(crate) struct Pipeline {
    pub model: String,
    pub created: i64,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub queues: Arc<Members>,
    pub workers: Arc<Members>,
    pub channels: Channels,
    pub metrics: Metrics,
    pub default_max_tokens: u32,
    pub request_timeout: Duration,
}

/// A request ready for the mesh: tokenized and hashed.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub params: GenerateParams,
    pub prompt_ids: Vec<u32>,
    pub block_hashes: Vec<u64>,
    pub block_size: usize,
    pub received: Instant,
}

/// Per-token log probability with the token's text.
#[derive(Debug, Clone)]
pub(crate) struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
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
        finish_reason: &'static str,
        usage: common::Usage,
        serving: Serving,
    },
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
    pub queue_wait_ms: f64,
}

impl Pipeline {
    /// The block size the workers for this model use.
    fn block_size(&self) -> usize {
        self.workers
            .serving(&self.model)
            .iter()
            .find_map(|i| i.metadata.get("block_size").and_then(|b| b.parse().ok()))
            .unwrap_or(DEFAULT_BLOCK_SIZE)
    }

    /// Whether a worker for the model is known (`/ready`).
    pub(crate) fn ready(&self) -> bool {
        !self.workers.serving(&self.model).is_empty()
    }

    /// Checks the model, renders the template, tokenizes and hashes, once.
    pub(crate) fn prepare(
        &self,
        mut params: GenerateParams,
        received: Instant,
    ) -> Result<Prepared, FrontendError> {
        if params.model != self.model {
            return Err(FrontendError::UnknownModel {
                model: params.model,
                served: self.model.clone(),
            });
        }
        let _span = tracing::info_span!("tokenize").entered();
        let prompt_ids = match &params.prompt {
            Prompt::Text(t) => self.tokenizer.encode(t, true)?,
            Prompt::Chat(messages) => {
                let text = self
                    .template
                    .render(messages.as_slice(), true)
                    .map_err(|e| {
                        FrontendError::invalid("messages", format!("chat template: {e}"))
                    })?;
                self.tokenizer.encode(&text, false)?
            }
            Prompt::Tokens(ids) => {
                let vocab = self.tokenizer.vocab_size() as u32;
                if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
                    return Err(FrontendError::invalid(
                        "prompt",
                        format!("token id {bad} is outside the vocabulary (size {vocab})"),
                    ));
                }
                ids.clone()
            }
        };
        if prompt_ids.is_empty() {
            return Err(FrontendError::invalid(
                "prompt",
                "the prompt tokenizes to nothing",
            ));
        }
        if params.sampling.max_tokens == 0 {
            params.sampling.max_tokens = self.default_max_tokens;
        }
        if params.timeout.is_none() {
            params.timeout = Some(self.request_timeout);
        }
        let block_size = self.block_size();
        let block_hashes = sluice_tokens::sequence_block_hashes(&prompt_ids, block_size);
        Ok(Prepared {
            params,
            prompt_ids,
            block_hashes,
            block_size,
            received,
        })
    }

    /// Takes the admission lease and opens the worker stream. Errors before
    /// the first token surface here, so the HTTP layer can still pick a status.
    pub(crate) async fn start(self: &Arc<Self>, p: Prepared) -> Result<Generation, FrontendError> {
        let deadline = p.received + p.params.timeout.unwrap_or(self.request_timeout);
        let admit = self.admit(&p).instrument(tracing::info_span!(
            "queue.admit",
            priority = p.params.hints.priority
        ));
        let (lease_tx, lease_rx, grant) = tokio::time::timeout_at(deadline.into(), admit)
            .await
            .map_err(|_| FrontendError::Deadline)??;
        let priority_label = p.params.hints.priority.to_string();
        self.metrics
            .queue_wait
            .with_label_values(&[&priority_label])
            .observe(grant.queue_wait_ms / 1000.0);
        Span::current().record("worker_id", grant.worker_id.as_str());

        let span = tracing::info_span!(
            "worker.generate",
            worker_id = %grant.worker_id,
            prefill_worker_id = %grant.prefill_worker_id,
            completion_tokens = tracing::field::Empty,
            cached_tokens = tracing::field::Empty,
        );
        let channel = self.channels.get(&grant.worker_endpoint)?;
        let mut client = wpb::worker_client::WorkerClient::new(channel);
        let req = wpb::GenerateRequest {
            request_id: p.params.request_id.clone(),
            model: self.model.clone(),
            prompt_token_ids: p.prompt_ids.clone(),
            sampling: Some(p.params.sampling.clone()),
            priority: p.params.hints.priority,
            dp_rank: grant.dp_rank,
            prefill_worker_id: grant.prefill_worker_id.clone(),
            prefill_worker_endpoint: grant.prefill_worker_endpoint.clone(),
        };
        let stream = tokio::time::timeout_at(
            deadline.into(),
            client.generate(req).instrument(span.clone()),
        )
        .await
        .map_err(|_| FrontendError::Deadline)?
        .map_err(|s| FrontendError::from_status("worker", s, &self.model))?
        .into_inner();

        let detok =
            IncrementalDetokenizer::new(self.tokenizer.clone(), p.params.stop.clone(), true)
                .with_prompt(&p.prompt_ids);
        self.metrics.inflight.inc();
        Ok(Generation {
            pipeline: Arc::clone(self),
            lease: Some(lease_tx),
            lease_responses: Some(lease_rx),
            stream: Some(stream),
            worker_done: false,
            detok,
            serving: Serving {
                worker_id: grant.worker_id,
                dp_rank: grant.dp_rank,
                // Set from the worker's answer: the grant only offers a
                // prefill worker; the decode worker decides whether to use it.
                prefill_worker_id: String::new(),
                priority: p.params.hints.priority,
                queue_wait_ms: grant.queue_wait_ms,
            },
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
            span,
        })
    }

    async fn admit(
        &self,
        p: &Prepared,
    ) -> Result<
        (
            mpsc::Sender<qpb::AdmitRequest>,
            tonic::Streaming<qpb::AdmitResponse>,
            qpb::Grant,
        ),
        FrontendError,
    > {
        if !self.ready() {
            return Err(FrontendError::NoWorkers {
                model: self.model.clone(),
            });
        }
        let queue = self.queues.pick().ok_or(FrontendError::Unavailable {
            component: "queue",
            message: "no queue instance is registered".into(),
        })?;
        let mut client = qpb::queue_client::QueueClient::new(self.channels.get(&queue.endpoint)?);
        let (tx, rx) = mpsc::channel(2);
        let remaining = p
            .params
            .timeout
            .map(|t| t.saturating_sub(p.received.elapsed()));
        let open = qpb::AdmitOpen {
            request_id: p.params.request_id.clone(),
            model: self.model.clone(),
            priority: p.params.hints.priority,
            strict_priority: p.params.hints.strict_priority,
            tenant: p.params.tenant.clone(),
            prompt_tokens: p.prompt_ids.len() as u32,
            block_hashes: p.block_hashes.clone(),
            block_size: p.block_size as u32,
            deadline_ms: remaining
                .map(|d| d.as_millis().min(u128::from(u32::MAX)) as u32)
                .unwrap_or(0),
            expected_output_tokens: if p.params.hints.osl > 0 {
                p.params.hints.osl
            } else {
                p.params.sampling.max_tokens
            },
        };
        tx.send(qpb::AdmitRequest {
            msg: Some(qpb::admit_request::Msg::Open(open)),
        })
        .await
        .map_err(|_| FrontendError::Internal {
            detail: "admission stream closed before open".into(),
        })?;
        let mut responses = client
            .admit(ReceiverStream::new(rx))
            .await
            .map_err(|s| FrontendError::from_status("queue", s, &self.model))?
            .into_inner();
        loop {
            match responses.message().await {
                Ok(Some(qpb::AdmitResponse {
                    msg: Some(qpb::admit_response::Msg::Grant(g)),
                })) => {
                    return Ok((tx, responses, g));
                }
                Ok(Some(qpb::AdmitResponse {
                    msg: Some(qpb::admit_response::Msg::Held(h)),
                })) => {
                    tracing::debug!(position = h.position, pending = h.pending, reason = %h.reason, "held by the queue");
                }
                Ok(Some(_)) => continue,
                Ok(None) => {
                    return Err(FrontendError::Unavailable {
                        component: "queue",
                        message: "the queue closed the lease without a grant".into(),
                    });
                }
                Err(s) => return Err(FrontendError::from_status("queue", s, &self.model)),
            }
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
    /// The lease's request side and the queue's answers; both are closed
    /// cleanly on drop (see `Drop`).
    lease: Option<mpsc::Sender<qpb::AdmitRequest>>,
    lease_responses: Option<tonic::Streaming<qpb::AdmitResponse>>,
    stream: Option<tonic::Streaming<wpb::GenerateResponse>>,
    /// The worker finished the sequence itself: its stream only has its
    /// trailers left, so it is drained rather than reset on drop.
    worker_done: bool,
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
    span: Span,
}

impl Generation {
    /// The next event; `None` after `Done` or an error.
    pub(crate) async fn next(&mut self) -> Option<Result<Event, FrontendError>> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Some(Ok(e));
            }
            if self.finished {
                return None;
            }
            if let Err(e) = self.read().await {
                self.finished = true;
                self.record_end(&e);
                return Some(Err(e));
            }
        }
    }

    /// Reads one worker message into `pending`.
    async fn read(&mut self) -> Result<(), FrontendError> {
        let Some(stream) = self.stream.as_mut() else {
            return Err(FrontendError::Internal {
                detail: "worker stream already closed".into(),
            });
        };
        let msg = match tokio::time::timeout_at(self.deadline.into(), stream.message()).await {
            Err(_) => return Err(FrontendError::Deadline),
            Ok(Err(s)) => {
                return Err(FrontendError::from_status(
                    "worker",
                    s,
                    &self.pipeline.model,
                ));
            }
            Ok(Ok(None)) => {
                return Err(FrontendError::Unavailable {
                    component: "worker",
                    message: "the worker ended the stream before finishing".into(),
                });
            }
            Ok(Ok(Some(m))) => m,
        };
        if let Some(u) = &msg.usage {
            self.usage.cached_tokens = u.cached_tokens;
            self.usage.prompt_tokens = u.prompt_tokens.max(self.usage.prompt_tokens);
        }
        if !msg.prefill_worker_id.is_empty() {
            self.serving.prefill_worker_id = msg.prefill_worker_id.clone();
        }
        if !msg.token_ids.is_empty() {
            let now = Instant::now();
            let m = &self.pipeline.metrics;
            match self.last_token {
                None => m
                    .ttft
                    .with_label_values(&[&self.priority_label])
                    .observe((now - self.received).as_secs_f64()),
                Some(prev) => {
                    let per = (now - prev).as_secs_f64() / msg.token_ids.len() as f64;
                    m.itl
                        .with_label_values(&[&self.priority_label])
                        .observe(per);
                }
            }
            self.last_token = Some(now);
        }
        let mut text = String::new();
        let mut token_ids = Vec::with_capacity(msg.token_ids.len());
        let mut logprobs = Vec::new();
        let mut reason = None;
        for (i, &id) in msg.token_ids.iter().enumerate() {
            self.usage.completion_tokens += 1;
            token_ids.push(id);
            if self.want_logprobs
                && let Some(lp) = msg.logprobs.get(i)
            {
                logprobs.push(self.pipeline.logprob_entry(lp));
            }
            text.push_str(&self.detok.push(id)?.text);
            if self.detok.is_stopped() {
                // A stop string: end here; dropping the worker stream aborts it.
                reason = Some("stop");
                break;
            }
        }
        if reason.is_none() {
            reason = match common::FinishReason::try_from(msg.finish_reason)
                .unwrap_or(common::FinishReason::Unspecified)
            {
                common::FinishReason::Unspecified => None,
                common::FinishReason::Stop => Some("stop"),
                common::FinishReason::Length => Some("length"),
                common::FinishReason::Abort => Some("abort"),
                common::FinishReason::Error => {
                    return Err(FrontendError::Internal {
                        detail: "the worker reported an error".into(),
                    });
                }
            };
            if reason.is_some() {
                self.worker_done = true;
                text.push_str(&self.detok.flush()?.text);
            }
        }
        if !text.is_empty() || !token_ids.is_empty() {
            self.pending.push_back(Event::Delta {
                text,
                token_ids,
                logprobs,
            });
        }
        if let Some(r) = reason {
            self.finished = true;
            self.pending.push_back(Event::Done {
                finish_reason: r,
                usage: self.usage,
                serving: self.serving.clone(),
            });
            self.record_end_ok();
        }
        Ok(())
    }

    fn record_end_ok(&self) {
        let m = &self.pipeline.metrics;
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
    /// Closes the lease cleanly — `done`, half-close, read the queue's end of
    /// stream — and drains a worker stream the worker already finished. An
    /// unfinished worker stream (client gone, stop string, deadline) is
    /// dropped: that reset is the cancellation. Dropping finished streams
    /// mid-frame instead would make h2 reset them too, and a connection
    /// counts such library resets until it gives up on itself (1,024 by
    /// default): every request after that on the shared channel would fail.
    fn drop(&mut self) {
        self.pipeline.metrics.inflight.dec();
        let lease = self.lease.take();
        let responses = self.lease_responses.take();
        let worker = if self.worker_done {
            self.stream.take()
        } else {
            None
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            let drain = async {
                if let Some(lease) = lease {
                    let _ = lease
                        .send(qpb::AdmitRequest {
                            msg: Some(qpb::admit_request::Msg::Done(qpb::AdmitDone {})),
                        })
                        .await;
                }
                if let Some(mut r) = responses {
                    while let Ok(Some(_)) = r.message().await {}
                }
                if let Some(mut w) = worker {
                    while let Ok(Some(_)) = w.message().await {}
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(5), drain).await;
        });
    }
}

impl Pipeline {
    fn logprob_entry(&self, lp: &common::PositionLogprobs) -> TokenLogprob {
        let chosen = lp.chosen.unwrap_or_default();
        TokenLogprob {
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
