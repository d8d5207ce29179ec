//! Reading the small JSON files of a Hugging Face model directory
//! (`tokenizer_config.json`, `generation_config.json`, `config.json`) for the
//! keys this crate needs. Owns the file names and the tolerant parsing of
//! keys that come in several shapes (a token as a string or as an
//! `AddedToken` object, an id as an integer or a list).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::TokensError;

/// `tokenizer.json`: the `tokenizers` crate's serialized tokenizer.
pub(crate) const TOKENIZER_JSON: &str = "tokenizer.json";
/// `tokenizer_config.json`: special tokens and the chat template.
pub(crate) const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";
/// `generation_config.json`: default generation settings, eos ids.
pub(crate) const GENERATION_CONFIG_JSON: &str = "generation_config.json";
/// `config.json`: the model architecture (eos/bos ids as a last resort).
pub(crate) const CONFIG_JSON: &str = "config.json";
/// `chat_template.jinja`: where newer transformers versions save the template.
pub(crate) const CHAT_TEMPLATE_JINJA: &str = "chat_template.jinja";

/// Reads a text file, mapping "not found" to [`TokensError::MissingFile`].
pub(crate) fn read_text(path: &Path) -> Result<String, TokensError> {
    std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            TokensError::MissingFile {
                path: path.to_path_buf(),
            }
        } else {
            TokensError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

/// Reads a text file that may be absent.
pub(crate) fn read_text_optional(path: &Path) -> Result<Option<String>, TokensError> {
    match read_text(path) {
        Ok(text) => Ok(Some(text)),
        Err(TokensError::MissingFile { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A parsed JSON file and where it came from, for error messages.
#[derive(Debug, Clone)]
pub(crate) struct JsonFile {
    pub(crate) path: PathBuf,
    pub(crate) value: Value,
}

impl JsonFile {
    /// Parses `text` as the contents of `path`.
    pub(crate) fn parse(path: PathBuf, text: &str) -> Result<Self, TokensError> {
        let value = serde_json::from_str(text).map_err(|source| TokensError::Json {
            path: path.clone(),
            source,
        })?;
        Ok(Self { path, value })
    }

    /// Reads `dir/name` if it exists.
    pub(crate) fn read_optional(dir: &Path, name: &str) -> Result<Option<Self>, TokensError> {
        let path = dir.join(name);
        match read_text_optional(&path)? {
            Some(text) => Self::parse(path, &text).map(Some),
            None => Ok(None),
        }
    }

    fn bad_key(&self, key: &str, problem: &str) -> TokensError {
        TokensError::BadKey {
            path: self.path.clone(),
            key: key.to_string(),
            problem: problem.to_string(),
        }
    }

    /// A special token given as a string, as `{"content": "..."}`, or null/absent.
    pub(crate) fn token_string(&self, key: &str) -> Result<Option<String>, TokensError> {
        match self.value.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Object(obj)) => match obj.get("content") {
                Some(Value::String(s)) => Ok(Some(s.clone())),
                _ => Err(self.bad_key(key, "is an object without a string \"content\"")),
            },
            Some(_) => Err(self.bad_key(key, "must be a string or an object with \"content\"")),
        }
    }

    /// Token ids given as an integer, a list of integers, or null/absent.
    pub(crate) fn token_ids(&self, key: &str) -> Result<Vec<u32>, TokensError> {
        let as_id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        match self.value.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    as_id(v)
                        .ok_or_else(|| self.bad_key(key, "must list non-negative 32-bit integers"))
                })
                .collect(),
            Some(v) => as_id(v).map(|id| vec![id]).ok_or_else(|| {
                self.bad_key(
                    key,
                    "must be a non-negative 32-bit integer or a list of them",
                )
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(json: &str) -> JsonFile {
        JsonFile::parse(PathBuf::from("x.json"), json).expect("test JSON parses")
    }

    #[test]
    fn token_string_accepts_string_object_and_null() {
        let f = file(r#"{"a": "<s>", "b": {"content": "</s>", "lstrip": false}, "c": null}"#);
        assert_eq!(
            f.token_string("a").expect("string"),
            Some("<s>".to_string())
        );
        assert_eq!(
            f.token_string("b").expect("object"),
            Some("</s>".to_string())
        );
        assert_eq!(f.token_string("c").expect("null"), None);
        assert_eq!(f.token_string("missing").expect("absent"), None);
        assert!(matches!(
            file(r#"{"a": 3}"#).token_string("a"),
            Err(TokensError::BadKey { .. })
        ));
    }

    #[test]
    fn token_ids_accepts_int_and_list() {
        let f = file(r#"{"a": 2, "b": [3, 4], "c": null}"#);
        assert_eq!(f.token_ids("a").expect("int"), vec![2]);
        assert_eq!(f.token_ids("b").expect("list"), vec![3, 4]);
        assert!(f.token_ids("c").expect("null").is_empty());
        let err = file(r#"{"a": -1}"#)
            .token_ids("a")
            .expect_err("negative id");
        assert!(err.to_string().contains("\"a\""), "{err}");
    }
}
