//! [`IncrementalDetokenizer`]: turns a stream of generated token ids into a
//! stream of text deltas, and finds stop strings in it.
//!
//! Text: each step decodes a short window of recent ids (the tokens of the
//! last emitted delta plus the new ones) and emits what the new ids add, the
//! method of vLLM and TGI. A delta that would end in U+FFFD (an incomplete
//! UTF-8 sequence, e.g. the first bytes of an emoji split over byte-level BPE
//! tokens) is held back until a later token completes it, so every delta is
//! whole characters and the concatenated deltas (with [`IncrementalDetokenizer::flush`])
//! equal one decode of all the ids.
//!
//! Stop strings: text that could be the start of a stop string is held back
//! until it is known not to be; when a stop string appears, the text before
//! it is emitted, the stop string and everything after are dropped, and the
//! stream is finished (later ids are ignored).

use crate::error::TokensError;
use crate::tokenizer::Tokenizer;

/// How many prompt ids [`IncrementalDetokenizer::with_prompt`] keeps as
/// decoding context (vLLM's `INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET` + 1).
const PROMPT_CONTEXT: usize = 6;
/// Ids before the decoding window are dropped once this many pile up.
const COMPACT_AFTER: usize = 256;

/// What one step produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Detokenized {
    /// Newly completed text (possibly empty).
    pub text: String,
    /// The stop string that ended the stream at this step, if one did.
    /// `text` then holds everything up to, not including, the stop string.
    pub stop: Option<String>,
}

/// Per-request incremental decoder with stop-string matching.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the decoding window (the ids of the last emitted delta).
    prefix_offset: usize,
    /// First id not yet turned into emitted text.
    read_offset: usize,
    stops: Vec<String>,
    /// Decoded text not yet emitted because it may begin a stop string.
    held: String,
    stopped: Option<String>,
}

impl IncrementalDetokenizer {
    /// A detokenizer for one generated sequence. Empty stop strings are ignored.
    pub fn new(tokenizer: Tokenizer, stop: Vec<String>, skip_special_tokens: bool) -> Self {
        Self {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            stops: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: None,
        }
    }

    /// Uses the last few prompt ids as decoding context, so the first
    /// generated token decodes as it would mid-text (decoders that strip a
    /// leading space at the start of text, e.g. SentencePiece's, keep it).
    /// Call before the first [`IncrementalDetokenizer::push`].
    pub fn with_prompt(mut self, prompt: &[u32]) -> Self {
        let context = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..];
        self.ids = context.to_vec();
        self.read_offset = self.ids.len();
        self.prefix_offset = self.ids.len().saturating_sub(PROMPT_CONTEXT - 1);
        self
    }

    /// Feeds one generated id; returns the text it completes.
    ///
    /// # Errors
    /// [`TokensError::Decode`] when the tokenizer cannot decode the window.
    pub fn push(&mut self, id: u32) -> Result<Detokenized, TokensError> {
        if self.stopped.is_some() {
            return Ok(Detokenized::default());
        }
        self.ids.push(id);
        let prefix = self.decode(self.prefix_offset, self.read_offset)?;
        let full = self.decode(self.prefix_offset, self.ids.len())?;
        if full.len() <= prefix.len()
            || full.ends_with('\u{FFFD}')
            || !full.is_char_boundary(prefix.len())
        {
            return Ok(Detokenized::default());
        }
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.compact();
        Ok(self.on_text(&full[prefix.len()..], false))
    }

    /// Feeds several ids; returns their combined text, stopping at the first
    /// stop string.
    ///
    /// # Errors
    /// As [`IncrementalDetokenizer::push`].
    pub fn push_all(&mut self, ids: &[u32]) -> Result<Detokenized, TokensError> {
        let mut out = Detokenized::default();
        for &id in ids {
            let step = self.push(id)?;
            out.text.push_str(&step.text);
            if step.stop.is_some() {
                out.stop = step.stop;
                break;
            }
        }
        Ok(out)
    }

    /// Ends the stream (end of sequence, max tokens, abort): returns the
    /// text still held back, including an incomplete UTF-8 tail decoded as
    /// U+FFFD, and checks it for stop strings one last time.
    ///
    /// # Errors
    /// As [`IncrementalDetokenizer::push`].
    pub fn flush(&mut self) -> Result<Detokenized, TokensError> {
        if self.stopped.is_some() {
            return Ok(Detokenized::default());
        }
        let prefix = self.decode(self.prefix_offset, self.read_offset)?;
        let full = self.decode(self.prefix_offset, self.ids.len())?;
        let tail = match full.get(prefix.len()..) {
            Some(tail) if full.starts_with(&prefix) => tail.to_string(),
            // The decoder rewrote the window (rare, e.g. whitespace cleanup):
            // emit whatever of the new decode lies past the old one.
            _ => full.chars().skip(prefix.chars().count()).collect(),
        };
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(self.on_text(&tail, true))
    }

    /// Whether a stop string ended the stream.
    pub fn is_stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// The stop string that ended the stream, if one did.
    pub fn stop_hit(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    fn decode(&self, from: usize, to: usize) -> Result<String, TokensError> {
        if from >= to {
            return Ok(String::new());
        }
        self.tokenizer
            .decode(&self.ids[from..to], self.skip_special_tokens)
    }

    fn compact(&mut self) {
        if self.prefix_offset >= COMPACT_AFTER {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
    }

    /// Adds decoded text to what is held back and emits what is safe.
    fn on_text(&mut self, text: &str, last: bool) -> Detokenized {
        self.held.push_str(text);
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|pos| (pos, s)))
            .min_by_key(|(pos, _)| *pos);
        if let Some((pos, stop)) = first_stop {
            let stop = stop.clone();
            let mut text = std::mem::take(&mut self.held);
            text.truncate(pos);
            self.stopped = Some(stop.clone());
            return Detokenized {
                text,
                stop: Some(stop),
            };
        }
        let keep = if last { 0 } else { self.partial_stop_len() };
        let rest = self.held.split_off(self.held.len() - keep);
        Detokenized {
            text: std::mem::replace(&mut self.held, rest),
            stop: None,
        }
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a
    /// stop string.
    fn partial_stop_len(&self) -> usize {
        let held = self.held.as_str();
        let mut best = 0;
        for stop in &self.stops {
            let longest = (stop.len() - 1).min(held.len());
            for k in (best + 1..=longest).rev() {
                let start = held.len() - k;
                if held.is_char_boundary(start) && stop.starts_with(&held[start..]) {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::test_tokenizer;
    use proptest::prelude::*;

    fn stream(det: &mut IncrementalDetokenizer, ids: &[u32]) -> Vec<Detokenized> {
        let mut steps: Vec<Detokenized> =
            ids.iter().map(|&id| det.push(id).expect("push")).collect();
        steps.push(det.flush().expect("flush"));
        steps
    }

    fn concat(steps: &[Detokenized]) -> String {
        steps.iter().map(|s| s.text.as_str()).collect()
    }

    #[test]
    fn multibyte_chars_split_over_tokens_emit_nothing_until_complete() {
        let tok = test_tokenizer();
        // An unseen 4-byte emoji and unseen CJK: byte-level BPE has one token per byte.
        let text = "a🦀b語";
        let ids = tok.encode(text, false).expect("encode");
        assert!(
            ids.len() >= 9,
            "bytes of unseen chars are separate tokens: {ids:?}"
        );
        let mut det = IncrementalDetokenizer::new(tok.clone(), Vec::new(), true);
        let steps = stream(&mut det, &ids);
        for step in &steps {
            assert!(
                !step.text.contains('\u{FFFD}'),
                "no replacement chars in {steps:?}"
            );
        }
        let non_empty: Vec<&str> = steps
            .iter()
            .map(|s| s.text.as_str())
            .filter(|t| !t.is_empty())
            .collect();
        assert_eq!(non_empty, vec!["a", "🦀", "b", "語"]);
        assert_eq!(concat(&steps), text);
    }

    #[test]
    fn streamed_text_equals_full_decode_for_seen_text() {
        let tok = test_tokenizer();
        let text = "Hello, world! 東京 café 😀 and the lazy dog.";
        let ids = tok.encode(text, false).expect("encode");
        let mut det = IncrementalDetokenizer::new(tok, Vec::new(), true);
        assert_eq!(concat(&stream(&mut det, &ids)), text);
    }

    #[test]
    fn special_tokens_are_skipped_or_kept_as_asked() {
        let tok = test_tokenizer();
        let ids = tok.encode("hi<|im_end|>", false).expect("encode");
        let mut skip = IncrementalDetokenizer::new(tok.clone(), Vec::new(), true);
        assert_eq!(concat(&stream(&mut skip, &ids)), "hi");
        let mut keep = IncrementalDetokenizer::new(tok, Vec::new(), false);
        assert_eq!(concat(&stream(&mut keep, &ids)), "hi<|im_end|>");
    }

    #[test]
    fn stop_string_is_excluded_and_ends_the_stream() {
        let tok = test_tokenizer();
        let ids = tok
            .encode("Hello, world! The dog sleeps.", false)
            .expect("encode");
        let mut det = IncrementalDetokenizer::new(tok, vec!["world!".into()], true);
        let steps = stream(&mut det, &ids);
        assert_eq!(concat(&steps), "Hello, ");
        let stops: Vec<&Detokenized> = steps.iter().filter(|s| s.stop.is_some()).collect();
        assert_eq!(stops.len(), 1);
        assert_eq!(stops[0].stop.as_deref(), Some("world!"));
        assert_eq!(det.stop_hit(), Some("world!"));
        assert_eq!(
            det.push(1).expect("push after stop"),
            Detokenized::default()
        );
    }

    #[test]
    fn possible_stop_prefix_is_held_back_then_released() {
        let tok = test_tokenizer();
        let mut det = IncrementalDetokenizer::new(tok.clone(), vec!["lazy cat".into()], true);
        let first = det
            .push_all(&tok.encode("the lazy", false).expect("encode"))
            .expect("push");
        assert_eq!(
            first.text, "the ",
            "'lazy' could start the stop string, so it is held"
        );
        // "lazy d" cannot be "lazy cat": released with the rest.
        let second = det
            .push_all(&tok.encode(" dog", false).expect("encode"))
            .expect("push");
        assert_eq!(second.text, "lazy dog");
        assert_eq!(det.flush().expect("flush"), Detokenized::default());
    }

    #[test]
    fn held_text_is_released_at_flush_when_the_stream_ends() {
        let tok = test_tokenizer();
        let mut det = IncrementalDetokenizer::new(tok.clone(), vec!["dog house".into()], true);
        let ids = tok.encode("the lazy dog", false).expect("encode");
        let streamed = det.push_all(&ids).expect("push");
        assert_eq!(streamed.text, "the lazy ");
        assert_eq!(det.flush().expect("flush").text, "dog");
    }

    #[test]
    fn stop_string_spanning_multibyte_tokens_is_found() {
        let tok = test_tokenizer();
        let mut det = IncrementalDetokenizer::new(tok.clone(), vec!["🦀b".into()], true);
        let ids = tok.encode("xy🦀bz", false).expect("encode");
        let out = det.push_all(&ids).expect("push");
        assert_eq!(out.text, "xy");
        assert_eq!(out.stop.as_deref(), Some("🦀b"));
    }

    #[test]
    fn with_prompt_context_does_not_repeat_prompt_text() {
        let tok = test_tokenizer();
        let prompt = tok.encode("The quick brown fox", false).expect("encode");
        let reply = tok.encode(" jumps over 😀", false).expect("encode");
        let mut det = IncrementalDetokenizer::new(tok, Vec::new(), true).with_prompt(&prompt);
        assert_eq!(concat(&stream(&mut det, &reply)), " jumps over 😀");
    }

    /// A SentencePiece-style tokenizer (Metaspace `▁`, whose decoder drops
    /// the space before the first word of a decode).
    fn metaspace_tokenizer() -> Tokenizer {
        use tokenizers::models::TrainerWrapper;
        use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
        use tokenizers::pre_tokenizers::metaspace::Metaspace;
        use tokenizers::{DecoderWrapper, PreTokenizerWrapper};
        let mut inner = tokenizers::Tokenizer::new(BPE::default());
        inner.with_pre_tokenizer(Some(PreTokenizerWrapper::Metaspace(Metaspace::default())));
        inner.with_decoder(Some(DecoderWrapper::Metaspace(Metaspace::default())));
        let mut trainer = TrainerWrapper::BpeTrainer(
            BpeTrainerBuilder::new()
                .vocab_size(200)
                .show_progress(false)
                .build(),
        );
        let corpus = ["hello world again", "hello again world", "world hello"];
        inner.train(&mut trainer, corpus.iter()).expect("trains");
        Tokenizer::from_parts(inner, crate::SpecialTokens::default())
    }

    #[test]
    fn metaspace_spaces_between_words_survive_streaming() {
        let tok = metaspace_tokenizer();
        let ids = tok.encode("hello world again", false).expect("encode");
        assert_eq!(
            tok.decode(&ids[1..2], true).expect("decode"),
            "world",
            "a lone word loses its space"
        );
        let mut det = IncrementalDetokenizer::new(tok, Vec::new(), true);
        assert_eq!(concat(&stream(&mut det, &ids)), "hello world again");
    }

    #[test]
    fn metaspace_first_generated_word_keeps_its_space_with_prompt_context() {
        let tok = metaspace_tokenizer();
        let prompt = tok.encode("hello world", false).expect("encode");
        let reply = tok.encode("again", false).expect("encode");
        let mut without = IncrementalDetokenizer::new(tok.clone(), Vec::new(), true);
        assert_eq!(concat(&stream(&mut without, &reply)), "again");
        let mut with = IncrementalDetokenizer::new(tok, Vec::new(), true).with_prompt(&prompt);
        assert_eq!(concat(&stream(&mut with, &reply)), " again");
    }

    #[test]
    fn long_streams_compact_their_window() {
        let tok = test_tokenizer();
        let ids = tok
            .encode(&"the dog 語 ".repeat(200), false)
            .expect("encode");
        let mut det = IncrementalDetokenizer::new(tok.clone(), Vec::new(), true);
        let text = concat(&stream(&mut det, &ids));
        assert!(
            det.ids.len() < COMPACT_AFTER + 8,
            "window was compacted: {}",
            det.ids.len()
        );
        assert_eq!(text, tok.decode(&ids, true).expect("decode"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any id sequence, invalid UTF-8 included: streamed == one decode.
        #[test]
        fn streaming_decode_concatenated_equals_full_decode(
            raw in proptest::collection::vec(any::<u32>(), 0..60),
            skip in any::<bool>(),
        ) {
            let tok = test_tokenizer();
            let vocab = u32::try_from(tok.vocab_size()).expect("small vocab");
            let ids: Vec<u32> = raw.iter().map(|r| r % vocab).collect();
            let mut det = IncrementalDetokenizer::new(tok.clone(), Vec::new(), skip);
            prop_assert_eq!(concat(&stream(&mut det, &ids)), tok.decode(&ids, skip).expect("decode"));
        }

        /// Text streamed through the tokenizer round-trips, and with a stop
        /// string the output is exactly the text before its first occurrence.
        #[test]
        fn streamed_text_stops_exactly_at_first_stop_string(
            text in "[a-d 😀語é]{0,40}",
            stop in "[a-d😀語]{1,3}",
        ) {
            let tok = test_tokenizer();
            let ids = tok.encode(&text, false).expect("encode");
            let mut det = IncrementalDetokenizer::new(tok.clone(), vec![stop.clone()], true);
            let steps = stream(&mut det, &ids);
            let expected = match text.find(&stop) {
                Some(pos) => &text[..pos],
                None => text.as_str(),
            };
            prop_assert_eq!(concat(&steps), expected);
            prop_assert_eq!(det.is_stopped(), text.contains(&stop));
        }
    }
}
