//! A GGUF file's tokenizer and chat template, from its metadata alone.
//!
//! llama.cpp keeps the vocabulary as `tokenizer.ggml.*` arrays and names
//! the pre-tokenizer (`tokenizer.ggml.pre`) instead of storing it; this
//! module rebuilds the equivalent Hugging Face `tokenizers` pipeline for
//! the two tokenizer models llama.cpp's GGUFs of the served families use:
//! byte-level BPE (`tokenizer.ggml.model = "gpt2"`: the vocabulary and
//! merges, the pre-tokenizer split llama.cpp uses for each named `pre`,
//! llama-vocab.cpp) and SentencePiece BPE (`"llama"`: pieces and scores,
//! see [`sentencepiece_bpe`]). Control and unknown tokens become special
//! added tokens, user-defined ones plain added tokens (Phi-3's strip the
//! whitespace after them, as llama.cpp's do), and bos leads when
//! `add_bos_token` says so. Other tokenizer models and unknown `pre` names
//! are errors that name them.

use serde_json::{Value as Json, json};
use sluice_gguf::{GgufFile, Value};

use crate::chat_template::ChatTemplate;
use crate::error::TokensError;
use crate::tokenizer::{SpecialTokens, Tokenizer};

/// GPT-2's split (also llama.cpp's `default`).
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split (`llama-bpe`).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's split: Llama 3's with single digits.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// ggml token types (`llama_token_type`).
const TOKEN_TYPE_NORMAL: u64 = 1;
const TOKEN_TYPE_UNKNOWN: u64 = 2;
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

fn bad(file: &GgufFile, key: &str, problem: impl Into<String>) -> TokensError {
    TokensError::BadKey {
        path: file.path().to_path_buf(),
        key: key.to_owned(),
        problem: problem.into(),
    }
}

fn strings<'a>(file: &'a GgufFile, key: &str) -> Result<Vec<&'a str>, TokensError> {
    let items = file
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| bad(file, key, "is missing or not an array"))?;
    items
        .iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| bad(file, key, "holds a non-string"))
        })
        .collect()
}

/// The `tokenizers` pre-tokenizer llama.cpp's `pre` name stands for.
fn pre_tokenizer(file: &GgufFile, pre: &str) -> Result<Json, TokensError> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => json!({
            "type": "Sequence",
            "pretokenizers": [split(GPT2_REGEX), byte_level(false)],
        }),
        // llama.cpp: each digit alone, then GPT-2's split.
        "smollm" | "starcoder" | "refact" | "codeshell" => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                split(GPT2_REGEX),
                byte_level(false),
            ],
        }),
        "llama-bpe" | "llama3" | "falcon3" | "pixtral" => json!({
            "type": "Sequence",
            "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)],
        }),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => json!({
            "type": "Sequence",
            "pretokenizers": [split(QWEN2_REGEX), byte_level(false)],
        }),
        other => {
            return Err(bad(
                file,
                "tokenizer.ggml.pre",
                format!(
                    "{other:?} is not a pre-tokenizer Sluice knows (known: default, gpt2, smollm, starcoder, refact, llama-bpe, qwen2)"
                ),
            ));
        }
    })
}

/// The tokenizer a GGUF file's metadata describes.
///
/// # Errors
/// [`TokensError::BadKey`] naming the key when the vocabulary is missing or
/// malformed, or its tokenizer model or pre-tokenizer is one Sluice does
/// not build.
pub fn tokenizer(file: &GgufFile) -> Result<Tokenizer, TokensError> {
    let model = file
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(file, "tokenizer.ggml.model", "is missing"))?;
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let types: Vec<u64> = match file.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(v) => v
            .as_array()
            .ok_or_else(|| bad(file, "tokenizer.ggml.token_type", "is not an array"))?
            .iter()
            .map(|t| t.as_u64().unwrap_or(TOKEN_TYPE_NORMAL))
            .collect(),
    };
    let ty = |id: usize| types.get(id).copied().unwrap_or(TOKEN_TYPE_NORMAL);
    // llama.cpp (llama-vocab.cpp): a model whose name says Phi-3 has every
    // special token strip the whitespace after it in the text, but these.
    let phi3 = file
        .get("general.name")
        .and_then(Value::as_str)
        .map(str::to_lowercase)
        .is_some_and(|n| n.contains("phi-3") || n.contains("phi3"));
    let rstrip = |token: &str| phi3 && !matches!(token, "<unk>" | "<s>" | "<|endoftext|>");
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        vocab.insert((*token).to_owned(), json!(id));
        // Text llama.cpp reads as the token itself: control and unknown
        // tokens (specials) and user-defined ones.
        if matches!(
            ty(id),
            TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN | TOKEN_TYPE_USER_DEFINED
        ) {
            added.push(json!({
                "id": id,
                "content": token,
                "single_word": false,
                "lstrip": false,
                "rstrip": rstrip(token),
                "normalized": false,
                "special": ty(id) != TOKEN_TYPE_USER_DEFINED,
            }));
        }
    }
    let name = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .map(|t| (*t).to_owned())
    };
    let bos_token_id = file.token_id("tokenizer.ggml.bos_token_id")?;
    let pipeline = match model {
        "gpt2" => byte_level_bpe(file, vocab)?,
        "llama" => sentencepiece_bpe(file, &tokens, vocab, name)?,
        other => {
            return Err(bad(
                file,
                "tokenizer.ggml.model",
                format!(
                    "{other:?} is not supported yet (supported: \"gpt2\", byte-level BPE; \"llama\", SentencePiece BPE); serve the model's Hugging Face directory instead"
                ),
            ));
        }
    };
    // llama.cpp adds bos by default for SentencePiece vocabularies only.
    let add_bos = file
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(model == "llama");
    let post_processor = match (add_bos, name(bos_token_id)) {
        (true, Some(bos)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos.clone(): {"id": bos, "ids": [bos_token_id], "tokens": [bos]}},
        }),
        _ => Json::Null,
    };
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": pipeline.normalizer,
        "pre_tokenizer": pipeline.pre_tokenizer,
        "post_processor": post_processor,
        "decoder": pipeline.decoder,
        "model": pipeline.model,
    });
    let inner: tokenizers::Tokenizer =
        spec.to_string()
            .parse()
            .map_err(|source| TokensError::LoadTokenizer {
                path: file.path().to_path_buf(),
                source,
            })?;
    let eos_token_ids = file.eos_token_ids()?;
    let special = SpecialTokens {
        bos_token: name(bos_token_id),
        bos_token_id,
        eos_token: name(file.token_id("tokenizer.ggml.eos_token_id")?),
        eos_token_ids,
    };
    Ok(Tokenizer::from_parts(inner, special))
}

/// The parts of a `tokenizers` pipeline that differ between tokenizer models.
struct Pipeline {
    normalizer: Json,
    pre_tokenizer: Json,
    decoder: Json,
    model: Json,
}

/// `tokenizer.ggml.model = "gpt2"`: byte-level BPE with the merges the file
/// lists and the split its `pre` names.
fn byte_level_bpe(
    file: &GgufFile,
    vocab: serde_json::Map<String, Json>,
) -> Result<Pipeline, TokensError> {
    let merges = strings(file, "tokenizer.ggml.merges")?;
    let pre = file
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    Ok(Pipeline {
        normalizer: Json::Null,
        pre_tokenizer: pre_tokenizer(file, pre)?,
        decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        model: json!({
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        }),
    })
}

/// SentencePiece's word-boundary mark, which stands for a space in pieces.
const SPM_SPACE: &str = "\u{2581}";

/// `tokenizer.ggml.model = "llama"`: a SentencePiece BPE vocabulary
/// (Llama 2, Mistral, Phi-3, Gemma), tokenized as llama.cpp's
/// `llm_tokenizer_spm` does.
///
/// llama.cpp keeps no merges for these: it splits text into characters and
/// repeatedly joins the adjacent pair whose concatenation is the piece with
/// the highest score (the leftmost on ties), then spells whatever is not a
/// piece as `<0xXX>` byte pieces. A BPE whose merges are every split of
/// every piece into two pieces, ranked by the joined piece's score, joins
/// the same pairs in the same order; this builds those merges (as
/// transformers' `SentencePieceExtractor` does) with byte fallback. Spaces
/// become `▁`, and with `add_space_prefix` (on unless the file says
/// otherwise) each run of text gets one in front — at the start and after
/// every special token, as llama.cpp does.
fn sentencepiece_bpe(
    file: &GgufFile,
    tokens: &[&str],
    vocab: serde_json::Map<String, Json>,
    name: impl Fn(Option<u32>) -> Option<String>,
) -> Result<Pipeline, TokensError> {
    let scores: Vec<f64> = file
        .get("tokenizer.ggml.scores")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(file, "tokenizer.ggml.scores", "is missing or not an array"))?
        .iter()
        .map(|v| {
            v.as_f64()
                .ok_or_else(|| bad(file, "tokenizer.ggml.scores", "holds a non-number"))
        })
        .collect::<Result<_, _>>()?;
    if scores.len() != tokens.len() {
        return Err(bad(
            file,
            "tokenizer.ggml.scores",
            format!("has {} scores for {} tokens", scores.len(), tokens.len()),
        ));
    }
    let merges = spm_merges(tokens, &scores);
    let add_space_prefix = file
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let mut normalizers = Vec::new();
    if add_space_prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": SPM_SPACE}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE}));
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    Ok(Pipeline {
        normalizer: json!({"type": "Sequence", "normalizers": normalizers}),
        pre_tokenizer: Json::Null,
        decoder: json!({"type": "Sequence", "decoders": decoders}),
        model: json!({
            "type": "BPE",
            "dropout": null,
            "unk_token": name(file.token_id("tokenizer.ggml.unknown_token_id")?.or(Some(0))),
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        }),
    })
}

/// BPE merges equivalent to SentencePiece's score-ordered joining: for every
/// piece, each split into two pieces, ranked by the piece's score (highest
/// first; splits of one piece by their halves' ids).
fn spm_merges(tokens: &[&str], scores: &[f64]) -> Vec<(String, String)> {
    let ids: std::collections::HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(f64, usize, usize, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        let mut local = Vec::new();
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                local.push((l, r));
            }
        }
        local.sort_unstable();
        merges.extend(local.into_iter().map(|(l, r)| (scores[id], id, l, r)));
    }
    // Stable: equal scores keep vocabulary order.
    merges.sort_by(|a, b| b.0.total_cmp(&a.0));
    merges
        .into_iter()
        .map(|(_, _, l, r)| (tokens[l].to_owned(), tokens[r].to_owned()))
        .collect()
}

/// The chat template in a GGUF file's metadata (`tokenizer.chat_template`),
/// or the fallback template when it has none.
///
/// # Errors
/// [`TokensError::TemplateSyntax`] when the template does not compile.
pub fn chat_template(file: &GgufFile) -> Result<ChatTemplate, TokensError> {
    let tokens = file.get("tokenizer.ggml.tokens").and_then(Value::as_array);
    let name = |key: &str| -> Result<String, TokensError> {
        Ok(file
            .token_id(key)?
            .and_then(|id| tokens?.get(id as usize)?.as_str())
            .unwrap_or_default()
            .to_owned())
    };
    let (bos, eos) = (
        name("tokenizer.ggml.bos_token_id")?,
        name("tokenizer.ggml.eos_token_id")?,
    );
    match file.get("tokenizer.chat_template").and_then(Value::as_str) {
        Some(source) => ChatTemplate::new(source, &bos, &eos),
        None => Ok(ChatTemplate::fallback(&bos, &eos)),
    }
}

/// The context length a GGUF file declares (`<arch>.context_length`).
pub fn context_length(path: &std::path::Path) -> Option<usize> {
    let file = GgufFile::open(path).ok()?;
    let arch = file.get("general.architecture")?.as_str()?;
    let n = file.get(&format!("{arch}.context_length"))?.as_u64()?;
    usize::try_from(n).ok()
}
