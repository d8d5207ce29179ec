//! Tool calls: how a model family writes them, the grammar that makes a
//! required call well-formed, and the parser that turns its output into
//! OpenAI `tool_calls`.
//!
//! Families ([`ToolFormat`]):
//! - `hermes` (Hermes, Qwen 2.5/3, SmolLM, most chatml models):
//!   `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, repeated
//!   for parallel calls.
//! - `llama3_json` (Llama 3.1–3.3): `{"name": …, "parameters": {…}}`, calls
//!   separated by `;`, optionally after `<|python_tag|>`.
//! - `mistral`: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`.
//!
//! The format is read from the chat template (each family's template
//! writes its own markers), else `hermes`; a flag can override it.

use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::grammar::GrammarSpec;

/// How a model family writes its tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolFormat {
    #[default]
    Hermes,
    Llama3Json,
    Mistral,
}

impl FromStr for ToolFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "hermes" => Ok(Self::Hermes),
            "llama3_json" => Ok(Self::Llama3Json),
            "mistral" => Ok(Self::Mistral),
            other => Err(format!(
                "unknown tool-call format `{other}`; one of hermes, llama3_json, mistral"
            )),
        }
    }
}

impl ToolFormat {
    /// The family a chat template's source writes tool calls for.
    pub fn detect(template_source: &str) -> Self {
        if template_source.contains("[TOOL_CALLS]") {
            Self::Mistral
        } else if template_source.contains("<|python_tag|>")
            || (template_source.contains("ipython") && template_source.contains("\"parameters\""))
        {
            Self::Llama3Json
        } else {
            Self::Hermes
        }
    }

    /// The key the family puts a call's arguments under.
    fn arguments_key(self) -> &'static str {
        match self {
            Self::Llama3Json => "parameters",
            Self::Hermes | Self::Mistral => "arguments",
        }
    }

    /// The grammar of the calls a request must make: one (or, with
    /// `parallel`, one or more) call of the `allowed` functions (all of
    /// `tools` when `None`), each with arguments valid against its
    /// parameters' schema.
    ///
    /// With `answer` (a JSON schema; `tool_choice` auto beside a
    /// `response_format`), the output is either calls or an answer valid
    /// against it.
    pub fn grammar(
        self,
        tools: &[ToolDef],
        allowed: Option<&str>,
        parallel: bool,
        answer: Option<&Value>,
    ) -> Result<GrammarSpec, String> {
        let calls: Vec<Value> = tools
            .iter()
            .filter(|t| allowed.is_none_or(|name| t.name == name))
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": t.name},
                        self.arguments_key(): t.parameters.clone().unwrap_or_else(|| json!({"type": "object"})),
                    },
                    "required": ["name", self.arguments_key()],
                    "additionalProperties": false,
                })
            })
            .collect();
        if calls.is_empty() {
            return Err(match allowed {
                Some(name) => format!("tool_choice names `{name}`, which is not in tools"),
                None => "tool_choice needs at least one tool".to_owned(),
            });
        }
        let options =
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        let call = json!({"anyOf": calls, "x-guidance": options});
        // The rule `calls`: the calls the family writes.
        let rules = match self {
            Self::Hermes => {
                let one = format!("\"<tool_call>\\n\" %json {call} \"\\n</tool_call>\"");
                if parallel {
                    format!("calls: call (\"\\n\" call)*\ncall: {one}\n")
                } else {
                    format!("calls: {one}\n")
                }
            }
            Self::Llama3Json => {
                if parallel {
                    format!("calls: call (\"; \" call)*\ncall: %json {call}\n")
                } else {
                    format!("calls: %json {call}\n")
                }
            }
            Self::Mistral => {
                let mut array = json!({"type": "array", "items": {"anyOf": call["anyOf"]}, "minItems": 1, "x-guidance": options});
                if !parallel {
                    array["maxItems"] = json!(1);
                }
                format!("calls: \"[TOOL_CALLS]\" %json {array}\n")
            }
        };
        let lark = match answer {
            None => format!("start: calls\n{rules}"),
            // Calls, or an answer in the requested shape.
            Some(schema) => {
                let mut schema = schema.clone();
                if let Some(o) = schema.as_object_mut() {
                    o.entry("x-guidance").or_insert(options);
                }
                format!("start: calls | answer\nanswer: %json {schema}\n{rules}")
            }
        };
        Ok(GrammarSpec::Lark(lark))
    }

    /// Splits a finished output into its text and its calls. Text that
    /// looks like a call but does not parse stays text.
    pub fn parse(self, output: &str) -> Parsed {
        match self {
            Self::Hermes => parse_hermes(output),
            Self::Llama3Json => parse_llama3(output),
            Self::Mistral => parse_mistral(output),
        }
    }

    /// Where, in streamed text, calls may begin: the text before it can be
    /// sent as content; from it on, it is held until the output ends.
    /// Checks a prefix of a marker at the very end too (a marker split over
    /// two deltas).
    pub fn hold_from(self, text: &str) -> Option<usize> {
        let markers: &[&str] = match self {
            Self::Hermes => &["<tool_call>"],
            Self::Mistral => &["[TOOL_CALLS]"],
            // A JSON call is the whole output.
            Self::Llama3Json => {
                const TAG: &str = "<|python_tag|>";
                let start = text.trim_start();
                return (start.is_empty()
                    || start.starts_with('{')
                    || start.starts_with(TAG)
                    || TAG.starts_with(start))
                .then_some(0);
            }
        };
        for m in markers {
            if let Some(i) = text.find(m) {
                return Some(i);
            }
        }
        // A marker's prefix at the end.
        markers
            .iter()
            .filter_map(|m| {
                (1..m.len())
                    .rev()
                    .find(|&k| text.ends_with(&m[..k]))
                    .map(|k| text.len() - k)
            })
            .min()
    }
}

/// A function the model may call (OpenAI's `tools[].function`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

/// One call parsed from the output.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI sends them as a string).
    pub arguments: String,
}

/// A finished output: its text (outside any call) and its calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

/// One call as a family writes it: `name` and its arguments (under
/// `arguments`, or Llama's `parameters`), kept as the model wrote them. Any
/// JSON the grammar allows parses, numbers too large for an `f64` included
/// (the arguments are never converted).
#[derive(Deserialize)]
struct RawCall<'a> {
    name: String,
    #[serde(borrow, alias = "parameters", default)]
    arguments: Option<&'a serde_json::value::RawValue>,
}

impl RawCall<'_> {
    fn parsed(self) -> ParsedCall {
        let raw = self.arguments.map_or("{}", |r| r.get());
        // Some models write the arguments as a JSON string of JSON.
        let arguments = if raw.starts_with('"') {
            serde_json::from_str::<String>(raw).unwrap_or_else(|_| raw.to_owned())
        } else {
            raw.to_owned()
        };
        ParsedCall {
            name: self.name,
            arguments,
        }
    }
}

/// The call in one JSON object's text.
fn call_of(text: &str) -> Option<ParsedCall> {
    serde_json::from_str::<RawCall>(text)
        .ok()
        .map(RawCall::parsed)
}

fn parse_hermes(output: &str) -> Parsed {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut parsed = Parsed::default();
    let mut rest = output;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        let (body, whole, next) = match after.find(CLOSE) {
            Some(end) => (
                &after[..end],
                end + CLOSE.len(),
                &after[end + CLOSE.len()..],
            ),
            None => (after, after.len(), ""),
        };
        match call_of(body.trim()) {
            Some(call) => {
                parsed.content.push_str(&rest[..start]);
                parsed.calls.push(call);
            }
            None => parsed.content.push_str(&rest[..start + OPEN.len() + whole]),
        }
        rest = next;
    }
    parsed.content.push_str(rest);
    if !parsed.calls.is_empty() {
        parsed.content = parsed.content.trim().to_owned();
    }
    parsed
}

fn parse_llama3(output: &str) -> Parsed {
    let body = output.trim();
    let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
    let mut calls = Vec::new();
    for part in body.split(';') {
        match call_of(part.trim()) {
            Some(c) => calls.push(c),
            None => {
                return Parsed {
                    content: output.to_owned(),
                    calls: Vec::new(),
                };
            }
        }
    }
    Parsed {
        content: String::new(),
        calls,
    }
}

fn parse_mistral(output: &str) -> Parsed {
    const OPEN: &str = "[TOOL_CALLS]";
    let Some(start) = output.find(OPEN) else {
        return Parsed {
            content: output.to_owned(),
            calls: Vec::new(),
        };
    };
    let body = output[start + OPEN.len()..].trim();
    let calls: Option<Vec<ParsedCall>> = serde_json::from_str::<Vec<RawCall>>(body)
        .ok()
        .map(|calls| calls.into_iter().map(RawCall::parsed).collect())
        .or_else(|| call_of(body).map(|c| vec![c]));
    match calls {
        Some(calls) => Parsed {
            content: output[..start].trim().to_owned(),
            calls,
        },
        None => Parsed {
            content: output.to_owned(),
            calls: Vec::new(),
        },
    }
}

/// The system prompt that describes `tools` to a model whose chat template
/// does not take them (the Hermes/Qwen wording).
pub fn system_prompt(tools: &[ToolDef]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&json!({"type": "function", "function": t}).to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A family's recorded output and the calls (name, arguments) in it.
    type Recorded = (ToolFormat, &'static str, Vec<(&'static str, Value)>);

    fn recorded() -> Vec<Recorded> {
        vec![
            (
                ToolFormat::Hermes,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
                vec![("get_weather", json!({"city": "Paris"}))],
            ),
            (
                ToolFormat::Hermes,
                "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>",
                vec![("a", json!({})), ("b", json!({"x": [1, 2]}))],
            ),
            (
                ToolFormat::Llama3Json,
                "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
                vec![("get_weather", json!({"city": "Paris"}))],
            ),
            (
                ToolFormat::Llama3Json,
                "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"k\": 1}}",
                vec![("a", json!({})), ("b", json!({"k": 1}))],
            ),
            (
                ToolFormat::Mistral,
                "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
                vec![("get_weather", json!({"city": "Paris"}))],
            ),
        ]
    }

    #[test]
    fn each_family_s_recorded_calls_parse() {
        for (format, output, want) in recorded() {
            let parsed = format.parse(output);
            let got: Vec<(String, Value)> = parsed
                .calls
                .iter()
                .map(|c| {
                    (
                        c.name.clone(),
                        serde_json::from_str(&c.arguments).expect("JSON args"),
                    )
                })
                .collect();
            let want: Vec<(String, Value)> =
                want.into_iter().map(|(n, a)| (n.to_owned(), a)).collect();
            assert_eq!(got, want, "{format:?}: {output}");
        }
        let p = ToolFormat::Hermes.parse(recorded()[1].1);
        assert_eq!(p.content, "Let me check.");
    }

    #[test]
    fn any_json_the_grammar_allows_parses_numbers_beyond_f64_included() {
        let out =
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 1e1280151212129}}\n</tool_call>";
        let p = ToolFormat::Hermes.parse(out);
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.calls[0].arguments, "{\"n\": 1e1280151212129}");
        // Arguments written as a string of JSON come back as that JSON.
        let out = "{\"name\": \"f\", \"parameters\": \"{\\\"a\\\": 1}\"}";
        assert_eq!(
            ToolFormat::Llama3Json.parse(out).calls[0].arguments,
            "{\"a\": 1}"
        );
    }

    #[test]
    fn text_that_is_not_a_call_stays_text() {
        for (format, text) in [
            (ToolFormat::Hermes, "no call here"),
            (ToolFormat::Hermes, "<tool_call>\n{not json\n</tool_call>"),
            (ToolFormat::Llama3Json, "The weather is fine."),
            (ToolFormat::Mistral, "[TOOL_CALLS] nope"),
        ] {
            let p = format.parse(text);
            assert!(p.calls.is_empty(), "{format:?}");
            assert_eq!(p.content, text);
        }
    }

    /// Streaming: at every split of the output into two deltas, the text
    /// sent before the hold point plus the held rest is the whole output,
    /// and nothing of a call is ever sent as content.
    #[test]
    fn the_hold_point_never_lets_part_of_a_call_out_at_any_split() {
        for (format, output, _) in recorded() {
            let parsed = format.parse(output);
            for cut in (0..=output.len()).filter(|&i| output.is_char_boundary(i)) {
                let first = &output[..cut];
                let sent = match format.hold_from(first) {
                    Some(i) => &first[..i],
                    None => first,
                };
                // What was sent is content the parser keeps as content.
                assert!(
                    parsed.content.starts_with(sent.trim_end()) || sent.trim().is_empty(),
                    "{format:?} cut {cut}: sent {sent:?}"
                );
            }
        }
    }

    #[test]
    fn the_grammar_names_the_allowed_functions_and_their_schemas() {
        let tools = vec![
            ToolDef {
                name: "get_weather".into(),
                description: None,
                parameters: Some(
                    json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
                ),
            },
            ToolDef {
                name: "add".into(),
                description: None,
                parameters: None,
            },
        ];
        let GrammarSpec::Lark(g) = ToolFormat::Hermes
            .grammar(&tools, Some("add"), false, None)
            .expect("grammar")
        else {
            panic!("lark")
        };
        assert!(g.contains("\"add\"") && !g.contains("get_weather"));
        assert!(
            ToolFormat::Hermes
                .grammar(&tools, Some("nope"), false, None)
                .is_err()
        );
        assert_eq!(
            ToolFormat::detect("{{ '[TOOL_CALLS]' }}"),
            ToolFormat::Mistral
        );
        assert_eq!(ToolFormat::detect("<|python_tag|>"), ToolFormat::Llama3Json);
        assert_eq!(ToolFormat::detect("<tool_call>"), ToolFormat::Hermes);
    }
}
