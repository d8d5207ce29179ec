//! API keys and tenants.
//!
//! With `--api-key-file`, every OpenAI route and every `Inference` RPC needs
//! `Authorization: Bearer <key>` (the scheme in any case) with one of the
//! file's keys, and the key decides the request's **tenant**: the identity
//! the queue shares capacity and quotas by. Probes (`/health`, `/ready`,
//! `/live`) and `/metrics` stay open. Without the flag the frontend is open,
//! as `sluice up` on a laptop expects, and a request names its own tenant
//! (the `x-sluice-tenant` header, else the OpenAI `user` field).
//!
//! # The key file
//!
//! One key per line, `KEY [TENANT [WEIGHT]]`, separated by whitespace;
//! blank lines and `#` comments are skipped. Several keys may share a
//! tenant. A bare key is a tenant of its own, named `key-` and 8 hex digits
//! of a hash of the key (the key itself never appears in metrics, traces or
//! responses). WEIGHT (an integer ≥ 1) is the tenant's fair-share weight,
//! sent to the queue with each request.
//!
//! # Comparing keys
//!
//! A presented key is hashed once with XXH3-128 under a seed drawn at
//! start-up, and its 16-byte digest is compared with every stored key's
//! digest, each comparison touching all 16 bytes, whichever key matches.
//! The time taken depends only on the presented key's length (which its
//! sender knows) and the number of keys, never on a stored key's length or
//! content, and an attacker cannot predict digests without the seed.
//!
//! # Tenants cannot be claimed
//!
//! With keys, the tenant is the key's: the `user` field is kept as OpenAI's
//! end-user id but never changes the tenant, and an `x-sluice-tenant`
//! header (or `Inference` `tenant` field) naming another tenant is refused
//! with 403 / `PERMISSION_DENIED`.

use std::path::Path;
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64;

use sluice_runtime::security::Secret;

use crate::error::FrontendError;

/// Header that names the tenant when the frontend has no API keys.
pub(crate) const TENANT_HEADER: &str = "x-sluice-tenant";

/// The tenant of a request that names none.
pub(crate) const DEFAULT_TENANT: &str = "default";

/// Longest tenant name, in bytes.
const MAX_TENANT_BYTES: usize = 128;

/// Who a key belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    /// The tenant the key's requests are queued and counted as.
    pub tenant: Arc<str>,
    /// The tenant's fair-share weight; 0 = none given.
    pub weight: u32,
}

/// A request's tenant, as the queue will see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tenant {
    pub name: String,
    /// Fair-share weight from the key file; 0 = none.
    pub weight: u32,
}

/// The accepted keys, as digests (see [`Secret`]: comparing leaks neither
/// where a wrong key differs nor how long the keys are).
#[derive(Debug, Clone)]
pub(crate) struct ApiKeys {
    /// Every key's digest, compared in full on every check.
    secrets: Vec<Secret>,
    keys: Vec<StoredKey>,
}

#[derive(Debug, Clone)]
struct StoredKey {
    secret: Secret,
    identity: Identity,
}

impl ApiKeys {
    /// Reads `path` (see the module docs for the format); a file without a
    /// key, or with a malformed line, is refused naming the line.
    pub(crate) fn from_file(path: &Path) -> Result<Self, FrontendError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            FrontendError::invalid(
                "--api-key-file",
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        Self::parse(&text).map_err(|reason| {
            FrontendError::invalid("--api-key-file", format!("{}: {reason}", path.display()))
        })
    }

    fn parse(text: &str) -> Result<Self, String> {
        let mut keys: Vec<StoredKey> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = |reason: String| format!("line {}: {reason}", n + 1);
            let mut fields = line.split_whitespace();
            let Some(key) = fields.next() else {
                continue;
            };
            let tenant = match fields.next() {
                Some(t) => {
                    check_tenant_name(t).map_err(at)?;
                    t.to_owned()
                }
                None => format!("key-{:08x}", xxh3_64(key.as_bytes()) >> 32),
            };
            let weight = match fields.next() {
                Some(w) => match w.parse::<u32>() {
                    Ok(w) if w >= 1 => w,
                    _ => return Err(at(format!("weight {w:?} must be an integer ≥ 1"))),
                },
                None => 0,
            };
            if let Some(extra) = fields.next() {
                return Err(at(format!(
                    "unexpected {extra:?}: a line is `KEY [TENANT [WEIGHT]]`"
                )));
            }
            if keys.iter().any(|k| k.secret.matches(key.as_bytes())) {
                return Err(at("the same key appears twice".into()));
            }
            keys.push(StoredKey {
                secret: Secret::new(key.as_bytes()),
                identity: Identity {
                    tenant: Arc::from(tenant),
                    weight,
                },
            });
        }
        if keys.is_empty() {
            return Err(
                "holds no key (one per line, `KEY [TENANT [WEIGHT]]`; # starts a comment)".into(),
            );
        }
        let secrets = keys.iter().map(|k| k.secret.clone()).collect();
        Ok(Self { secrets, keys })
    }

    /// Checks an `Authorization` header value; the key's identity when it is
    /// one of the file's.
    pub(crate) fn check(&self, authorization: Option<&[u8]>) -> Result<Identity, FrontendError> {
        let Some(value) = authorization else {
            return Err(FrontendError::Unauthorized {
                message: "missing API key: send `Authorization: Bearer <key>`".into(),
            });
        };
        let value = value.trim_ascii();
        let key = value
            .iter()
            .position(|b| b.is_ascii_whitespace())
            .filter(|&end| value[..end].eq_ignore_ascii_case(b"bearer"))
            .map(|end| value[end..].trim_ascii())
            .filter(|key| !key.is_empty());
        let Some(key) = key else {
            return Err(FrontendError::Unauthorized {
                message: "the Authorization header must be `Bearer <key>`".into(),
            });
        };
        match Secret::position(&self.secrets, key).and_then(|i| self.keys.get(i)) {
            Some(stored) => Ok(stored.identity.clone()),
            None => Err(FrontendError::Unauthorized {
                message: "invalid API key".into(),
            }),
        }
    }
}

/// A tenant name is 1..=128 bytes without control characters.
fn check_tenant_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_TENANT_BYTES {
        return Err(format!(
            "tenant {name:?} must be 1 to {MAX_TENANT_BYTES} bytes long"
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(format!(
            "tenant {name:?} must not contain control characters"
        ));
    }
    Ok(())
}

/// The request's tenant: the key's when there is one (`identity`), else the
/// one the request claims (`claimed`: the `x-sluice-tenant` header or the
/// `Inference` `tenant` field, named `claim_field`), else the OpenAI `user`
/// field, else [`DEFAULT_TENANT`].
///
/// With a key, a claim naming another tenant is refused (403) and `user` is
/// ignored; without one, a claimed name must be a valid tenant name (400).
pub(crate) fn resolve_tenant(
    identity: Option<&Identity>,
    claimed: Option<&str>,
    claim_field: &str,
    user: Option<&str>,
) -> Result<Tenant, FrontendError> {
    let claimed = claimed.map(str::trim).filter(|c| !c.is_empty());
    if let Some(id) = identity {
        if let Some(c) = claimed
            && c != &*id.tenant
        {
            return Err(FrontendError::Forbidden {
                message: format!(
                    "this API key belongs to tenant {:?}; `{claim_field}` cannot name another tenant ({c:?})",
                    &*id.tenant
                ),
            });
        }
        return Ok(Tenant {
            name: id.tenant.to_string(),
            weight: id.weight,
        });
    }
    let (name, field) = match (claimed, user.filter(|u| !u.is_empty())) {
        (Some(c), _) => (c, claim_field),
        (None, Some(u)) => (u, "user"),
        (None, None) => (DEFAULT_TENANT, ""),
    };
    check_tenant_name(name).map_err(|reason| FrontendError::invalid(field, reason))?;
    Ok(Tenant {
        name: name.to_owned(),
        weight: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(keys: &ApiKeys, header: &[u8]) -> Identity {
        keys.check(Some(header)).expect("accepted")
    }

    #[test]
    fn keys_name_their_tenant_and_weight_and_a_bare_key_is_its_own_tenant() {
        let keys =
            ApiKeys::parse("# ops team\nsk-one acme 3\n\n  sk-two   acme  \nsk-three\nsk-four\n")
                .expect("keys");
        let one = identity(&keys, b"Bearer sk-one");
        assert_eq!((&*one.tenant, one.weight), ("acme", 3));
        let two = identity(&keys, b"Bearer sk-two");
        assert_eq!((&*two.tenant, two.weight), ("acme", 0));
        let three = identity(&keys, b"Bearer sk-three");
        let four = identity(&keys, b"Bearer sk-four");
        assert!(three.tenant.starts_with("key-") && three.tenant.len() == 12);
        assert_ne!(three.tenant, four.tenant, "each bare key is a tenant");
        assert!(
            !three.tenant.contains("sk-three"),
            "the key is not its name"
        );
        assert_eq!(
            identity(&keys, b"Bearer sk-three"),
            three,
            "the name is stable"
        );
    }

    #[test]
    fn malformed_key_files_are_refused_naming_the_line() {
        let err = |text: &str| ApiKeys::parse(text).expect_err(text);
        assert!(err("# nothing here\n\n").contains("holds no key"));
        assert!(err("sk-a acme 0").starts_with("line 1: weight"));
        assert!(err("sk-a acme x").contains("weight \"x\""));
        assert!(err("sk-a acme 2 extra").contains("KEY [TENANT [WEIGHT]]"));
        assert!(err("sk-a a\nsk-a b").starts_with("line 2: the same key"));
        let long = format!("sk-a {}", "t".repeat(200));
        assert!(err(&long).contains("1 to 128 bytes"));
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        let keys = ApiKeys::parse("sk-one").expect("keys");
        for header in [
            &b"Bearer sk-one"[..],
            b"bearer sk-one",
            b"BEARER sk-one",
            b"BeArEr   sk-one  ",
            b"Bearer\tsk-one",
        ] {
            assert!(
                keys.check(Some(header)).is_ok(),
                "{}",
                String::from_utf8_lossy(header)
            );
        }
    }

    #[test]
    fn a_missing_malformed_or_wrong_key_is_refused_saying_which() {
        let keys = ApiKeys::parse("sk-one\nsk-two t").expect("keys");
        let msg = |h: Option<&[u8]>| keys.check(h).expect_err("refused").to_string();
        assert!(msg(None).contains("missing API key"));
        assert!(msg(Some(b"sk-one")).contains("Bearer"));
        assert!(msg(Some(b"Bearer")).contains("Bearer <key>"));
        assert!(msg(Some(b"Bearer ")).contains("Bearer <key>"));
        assert!(msg(Some(b"Basic sk-one")).contains("Bearer <key>"));
        assert!(msg(Some(b"Bearersk-one")).contains("Bearer <key>"));
        assert!(msg(Some(b"Bearer sk-on")).contains("invalid API key"));
        assert!(msg(Some(b"Bearer sk-one2")).contains("invalid API key"));
        assert!(msg(Some(b"Bearersk-one")).contains("Bearer"));
        assert!(msg(Some(b"Basic sk-one")).contains("Bearer"));
        assert!(msg(Some(b"Bearer sk-two t")).contains("invalid API key"));
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

    #[test]
    fn with_a_key_the_tenant_is_the_keys_and_cannot_be_claimed() {
        let id = Identity {
            tenant: Arc::from("acme"),
            weight: 2,
        };
        let t = resolve_tenant(Some(&id), None, TENANT_HEADER, Some("mallory")).expect("ok");
        assert_eq!(
            t,
            Tenant {
                name: "acme".into(),
                weight: 2
            },
            "`user` does not change the tenant"
        );
        let same = resolve_tenant(Some(&id), Some("acme"), TENANT_HEADER, None).expect("ok");
        assert_eq!(same.name, "acme");
        let err = resolve_tenant(Some(&id), Some("globex"), TENANT_HEADER, None)
            .expect_err("impersonation");
        assert!(matches!(err, FrontendError::Forbidden { .. }), "{err:?}");
        assert!(err.to_string().contains(TENANT_HEADER));
        assert_eq!(err.status(), axum::http::StatusCode::FORBIDDEN);
    }

    #[test]
    fn without_keys_the_header_then_user_then_default_names_the_tenant() {
        let t = |claimed, user| resolve_tenant(None, claimed, TENANT_HEADER, user);
        assert_eq!(t(Some("h"), Some("u")).expect("ok").name, "h");
        assert_eq!(t(None, Some("u")).expect("ok").name, "u");
        assert_eq!(t(Some(" "), None).expect("ok").name, DEFAULT_TENANT);
        assert_eq!(t(None, None).expect("ok").name, DEFAULT_TENANT);
        let err = t(None, Some("bad\nname")).expect_err("control character");
        assert!(
            matches!(&err, FrontendError::InvalidRequest { param: Some(p), .. } if p == "user"),
            "{err:?}"
        );
    }
}
