//! API keys (`--api-key-file`): when set, every OpenAI route and every
//! `Inference` RPC needs `Authorization: Bearer <key>` with one of the
//! file's keys; probes (`/health`, `/ready`, `/live`) and `/metrics` stay
//! open. Without the flag the frontend is open, as `sluice up` on a laptop
//! expects.

use std::path::Path;

use sluice_runtime::security::Secret;

use crate::error::FrontendError;

/// The accepted keys, as digests (see [`Secret`]: comparing leaks neither
/// where a wrong key differs nor how long the keys are).
#[derive(Debug, Clone)]
pub(crate) struct ApiKeys {
    keys: Vec<Secret>,
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
        let keys: Vec<Secret> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| Secret::new(l.as_bytes()))
            .collect();
        (!keys.is_empty()).then_some(Self { keys })
    }

    /// Checks an `Authorization` header value: the scheme `Bearer` in any
    /// case (RFC 9110 makes auth schemes case-insensitive), then the key.
    pub(crate) fn check(&self, authorization: Option<&[u8]>) -> Result<(), FrontendError> {
        let Some(value) = authorization else {
            return Err(FrontendError::Unauthorized {
                message: "missing API key: send `Authorization: Bearer <key>`".into(),
            });
        };
        let value = value.trim_ascii();
        let key = match value.split_at_checked(6) {
            Some((scheme, rest))
                if scheme.eq_ignore_ascii_case(b"bearer")
                    && rest.first().is_some_and(|b| *b == b' ' || *b == b'\t') =>
            {
                rest.trim_ascii()
            }
            _ => {
                return Err(FrontendError::Unauthorized {
                    message: "the Authorization header must be `Bearer <key>`".into(),
                });
            }
        };
        if Secret::any_matches(&self.keys, key) {
            Ok(())
        } else {
            Err(FrontendError::Unauthorized {
                message: "invalid API key".into(),
            })
        }
    }
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
        assert!(msg(Some(b"Bearersk-one")).contains("Bearer"));
        assert!(msg(Some(b"Basic sk-one")).contains("Bearer"));
    }

    #[test]
    fn the_scheme_is_case_insensitive() {
        let keys = ApiKeys::parse("sk-one").expect("keys");
        for h in [
            &b"Bearer sk-one"[..],
            b"bearer sk-one",
            b"BEARER sk-one",
            b"bEaReR   sk-one",
        ] {
            assert!(
                keys.check(Some(h)).is_ok(),
                "{}",
                String::from_utf8_lossy(h)
            );
        }
    }
}
