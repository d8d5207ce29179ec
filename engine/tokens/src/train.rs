//! Deterministic training of a GPT-2-style byte-level BPE tokenizer with the
//! `tokenizers` crate's `BpeTrainer`, for the built-in model and for tests.
//!
//! The result is a plain Hugging Face `tokenizer.json` tokenizer: ByteLevel
//! pre-tokenizer (GPT-2 regex, no prefix space) and decoder, the special
//! tokens first in the vocabulary (ids 0, 1, …), then the 256 byte symbols,
//! then the merges. Training twice on the same input yields the same
//! tokenizer: the trainer breaks count ties by token ids, which are assigned
//! in a fixed order.

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper, PostProcessorWrapper, PreTokenizerWrapper};

use crate::error::TokensError;
use crate::tokenizer::{SpecialTokens, Tokenizer};

/// Trains a byte-level BPE tokenizer of at most `vocab_size` ids (special
/// tokens and the 256 byte symbols included) on `corpus`.
///
/// Pairs seen fewer than twice are never merged, so a small corpus yields a
/// smaller vocabulary. With `bos` set (it must be one of `special_tokens`),
/// encoding with special tokens prepends it, as Llama 3's tokenizer does.
/// The returned tokenizer's [`SpecialTokens`] are empty: a model directory
/// declares those in its config files.
///
/// # Errors
/// [`TokensError::Train`] when training or building the post-processor fails
/// (for example when `bos` is not among `special_tokens`).
pub fn train_byte_level_bpe(
    corpus: &[&str],
    vocab_size: usize,
    special_tokens: &[&str],
    bos: Option<&str>,
) -> Result<Tokenizer, TokensError> {
    let mut tokenizer = tokenizers::Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, true, true,
    ))));
    tokenizer.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));

    let trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(
            special_tokens
                .iter()
                .map(|t| AddedToken::from(t.to_string(), true))
                .collect(),
        )
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut trainer = TrainerWrapper::BpeTrainer(trainer);
    tokenizer
        .train(&mut trainer, corpus.iter())
        .map_err(TokensError::Train)?;

    if let Some(bos) = bos {
        let id = tokenizer.token_to_id(bos).ok_or_else(|| {
            TokensError::Train(format!("bos token {bos:?} is not a special token").into())
        })?;
        let processor = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .and_then(|b| b.try_pair(format!("{bos} $A {bos}:1 $B:1")))
            .map_err(|e| TokensError::Train(e.into()))?
            .special_tokens(vec![(bos.to_string(), id)])
            .build()
            .map_err(|e| TokensError::Train(e.into()))?;
        tokenizer.with_post_processor(Some(PostProcessorWrapper::Template(processor)));
    }
    Ok(Tokenizer::from_parts(tokenizer, SpecialTokens::default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CORPUS: [&str; 2] = [
        "low lower lowest slow slower",
        "new newer newest renew renewed",
    ];
    const SPECIALS: [&str; 2] = ["<|begin_of_text|>", "<|end_of_text|>"];

    #[test]
    fn special_tokens_come_first_then_bytes() {
        let tok = train_byte_level_bpe(&CORPUS, 300, &SPECIALS, None).expect("train");
        assert_eq!(tok.token_to_id("<|begin_of_text|>"), Some(0));
        assert_eq!(tok.token_to_id("<|end_of_text|>"), Some(1));
        assert!(
            tok.vocab_size() > 256 + SPECIALS.len(),
            "some merges were learned"
        );
        assert!(tok.vocab_size() <= 300);
    }

    #[test]
    fn training_twice_gives_identical_json() {
        let a = train_byte_level_bpe(&CORPUS, 300, &SPECIALS, Some("<|begin_of_text|>"))
            .expect("train");
        let b = train_byte_level_bpe(&CORPUS, 300, &SPECIALS, Some("<|begin_of_text|>"))
            .expect("train");
        assert_eq!(
            a.to_json(false).expect("json"),
            b.to_json(false).expect("json")
        );
    }

    #[test]
    fn any_text_round_trips_even_unseen_bytes() {
        let tok = train_byte_level_bpe(&CORPUS, 300, &SPECIALS, None).expect("train");
        let text = "Zebra → 日本語 🎉 \t\n";
        let ids = tok.encode(text, false).expect("encode");
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    }

    #[test]
    fn unknown_bos_is_an_error() {
        let err = train_byte_level_bpe(&CORPUS, 300, &SPECIALS, Some("<s>"))
            .expect_err("bos not special");
        assert!(matches!(err, TokensError::Train(_)));
    }
}
