//! A prompt's size against the model's context, checked twice: in bytes
//! before any tokenization (so an oversized prompt costs a length check, not
//! seconds of CPU and hundreds of megabytes), and in tokens right after.
//!
//! The byte bound is sound for the usual tokenizers: no token stands for
//! more bytes than the longest vocabulary entry is long (in UTF-8, which is
//! at least the bytes a byte-level or SentencePiece entry stands for), so a
//! prompt of more than `context × that` bytes cannot fit. A factor of
//! [`NORMALIZATION_SLACK`] leaves room for normalizers that shorten text
//! before tokenization; the token check is the exact one.

use std::path::Path;

use sluice_tokens::Tokenizer;

/// Room for normalizers that shorten text (NFC composition and the like).
const NORMALIZATION_SLACK: usize = 2;

/// At least this many bytes per token are allowed, whatever the vocabulary.
const MIN_BYTES_PER_TOKEN: usize = 4;

/// What the frontend knows about the model's context.
#[derive(Debug, Clone)]
pub(crate) struct PromptLimits {
    /// `max_position_embeddings` (or `max_seq_len`) of the model's
    /// `config.json`; `None` when it names neither.
    model_context: Option<usize>,
    /// Bytes one token stands for at most.
    bytes_per_token: usize,
}

impl PromptLimits {
    /// Reads the model's context from `dir/config.json` and the longest
    /// vocabulary entry of `tokenizer`.
    pub(crate) fn new(dir: &Path, tokenizer: &Tokenizer) -> Self {
        let model_context = if sluice_gguf::GgufFile::is_gguf(dir) {
            sluice_tokens::gguf::context_length(dir)
        } else {
            std::fs::read(dir.join("config.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .and_then(|c| {
                    ["max_position_embeddings", "max_seq_len", "n_positions"]
                        .iter()
                        .find_map(|k| c.get(*k).and_then(serde_json::Value::as_u64))
                })
                .and_then(|n| usize::try_from(n).ok())
        };
        let longest = tokenizer
            .inner()
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(0);
        Self {
            model_context,
            bytes_per_token: longest.max(MIN_BYTES_PER_TOKEN),
        }
    }

    /// Limits for a model of `context` tokens and `bytes_per_token` (tests).
    #[cfg(test)]
    pub(crate) fn fixed(context: usize, bytes_per_token: usize) -> Self {
        Self {
            model_context: Some(context),
            bytes_per_token,
        }
    }

    /// The context a prompt must fit, output included: the smallest of the
    /// serving workers' (`max_model_len` in discovery, which each worker
    /// has already capped by what its engine can hold: the model's
    /// positions for a real one, not for the mocker), or the model's own
    /// when no worker says.
    pub(crate) fn context(&self, workers: impl IntoIterator<Item = usize>) -> Option<usize> {
        workers.into_iter().min().or(self.model_context)
    }

    /// Bytes of prompt text that cannot fit `context` tokens.
    pub(crate) fn max_bytes(&self, context: usize) -> usize {
        context
            .saturating_mul(self.bytes_per_token)
            .saturating_mul(NORMALIZATION_SLACK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_context_is_the_smallest_worker_s_or_the_model_s_and_bytes_scale_with_it() {
        let l = PromptLimits::fixed(2048, 16);
        assert_eq!(l.context([]), Some(2048));
        assert_eq!(l.context([4096, 1024]), Some(1024));
        // A mocker worker serves beyond the model's positions (`--max-model-len`).
        assert_eq!(l.context([32768]), Some(32768));
        assert_eq!(l.max_bytes(1024), 1024 * 16 * 2);
        let unknown = PromptLimits {
            model_context: None,
            bytes_per_token: 8,
        };
        assert_eq!(unknown.context([]), None);
    }
}
