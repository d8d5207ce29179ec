//! The OpenAI request bodies Sluice accepts, strict as OpenAI's and Dynamo's
//! are: an unknown field is a 400 that names it, and a priority anywhere but
//! `nvext.agent_hints.priority` is a 400 that names the right path. Parsing
//! ends in a [`GenerateParams`], the one form the pipeline serves.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use sluice_proto::common::v1 as common;
use sluice_runtime::limits;
use sluice_tokens::ChatMessage;
use sluice_tokens::tools::{Parsed, ToolDef, ToolFormat};

use crate::error::FrontendError;

/// The one place priority lives in a request body.
pub(crate) const PRIORITY_PATH: &str = "nvext.agent_hints.priority";

/// Where a request body names its TTFT target, in milliseconds.
pub(crate) const TTFT_TARGET_PATH: &str = "nvext.agent_hints.ttft_target_ms";
pub(crate) const TPOT_TARGET_PATH: &str = "nvext.agent_hints.tpot_target_ms";

/// What the pipeline serves, whichever API it came from.
#[derive(Debug, Clone)]
pub(crate) struct GenerateParams {
    pub request_id: String,
    pub model: String,
    pub prompt: Prompt,
    pub sampling: common::SamplingParams,
    pub stop: Vec<String>,
    pub hints: common::PriorityHints,
    /// OpenAI's end-user id; names the tenant only without API keys.
    pub user: Option<String>,
    /// The tenant the request is queued as (see `auth::resolve_tenant`);
    /// before resolution, the one the request claims, if any.
    pub tenant: String,
    /// The tenant's fair-share weight from the API key file; 0 = none.
    pub tenant_weight: u32,
    pub timeout: Option<Duration>,
    /// A chat request's tools, unless it has none (or `tool_choice` is
    /// `none`).
    pub tools: Option<Arc<Tools>>,
    /// Choices to generate from the one prompt (`n`).
    pub n: u32,
}

/// A chat request's tools and how it wants them used.
#[derive(Debug, Clone)]
pub(crate) struct Tools {
    pub defs: Vec<ToolDef>,
    /// OpenAI's `tools` array as given, for templates that render it.
    pub json: Value,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): more than one call per turn.
    pub parallel: bool,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToolChoice {
    /// The model decides; its output is parsed for calls.
    Auto,
    /// At least one call, well-formed by grammar.
    Required,
    /// A call of this function, well-formed by grammar.
    Named(String),
}

/// With tools, one choice's text as it streams: text before a possible
/// call goes out at once; from where a call may start it is held, and
/// parsed into calls (and any text) when the output ends. Both APIs stream
/// through it.
#[derive(Debug)]
pub(crate) struct ToolHold {
    format: ToolFormat,
    held: String,
}

impl ToolHold {
    pub(crate) fn new(format: ToolFormat) -> Self {
        Self {
            format,
            held: String::new(),
        }
    }

    /// `text` generated: what of the output may go out now.
    pub(crate) fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        let cut = self.format.hold_from(&self.held).unwrap_or(self.held.len());
        self.held.drain(..cut).collect()
    }

    /// The output ended: the held text, parsed.
    pub(crate) fn finish(&mut self) -> Parsed {
        self.format.parse(&std::mem::take(&mut self.held))
    }
}

/// A new call's id, as OpenAI's look (`call_…`).
pub(crate) fn call_id() -> String {
    format!("call_{}", uuid::Uuid::new_v4().simple())
}

/// One entry of `tools`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ToolIn {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: ToolDef,
}

impl Tools {
    /// From a request's `tools`, `tool_choice` and `parallel_tool_calls`;
    /// `None` without tools or with `tool_choice: "none"`.
    pub(crate) fn of(
        tools: Option<Vec<ToolIn>>,
        choice: Option<Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Arc<Self>>, FrontendError> {
        let tools = tools.unwrap_or_default();
        let choice = match &choice {
            None => ToolChoice::Auto,
            Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
            Some(Value::String(s)) if s == "none" => return Ok(None),
            Some(Value::String(s)) if s == "required" => ToolChoice::Required,
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(name) if v.get("type").and_then(Value::as_str) == Some("function") => {
                    ToolChoice::Named(name.to_owned())
                }
                _ => {
                    return Err(FrontendError::invalid(
                        "tool_choice",
                        "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ));
                }
            },
        };
        if tools.is_empty() {
            return match choice {
                ToolChoice::Auto => Ok(None),
                _ => Err(FrontendError::invalid(
                    "tool_choice",
                    "tool_choice asks for a call but tools is empty",
                )),
            };
        }
        for (i, t) in tools.iter().enumerate() {
            if t.kind != "function" {
                return Err(FrontendError::invalid(
                    format!("tools[{i}].type"),
                    format!("tool type `{}` is not supported; only `function`", t.kind),
                ));
            }
            limits::check_id("tools[].function.name", &t.function.name).map_err(|e| {
                FrontendError::invalid(format!("tools[{i}].function.name"), e.message)
            })?;
        }
        if let ToolChoice::Named(name) = &choice
            && !tools.iter().any(|t| &t.function.name == name)
        {
            return Err(FrontendError::invalid(
                "tool_choice",
                format!("tool_choice names `{name}`, which is not in tools"),
            ));
        }
        let json = Value::Array(
            tools
                .iter()
                .map(|t| serde_json::json!({"type": "function", "function": t.function}))
                .collect(),
        );
        Ok(Some(Arc::new(Self {
            defs: tools.into_iter().map(|t| t.function).collect(),
            json,
            choice,
            parallel: parallel.unwrap_or(true),
        })))
    }
}

/// The prompt as the client gave it.
#[derive(Debug, Clone)]
pub(crate) enum Prompt {
    Text(String),
    Chat(Vec<ChatMessage>),
    Tokens(Vec<u32>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Nvext {
    #[serde(default)]
    pub agent_hints: Option<AgentHints>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentHints {
    #[serde(default)]
    pub priority: Option<i32>,
    #[serde(default)]
    pub strict_priority: Option<u32>,
    #[serde(default)]
    pub osl: Option<u32>,
    /// Time to first token wanted, in milliseconds: a request the queue
    /// predicts cannot get its first token in time is refused at once
    /// (429) instead of served late. Unset: the queue's default for the
    /// priority.
    #[serde(default)]
    pub ttft_target_ms: Option<u32>,
    /// Time per output token wanted, in milliseconds: the router keeps the
    /// request off workers whose decode batch would be slower. Unset: the
    /// queue's default for the priority, if any.
    #[serde(default)]
    pub tpot_target_ms: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessageIn>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i32>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub min_tokens: Option<u32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    #[serde(default)]
    pub tools: Option<Vec<ToolIn>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub nvext: Option<Nvext>,
}

/// `response_format`: free text, any JSON object, or JSON valid against a
/// schema, enforced while decoding.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct JsonSchemaFormat {
    #[allow(dead_code)]
    pub name: String,
    #[serde(default)]
    #[allow(dead_code)]
    pub description: Option<String>,
    #[serde(default)]
    pub schema: Option<Value>,
    /// Always enforced: decoding cannot leave the schema either way.
    #[serde(default)]
    #[allow(dead_code)]
    pub strict: Option<bool>,
}

impl ResponseFormat {
    /// On the wire; `None` for free text.
    fn to_wire(&self) -> Option<common::StructuredOutput> {
        use common::structured_output::Kind;
        let kind = match self {
            Self::Text => return None,
            Self::JsonObject => Kind::JsonObject(true),
            Self::JsonSchema { json_schema } => Kind::JsonSchema(
                json_schema
                    .schema
                    .as_ref()
                    .map_or_else(|| "{}".to_owned(), Value::to_string),
            ),
        };
        Some(common::StructuredOutput { kind: Some(kind) })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ChatMessageIn {
    pub role: String,
    /// `null` or absent on an assistant turn that only calls tools.
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCallIn>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

/// An assistant turn's call, as the client sends it back.
#[derive(Debug, Deserialize)]
pub(crate) struct ToolCallIn {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(rename = "type", default)]
    #[allow(dead_code)]
    pub kind: Option<String>,
    pub function: FunctionCallIn,
}

#[derive(Debug, Deserialize)]
pub(crate) struct FunctionCallIn {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum PromptIn {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompletionRequest {
    pub model: String,
    pub prompt: PromptIn,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<i32>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Completions API: number of top logprobs per token (0..=20).
    #[serde(default)]
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub best_of: Option<u32>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub min_tokens: Option<u32>,
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    #[serde(default)]
    pub nvext: Option<Nvext>,
}

/// Streaming choices of a parsed request.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StreamMode {
    pub stream: bool,
    pub include_usage: bool,
}

/// Rejects a priority in the wrong place before typed parsing, so the error
/// names the right path instead of "unknown field".
pub(crate) fn check_priority_placement(body: &Value) -> Result<(), FrontendError> {
    let misplaced = |found: &str| {
        FrontendError::invalid(
            PRIORITY_PATH,
            format!(
                "`{found}` is not read; put the priority (an integer, higher = more important) in `{PRIORITY_PATH}`"
            ),
        )
    };
    let Some(obj) = body.as_object() else {
        return Err(FrontendError::invalid(
            "body",
            "the request body must be a JSON object",
        ));
    };
    if obj.contains_key("priority") {
        return Err(misplaced("priority"));
    }
    if let Some(extra) = obj.get("extra").or_else(|| obj.get("extra_body")) {
        let key = if obj.contains_key("extra") {
            "extra"
        } else {
            "extra_body"
        };
        if extra.get("nvext").is_some() || extra.get("priority").is_some() {
            return Err(misplaced(&format!("{key}.nvext")));
        }
    }
    if let Some(nvext) = obj.get("nvext") {
        if nvext.get("priority").is_some() {
            return Err(misplaced("nvext.priority"));
        }
        if let Some(p) = nvext.get("agent_hints").and_then(|h| h.get("priority"))
            && !(p.is_i64() && p.as_i64().is_some_and(|v| i32::try_from(v).is_ok()))
            && !p.is_null()
        {
            return Err(FrontendError::invalid(
                PRIORITY_PATH,
                format!(
                    "`{PRIORITY_PATH}` must be a 32-bit integer (higher = more important), got {p}"
                ),
            ));
        }
        if let Some(p) = nvext
            .get("agent_hints")
            .and_then(|h| h.get("strict_priority"))
            && !(p.is_u64() || p.is_null())
        {
            return Err(FrontendError::invalid(
                "nvext.agent_hints.strict_priority",
                format!(
                    "`nvext.agent_hints.strict_priority` must be a non-negative integer tier, got {p}"
                ),
            ));
        }
    }
    Ok(())
}

/// Turns a serde error into a 400 that names the offending field.
pub(crate) fn parse_error(e: serde_json::Error) -> FrontendError {
    let msg = e.to_string();
    let param = msg
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split('`').next())
        .or_else(|| {
            msg.strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next())
        })
        .map(str::to_string);
    let message = match &param {
        Some(p) if msg.starts_with("unknown field") => {
            format!("unknown field `{p}`: remove it or check its spelling and place ({msg})")
        }
        _ => format!("invalid request body: {msg}"),
    };
    FrontendError::InvalidRequest { message, param }
}

fn stop_list(stop: Option<Stop>) -> Result<Vec<String>, FrontendError> {
    let v = match stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    limits::check_stop_strings(&v).map_err(limit_error)?;
    Ok(v)
}

/// A rule of [`sluice_runtime::limits`] broken, as a 400 naming the field.
pub(crate) fn limit_error(e: limits::Invalid) -> FrontendError {
    FrontendError::invalid(e.field, e.message)
}

/// The roles a chat message may have.
pub(crate) fn check_role(role: &str, i: usize) -> Result<(), FrontendError> {
    if matches!(role, "system" | "user" | "assistant" | "tool" | "developer") {
        Ok(())
    } else {
        Err(FrontendError::invalid(
            format!("messages[{i}].role"),
            format!("unknown role `{role}` (system, user, assistant, tool or developer)"),
        ))
    }
}

struct Common {
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    seed: Option<i64>,
    n: Option<u32>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    min_tokens: Option<u32>,
    repetition_penalty: Option<f32>,
    logprobs: bool,
    top_logprobs: u32,
    structured_output: Option<common::StructuredOutput>,
}

/// Most choices one request may ask for.
pub(crate) const MAX_N: u32 = 16;

/// `n` within 1..=[`MAX_N`]: the one rule both APIs apply.
pub(crate) fn check_n(n: u32) -> Result<(), FrontendError> {
    if (1..=MAX_N).contains(&n) {
        Ok(())
    } else {
        Err(FrontendError::invalid(
            "n",
            format!("n must be between 1 and {MAX_N}"),
        ))
    }
}

fn sampling(c: &Common) -> Result<common::SamplingParams, FrontendError> {
    if let Some(n) = c.n {
        check_n(n)?;
    }
    if let Some(t) = c.temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err(FrontendError::invalid(
            "temperature",
            "temperature must be between 0 and 2",
        ));
    }
    if let Some(p) = c.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(FrontendError::invalid("top_p", "top_p must be in (0, 1]"));
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as u32,
        Some(_) => {
            return Err(FrontendError::invalid(
                "top_k",
                "top_k must be -1, 0 (off) or positive",
            ));
        }
    };
    for (name, v) in [
        ("frequency_penalty", c.frequency_penalty),
        ("presence_penalty", c.presence_penalty),
    ] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(FrontendError::invalid(
                name,
                format!("{name} is not supported; use repetition_penalty"),
            ));
        }
    }
    if let Some(r) = c.repetition_penalty
        && !(r > 0.0 && r <= 10.0)
    {
        return Err(FrontendError::invalid(
            "repetition_penalty",
            "repetition_penalty must be in (0, 10]",
        ));
    }
    if c.max_tokens == Some(0) {
        return Err(FrontendError::invalid(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    if c.top_logprobs > 20 {
        return Err(FrontendError::invalid(
            "top_logprobs",
            "top_logprobs must be at most 20",
        ));
    }
    let seed = match c.seed {
        None => None,
        Some(s) => Some(
            u64::try_from(s)
                .map_err(|_| FrontendError::invalid("seed", "seed must be non-negative"))?,
        ),
    };
    let params = common::SamplingParams {
        max_tokens: c.max_tokens.unwrap_or(0),
        min_tokens: c.min_tokens.unwrap_or(0),
        temperature: c.temperature,
        top_p: c.top_p,
        top_k,
        seed,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: c.ignore_eos.unwrap_or(false),
        repetition_penalty: c.repetition_penalty,
        top_logprobs: c.top_logprobs,
        logprobs: c.logprobs,
        structured_output: c.structured_output.clone(),
    };
    // The rules every boundary applies (the checks above name the API's
    // own fields; these keep HTTP, gRPC and the workers in step).
    limits::check_sampling(&params).map_err(limit_error)?;
    Ok(params)
}

/// The `user` field (an end-user id; the tenant without keys), bounded
/// like every id.
fn user(user: Option<String>) -> Result<Option<String>, FrontendError> {
    if let Some(u) = &user {
        limits::check_id("user", u).map_err(limit_error)?;
    }
    Ok(user)
}

fn hints(nvext: &Option<Nvext>) -> common::PriorityHints {
    let h = nvext.as_ref().and_then(|n| n.agent_hints.as_ref());
    common::PriorityHints {
        priority: h.and_then(|h| h.priority).unwrap_or(0),
        strict_priority: h.and_then(|h| h.strict_priority).unwrap_or(0),
        osl: h.and_then(|h| h.osl).unwrap_or(0),
        ttft_target_ms: h.and_then(|h| h.ttft_target_ms).unwrap_or(0),
        tpot_target_ms: h.and_then(|h| h.tpot_target_ms).unwrap_or(0),
    }
}

pub(crate) fn message_text(m: ChatMessageIn, i: usize) -> Result<ChatMessage, FrontendError> {
    let content = match m.content {
        None => String::new(),
        Some(Content::Text(t)) => t,
        Some(Content::Parts(parts)) => {
            let mut out = String::new();
            for p in parts {
                if p.kind != "text" {
                    return Err(FrontendError::invalid(
                        format!("messages[{i}].content"),
                        format!(
                            "content part type `{}` is not supported; only `text`",
                            p.kind
                        ),
                    ));
                }
                out.push_str(p.text.as_deref().unwrap_or_default());
            }
            out
        }
    };
    check_role(&m.role, i)?;
    let _ = m.name;
    let mut message = ChatMessage::new(m.role, content);
    if let Some(calls) = m.tool_calls {
        // Templates read each call's arguments as an object.
        let calls: Vec<Value> = calls
            .into_iter()
            .enumerate()
            .map(|(k, c)| {
                let arguments: Value =
                    serde_json::from_str(&c.function.arguments).map_err(|e| {
                        FrontendError::invalid(
                            format!("messages[{i}].tool_calls[{k}].function.arguments"),
                            format!("arguments must be JSON text: {e}"),
                        )
                    })?;
                Ok(serde_json::json!({
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": arguments},
                }))
            })
            .collect::<Result<_, FrontendError>>()?;
        message.tool_calls = Some(Value::Array(calls));
    }
    message.tool_call_id = m.tool_call_id;
    Ok(message)
}

impl ChatRequest {
    /// Validates and converts; `request_id` is the server's id for it.
    pub(crate) fn into_params(
        self,
        request_id: String,
    ) -> Result<(GenerateParams, StreamMode), FrontendError> {
        if self.messages.is_empty() {
            return Err(FrontendError::invalid(
                "messages",
                "messages must not be empty",
            ));
        }
        let mode = StreamMode {
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
        };
        if self.stream_options.is_some() && !self.stream {
            return Err(FrontendError::invalid(
                "stream_options",
                "stream_options is only allowed with stream: true",
            ));
        }
        let logprobs = self.logprobs.unwrap_or(false);
        if self.top_logprobs.is_some() && !logprobs {
            return Err(FrontendError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        }
        let common = Common {
            max_tokens: self.max_completion_tokens.or(self.max_tokens),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            n: self.n,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens,
            repetition_penalty: self.repetition_penalty,
            logprobs,
            top_logprobs: self.top_logprobs.unwrap_or(0),
            structured_output: self
                .response_format
                .as_ref()
                .and_then(ResponseFormat::to_wire),
        };
        let tools = Tools::of(self.tools, self.tool_choice, self.parallel_tool_calls)?;
        let sampling = sampling(&common)?;
        let messages = self
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| message_text(m, i))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((
            GenerateParams {
                request_id,
                model: self.model,
                prompt: Prompt::Chat(messages),
                sampling,
                stop: stop_list(self.stop)?,
                hints: hints(&self.nvext),
                user: user(self.user)?,
                tenant: String::new(),
                tenant_weight: 0,
                timeout: None,
                tools,
                n: common.n.unwrap_or(1),
            },
            mode,
        ))
    }
}

impl CompletionRequest {
    /// Validates and converts; `request_id` is the server's id for it.
    pub(crate) fn into_params(
        self,
        request_id: String,
    ) -> Result<(GenerateParams, StreamMode), FrontendError> {
        let prompt = match self.prompt {
            PromptIn::Text(t) => Prompt::Text(t),
            PromptIn::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
            PromptIn::Tokens(t) => Prompt::Tokens(t),
            PromptIn::TokenLists(mut v) if v.len() == 1 => Prompt::Tokens(v.remove(0)),
            _ => {
                return Err(FrontendError::invalid(
                    "prompt",
                    "exactly one prompt per request is supported",
                ));
            }
        };
        if matches!(&prompt, Prompt::Text(t) if t.is_empty())
            || matches!(&prompt, Prompt::Tokens(t) if t.is_empty())
        {
            return Err(FrontendError::invalid("prompt", "prompt must not be empty"));
        }
        if self.echo == Some(true) {
            return Err(FrontendError::invalid("echo", "echo is not supported"));
        }
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(FrontendError::invalid(
                "best_of",
                "only best_of = 1 is supported",
            ));
        }
        if self.stream_options.is_some() && !self.stream {
            return Err(FrontendError::invalid(
                "stream_options",
                "stream_options is only allowed with stream: true",
            ));
        }
        let mode = StreamMode {
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
        };
        let common = Common {
            max_tokens: self.max_tokens.or(Some(16)),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            n: self.n,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens,
            repetition_penalty: self.repetition_penalty,
            logprobs: self.logprobs.is_some(),
            top_logprobs: self.logprobs.unwrap_or(0),
            structured_output: self
                .response_format
                .as_ref()
                .and_then(ResponseFormat::to_wire),
        };
        let sampling = sampling(&common)?;
        Ok((
            GenerateParams {
                request_id,
                model: self.model,
                prompt,
                sampling,
                stop: stop_list(self.stop)?,
                hints: hints(&self.nvext),
                user: user(self.user)?,
                tenant: String::new(),
                tenant_weight: 0,
                timeout: None,
                tools: None,
                n: common.n.unwrap_or(1),
            },
            mode,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param_of(e: FrontendError) -> Option<String> {
        match e {
            FrontendError::InvalidRequest { param, .. } => param,
            other => panic!("expected InvalidRequest, got {other:?}"),
        }
    }

    #[test]
    fn misplaced_priority_is_rejected_naming_the_right_path() {
        for body in [
            json!({"model": "m", "messages": [], "priority": 5}),
            json!({"model": "m", "messages": [], "nvext": {"priority": 5}}),
            json!({"model": "m", "messages": [], "extra": {"nvext": {"agent_hints": {"priority": 5}}}}),
            json!({"model": "m", "messages": [], "nvext": {"agent_hints": {"priority": "high"}}}),
            json!({"model": "m", "messages": [], "nvext": {"agent_hints": {"priority": 1.5}}}),
        ] {
            let err = check_priority_placement(&body).expect_err("must be rejected");
            assert_eq!(param_of(err).as_deref(), Some(PRIORITY_PATH), "{body}");
        }
        let ok = json!({"model": "m", "messages": [], "nvext": {"agent_hints": {"priority": -3}}});
        assert!(check_priority_placement(&ok).is_ok());
    }

    #[test]
    fn unknown_field_names_the_field() {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temprature": 0.5});
        let err = serde_json::from_value::<ChatRequest>(body)
            .map_err(parse_error)
            .expect_err("unknown field");
        assert_eq!(param_of(err).as_deref(), Some("temprature"));
    }

    #[test]
    fn chat_request_carries_priority_hints_and_sampling() {
        let body = json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 7, "temperature": 0, "seed": 3, "stop": "x",
            "nvext": {"agent_hints": {"priority": 4, "strict_priority": 1, "osl": 9}}
        });
        let req: ChatRequest = serde_json::from_value(body).expect("parses");
        let (p, mode) = req.into_params("id".into()).expect("valid");
        assert!(!mode.stream);
        assert_eq!(p.hints.priority, 4);
        assert_eq!(p.hints.strict_priority, 1);
        assert_eq!(p.hints.osl, 9);
        assert_eq!(p.sampling.max_tokens, 7);
        assert_eq!(p.sampling.seed, Some(3));
        assert_eq!(p.stop, vec!["x".to_string()]);
    }

    #[test]
    fn n_out_of_range_is_a_clear_400() {
        for n in [0, MAX_N + 1] {
            let body =
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": n});
            let req: ChatRequest = serde_json::from_value(body).expect("parses");
            assert_eq!(
                param_of(req.into_params("id".into()).expect_err("out of range")).as_deref(),
                Some("n")
            );
        }
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 4});
        let req: ChatRequest = serde_json::from_value(body).expect("parses");
        assert_eq!(req.into_params("id".into()).expect("n=4").0.n, 4);
    }

    #[test]
    fn completion_accepts_token_prompts_and_logprobs_count() {
        let body = json!({"model": "m", "prompt": [1, 2, 3], "logprobs": 2});
        let req: CompletionRequest = serde_json::from_value(body).expect("parses");
        let (p, _) = req.into_params("id".into()).expect("valid");
        assert!(matches!(p.prompt, Prompt::Tokens(ref t) if t == &[1, 2, 3]));
        assert!(p.sampling.logprobs);
        assert_eq!(p.sampling.top_logprobs, 2);
        assert_eq!(p.sampling.max_tokens, 16);
    }
}
