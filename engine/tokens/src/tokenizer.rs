//! [`Tokenizer`]: a model's Hugging Face `tokenizer.json`, loaded through the
//! `tokenizers` crate (no network features), plus the special tokens a server
//! needs (bos, every eos id) discovered from the model directory's
//! `tokenizer_config.json`, `generation_config.json` and `config.json`.
//!
//! Cheap to clone: the loaded tokenizer is shared behind an `Arc`, so each
//! request's [`crate::IncrementalDetokenizer`] holds a clone.

use std::path::Path;
use std::sync::Arc;

use crate::error::TokensError;
use crate::hf_config::{
    CONFIG_JSON, GENERATION_CONFIG_JSON, JsonFile, TOKENIZER_CONFIG_JSON, TOKENIZER_JSON, read_text,
};

/// The special tokens of a model, as its directory declares them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token` of `tokenizer_config.json`, if any.
    pub bos_token: Option<String>,
    /// The id of the bos token: `bos_token` looked up in the vocabulary, else
    /// `bos_token_id` of `generation_config.json` or `config.json`.
    pub bos_token_id: Option<u32>,
    /// `eos_token` of `tokenizer_config.json`, if any.
    pub eos_token: Option<String>,
    /// Every id that ends generation, deduplicated, in this order:
    /// `generation_config.json`'s `eos_token_id`, then `config.json`'s, then
    /// `eos_token` of `tokenizer_config.json` looked up in the vocabulary.
    pub eos_token_ids: Vec<u32>,
}

/// A model's tokenizer with its special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    special: Arc<SpecialTokens>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and discovers the special tokens from the
    /// optional `tokenizer_config.json`, `generation_config.json` and
    /// `config.json` beside it.
    ///
    /// # Errors
    /// [`TokensError::MissingFile`] naming `tokenizer.json` when it is absent;
    /// a parse error naming the file and key when one of the files is malformed.
    pub fn from_dir(dir: &Path) -> Result<Self, TokensError> {
        let tokenizer = load_tokenizer_json(&dir.join(TOKENIZER_JSON))?;
        let tokenizer_config = JsonFile::read_optional(dir, TOKENIZER_CONFIG_JSON)?;
        let generation_config = JsonFile::read_optional(dir, GENERATION_CONFIG_JSON)?;
        let config = JsonFile::read_optional(dir, CONFIG_JSON)?;

        let mut special = SpecialTokens::default();
        if let Some(tc) = &tokenizer_config {
            special.bos_token = tc.token_string("bos_token")?;
            special.eos_token = tc.token_string("eos_token")?;
        }
        special.bos_token_id = special
            .bos_token
            .as_deref()
            .and_then(|t| tokenizer.token_to_id(t));
        for file in [&generation_config, &config].into_iter().flatten() {
            if special.bos_token_id.is_none() {
                special.bos_token_id = file.token_ids("bos_token_id")?.first().copied();
            }
            for id in file.token_ids("eos_token_id")? {
                push_unique(&mut special.eos_token_ids, id);
            }
        }
        if let Some(id) = special
            .eos_token
            .as_deref()
            .and_then(|t| tokenizer.token_to_id(t))
        {
            push_unique(&mut special.eos_token_ids, id);
        }
        Ok(Self::from_parts(tokenizer, special))
    }

    /// The tokenizer of a model directory ([`Self::from_dir`]) or of a GGUF
    /// file's metadata.
    ///
    /// # Errors
    /// As [`Self::from_dir`], or the GGUF's metadata error naming its key.
    pub fn from_path(path: &Path) -> Result<Self, TokensError> {
        if sluice_gguf::GgufFile::is_gguf(path) {
            return crate::gguf::tokenizer(&sluice_gguf::GgufFile::open(path)?);
        }
        Self::from_dir(path)
    }

    /// Loads a single `tokenizer.json` with no special-token discovery.
    ///
    /// # Errors
    /// [`TokensError::MissingFile`] when the file is absent,
    /// [`TokensError::LoadTokenizer`] when the crate cannot load it.
    pub fn from_file(path: &Path) -> Result<Self, TokensError> {
        Ok(Self::from_parts(
            load_tokenizer_json(path)?,
            SpecialTokens::default(),
        ))
    }

    /// Wraps an already built tokenizer.
    pub fn from_parts(tokenizer: tokenizers::Tokenizer, special: SpecialTokens) -> Self {
        Self {
            inner: Arc::new(tokenizer),
            special: Arc::new(special),
        }
    }

    /// Token ids of `text`; with `add_special_tokens` the tokenizer's
    /// post-processor adds what it declares (e.g. a leading bos).
    ///
    /// # Errors
    /// [`TokensError::Encode`] when the tokenizer rejects the input.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokensError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(TokensError::Encode)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`; with `skip_special_tokens` special tokens are dropped.
    ///
    /// # Errors
    /// [`TokensError::Decode`] when the decoder fails.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokensError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(TokensError::Decode)
    }

    /// The id of a token string (vocabulary or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id (in the tokenizer's internal alphabet, e.g.
    /// `Ġ` for a leading space in byte-level BPE).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included (what `len(tokenizer)` says in
    /// transformers).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The bos token id, if the model declares one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.special.bos_token_id
    }

    /// Every id that ends generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.special.eos_token_ids
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.special.eos_token_ids.contains(&id)
    }

    /// The special tokens discovered for this model.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The tokenizer serialized in `tokenizer.json` format.
    ///
    /// # Errors
    /// [`TokensError::Serialize`] when serialization fails.
    pub fn to_json(&self, pretty: bool) -> Result<String, TokensError> {
        self.inner.to_string(pretty).map_err(TokensError::Serialize)
    }
}

fn push_unique(ids: &mut Vec<u32>, id: u32) {
    if !ids.contains(&id) {
        ids.push(id);
    }
}

fn load_tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer, TokensError> {
    let text = read_text(path)?;
    text.parse::<tokenizers::Tokenizer>()
        .map_err(|source| TokensError::LoadTokenizer {
            path: path.to_path_buf(),
            source,
        })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::train::train_byte_level_bpe;

    /// A small byte-level BPE tokenizer trained on a fixed text, with
    /// Llama-3/ChatML special tokens; shared by the tests of this crate.
    pub(crate) fn test_tokenizer() -> Tokenizer {
        let corpus = [
            "The quick brown fox jumps over the lazy dog. The dog sleeps.",
            "Streaming text must stay valid UTF-8: café, naïve, 東京, 😀.",
            "Hello, world! Hello again, world. Tokens and more tokens.",
        ];
        let specials = [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|im_start|>",
            "<|im_end|>",
        ];
        train_byte_level_bpe(&corpus, 400, &specials, Some("<|begin_of_text|>"))
            .expect("training on a fixed corpus succeeds")
    }

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).expect("write test file");
    }

    #[test]
    fn from_dir_without_tokenizer_json_names_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = Tokenizer::from_dir(dir.path()).expect_err("no tokenizer.json");
        assert!(
            matches!(&err, TokensError::MissingFile { path } if path.ends_with("tokenizer.json"))
        );
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn from_dir_with_garbage_tokenizer_json_is_a_load_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        write(dir.path(), "tokenizer.json", "{\"not\": \"a tokenizer\"}");
        let err = Tokenizer::from_dir(dir.path()).expect_err("bad tokenizer.json");
        assert!(matches!(err, TokensError::LoadTokenizer { .. }), "{err:?}");
    }

    #[test]
    fn encode_decode_round_trips_text() {
        let tok = test_tokenizer();
        let text = "The quick fox says: hello, 東京 😀!";
        let ids = tok.encode(text, false).expect("encode");
        assert!(!ids.is_empty());
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    }

    #[test]
    fn add_special_tokens_prepends_bos() {
        let tok = test_tokenizer();
        let bos = tok.token_to_id("<|begin_of_text|>").expect("bos in vocab");
        let plain = tok.encode("hello", false).expect("encode");
        let with = tok.encode("hello", true).expect("encode");
        assert_eq!(with[0], bos);
        assert_eq!(&with[1..], plain.as_slice());
        assert_eq!(tok.decode(&with, true).expect("decode"), "hello");
        assert_eq!(
            tok.decode(&with, false).expect("decode"),
            "<|begin_of_text|>hello"
        );
    }

    #[test]
    fn special_tokens_in_text_are_single_ids() {
        let tok = test_tokenizer();
        let im_start = tok.token_to_id("<|im_start|>").expect("in vocab");
        let ids = tok.encode("<|im_start|>user", false).expect("encode");
        assert_eq!(ids[0], im_start);
        assert_eq!(tok.id_to_token(im_start).as_deref(), Some("<|im_start|>"));
    }

    #[test]
    fn from_dir_discovers_bos_and_all_eos_ids() {
        let tok = test_tokenizer();
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "tokenizer.json",
            &tok.to_json(false).expect("serialize"),
        );
        let im_end = tok.token_to_id("<|im_end|>").expect("in vocab");
        let eot = tok.token_to_id("<|end_of_text|>").expect("in vocab");
        let bos = tok.token_to_id("<|begin_of_text|>").expect("in vocab");
        write(
            dir.path(),
            "tokenizer_config.json",
            r#"{"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|im_end|>"}"#,
        );
        write(
            dir.path(),
            "generation_config.json",
            &format!(r#"{{"eos_token_id": [{eot}, {im_end}]}}"#),
        );
        write(
            dir.path(),
            "config.json",
            &format!(r#"{{"eos_token_id": {eot}, "bos_token_id": 999}}"#),
        );

        let loaded = Tokenizer::from_dir(dir.path()).expect("load");
        assert_eq!(loaded.bos_token_id(), Some(bos));
        assert_eq!(loaded.eos_token_ids(), &[eot, im_end]);
        assert!(loaded.is_eos(im_end));
        assert_eq!(
            loaded.special_tokens().eos_token.as_deref(),
            Some("<|im_end|>")
        );
        assert_eq!(loaded.vocab_size(), tok.vocab_size());
    }

    #[test]
    fn from_dir_with_only_tokenizer_json_has_no_special_ids() {
        let tok = test_tokenizer();
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "tokenizer.json",
            &tok.to_json(true).expect("serialize"),
        );
        let loaded = Tokenizer::from_dir(dir.path()).expect("load");
        assert_eq!(loaded.bos_token_id(), None);
        assert!(loaded.eos_token_ids().is_empty());
    }

    #[test]
    fn bad_generation_config_names_file_and_key() {
        let tok = test_tokenizer();
        let dir = tempfile::tempdir().expect("tempdir");
        write(
            dir.path(),
            "tokenizer.json",
            &tok.to_json(false).expect("serialize"),
        );
        write(
            dir.path(),
            "generation_config.json",
            r#"{"eos_token_id": "two"}"#,
        );
        let err = Tokenizer::from_dir(dir.path())
            .expect_err("bad eos id")
            .to_string();
        assert!(
            err.contains("generation_config.json") && err.contains("eos_token_id"),
            "{err}"
        );
    }
}
