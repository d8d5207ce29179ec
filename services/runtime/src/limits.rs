//! The input rules every boundary applies to the messages services share,
//! one set for all: the frontend's HTTP API and gRPC `Inference`, and the
//! internal RPCs of workers, queue and router. A request one boundary
//! accepts, the next accepts too; one it refuses, none serves.
//!
//! Each check names the field and says what to fix; callers render it as
//! their own 400 / `INVALID_ARGUMENT`.

use sluice_proto::common::v1 as common;

/// Stop strings per request, at most.
pub const MAX_STOP_STRINGS: usize = 16;
/// Bytes of one stop string, at most.
pub const MAX_STOP_STRING_BYTES: usize = 1024;
/// Stop token ids per request, at most.
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// Alternatives reported per generated position, at most.
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Highest sampling temperature.
pub const MAX_TEMPERATURE: f32 = 2.0;
/// Highest repetition penalty.
pub const MAX_REPETITION_PENALTY: f32 = 10.0;
/// Bytes of a request id, tenant, model name or worker id, at most.
pub const MAX_ID_BYTES: usize = 256;
/// Workers a migrating request may exclude, at most.
pub const MAX_EXCLUDED_WORKERS: usize = 64;

/// Lowest and highest request priority (higher = more important).
pub const MIN_PRIORITY: i32 = -1000;
pub const MAX_PRIORITY: i32 = 1000;
/// Highest strict priority tier.
pub const MAX_STRICT_PRIORITY: u32 = 1000;

/// A field that breaks a rule, and what to do instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    /// The field, as the wire names it (`sampling.top_p`, `stop`, …).
    pub field: &'static str,
    pub message: String,
}

fn invalid(field: &'static str, message: impl Into<String>) -> Invalid {
    Invalid {
        field,
        message: message.into(),
    }
}

/// Checks sampling parameters (stop strings included) against the rules.
pub fn check_sampling(s: &common::SamplingParams) -> Result<(), Invalid> {
    if let Some(t) = s.temperature
        && !(t.is_finite() && (0.0..=MAX_TEMPERATURE).contains(&t))
    {
        return Err(invalid(
            "temperature",
            format!("temperature must be between 0 and {MAX_TEMPERATURE}"),
        ));
    }
    if let Some(p) = s.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(invalid("top_p", "top_p must be in (0, 1]"));
    }
    if let Some(r) = s.repetition_penalty
        && !(r > 0.0 && r <= MAX_REPETITION_PENALTY)
    {
        return Err(invalid(
            "repetition_penalty",
            format!("repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}]"),
        ));
    }
    if s.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(invalid(
            "top_logprobs",
            format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"),
        ));
    }
    if s.max_tokens > 0 && s.min_tokens > s.max_tokens {
        return Err(invalid(
            "min_tokens",
            format!(
                "min_tokens ({}) must not exceed max_tokens ({})",
                s.min_tokens, s.max_tokens
            ),
        ));
    }
    if s.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(invalid(
            "stop_token_ids",
            format!("at most {MAX_STOP_TOKEN_IDS} stop token ids"),
        ));
    }
    check_stop_strings(&s.stop)
}

/// Checks a list of stop strings: at most [`MAX_STOP_STRINGS`], none empty,
/// none longer than [`MAX_STOP_STRING_BYTES`].
pub fn check_stop_strings(stop: &[String]) -> Result<(), Invalid> {
    if stop.len() > MAX_STOP_STRINGS {
        return Err(invalid(
            "stop",
            format!("at most {MAX_STOP_STRINGS} stop strings"),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(invalid("stop", "stop strings must not be empty"));
    }
    if stop.iter().any(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(invalid(
            "stop",
            format!("a stop string may be at most {MAX_STOP_STRING_BYTES} bytes"),
        ));
    }
    Ok(())
}

/// Checks that every id of `ids` is in a vocabulary of `vocab_size` tokens.
pub fn check_token_ids(field: &'static str, ids: &[u32], vocab_size: usize) -> Result<(), Invalid> {
    match ids.iter().find(|&&t| t as usize >= vocab_size) {
        Some(bad) => Err(invalid(
            field,
            format!("token id {bad} is outside the vocabulary (size {vocab_size})"),
        )),
        None => Ok(()),
    }
}

/// Checks a prompt of `len` tokens against a model that holds `max_len`
/// tokens per sequence, output included.
pub fn check_prompt_len(field: &'static str, len: usize, max_len: usize) -> Result<(), Invalid> {
    if len == 0 {
        return Err(invalid(field, "the prompt must not be empty"));
    }
    if len >= max_len {
        return Err(invalid(
            field,
            format!(
                "the prompt has {len} tokens; the model holds at most {max_len} per request, output included"
            ),
        ));
    }
    Ok(())
}

/// Checks a priority and a strict tier against [`MIN_PRIORITY`] ..=
/// [`MAX_PRIORITY`] and [`MAX_STRICT_PRIORITY`].
pub fn check_priority(
    field: &'static str,
    priority: i32,
    strict_field: &'static str,
    strict: u32,
) -> Result<(), Invalid> {
    if !(MIN_PRIORITY..=MAX_PRIORITY).contains(&priority) {
        return Err(invalid(
            field,
            format!(
                "priority {priority} is out of range: use {MIN_PRIORITY} to {MAX_PRIORITY} (higher = more important)"
            ),
        ));
    }
    if strict > MAX_STRICT_PRIORITY {
        return Err(invalid(
            strict_field,
            format!(
                "strict priority tier {strict} is out of range: use 0 to {MAX_STRICT_PRIORITY}"
            ),
        ));
    }
    Ok(())
}

/// Checks an identifier-like string (request id, tenant, model, worker id).
pub fn check_id(field: &'static str, value: &str) -> Result<(), Invalid> {
    if value.len() > MAX_ID_BYTES {
        return Err(invalid(
            field,
            format!("must be at most {MAX_ID_BYTES} bytes"),
        ));
    }
    Ok(())
}

/// Checks a list of worker ids to exclude.
pub fn check_excluded(field: &'static str, ids: &[String]) -> Result<(), Invalid> {
    if ids.len() > MAX_EXCLUDED_WORKERS {
        return Err(invalid(
            field,
            format!("at most {MAX_EXCLUDED_WORKERS} workers"),
        ));
    }
    ids.iter().try_for_each(|id| check_id(field, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_name_the_field_they_refuse() {
        let ok = common::SamplingParams::default();
        assert!(check_sampling(&ok).is_ok());
        let cases = [
            (
                common::SamplingParams {
                    temperature: Some(2.5),
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                common::SamplingParams {
                    temperature: Some(f32::NAN),
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                common::SamplingParams {
                    top_p: Some(0.0),
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                common::SamplingParams {
                    repetition_penalty: Some(11.0),
                    ..ok.clone()
                },
                "repetition_penalty",
            ),
            (
                common::SamplingParams {
                    top_logprobs: u32::MAX,
                    ..ok.clone()
                },
                "top_logprobs",
            ),
            (
                common::SamplingParams {
                    max_tokens: 2,
                    min_tokens: 3,
                    ..ok.clone()
                },
                "min_tokens",
            ),
            (
                common::SamplingParams {
                    stop: vec![String::new()],
                    ..ok.clone()
                },
                "stop",
            ),
            (
                common::SamplingParams {
                    stop: vec!["x".into(); 10_000],
                    ..ok.clone()
                },
                "stop",
            ),
            (
                common::SamplingParams {
                    stop_token_ids: vec![1; 65],
                    ..ok.clone()
                },
                "stop_token_ids",
            ),
        ];
        for (s, field) in cases {
            assert_eq!(check_sampling(&s).map_err(|e| e.field), Err(field), "{s:?}");
        }
        assert!(check_token_ids("prompt", &[0, 9], 10).is_ok());
        assert_eq!(
            check_token_ids("prompt", &[5, u32::MAX], 10).map_err(|e| e.field),
            Err("prompt")
        );
        assert!(check_prompt_len("prompt", 9, 10).is_ok());
        assert!(check_prompt_len("prompt", 10, 10).is_err());
        assert!(check_prompt_len("prompt", 0, 10).is_err());
        assert!(check_priority("p", 3, "s", 1).is_ok());
        assert!(check_priority("p", MIN_PRIORITY, "s", MAX_STRICT_PRIORITY).is_ok());
        assert_eq!(
            check_priority("p", i32::MAX, "s", 0).map_err(|e| e.field),
            Err("p")
        );
        assert_eq!(
            check_priority("p", 0, "s", u32::MAX).map_err(|e| e.field),
            Err("s")
        );
    }
}
