//! The gRPC `Inference` API: the same pipeline as HTTP, without JSON.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use sluice_proto::inference::v1 as pb;
use sluice_runtime::limits;
use sluice_tokens::tools::{ToolDef, ToolFormat};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::auth::Identity;
use crate::error::FrontendError;
use crate::openai::{
    ChatMessageIn, Content, FunctionCallIn, GenerateParams, Prompt, ToolCallIn, ToolHold, ToolIn,
    Tools, call_id, check_n, limit_error, message_text,
};
use crate::pipeline::{Event, Generation, Pipeline, Serving, assign_tenant};

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
                .map(|(i, m)| message_text(chat_message(m), i))
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
    // Unset (0) is one choice.
    let n = req.n.max(1);
    check_n(n)?;
    let defs = req
        .tools
        .into_iter()
        .enumerate()
        .map(tool)
        .collect::<Result<Vec<_>, _>>()?;
    let choice = req
        .tool_choice
        .and_then(|c| c.choice)
        .map(tool_choice)
        .transpose()?;
    let tools = Tools::of(
        (!defs.is_empty()).then_some(defs),
        choice,
        req.parallel_tool_calls,
    )?;
    if tools.is_some() && !matches!(prompt, Prompt::Chat(_)) {
        return Err(FrontendError::invalid(
            "tools",
            "tools need chat input: the chat template describes them to the model",
        ));
    }
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
        tools,
        n,
    })
}

/// A chat message as the HTTP API reads one, so both APIs check and render
/// it by the same rules.
fn chat_message(m: pb::ChatMessage) -> ChatMessageIn {
    ChatMessageIn {
        role: m.role,
        content: Some(Content::Text(m.content)),
        name: None,
        tool_calls: (!m.tool_calls.is_empty()).then(|| {
            m.tool_calls
                .into_iter()
                .map(|c| ToolCallIn {
                    id: (!c.id.is_empty()).then_some(c.id),
                    kind: None,
                    function: FunctionCallIn {
                        name: c.name,
                        arguments: c.arguments_json,
                    },
                })
                .collect()
        }),
        tool_call_id: (!m.tool_call_id.is_empty()).then_some(m.tool_call_id),
    }
}

/// The `i`th tool as the HTTP API reads one.
fn tool((i, t): (usize, pb::Tool)) -> Result<ToolIn, FrontendError> {
    let parameters = if t.parameters_json.is_empty() {
        None
    } else {
        Some(serde_json::from_str(&t.parameters_json).map_err(|e| {
            FrontendError::invalid(
                format!("tools[{i}].parameters_json"),
                format!("a function's parameters must be a JSON schema as JSON text: {e}"),
            )
        })?)
    };
    Ok(ToolIn {
        kind: "function".into(),
        function: ToolDef {
            name: t.name,
            description: (!t.description.is_empty()).then_some(t.description),
            parameters,
        },
    })
}

/// `tool_choice` as the HTTP API's JSON.
fn tool_choice(c: pb::tool_choice::Choice) -> Result<Value, FrontendError> {
    use pb::tool_choice::{Choice, Mode};
    Ok(match c {
        Choice::Mode(m) => match Mode::try_from(m) {
            Ok(Mode::Unspecified | Mode::Auto) => json!("auto"),
            Ok(Mode::None) => json!("none"),
            Ok(Mode::Required) => json!("required"),
            Err(_) => {
                return Err(FrontendError::invalid(
                    "tool_choice.mode",
                    format!("unknown mode {m}: use AUTO, NONE or REQUIRED"),
                ));
            }
        },
        Choice::Function(name) => json!({"type": "function", "function": {"name": name}}),
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

/// One choice's messages: its deltas (with tools, text that may be a call
/// held back and parsed at the end), then its last chunk.
fn choice(
    index: u32,
    generation: Generation,
    first: Option<Event>,
    tools: Option<ToolFormat>,
    request_id: String,
) -> futures::stream::BoxStream<'static, Result<pb::GenerateResponse, FrontendError>> {
    let hold = tools.map(ToolHold::new);
    // The id rides in the state: it is needed once, on the last chunk.
    Box::pin(futures::stream::unfold(
        Some((generation, first, hold, request_id)),
        move |state| {
            async move {
                let (mut g, mut first, mut hold, request_id) = state?;
                let event = match first.take() {
                    Some(e) => Ok(e),
                    None => g.next().await?,
                };
                match event {
                    Ok(Event::Delta {
                        text,
                        token_ids,
                        logprobs,
                    }) => {
                        let text = match &mut hold {
                            Some(hold) => hold.push(&text),
                            None => text,
                        };
                        // As the worker sent them, alternatives included.
                        let logprobs = logprobs.into_iter().map(|l| l.wire).collect();
                        let resp = pb::GenerateResponse {
                            text,
                            token_ids,
                            logprobs,
                            index,
                            ..Default::default()
                        };
                        Some((Ok(resp), Some((g, first, hold, request_id))))
                    }
                    Ok(Event::Done {
                        finish_reason,
                        usage,
                        serving,
                    }) => {
                        let parsed = hold.as_mut().map(ToolHold::finish).unwrap_or_default();
                        let resp = pb::GenerateResponse {
                            text: parsed.content,
                            tool_calls: parsed
                                .calls
                                .into_iter()
                                .map(|c| pb::ToolCall {
                                    id: call_id(),
                                    name: c.name,
                                    arguments_json: c.arguments,
                                })
                                .collect(),
                            finish_reason: finish_reason as i32,
                            usage: Some(usage),
                            serving: Some(serving_info(serving, request_id)),
                            index,
                            ..Default::default()
                        };
                        Some((Ok(resp), None))
                    }
                    Err(e) => Some((Err(e), None)),
                }
            }
        },
    ))
}

fn serving_info(serving: Serving, request_id: String) -> pb::ServingInfo {
    pb::ServingInfo {
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
        routed_ttft_ms: serving.routed_ttft_ms,
        routed_within_target: serving.routed_within_target,
        tpot_target_ms: serving.tpot_target_ms,
        tpot_ms: serving.tpot_ms,
        tpot_target_met: serving.tpot_target_met,
        fetched_tokens: serving.fetched_tokens,
        prefix_source_worker_id: serving.prefix_source_worker_id,
        ttft_ms: serving.ttft_ms,
        ttft_target_met: serving.ttft_target_met,
    }
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
            let tools = params.tools.as_ref().map(|_| p.tool_format);
            let generations = async {
                let prepared = p.prepare(params, received).await?;
                p.start_choices(prepared).await
            }
            .instrument(span)
            .await?;
            Ok::<_, FrontendError>((request_id, tools, generations))
        }
        .await;
        let (request_id, tools, (generations, mut first)) = match started {
            Ok(s) => s,
            Err(e) => {
                outcome.failed(&e);
                return Err(e.into());
            }
        };
        let choices = generations.into_iter().enumerate().map(|(index, g)| {
            let first = if index == 0 { first.take() } else { None };
            choice(index as u32, g, first, tools, request_id.clone())
        });
        // The outcome rides with the stream: recorded when it ends, by how
        // it ends (dropped first: the client left).
        let merged = futures::stream::select_all(choices);
        let stream = futures::stream::unfold(Some((merged, outcome)), |state| async move {
            let (mut merged, mut outcome) = state?;
            match merged.next().await {
                Some(Ok(resp)) => Some((Ok(resp), Some((merged, outcome)))),
                Some(Err(e)) => {
                    outcome.failed(&e);
                    Some((Err(Status::from(e)), None))
                }
                None => {
                    outcome.ok();
                    None
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
