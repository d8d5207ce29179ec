//! `sluice-tokens`: what the frontend, the router and the engine must agree on
//! about tokens, with no network dependency.
//!
//! - [`block_hash`]: the chained block hashes of DESIGN.md; one function, so an
//!   equal hash always means an equal prefix everywhere.
//! - [`Tokenizer`]: a model's `tokenizer.json` with its bos/eos ids.
//! - [`gguf`]: the tokenizer and chat template of a GGUF file, rebuilt from
//!   its metadata.
//! - [`ChatTemplate`]: the model's Jinja chat template, rendered as
//!   transformers renders it.
//! - [`IncrementalDetokenizer`]: token ids in, whole-character text deltas
//!   out, with stop strings.
//! - [`grammar`]: JSON schemas, regexes and Lark grammars compiled to
//!   token masks (llguidance), for structured outputs and tool calls.
//! - [`train_byte_level_bpe`]: deterministic BPE training, for the built-in
//!   model and tests.

#![forbid(unsafe_code)]

pub mod block_hash;
mod chat_template;
mod detokenizer;
mod error;
pub mod gguf;
pub mod grammar;
mod hf_config;
mod tokenizer;
pub mod tools;
mod train;

pub use block_hash::{BlockHashes, HASH_SEED, local_block_hash, sequence_block_hashes};
pub use chat_template::{ChatMessage, ChatRenderOptions, ChatTemplate, FALLBACK_CHAT_TEMPLATE};
pub use detokenizer::{Detokenized, IncrementalDetokenizer};
pub use error::TokensError;
pub use tokenizer::{SpecialTokens, Tokenizer};
pub use train::train_byte_level_bpe;
