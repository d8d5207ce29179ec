//! The error type of `sluice-tokens`: every failure names the file, key or
//! template that caused it.

use std::path::PathBuf;

/// Everything that can go wrong loading a tokenizer or chat template,
/// encoding, decoding or rendering.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    /// A file the model directory must contain is not there.
    #[error("model file {path} is missing")]
    MissingFile { path: PathBuf },
    /// A GGUF file could not be read.
    #[error(transparent)]
    Gguf(#[from] sluice_gguf::GgufError),
    /// A file exists but could not be read.
    #[error("reading {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON.
    #[error("{path} is not valid JSON")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A file is valid JSON but a key has the wrong shape.
    #[error("{path}: key {key:?} {problem}")]
    BadKey {
        path: PathBuf,
        key: String,
        problem: String,
    },
    /// `tokenizer.json` could not be loaded by the `tokenizers` crate.
    #[error("{path} is not a tokenizer the tokenizers crate can load")]
    LoadTokenizer {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },
    /// Encoding text failed.
    #[error("encoding text failed")]
    Encode(#[source] tokenizers::Error),
    /// Decoding token ids failed.
    #[error("decoding token ids failed")]
    Decode(#[source] tokenizers::Error),
    /// Training a BPE tokenizer failed.
    #[error("training the BPE tokenizer failed")]
    Train(#[source] tokenizers::Error),
    /// Serializing a tokenizer to `tokenizer.json` failed.
    #[error("serializing the tokenizer failed")]
    Serialize(#[source] tokenizers::Error),
    /// The chat template does not compile.
    #[error("the chat template does not compile")]
    TemplateSyntax(#[source] minijinja::Error),
    /// The chat template failed while rendering (including `raise_exception`).
    #[error("rendering the chat template failed: {0}")]
    TemplateRender(#[source] minijinja::Error),
    /// `tokenizer_config.json` lists named templates but none is called "default".
    #[error("{path}: chat_template lists templates {names:?} but none is named \"default\"")]
    NoDefaultTemplate { path: PathBuf, names: Vec<String> },
}
