//! The gRPC `Inference` API: the same pipeline as HTTP, without JSON.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use sluice_proto::common::v1 as common;
use sluice_proto::inference::v1 as pb;
use sluice_tokens::ChatMessage;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::auth::Identity;
use crate::error::FrontendError;
use crate::openai::{GenerateParams, Prompt};
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

fn params(req: pb::GenerateRequest) -> Result<GenerateParams, FrontendError> {
    let prompt = match req.input {
        Some(pb::generate_request::Input::Text(t)) if !t.is_empty() => Prompt::Text(t),
        Some(pb::generate_request::Input::Chat(c)) if !c.messages.is_empty() => Prompt::Chat(
            c.messages
                .into_iter()
                .map(|m| ChatMessage::new(m.role, m.content))
                .collect(),
        ),
        Some(pb::generate_request::Input::Tokens(t)) if !t.ids.is_empty() => Prompt::Tokens(t.ids),
        _ => {
            return Err(FrontendError::invalid(
                "input",
                "set exactly one non-empty input: text, chat or tokens",
            ));
        }
    };
    let mut sampling = req.sampling.unwrap_or_default();
    if let Some(t) = sampling.temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err(FrontendError::invalid(
            "sampling.temperature",
            "temperature must be between 0 and 2",
        ));
    }
    if let Some(p) = sampling.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(FrontendError::invalid(
            "sampling.top_p",
            "top_p must be in (0, 1]",
        ));
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
    })
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::inference_server::Inference for InferenceService {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let received = Instant::now();
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
        let p = Arc::clone(&self.pipeline);
        let request_id = params.request_id.clone();
        let generation = async {
            let prepared = p.prepare(params, received)?;
            p.start(prepared).await
        }
        .instrument(span)
        .await?;
        let stream = futures::stream::unfold(Some(generation), move |g| {
            let request_id = request_id.clone();
            async move {
                let mut g = g?;
                match g.next().await? {
                    Ok(Event::Delta {
                        text,
                        token_ids,
                        logprobs,
                    }) => {
                        let logprobs = logprobs
                            .into_iter()
                            .zip(token_ids.iter())
                            .map(|(l, &id)| common::PositionLogprobs {
                                chosen: Some(common::TokenLogprob {
                                    token_id: id,
                                    logprob: l.logprob,
                                }),
                                top: Vec::new(),
                            })
                            .collect();
                        Some((
                            Ok(pb::GenerateResponse {
                                text,
                                token_ids,
                                logprobs,
                                ..Default::default()
                            }),
                            Some(g),
                        ))
                    }
                    Ok(Event::Done {
                        finish_reason,
                        usage,
                        serving,
                    }) => {
                        let reason = match finish_reason {
                            "stop" => common::FinishReason::Stop,
                            "length" => common::FinishReason::Length,
                            _ => common::FinishReason::Abort,
                        };
                        let resp = pb::GenerateResponse {
                            finish_reason: reason as i32,
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
                            }),
                            ..Default::default()
                        };
                        Some((Ok(resp), None))
                    }
                    Err(e) => Some((Err(Status::from(e)), None)),
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
