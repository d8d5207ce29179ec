//! [`ChatTemplate`]: a model's Jinja chat template rendered with minijinja in
//! Hugging Face transformers' conventions, so a prompt renders to the same
//! text here as `tokenizer.apply_chat_template(..., tokenize=False)` gives.
//!
//! Conventions kept: `trim_blocks` and `lstrip_blocks` on, no trailing
//! newline kept; the context holds `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token`, `tools` when given, and any extra keyword
//! arguments; `raise_exception(msg)` fails the render with `msg`;
//! `strftime_now(fmt)` formats the current UTC time; Python string, dict and
//! list methods (`.strip()`, `.split()`, `.items()`, …) through
//! minijinja-contrib's pycompat; `tojson` behaves like transformers' (Python
//! `json.dumps` with `ensure_ascii=False`: `", "` and `": "` separators,
//! `indent`, `sort_keys`, `separators`, no HTML escaping).
//!
//! Where the template comes from ([`ChatTemplate::from_dir`]): the
//! directory's `chat_template.jinja` if present, else `chat_template` in
//! `tokenizer_config.json` (a string, or a list of `{name, template}` of
//! which "default" is used, and "tool_use" when tools are passed). A model
//! with neither gets [`FALLBACK_CHAT_TEMPLATE`], a ChatML template
//! (`<|im_start|>role\ncontent<|im_end|>\n`), and [`ChatTemplate::is_fallback`]
//! says so.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Output, State};
use serde::{Deserialize, Serialize};

use crate::error::TokensError;
use crate::hf_config::{CHAT_TEMPLATE_JINJA, JsonFile, TOKENIZER_CONFIG_JSON, read_text_optional};
use crate::tools::ToolFormat;

/// The template used when a model declares none: ChatML, with string
/// content or OpenAI-style content parts (their `text` concatenated).
pub const FALLBACK_CHAT_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' }}\
{%- if message['content'] is string %}{{- message['content'] }}\
{%- elif message['content'] is not none %}{%- for part in message['content'] %}\
{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}\
{{- '<|im_end|>\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

const DEFAULT_NAME: &str = "default";
const TOOL_USE_NAME: &str = "tool_use";

/// One chat message with text content; any other `Serialize` type with the
/// fields a template reads (e.g. content parts, tool calls) works as well.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// "system", "user", "assistant", "tool", …
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant turn's calls (OpenAI's `tool_calls`, each function's
    /// `arguments` an object, as templates read them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn's answer is to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of `role` with `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// Everything a render takes besides the messages.
#[derive(Debug, Clone, Default)]
pub struct ChatRenderOptions {
    /// End the prompt with the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// Tool definitions (OpenAI's `tools` array), exposed as `tools`.
    pub tools: Option<serde_json::Value>,
    /// Extra template variables (e.g. `enable_thinking`), as transformers'
    /// `**kwargs` to `apply_chat_template`.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A compiled chat template with the model's bos/eos token strings.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    has_tool_use: bool,
    /// Whether a template reads `tools` (else tools go in a system prompt).
    takes_tools: bool,
    /// The tool-call format its sources write.
    tool_format: ToolFormat,
    bos_token: String,
    eos_token: String,
    is_fallback: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("has_tool_use", &self.has_tool_use)
            .field("is_fallback", &self.is_fallback)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` with the given special token strings.
    ///
    /// # Errors
    /// [`TokensError::TemplateSyntax`] when the template does not compile.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TokensError> {
        Self::build(
            vec![(DEFAULT_NAME.to_string(), source.to_string())],
            bos_token,
            eos_token,
            false,
        )
    }

    /// [`FALLBACK_CHAT_TEMPLATE`] with the given special token strings.
    pub fn fallback(bos_token: &str, eos_token: &str) -> Self {
        Self::build(
            vec![(DEFAULT_NAME.to_string(), FALLBACK_CHAT_TEMPLATE.to_string())],
            bos_token,
            eos_token,
            true,
        )
        .expect("the fallback chat template is valid minijinja")
    }

    /// Loads the template of a model directory (see the module doc for the
    /// order of sources); bos/eos strings come from `tokenizer_config.json`.
    ///
    /// # Errors
    /// A parse error naming `tokenizer_config.json` and the key when it is
    /// malformed, [`TokensError::NoDefaultTemplate`] for a template list
    /// without "default", [`TokensError::TemplateSyntax`] when it does not compile.
    pub fn from_dir(dir: &Path) -> Result<Self, TokensError> {
        let config = JsonFile::read_optional(dir, TOKENIZER_CONFIG_JSON)?;
        let jinja = read_text_optional(&dir.join(CHAT_TEMPLATE_JINJA))?;
        let (bos, eos) = match &config {
            Some(c) => (c.token_string("bos_token")?, c.token_string("eos_token")?),
            None => (None, None),
        };
        let (bos, eos) = (bos.unwrap_or_default(), eos.unwrap_or_default());
        if let Some(source) = jinja {
            return Self::build(vec![(DEFAULT_NAME.to_string(), source)], &bos, &eos, false);
        }
        let templates = match &config {
            Some(c) => templates_of(c)?,
            None => Vec::new(),
        };
        if templates.is_empty() {
            return Ok(Self::fallback(&bos, &eos));
        }
        Self::build(templates, &bos, &eos, false)
    }

    /// The template of a model directory ([`Self::from_dir`]) or of a GGUF
    /// file's metadata.
    ///
    /// # Errors
    /// As [`Self::from_dir`], or when the GGUF cannot be read.
    pub fn from_path(path: &Path) -> Result<Self, TokensError> {
        if sluice_gguf::GgufFile::is_gguf(path) {
            return crate::gguf::chat_template(&sluice_gguf::GgufFile::open(path)?);
        }
        Self::from_dir(path)
    }

    fn build(
        templates: Vec<(String, String)>,
        bos_token: &str,
        eos_token: &str,
        is_fallback: bool,
    ) -> Result<Self, TokensError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_formatter(python_formatter);
        let mut has_tool_use = false;
        let takes_tools = templates.iter().any(|(_, s)| s.contains("tools"));
        let all: String = templates.iter().map(|(_, s)| s.as_str()).collect();
        let tool_format = ToolFormat::detect(&all);
        for (name, source) in templates {
            has_tool_use |= name == TOOL_USE_NAME;
            env.add_template_owned(name, source)
                .map_err(TokensError::TemplateSyntax)?;
        }
        Ok(Self {
            env: Arc::new(env),
            has_tool_use,
            takes_tools,
            tool_format,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            is_fallback,
        })
    }

    /// Renders `messages` (a sequence of objects with at least `role` and
    /// `content`), optionally opening an assistant turn.
    ///
    /// # Errors
    /// [`TokensError::TemplateRender`] when the template fails, including
    /// through `raise_exception` (its message is kept).
    pub fn render<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
    ) -> Result<String, TokensError> {
        self.render_with(
            messages,
            &ChatRenderOptions {
                add_generation_prompt,
                ..Default::default()
            },
        )
    }

    /// Renders `messages` with tools and extra variables.
    ///
    /// # Errors
    /// As [`ChatTemplate::render`].
    pub fn render_with<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        options: &ChatRenderOptions,
    ) -> Result<String, TokensError> {
        let name = if options.tools.is_some() && self.has_tool_use {
            TOOL_USE_NAME
        } else {
            DEFAULT_NAME
        };
        let template = self
            .env
            .get_template(name)
            .map_err(TokensError::TemplateRender)?;
        let mut ctx: BTreeMap<String, Value> = options
            .extra
            .iter()
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(options.add_generation_prompt),
        );
        ctx.insert("bos_token".into(), Value::from(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::from(self.eos_token.clone()));
        if let Some(tools) = &options.tools {
            ctx.insert("tools".into(), Value::from_serialize(tools));
        }
        template.render(ctx).map_err(TokensError::TemplateRender)
    }

    /// The bos token string templates see as `bos_token` ("" if none).
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The eos token string templates see as `eos_token` ("" if none).
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Whether the model declared no template and the ChatML fallback is used.
    pub fn is_fallback(&self) -> bool {
        self.is_fallback
    }

    /// Whether the template renders `tools` itself.
    pub fn takes_tools(&self) -> bool {
        self.takes_tools
    }

    /// How this model family writes tool calls, read from its template.
    pub fn tool_format(&self) -> ToolFormat {
        self.tool_format
    }
}

/// The `chat_template` entries of `tokenizer_config.json` as (name, source).
fn templates_of(config: &JsonFile) -> Result<Vec<(String, String)>, TokensError> {
    let bad = |problem: &str| TokensError::BadKey {
        path: config.path.clone(),
        key: "chat_template".into(),
        problem: problem.into(),
    };
    match config.value.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::String(s)) => Ok(vec![(DEFAULT_NAME.to_string(), s.clone())]),
        Some(serde_json::Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                let name = item.get("name").and_then(|v| v.as_str());
                let template = item.get("template").and_then(|v| v.as_str());
                match (name, template) {
                    (Some(n), Some(t)) => out.push((n.to_string(), t.to_string())),
                    _ => {
                        return Err(bad(
                            "lists an entry without string \"name\" and \"template\"",
                        ));
                    }
                }
            }
            if !out.iter().any(|(n, _)| n == DEFAULT_NAME) {
                let names = out.into_iter().map(|(n, _)| n).collect();
                return Err(TokensError::NoDefaultTemplate {
                    path: config.path.clone(),
                    names,
                });
            }
            Ok(out)
        }
        Some(_) => Err(bad("must be a string or a list of {name, template}")),
    }
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Prints lists and dicts as Python's `str()` does (`['a', None]`,
/// `{'k': True}`), as a template printing `{{ message.content }}` with
/// content parts would under transformers; everything else as minijinja
/// prints it (already Python-like: `True`, `None`).
fn python_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(value, &mut text)?;
            out.write_str(&text)
                .map_err(|_| Error::new(ErrorKind::WriteFailure, "writing template output failed"))
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// Python's `repr()` of a template value, for containers and their items.
fn python_repr(value: &Value, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::String => python_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&key, out)?;
                out.push_str(": ");
                python_repr(&value.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
    Ok(())
}

/// Python's `repr()` of a string: single quotes unless the text has a single
/// quote and no double quote.
fn python_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`; keyword arguments as in Python.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson separators must be a pair",
            ));
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut writer = PyJson {
        indent,
        item_sep,
        key_sep,
        ensure_ascii,
        sort_keys,
        out: String::new(),
    };
    writer.write(value, 0)?;
    Ok(Value::from_safe_string(writer.out))
}

/// A JSON writer with Python `json.dumps` formatting.
struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
    out: String,
}

impl PyJson {
    fn write(&mut self, value: &Value, depth: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                let text = serde_json::to_string(value).map_err(|e| {
                    Error::new(ErrorKind::InvalidOperation, "number is not JSON").with_source(e)
                })?;
                self.out.push_str(&text);
            }
            ValueKind::String => self.write_str(value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_container('[', ']', depth, items.len(), |w, i, d| {
                    w.write(&items[i], d)
                })?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    let key = key.as_str().map_or_else(|| key.to_string(), str::to_string);
                    entries.push((key, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.write_container('{', '}', depth, entries.len(), |w, i, d| {
                    w.write_str(&entries[i].0);
                    w.out.push_str(&w.key_sep.clone());
                    w.write(&entries[i].1, d)
                })?;
            }
            _ => self.write_str(&value.to_string()),
        }
        Ok(())
    }

    fn write_container(
        &mut self,
        open: char,
        close: char,
        depth: usize,
        len: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if len == 0 {
            self.out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                self.out.push_str(&self.item_sep.clone());
            }
            self.newline(depth + 1);
            item(self, i, depth + 1)?;
        }
        self.newline(depth);
        self.out.push(close);
        Ok(())
    }

    fn newline(&mut self, depth: usize) {
        if let Some(indent) = &self.indent {
            self.out.push('\n');
            for _ in 0..depth {
                self.out.push_str(indent);
            }
        }
    }

    fn write_str(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{08}' => self.out.push_str("\\b"),
                '\u{0c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        self.out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// transformers' `strftime_now(format)`: the current UTC time formatted with
/// the common `strftime` directives (`%Y %y %m %d %e %j %H %I %M %S %p %b %B
/// %a %A %%`); other directives are copied through.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(&format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats `unix_secs` (UTC) with a subset of `strftime`.
fn strftime(format: &str, unix_secs: u64) -> String {
    let days = unix_secs / 86_400;
    let secs_of_day = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = ((days + 3) % 7) as usize;
    let day_of_year = days - days_before_year(year) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let weekday_name = WEEKDAYS[weekday];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday_name[..3]),
            Some('A') => out.push_str(weekday_name),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Days from 1970-01-01 to January 1st of `year` (`year` >= 1970).
fn days_before_year(year: u64) -> u64 {
    let leaps = |y: u64| y / 4 - y / 100 + y / 400;
    (year - 1970) * 365 + leaps(year - 1) - leaps(1969)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi!"),
        ]
    }

    fn render_expr(expr: &str) -> String {
        ChatTemplate::new(expr, "<s>", "</s>")
            .expect("compiles")
            .render(&msgs(), false)
            .expect("renders")
    }

    #[test]
    fn fallback_renders_chatml_with_generation_prompt() {
        let t = ChatTemplate::fallback("", "");
        assert!(t.is_fallback());
        let out = t.render(&msgs(), true).expect("renders");
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
        let without = t.render(&msgs(), false).expect("renders");
        assert!(!without.ends_with("assistant\n"));
    }

    #[test]
    fn fallback_accepts_openai_content_parts() {
        let messages = serde_json::json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]}
        ]);
        let out = ChatTemplate::fallback("", "")
            .render(&messages, false)
            .expect("renders");
        assert_eq!(out, "<|im_start|>user\nab<|im_end|>\n");
    }

    /// Meta's Llama 3 template (without the date logic), as published.
    const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    #[test]
    fn llama3_template_renders_like_transformers() {
        let t = ChatTemplate::new(LLAMA3, "<|begin_of_text|>", "<|eot_id|>").expect("compiles");
        let out = t.render(&msgs(), true).expect("renders");
        assert_eq!(
            out,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_follow_transformers() {
        let source = "{% for m in messages %}\n    {{ m.role }}\n{% endfor %}";
        assert_eq!(render_expr(source), "    system\n    user\n");
    }

    #[test]
    fn raise_exception_is_a_render_error_with_its_message() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}",
            "",
            "",
        )
        .expect("compiles");
        let err = t.render(&msgs(), false).expect_err("raises");
        assert!(matches!(err, TokensError::TemplateRender(_)));
        assert!(
            err.to_string().contains("System role not supported"),
            "{err}"
        );
    }

    #[test]
    fn syntax_error_is_reported_not_panicked() {
        let err = ChatTemplate::new("{% for m in messages %}", "", "").expect_err("unclosed for");
        assert!(matches!(err, TokensError::TemplateSyntax(_)), "{err:?}");
    }

    #[test]
    fn python_string_methods_work() {
        assert_eq!(
            render_expr("{{ '  x y  '.strip().split(' ') | join('-') }}"),
            "x-y"
        );
        assert_eq!(
            render_expr("{{ messages[1].content.startswith('Hi') }}"),
            "True"
        );
        assert_eq!(
            render_expr("{{ true }}/{{ false }}/{{ none }}"),
            "True/False/None",
            "printed as Python prints"
        );
        assert_eq!(
            render_expr("{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}"),
            "a=1"
        );
    }

    #[test]
    fn lists_and_dicts_print_as_python_prints_them() {
        assert_eq!(
            render_expr("{{ 'a,b,,c'.split(',') }}"),
            "['a', 'b', '', 'c']"
        );
        assert_eq!(
            render_expr("{{ [1, 2.5, none, true, \"it's\", 'q\\'\"'] }}"),
            r#"[1, 2.5, None, True, "it's", 'q\'"']"#
        );
        assert_eq!(
            render_expr("{{ {'k': [false], 'tab': '\t'} }}"),
            r"{'k': [False], 'tab': '\t'}"
        );
        assert_eq!(render_expr("{{ 'plain' }} {{ 3 }}"), "plain 3");
    }

    #[test]
    fn bos_eos_and_namespace_are_available() {
        assert_eq!(render_expr("{{ bos_token }}|{{ eos_token }}"), "<s>|</s>");
        let ns = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}";
        assert_eq!(render_expr(ns), "2");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let value = "{'b': 1, 'a': [1, 2.5, none, true], 'c': 'é<\"x\">'}";
        assert_eq!(
            render_expr(&format!("{{{{ {value} | tojson }}}}")),
            r#"{"b": 1, "a": [1, 2.5, null, true], "c": "é<\"x\">"}"#
        );
        assert_eq!(
            render_expr(&format!(
                "{{{{ {value} | tojson(indent=2, sort_keys=true) }}}}"
            )),
            "{\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"b\": 1,\n  \"c\": \"é<\\\"x\\\">\"\n}"
        );
        assert_eq!(
            render_expr("{{ 'é😀' | tojson(ensure_ascii=true) }}"),
            r#""\u00e9\ud83d\ude00""#
        );
        assert_eq!(
            render_expr("{{ {'a': []} | tojson(separators=(',', ':')) }}"),
            r#"{"a":[]}"#
        );
    }

    #[test]
    fn tools_and_extra_variables_reach_the_template() {
        let t = ChatTemplate::new(
            "{% if tools %}{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}{{ enable_thinking }}",
            "",
            "",
        )
        .expect("compiles");
        let mut options = ChatRenderOptions {
            tools: Some(
                serde_json::json!([{"type": "function", "function": {"name": "get_time"}}]),
            ),
            ..Default::default()
        };
        options
            .extra
            .insert("enable_thinking".into(), serde_json::Value::Bool(false));
        assert_eq!(
            t.render_with(&msgs(), &options).expect("renders"),
            "get_time;False"
        );
    }

    #[test]
    fn tojson_keeps_the_key_order_of_request_json() {
        let tools: serde_json::Value = serde_json::from_str(
            r#"[{"type": "function", "function": {"name": "f", "description": "d"}}]"#,
        )
        .expect("valid JSON");
        let t = ChatTemplate::new("{% for t in tools %}{{ t | tojson }}{% endfor %}", "", "")
            .expect("compiles");
        let options = ChatRenderOptions {
            tools: Some(tools),
            ..Default::default()
        };
        assert_eq!(
            t.render_with(&msgs(), &options).expect("renders"),
            r#"{"type": "function", "function": {"name": "f", "description": "d"}}"#
        );
    }

    #[test]
    fn strftime_formats_a_known_instant() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let secs = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", secs), "2024-02-29 13:05:09");
        assert_eq!(
            strftime("%d %b %Y (%A, day %j, %I %p) 100%%", secs),
            "29 Feb 2024 (Thursday, day 060, 01 PM) 100%"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(strftime("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
    }

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).expect("write test file");
    }

    #[test]
    fn from_dir_without_template_falls_back_to_chatml() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(
            ChatTemplate::from_dir(dir.path())
                .expect("no files is fine")
                .is_fallback()
        );
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"eos_token": "<|im_end|>"}"#,
        );
        let t = ChatTemplate::from_dir(dir.path()).expect("no chat_template key");
        assert!(t.is_fallback());
        assert_eq!(t.eos_token(), "<|im_end|>");
    }

    #[test]
    fn from_dir_reads_string_template_and_tokens() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}"#,
        );
        let t = ChatTemplate::from_dir(dir.path()).expect("loads");
        assert!(!t.is_fallback());
        assert_eq!(
            t.render(&msgs(), false).expect("renders"),
            "<s>Be brief.</s>"
        );
    }

    #[test]
    fn from_dir_picks_default_and_tool_use_from_a_list() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}"#,
        );
        let t = ChatTemplate::from_dir(dir.path()).expect("loads");
        assert_eq!(t.render(&msgs(), false).expect("renders"), "plain");
        let options = ChatRenderOptions {
            tools: Some(serde_json::json!([])),
            ..Default::default()
        };
        assert_eq!(t.render_with(&msgs(), &options).expect("renders"), "tools");
    }

    #[test]
    fn from_dir_list_without_default_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#,
        );
        let err = ChatTemplate::from_dir(dir.path()).expect_err("no default");
        assert!(
            matches!(err, TokensError::NoDefaultTemplate { ref names, .. } if names == &["rag"])
        );
    }

    #[test]
    fn chat_template_jinja_file_takes_precedence() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"chat_template": "from config"}"#,
        );
        write(dir.path(), "chat_template.jinja", "from file");
        assert_eq!(
            ChatTemplate::from_dir(dir.path())
                .expect("loads")
                .render(&msgs(), false)
                .expect("renders"),
            "from file"
        );
    }

    #[test]
    fn malformed_tokenizer_config_names_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(dir.path(), "tokenizer_config.json", "{not json");
        let err = ChatTemplate::from_dir(dir.path())
            .expect_err("bad json")
            .to_string();
        assert!(err.contains("tokenizer_config.json"), "{err}");
    }
}
