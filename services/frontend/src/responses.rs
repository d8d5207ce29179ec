//! OpenAI's Responses API (`POST /v1/responses`), stateless: a request is
//! turned into the chat request it means (instructions and input items as
//! messages, flat function tools as chat tools, `text.format` as
//! `response_format`) and parsed by the chat parser, so both APIs share
//! every rule; the output is shaped as a `response` object, or streamed as
//! the typed events the `openai` package reads.
//!
//! Nothing is stored: `store: true`, `previous_response_id` and
//! `background: true` are 400s that say so.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::Event as SseEvent;
use futures::Stream;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use sluice_proto::common::v1::FinishReason;
use sluice_tokens::tools::{ParsedCall, ToolFormat};

use crate::error::FrontendError;
use crate::openai::ChatRequest;
use crate::pipeline::{Event, Generation, Serving};

/// The request body. Fields of the API that change nothing here
/// (`metadata`, `include`, `truncation`, `reasoning`, …) are accepted and
/// ignored; any other unknown field is a 400 like on chat.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ResponsesRequest {
    model: String,
    input: Input,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    text: Option<TextConfig>,
    #[serde(default)]
    max_output_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    background: Option<bool>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    nvext: Option<Value>,
    // Accepted, no effect here.
    #[serde(default)]
    #[allow(dead_code)]
    metadata: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    include: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    truncation: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    reasoning: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    service_tier: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    prompt_cache_key: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    safety_identifier: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    stream_options: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    top_logprobs: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Value>),
}

#[derive(Debug, Deserialize)]
struct TextConfig {
    #[serde(default)]
    format: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    verbosity: Option<Value>,
}

/// What the response echoes of its request.
#[derive(Debug, Clone)]
pub(crate) struct Echo {
    instructions: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
    text: Value,
    max_output_tokens: Value,
    temperature: Value,
    top_p: Value,
}

fn invalid(param: &str, message: impl Into<String>) -> FrontendError {
    FrontendError::invalid(param.to_owned(), message.into())
}

/// A message's text from a string or a list of `input_text` /
/// `output_text` parts.
fn text_of(content: &Value, at: &str) -> Result<String, FrontendError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (k, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        out.push_str(p.get("text").and_then(Value::as_str).unwrap_or_default());
                    }
                    other => {
                        return Err(invalid(
                            &format!("{at}.content[{k}].type"),
                            format!(
                                "content part type {:?} is not supported; only input_text and output_text",
                                other.unwrap_or("(none)")
                            ),
                        ));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(invalid(
            &format!("{at}.content"),
            "content must be text or a list of parts",
        )),
    }
}

impl ResponsesRequest {
    /// The chat request it means, the stream flag, and what the response
    /// echoes.
    pub(crate) fn into_chat(self) -> Result<(ChatRequest, Echo), FrontendError> {
        if self.store == Some(true) {
            return Err(invalid(
                "store",
                "responses are not stored here; send store: false (or leave it out) and send the whole conversation as input",
            ));
        }
        if self.previous_response_id.is_some() {
            return Err(invalid(
                "previous_response_id",
                "responses are not stored, so there is no previous response to continue; send the whole conversation as input",
            ));
        }
        if self.background == Some(true) {
            return Err(invalid(
                "background",
                "background responses are not supported",
            ));
        }
        let mut messages = Vec::new();
        if let Some(i) = &self.instructions {
            messages.push(json!({"role": "system", "content": i}));
        }
        match &self.input {
            Input::Text(t) => messages.push(json!({"role": "user", "content": t})),
            Input::Items(items) => {
                for (i, item) in items.iter().enumerate() {
                    let at = format!("input[{i}]");
                    let kind = item
                        .get("type")
                        .and_then(Value::as_str)
                        .unwrap_or("message");
                    match kind {
                        "message" => {
                            let role =
                                item.get("role").and_then(Value::as_str).ok_or_else(|| {
                                    invalid(&format!("{at}.role"), "a message needs a role")
                                })?;
                            let content =
                                text_of(item.get("content").unwrap_or(&Value::Null), &at)?;
                            messages.push(json!({"role": role, "content": content}));
                        }
                        "function_call" => {
                            let call = json!({
                                "id": item.get("call_id"),
                                "type": "function",
                                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                            });
                            // Consecutive calls are one assistant turn.
                            match messages.last_mut() {
                                Some(last)
                                    if last["role"] == "assistant" && last.get("tool_calls").is_some() =>
                                {
                                    if let Some(calls) = last["tool_calls"].as_array_mut() {
                                        calls.push(call);
                                    }
                                }
                                _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                            }
                        }
                        "function_call_output" => {
                            let output = match item.get("output") {
                                Some(Value::String(s)) => s.clone(),
                                Some(other) => text_of(other, &at)?,
                                None => String::new(),
                            };
                            messages.push(json!({
                                "role": "tool",
                                "tool_call_id": item.get("call_id"),
                                "content": output,
                            }));
                        }
                        other => {
                            return Err(invalid(
                                &format!("{at}.type"),
                                format!(
                                    "input item type `{other}` is not supported; message, function_call, function_call_output"
                                ),
                            ));
                        }
                    }
                }
            }
        }
        let tools: Option<Vec<Value>> = self
            .tools
            .as_ref()
            .map(|tools| {
                tools
                    .iter()
                    .enumerate()
                    .map(|(i, t)| match t.get("type").and_then(Value::as_str) {
                        Some("function") => Ok(json!({"type": "function", "function": {
                            "name": t.get("name"),
                            "description": t.get("description"),
                            "parameters": t.get("parameters"),
                        }})),
                        other => Err(invalid(
                            &format!("tools[{i}].type"),
                            format!(
                                "tool type {:?} is not supported; only function",
                                other.unwrap_or("(none)")
                            ),
                        )),
                    })
                    .collect::<Result<_, _>>()
            })
            .transpose()?;
        let tool_choice = match &self.tool_choice {
            Some(v @ Value::Object(o))
                if o.get("type").and_then(Value::as_str) == Some("function") =>
            {
                Some(json!({"type": "function", "function": {"name": v.get("name")}}))
            }
            other => other.clone(),
        };
        let format = self.text.as_ref().and_then(|t| t.format.clone());
        let response_format = match &format {
            None => None,
            Some(f) => match f.get("type").and_then(Value::as_str) {
                Some("text") => None,
                Some("json_object") => Some(json!({"type": "json_object"})),
                Some("json_schema") => Some(json!({"type": "json_schema", "json_schema": {
                    "name": f.get("name").cloned().unwrap_or(json!("output")),
                    "schema": f.get("schema"),
                    "strict": f.get("strict"),
                }})),
                other => {
                    return Err(invalid(
                        "text.format.type",
                        format!(
                            "format type {:?} is not supported; text, json_object or json_schema",
                            other.unwrap_or("(none)")
                        ),
                    ));
                }
            },
        };
        let mut chat = Map::new();
        chat.insert("model".into(), json!(self.model));
        chat.insert("messages".into(), Value::Array(messages));
        chat.insert("stream".into(), json!(self.stream));
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v.filter(|v| !v.is_null()) {
                chat.insert(k.into(), v);
            }
        };
        put(
            "max_completion_tokens",
            self.max_output_tokens.map(|n| json!(n)),
        );
        put("temperature", self.temperature.map(|t| json!(t)));
        put("top_p", self.top_p.map(|t| json!(t)));
        put("seed", self.seed.map(|s| json!(s)));
        put("tools", tools.map(Value::Array));
        put("tool_choice", tool_choice);
        put(
            "parallel_tool_calls",
            self.parallel_tool_calls.map(Value::Bool),
        );
        put("response_format", response_format);
        put("user", self.user.clone().map(Value::String));
        put("nvext", self.nvext.clone());
        let chat: ChatRequest = serde_json::from_value(Value::Object(chat))
            .map_err(|e| invalid("body", format!("{e}")))?;
        let echo = Echo {
            instructions: json!(self.instructions),
            tools: json!(self.tools.unwrap_or_default()),
            tool_choice: self.tool_choice.unwrap_or(json!("auto")),
            parallel_tool_calls: self.parallel_tool_calls.unwrap_or(true),
            text: json!({"format": format.unwrap_or(json!({"type": "text"}))}),
            max_output_tokens: json!(self.max_output_tokens),
            temperature: json!(self.temperature.unwrap_or(1.0)),
            top_p: json!(self.top_p.unwrap_or(1.0)),
        };
        Ok((chat, echo))
    }
}

/// What a finished response says.
struct Finished {
    text: String,
    calls: Vec<ParsedCall>,
    reason: FinishReason,
    usage: sluice_proto::common::v1::Usage,
    serving: Serving,
}

/// Shapes responses for one request.
pub(crate) struct Shape {
    pub id: String,
    pub model: String,
    pub created: i64,
    pub tools: Option<ToolFormat>,
    pub echo: Echo,
}

impl Shape {
    fn message_item(&self, text: &str, done: bool) -> Value {
        json!({
            "type": "message",
            "id": format!("msg_{}", &self.id[5..]),
            "status": if done { "completed" } else { "in_progress" },
            "role": "assistant",
            "content": if done { json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]) } else { json!([]) },
        })
    }

    fn call_item(&self, call: &ParsedCall, k: usize, done: bool) -> Value {
        json!({
            "type": "function_call",
            "id": format!("fc_{}_{k}", &self.id[5..]),
            "call_id": format!("call_{}", uuid::Uuid::new_v4().simple()),
            "name": call.name,
            "arguments": if done { call.arguments.as_str() } else { "" },
            "status": if done { "completed" } else { "in_progress" },
        })
    }

    fn response(&self, status: &str, output: Vec<Value>, end: Option<&Finished>) -> Value {
        let e = &self.echo;
        let incomplete = end
            .filter(|f| f.reason == FinishReason::Length)
            .map(|_| json!({"reason": "max_output_tokens"}));
        let status = match (end, &incomplete) {
            (Some(_), Some(_)) => "incomplete",
            _ => status,
        };
        let mut v = json!({
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": output,
            "instructions": e.instructions, "tools": e.tools, "tool_choice": e.tool_choice,
            "parallel_tool_calls": e.parallel_tool_calls, "text": e.text,
            "max_output_tokens": e.max_output_tokens, "temperature": e.temperature, "top_p": e.top_p,
            "previous_response_id": null, "reasoning": null, "store": false,
            "truncation": "disabled", "metadata": {}, "error": null,
            "incomplete_details": incomplete, "usage": null,
        });
        if let Some(f) = end
            && let Some(o) = v.as_object_mut()
        {
            let u = &f.usage;
            o.insert(
                "usage".into(),
                json!({
                    "input_tokens": u.prompt_tokens,
                    "input_tokens_details": {"cached_tokens": u.cached_tokens},
                    "output_tokens": u.completion_tokens,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": u.prompt_tokens + u.completion_tokens,
                }),
            );
            o.insert("nvext".into(), crate::http::nvext_json(&f.serving));
        }
        v
    }

    /// The finished output: the text, or the calls parsed from it.
    fn finish(
        &self,
        text: String,
        reason: FinishReason,
        usage: sluice_proto::common::v1::Usage,
        serving: Serving,
    ) -> Finished {
        let (text, calls) = match self.tools.map(|f| f.parse(&text)) {
            Some(p) if !p.calls.is_empty() => (p.content, p.calls),
            _ => (text, Vec::new()),
        };
        Finished {
            text,
            calls,
            reason,
            usage,
            serving,
        }
    }

    fn output_items(&self, f: &Finished) -> Vec<Value> {
        let mut items = Vec::new();
        if !f.text.is_empty() || f.calls.is_empty() {
            items.push(self.message_item(&f.text, true));
        }
        items.extend(
            f.calls
                .iter()
                .enumerate()
                .map(|(k, c)| self.call_item(c, k, true)),
        );
        items
    }
}

/// A whole response, not streamed.
pub(crate) async fn collect(
    shape: Shape,
    mut generation: Generation,
) -> Result<Value, FrontendError> {
    let mut text = String::new();
    while let Some(ev) = generation.next().await {
        match ev? {
            Event::Delta { text: t, .. } => text.push_str(&t),
            Event::Done {
                finish_reason,
                usage,
                serving,
            } => {
                let f = shape.finish(std::mem::take(&mut text), finish_reason, usage, serving);
                return Ok(shape.response("completed", shape.output_items(&f), Some(&f)));
            }
        }
    }
    Err(FrontendError::internal(
        "generation ended without a final event",
    ))
}

/// The response as server-sent events, typed as the `openai` package reads
/// them: `response.created`, the output items with their text deltas (or,
/// with tools, the items once the output is parsed), `response.completed`.
pub(crate) fn sse(
    shape: Shape,
    generation: Generation,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    struct St {
        shape: Shape,
        generation: Generation,
        queued: VecDeque<SseEvent>,
        seq: u64,
        text: String,
        /// The text message item is open (streaming text without tools).
        open: bool,
        done: bool,
    }
    impl St {
        fn push(&mut self, kind: &str, mut data: Value) {
            if let Some(o) = data.as_object_mut() {
                o.insert("type".into(), json!(kind));
                o.insert("sequence_number".into(), json!(self.seq));
            }
            self.seq += 1;
            self.queued
                .push_back(SseEvent::default().event(kind).data(data.to_string()));
        }
        fn item_id(&self) -> String {
            format!("msg_{}", &self.shape.id[5..])
        }
        fn open_text(&mut self) {
            self.open = true;
            let item = self.shape.message_item("", false);
            self.push(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            let id = self.item_id();
            self.push(
                "response.content_part.added",
                json!({"item_id": id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
            );
        }
        fn close_text(&mut self, text: &str, index: usize) {
            let id = self.item_id();
            self.push("response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}));
            self.push(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": []}}),
            );
            let item = self.shape.message_item(text, true);
            self.push(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            );
        }
    }
    let mut st = St {
        shape,
        generation,
        queued: VecDeque::new(),
        seq: 0,
        text: String::new(),
        open: false,
        done: false,
    };
    let created = st.shape.response("in_progress", Vec::new(), None);
    st.push("response.created", json!({"response": created.clone()}));
    st.push("response.in_progress", json!({"response": created}));
    futures::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(ev) = st.queued.pop_front() {
                return Some((Ok(ev), st));
            }
            if st.done {
                return None;
            }
            match st.generation.next().await {
                Some(Ok(Event::Delta { text, .. })) => {
                    st.text.push_str(&text);
                    // With tools the output is parsed at the end; without,
                    // text streams as it comes.
                    if st.shape.tools.is_none() && !text.is_empty() {
                        if !st.open {
                            st.open_text();
                        }
                        let id = st.item_id();
                        st.push("response.output_text.delta", json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": text, "logprobs": []}));
                    }
                }
                Some(Ok(Event::Done {
                    finish_reason,
                    usage,
                    serving,
                })) => {
                    st.done = true;
                    let text = std::mem::take(&mut st.text);
                    let f = st.shape.finish(text, finish_reason, usage, serving);
                    let mut index = 0;
                    if !f.text.is_empty() || f.calls.is_empty() {
                        if !st.open {
                            st.open_text();
                            if !f.text.is_empty() {
                                let id = st.item_id();
                                st.push("response.output_text.delta", json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": f.text, "logprobs": []}));
                            }
                        }
                        st.close_text(&f.text, 0);
                        index = 1;
                    }
                    let mut items = Vec::new();
                    if index == 1 {
                        items.push(st.shape.message_item(&f.text, true));
                    }
                    for (k, call) in f.calls.iter().enumerate() {
                        let done = st.shape.call_item(call, k, true);
                        let mut added = done.clone();
                        added["arguments"] = json!("");
                        added["status"] = json!("in_progress");
                        let output_index = index + k;
                        let id = done["id"].clone();
                        st.push(
                            "response.output_item.added",
                            json!({"output_index": output_index, "item": added}),
                        );
                        st.push("response.function_call_arguments.delta", json!({"item_id": id, "output_index": output_index, "delta": call.arguments}));
                        st.push("response.function_call_arguments.done", json!({"item_id": id, "output_index": output_index, "name": call.name, "arguments": call.arguments}));
                        st.push(
                            "response.output_item.done",
                            json!({"output_index": output_index, "item": done.clone()}),
                        );
                        items.push(done);
                    }
                    let response = st.shape.response("completed", items, Some(&f));
                    let kind = if response["status"] == "incomplete" {
                        "response.incomplete"
                    } else {
                        "response.completed"
                    };
                    st.push(kind, json!({"response": response}));
                }
                Some(Err(e)) => {
                    st.done = true;
                    st.push("error", json!({"code": e.status().as_str(), "message": e.to_string(), "param": null}));
                }
                None => return None,
            }
        }
    })
}
