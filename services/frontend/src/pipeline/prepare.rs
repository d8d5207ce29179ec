//! Preparing a request: the model and input checks that need the model
//! (structured outputs compile, prompt sizes), the chat template and the
//! tokenizer (on a bounded pool for long prompts), and the description that
//! travels with it through admission and placement.

use super::*;

impl Pipeline {
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
            first_token_sent: false,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn def(name: &str) -> ToolDef {
        ToolDef {
            name: name.into(),
            description: None,
            parameters: None,
        }
    }

    #[test]
    fn tools_join_an_existing_system_message_or_lead_a_new_one() {
        let user = ChatMessage::new("user", "hi");
        let out = with_tool_prompt(std::slice::from_ref(&user), &[def("get_weather")]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].role, "system");
        assert!(
            out[0].content.contains("\"get_weather\""),
            "{}",
            out[0].content
        );
        assert_eq!(out[1], user);

        let system = ChatMessage::new("system", "Be brief.");
        let out = with_tool_prompt(&[system, user.clone()], &[def("f")]);
        assert_eq!(out.len(), 2, "no second system message");
        assert!(
            out[0].content.starts_with("Be brief.\n\n# Tools"),
            "{}",
            out[0].content
        );
        assert_eq!(out[1], user);
    }

    #[test]
    fn a_prompts_size_counts_its_text_and_roles_not_token_ids() {
        assert_eq!(prompt_bytes(&Prompt::Text("héllo".into())), 6);
        let chat = vec![
            ChatMessage::new("user", "abc"),
            ChatMessage::new("system", "de"),
        ];
        assert_eq!(prompt_bytes(&Prompt::Chat(chat)), 4 + 3 + 6 + 2);
        assert_eq!(prompt_bytes(&Prompt::Tokens(vec![1, 2, 3])), 0);
    }
}
