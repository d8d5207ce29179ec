//! API keys (`--api-key-file`): when set, every OpenAI route and every
//! `Inference` RPC needs `Authorization: Bearer <key>` with one of the
//! file's keys; probes (`/health`, `/ready`, `/live`) and `/metrics` stay
//! open. Without the flag the frontend is open, as `sluice up` on a laptop
//! expects.

use std::path::Path;

use crate::error::FrontendError;

/// The accepted keys.
#[derive(Debug, Clone)]
pub(crate) struct ApiKeys {
    keys: Vec<Vec<u8>>,
}

impl ApiKeys {
    /// Reads one key per line from `path` (blank lines and `#` comments
    /// skipped); a file without a key is refused.
    pub(crate) fn from_file(path: &Path) -> Result<Self, FrontendError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            FrontendError::invalid(
                "--api-key-file",
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        Self::parse(&text).ok_or_else(|| {
            FrontendError::invalid(
                "--api-key-file",
                format!(
                    "{} holds no key (one per line; # starts a comment)",
                    path.display()
                ),
            )
        })
    }

    fn parse(text: &str) -> Option<Self> {
        let keys: Vec<Vec<u8>> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| l.as_bytes().to_vec())
            .collect();
        (!keys.is_empty()).then_some(Self { keys })
    }

    /// Checks an `Authorization` header value.
    pub(crate) fn check(&self, authorization: Option<&[u8]>) -> Result<(), FrontendError> {
        let Some(value) = authorization else {
            return Err(FrontendError::Unauthorized {
                message: "missing API key: send `Authorization: Bearer <key>`".into(),
            });
        };
        let Some(key) = value
            .strip_prefix(b"Bearer ")
            .or_else(|| value.strip_prefix(b"bearer "))
        else {
            return Err(FrontendError::Unauthorized {
                message: "the Authorization header must be `Bearer <key>`".into(),
            });
        };
        // Every key is compared in full, whichever matches.
        let ok = self
            .keys
            .iter()
            .fold(false, |ok, k| ok | constant_time_eq(k, key.trim_ascii()));
        if ok {
            Ok(())
        } else {
            Err(FrontendError::Unauthorized {
                message: "invalid API key".into(),
            })
        }
    }
}

/// Equality whose time depends on the lengths only, not on where the
/// bytes first differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_one_per_line_without_comments_and_blanks() {
        let keys = ApiKeys::parse("# ops team\nsk-one\n\n  sk-two  \n").expect("keys");
        assert!(keys.check(Some(b"Bearer sk-one")).is_ok());
        assert!(keys.check(Some(b"Bearer sk-two")).is_ok());
        assert!(ApiKeys::parse("# nothing here\n\n").is_none());
    }

    #[test]
    fn a_missing_malformed_or_wrong_key_is_refused_saying_which() {
        let keys = ApiKeys::parse("sk-one").expect("keys");
        let msg = |h: Option<&[u8]>| keys.check(h).expect_err("refused").to_string();
        assert!(msg(None).contains("missing API key"));
        assert!(msg(Some(b"sk-one")).contains("Bearer"));
        assert!(msg(Some(b"Bearer sk-on")).contains("invalid API key"));
        assert!(msg(Some(b"Bearer sk-one2")).contains("invalid API key"));
    }
}
