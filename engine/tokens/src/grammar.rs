//! Structured outputs: grammars that constrain decoding, on llguidance (the
//! library vLLM, SGLang and llama.cpp use).
//!
//! A [`Grammars`] is built once per model from its `tokenizer.json` (every
//! token's bytes) and compiles a [`GrammarSpec`] — a JSON schema, any JSON
//! object, a regex or a Lark grammar — into a [`Constraint`] per request.
//! The engine asks the constraint for the tokens allowed next
//! ([`Constraint::allowed`]), masks every other logit, and feeds it the
//! token it sampled ([`Constraint::accept`]). The grammar accepts EOS only
//! once the output is complete, so a sequence that ends by EOS ends valid.
//!
//! JSON is compiled compact (`,` and `:`, no free whitespace between
//! tokens), so a model cannot wander off into whitespace; a schema's own
//! `x-guidance` options win.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use crate::Tokenizer;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// One JSON value valid against this JSON schema.
    JsonSchema(Value),
    /// Any JSON object.
    JsonObject,
    /// The whole output matches this regular expression.
    Regex(String),
    /// A Lark grammar, in llguidance's dialect.
    Lark(String),
}

/// Why a grammar could not be used.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The model's tokenizer cannot be mapped to bytes (neither byte-level
    /// BPE nor byte fallback).
    #[error("this model's tokenizer cannot constrain decoding: {0}")]
    Tokenizer(String),
    /// The schema, regex or grammar does not compile.
    #[error("{0}")]
    Compile(String),
    /// A token the grammar did not allow was fed to it.
    #[error("the output left its grammar: {0}")]
    Rejected(String),
}

/// Compiles grammars for one model's vocabulary. Cheap to clone.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish_non_exhaustive()
    }
}

/// The tokenizer as llguidance sees it: every token's bytes in a trie, and
/// our tokenizer for text it must tokenize itself.
struct Env {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tokenizer.encode(s, false).unwrap_or_default()
        })
    }
}

impl Grammars {
    /// For `tokenizer`, with logit rows of `vocab_size` (at least the
    /// tokenizer's; rows past it are padding no grammar allows).
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize) -> Result<Self, GrammarError> {
        let text = tokenizer
            .to_json(false)
            .map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let value: Value =
            serde_json::from_str(&text).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&value)
            .map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let size = vocab_size.max(words.len());
        // Padding rows: special tokens no grammar can produce.
        while words.len() < size {
            let mut name = format!(".<[{}]>", words.len()).into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(name);
        }
        let eos = tokenizer.eos_token_ids();
        let mut info = TokRxInfo::new(
            u32::try_from(size).map_err(|e| GrammarError::Tokenizer(e.to_string()))?,
            eos.first().copied().unwrap_or(0),
        );
        info.tok_bos = tokenizer.bos_token_id();
        let mut trie = TokTrie::from(&info, &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        let env: TokEnv = Arc::new(Env {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// A fresh constraint for one request's output.
    pub fn constrain(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        let grammar = match spec {
            GrammarSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)),
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(&json!({"type": "object"})))
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Compile(e));
        }
        Ok(Constraint { matcher })
    }
}

/// A schema with llguidance's compact JSON options unless it sets its own.
fn compact(schema: &Value) -> Value {
    let options =
        json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"});
    match schema {
        Value::Object(map) if !map.contains_key("x-guidance") => {
            let mut map = map.clone();
            map.insert("x-guidance".into(), options);
            Value::Object(map)
        }
        Value::Bool(true) => json!({"x-guidance": options}),
        other => other.clone(),
    }
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
        }
    }
}

/// The tokens a constraint allows next: a bit per vocabulary entry.
pub struct Allowed(llguidance::toktrie::SimpleVob);

impl std::fmt::Debug for Allowed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allowed")
            .field("count", &self.0.num_set())
            .finish()
    }
}

impl Allowed {
    pub fn contains(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// Sets every logit it does not allow to -inf.
    pub fn mask(&self, logits: &mut [f32]) {
        for (i, x) in logits.iter_mut().enumerate() {
            if !self.contains(i as u32) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

impl Constraint {
    /// The tokens that keep the output within the grammar (EOS among them
    /// once the output is complete; only EOS once nothing may follow).
    pub fn allowed(&mut self) -> Result<Allowed, GrammarError> {
        self.matcher
            .compute_mask_or_eos()
            .map(Allowed)
            .map_err(|e| GrammarError::Rejected(e.to_string()))
    }

    /// Feeds the token the sampler chose.
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Rejected(e.to_string()))
    }

    /// Whether the output so far is complete (EOS would be allowed).
    pub fn is_complete(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grammars() -> (Tokenizer, Grammars) {
        let corpus = "{\"name\": \"river\", \"n\": 12, \"tags\": [\"a\", \"b\"]} the river runs";
        let trained =
            crate::train_byte_level_bpe(&[corpus], 300, &["<eos>"], None).expect("trained");
        let eos = trained.token_to_id("<eos>").expect("eos in vocab");
        let special = crate::SpecialTokens {
            eos_token: Some("<eos>".into()),
            eos_token_ids: vec![eos],
            ..Default::default()
        };
        let tok = Tokenizer::from_parts(trained.inner().clone(), special);
        let g = Grammars::new(&tok, tok.vocab_size() + 5).expect("grammars");
        (tok, g)
    }

    /// Greedy walk: always the first allowed token that is not EOS, unless
    /// the output is complete.
    fn walk(tok: &Tokenizer, c: &mut Constraint, limit: usize) -> String {
        let mut out = Vec::new();
        for _ in 0..limit {
            let allowed = c.allowed().expect("mask");
            if c.is_complete() {
                break;
            }
            let next = (0..tok.vocab_size() as u32)
                .find(|&t| allowed.contains(t) && !tok.is_eos(t))
                .expect("some token allowed");
            c.accept(next).expect("accepted");
            out.push(next);
        }
        tok.decode(&out, true).expect("decoded")
    }

    #[test]
    fn a_json_schema_constrains_every_token_and_ends_complete() {
        let (tok, g) = grammars();
        let schema = json!({
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": false
        });
        let mut c = g
            .constrain(&GrammarSpec::JsonSchema(schema))
            .expect("compiles");
        let text = walk(&tok, &mut c, 64);
        let v: Value = serde_json::from_str(&text).expect("valid JSON");
        assert!(
            v["n"].as_i64().is_some_and(|n| (0..=9).contains(&n)),
            "{text}"
        );
        // Complete: EOS is allowed now.
        let allowed = c.allowed().expect("mask");
        assert!(tok.eos_token_ids().iter().any(|&e| allowed.contains(e)));
    }

    #[test]
    fn padding_rows_are_never_allowed_and_bad_schemas_name_the_problem() {
        let (tok, g) = grammars();
        let mut c = g.constrain(&GrammarSpec::JsonObject).expect("compiles");
        let allowed = c.allowed().expect("mask");
        assert!(!allowed.contains(tok.vocab_size() as u32 + 1));
        assert!(allowed.contains(tok.token_to_id("{").expect("in vocab")));
        let err = g
            .constrain(&GrammarSpec::JsonSchema(json!({"type": "no-such-type"})))
            .expect_err("does not compile");
        assert!(err.to_string().contains("no-such-type"), "{err}");
        let err = g
            .constrain(&GrammarSpec::Regex("(unclosed".into()))
            .expect_err("does not compile");
        assert!(!err.to_string().is_empty());
    }

    #[test]
    fn a_required_tool_call_is_well_formed_in_every_family_and_parses_back() {
        use crate::tools::{ToolDef, ToolFormat};
        let (tok, g) = grammars();
        let tools = vec![
            ToolDef {
                name: "get_weather".into(),
                description: None,
                parameters: Some(json!({
                    "type": "object",
                    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}},
                    "required": ["n"],
                    "additionalProperties": false
                })),
            },
            ToolDef {
                name: "noop".into(),
                description: None,
                parameters: Some(
                    json!({"type": "object", "properties": {}, "additionalProperties": false}),
                ),
            },
        ];
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Mistral,
        ] {
            let spec = format
                .grammar(&tools, Some("get_weather"), false, None)
                .expect("grammar");
            let mut c = g
                .constrain(&spec)
                .unwrap_or_else(|e| panic!("{format:?}: {e}"));
            let text = walk(&tok, &mut c, 200);
            let parsed = format.parse(&text);
            assert_eq!(parsed.calls.len(), 1, "{format:?}: {text}");
            assert_eq!(parsed.calls[0].name, "get_weather");
            let args: Value = serde_json::from_str(&parsed.calls[0].arguments).expect("JSON");
            assert!(
                args["n"].as_i64().is_some_and(|n| (1..=3).contains(&n)),
                "{text}"
            );
        }
    }

    #[test]
    fn auto_beside_a_response_format_is_calls_or_an_answer_of_that_shape() {
        use crate::tools::{ToolDef, ToolFormat};
        let (tok, g) = grammars();
        let tools = vec![ToolDef {
            name: "noop".into(),
            description: None,
            parameters: Some(
                json!({"type": "object", "properties": {}, "additionalProperties": false}),
            ),
        }];
        let answer = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": false});
        let spec = ToolFormat::Hermes
            .grammar(&tools, None, false, Some(&answer))
            .expect("grammar");
        let mut c = g.constrain(&spec).expect("compiles");
        let text = walk(&tok, &mut c, 200);
        let parsed = ToolFormat::Hermes.parse(&text);
        let is_call = parsed.calls.len() == 1 && parsed.calls[0].name == "noop";
        let is_answer = serde_json::from_str::<Value>(&text)
            .is_ok_and(|v| v["n"].as_i64().is_some_and(|n| (0..=9).contains(&n)));
        assert!(is_call || is_answer, "{text}");
    }
}
