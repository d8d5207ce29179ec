//! The gRPC `Inference` API: the same pipeline as HTTP, without JSON.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use sluice_proto::inference::v1 as pb;
use sluice_runtime::limits;
use sluice_tokens::ChatMessage;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::auth::Identity;
use crate::error::FrontendError;
use crate::openai::{GenerateParams, Prompt, check_role, limit_error};
use crate::pipeline::{Event, Pipeline, assign_tenant};

/// The tonic service.
#[derive(Debug, Clone)]
pub(crate) struct InferenceService {
    pub pipeline: Arc<Pipeline>,
}

impl InferenceService {
    /// `authorization` metadata against `--api-key-file`: the key's
    /// identity, or `None` without keys.
    fn authorize<T>(&self, request: &Request<T>) -> Result<Option<Identity>, FrontendError> {
        let value = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        self.pipeline.authorize(value)
    }
}

/// The request as the pipeline serves it, checked with the HTTP API's rules
/// (roles, stop strings, sampling limits, logprob counts, id lengths).
fn params(req: pb::GenerateRequest) -> Result<GenerateParams, FrontendError> {
    let prompt = match req.input {
        Some(pb::generate_request::Input::Text(t)) if !t.is_empty() => Prompt::Text(t),
        Some(pb::generate_request::Input::Chat(c)) if !c.messages.is_empty() => {
            let messages = c
                .messages
                .into_iter()
                .enumerate()
                .map(|(i, m)| {
                    check_role(&m.role, i)?;
                    Ok(ChatMessage::new(m.role, m.content))
                })
                .collect::<Result<Vec<_>, FrontendError>>()?;
            Prompt::Chat(messages)
        }
        Some(pb::generate_request::Input::Tokens(t)) if !t.ids.is_empty() => Prompt::Tokens(t.ids),
        _ => {
            return Err(FrontendError::invalid(
                "input",
                "set exactly one non-empty input: text, chat or tokens",
            ));
        }
    };
    let mut sampling = req.sampling.unwrap_or_default();
    limits::check_sampling(&sampling).map_err(|e| limit_error(prefixed(e)))?;
    limits::check_id("request_id", &req.request_id).map_err(limit_error)?;
    limits::check_id("tenant", &req.tenant).map_err(limit_error)?;
    limits::check_id("model", &req.model).map_err(limit_error)?;
    if let Some(h) = &req.hints {
        limits::check_priority(
            "hints.priority",
            h.priority,
            "hints.strict_priority",
            h.strict_priority,
        )
        .map_err(limit_error)?;
    }
    let stop = std::mem::take(&mut sampling.stop);
    Ok(GenerateParams {
        request_id: if req.request_id.is_empty() {
            format!("grpc-{}", uuid::Uuid::new_v4().simple())
        } else {
            req.request_id
        },
        model: req.model,
        prompt,
        sampling,
        stop,
        hints: req.hints.unwrap_or_default(),
        user: None,
        tenant: req.tenant,
        tenant_weight: 0,
        timeout: (req.timeout_ms > 0).then(|| Duration::from_millis(u64::from(req.timeout_ms))),
        tools: None,
        n: 1,
    })
}

/// A sampling rule's field as the gRPC API names it (`sampling.top_p`).
fn prefixed(e: limits::Invalid) -> limits::Invalid {
    let field = match e.field {
        "temperature" => "sampling.temperature",
        "top_p" => "sampling.top_p",
        "repetition_penalty" => "sampling.repetition_penalty",
        "top_logprobs" => "sampling.top_logprobs",
        "min_tokens" => "sampling.min_tokens",
        "stop" => "sampling.stop",
        "stop_token_ids" => "sampling.stop_token_ids",
        other => other,
    };
    limits::Invalid { field, ..e }
}

/// This API's line in `sluice_frontend_requests_total`.
const ENDPOINT: &str = "grpc_generate";

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::inference_server::Inference for InferenceService {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let received = Instant::now();
        let mut outcome = self.pipeline.metrics.outcome(ENDPOINT);
        let p = Arc::clone(&self.pipeline);
        let started = async {
            let identity = self.authorize(&request)?;
            let mut params = params(request.into_inner())?;
            let claimed = std::mem::take(&mut params.tenant);
            assign_tenant(&mut params, identity.as_ref(), Some(&claimed), "tenant")?;
            let span = tracing::info_span!(
                "inference.generate",
                request_id = %params.request_id,
                priority = params.hints.priority,
                tenant = %params.tenant,
            );
            let request_id = params.request_id.clone();
            let generation = async {
                let prepared = p.prepare(params, received).await?;
                p.start(prepared).await
            }
            .instrument(span)
            .await?;
            Ok::<_, FrontendError>((request_id, generation))
        }
        .await;
        let (request_id, generation) = match started {
            Ok(s) => s,
            Err(e) => {
                outcome.failed(&e);
                return Err(e.into());
            }
        };
        // The outcome rides with the stream: recorded when it ends, by how
        // it ends (dropped first: the client left).
        let stream = futures::stream::unfold(Some((generation, outcome)), move |g| {
            let request_id = request_id.clone();
            async move {
                let (mut g, mut outcome) = g?;
                match g.next().await? {
                    Ok(Event::Delta {
                        text,
                        token_ids,
                        logprobs,
                    }) => {
                        // As the worker sent them, alternatives included.
                        let logprobs = logprobs.into_iter().map(|l| l.wire).collect();
                        Some((
                            Ok(pb::GenerateResponse {
                                text,
                                token_ids,
                                logprobs,
                                ..Default::default()
                            }),
                            Some((g, outcome)),
                        ))
                    }
                    Ok(Event::Done {
                        finish_reason,
                        usage,
                        serving,
                    }) => {
                        let resp = pb::GenerateResponse {
                            finish_reason: finish_reason as i32,
                            usage: Some(usage),
                            serving: Some(pb::ServingInfo {
                                worker_id: serving.worker_id,
                                prefill_worker_id: serving.prefill_worker_id,
                                priority: serving.priority,
                                queue_wait_ms: serving.queue_wait_ms,
                                migrations: serving.migrations,
                                routed_overlap_tokens: serving.routed_overlap_tokens,
                                request_id,
                                tenant: serving.tenant,
                                ttft_target_ms: serving.ttft_target_ms,
                                predicted_queue_wait_ms: serving.predicted_queue_wait_ms,
                                ttft_ms: serving.ttft_ms,
                                ttft_target_met: serving.ttft_target_met,
                            }),
                            ..Default::default()
                        };
                        outcome.ok();
                        Some((Ok(resp), None))
                    }
                    Err(e) => {
                        outcome.failed(&e);
                        Some((Err(Status::from(e)), None))
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_models(
        &self,
        request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        self.authorize(&request)?;
        Ok(Response::new(pb::ListModelsResponse {
            models: vec![pb::Model {
                id: self.pipeline.model.clone(),
                created: self.pipeline.created,
                owned_by: "sluice".into(),
                max_model_len: 0,
            }],
        }))
    }
}
