//! The frontend's errors, classified where they happen and rendered here:
//! once as an OpenAI-shaped JSON error for HTTP, once as a `tonic::Status`.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sluice_proto::queue::v1::QueueReason;

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    /// Malformed or unsupported input; `param` names the field to fix.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    /// The prompt does not fit the model's context (checked in bytes before
    /// tokenization and in tokens after).
    #[error("{message}")]
    PromptTooLong {
        param: &'static str,
        message: String,
    },
    /// The HTTP body is over `--max-body-bytes`.
    #[error("the request body is larger than {limit} bytes")]
    PayloadTooLarge { limit: usize },
    /// No or a wrong API key (`--api-key-file`).
    #[error("{message}")]
    Unauthorized { message: String },
    /// A valid key asked for something it may not (another tenant).
    #[error("{message}")]
    Forbidden { message: String },
    #[error("the model `{model}` does not exist; this server serves `{served}`")]
    UnknownModel { model: String, served: String },
    #[error("the queue refused the request: {message}")]
    Overloaded {
        message: String,
        /// The queue's reason (`sluice-reason`); its label is the error's
        /// `code`: `queue_full`, `ttft_target_unmeetable`, ... (a refusal
        /// that names none counts as `queue_full`).
        reason: QueueReason,
        retry_after_secs: u32,
    },
    /// The tenant is over one of its quotas (the queue's `--tenant-limits`).
    #[error("{message}")]
    QuotaExceeded {
        message: String,
        /// Which limit: `tokens` (per minute) or `requests` (concurrent),
        /// the error `type` OpenAI uses for each.
        quota: &'static str,
        retry_after_secs: u32,
    },
    #[error("no worker serves the model `{model}` right now")]
    NoWorkers { model: String },
    #[error("{component} is unavailable: {message}")]
    Unavailable {
        component: &'static str,
        message: String,
    },
    #[error("the request did not finish within its deadline")]
    Deadline,
    #[error("the request was cancelled")]
    Cancelled,
    #[error("tokenizer")]
    Tokens(#[from] sluice_tokens::TokensError),
    /// An internal step (`what`) failed, on an underlying error when there
    /// is one (kept as the source); logged, not shown to the client.
    #[error("internal error")]
    Internal {
        what: String,
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The frontend could not start: what it was doing, and why.
    #[error("starting the frontend: {what}")]
    Startup {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl FrontendError {
    /// Wraps an error an internal step (`what`) met.
    pub(crate) fn broken<E>(what: impl Into<String>) -> impl FnOnce(E) -> Self
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let what = what.into();
        move |e| Self::Internal {
            what,
            source: Some(e.into()),
        }
    }

    /// An internal condition with no underlying error: `what` went wrong.
    pub(crate) fn internal(what: impl Into<String>) -> Self {
        Self::Internal {
            what: what.into(),
            source: None,
        }
    }

    /// Logs an internal error (its step and source) where it meets the
    /// client; the client sees only "internal error".
    fn log_internal(&self) {
        if let Self::Internal { what, source } = self {
            match source {
                Some(source) => tracing::error!(what = %what, error = %source, "internal error"),
                None => tracing::error!(what = %what, "internal error"),
            }
        }
    }

    /// Wraps an error met while starting, doing `what`.
    pub(crate) fn startup<E>(what: &'static str) -> impl FnOnce(E) -> Self
    where
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        move |e| Self::Startup {
            what,
            source: e.into(),
        }
    }

    /// The queue's refusal reason, for metrics.
    pub(crate) fn refusal_reason(&self) -> Option<&'static str> {
        match self {
            Self::Overloaded { reason, .. } => Some(reason.label()),
            Self::QuotaExceeded { quota, .. } => Some(quota),
            _ => None,
        }
    }

    /// A 400 naming `param`.
    pub(crate) fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// Classifies a status from the queue or a worker.
    pub(crate) fn from_status(component: &'static str, s: tonic::Status, model: &str) -> Self {
        use tonic::Code;
        match s.code() {
            Code::ResourceExhausted => {
                let meta = |k: &str| s.metadata().get(k).and_then(|v| v.to_str().ok());
                let retry_after_secs = meta("retry-after")
                    .and_then(|v| v.trim().parse::<u32>().ok())
                    .unwrap_or(1)
                    .max(1);
                let quota = match meta("sluice-quota") {
                    Some("tokens") => Some("tokens"),
                    Some("requests") => Some("requests"),
                    _ => None,
                };
                match quota {
                    Some(quota) => Self::QuotaExceeded {
                        message: s.message().to_string(),
                        quota,
                        retry_after_secs,
                    },
                    None => Self::Overloaded {
                        message: s.message().to_string(),
                        reason: QueueReason::of_status(&s).unwrap_or(QueueReason::QueueFull),
                        retry_after_secs,
                    },
                }
            }
            Code::DeadlineExceeded => Self::Deadline,
            Code::Cancelled => Self::Cancelled,
            Code::InvalidArgument | Code::OutOfRange => Self::InvalidRequest {
                message: s.message().to_string(),
                param: None,
            },
            Code::NotFound if component == "queue" => Self::NoWorkers {
                model: model.to_string(),
            },
            Code::Unavailable | Code::NotFound => Self::Unavailable {
                component,
                message: s.message().to_string(),
            },
            _ => Self::broken(component)(s),
        }
    }

    /// HTTP status for this error.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Tokens(_) => StatusCode::BAD_REQUEST,
            Self::PromptTooLong { .. } => StatusCode::BAD_REQUEST,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            Self::Forbidden { .. } => StatusCode::FORBIDDEN,
            Self::UnknownModel { .. } => StatusCode::NOT_FOUND,
            Self::Overloaded { .. } | Self::QuotaExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::NoWorkers { .. } | Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Deadline => StatusCode::GATEWAY_TIMEOUT,
            Self::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Self::Internal { .. } | Self::Startup { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            Self::InvalidRequest { .. } | Self::Tokens(_) => {
                ("invalid_request_error", "invalid_request")
            }
            Self::PromptTooLong { .. } => ("invalid_request_error", "context_length_exceeded"),
            Self::PayloadTooLarge { .. } => ("invalid_request_error", "request_too_large"),
            Self::Unauthorized { .. } => ("invalid_request_error", "invalid_api_key"),
            Self::Forbidden { .. } => ("permission_error", "tenant_mismatch"),
            Self::UnknownModel { .. } => ("invalid_request_error", "model_not_found"),
            Self::Overloaded { reason, .. } => ("rate_limit_error", reason.label()),
            // OpenAI's rate-limit errors name the limit in `type`.
            Self::QuotaExceeded { quota, .. } => (quota, "rate_limit_exceeded"),
            Self::NoWorkers { .. } => ("service_unavailable", "no_workers"),
            Self::Unavailable { .. } => ("service_unavailable", "unavailable"),
            Self::Deadline => ("timeout", "deadline_exceeded"),
            Self::Cancelled => ("cancelled", "cancelled"),
            Self::Internal { .. } | Self::Startup { .. } => ("server_error", "internal_error"),
        }
    }

    /// The user-facing message: detail of internal errors stays in the logs.
    pub(crate) fn public_message(&self) -> String {
        match self {
            Self::Tokens(e) => format!("cannot tokenize the input: {e}"),
            other => other.to_string(),
        }
    }

    /// Seconds a refused client should wait before retrying, when known.
    pub(crate) fn retry_after_secs(&self) -> Option<u32> {
        match self {
            Self::Overloaded {
                retry_after_secs, ..
            }
            | Self::QuotaExceeded {
                retry_after_secs, ..
            } => Some(*retry_after_secs),
            _ => None,
        }
    }

    /// The OpenAI error object.
    pub(crate) fn body(&self) -> serde_json::Value {
        let (ty, code) = self.kind();
        let param = match self {
            Self::InvalidRequest { param, .. } => param.clone(),
            Self::PromptTooLong { param, .. } => Some((*param).into()),
            Self::UnknownModel { .. } => Some("model".into()),
            _ => None,
        };
        json!({ "error": { "message": self.public_message(), "type": ty, "param": param, "code": code } })
    }
}

impl IntoResponse for FrontendError {
    fn into_response(self) -> Response {
        self.log_internal();
        let mut resp = (self.status(), Json(self.body())).into_response();
        if let Some(secs) = self.retry_after_secs() {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

impl From<FrontendError> for tonic::Status {
    fn from(e: FrontendError) -> Self {
        use tonic::Code;
        let code = match &e {
            FrontendError::InvalidRequest { .. }
            | FrontendError::Tokens(_)
            | FrontendError::PromptTooLong { .. } => Code::InvalidArgument,
            FrontendError::PayloadTooLarge { .. } => Code::ResourceExhausted,
            FrontendError::Unauthorized { .. } => Code::Unauthenticated,
            FrontendError::Forbidden { .. } => Code::PermissionDenied,
            FrontendError::UnknownModel { .. } => Code::NotFound,
            FrontendError::Overloaded { .. } | FrontendError::QuotaExceeded { .. } => {
                Code::ResourceExhausted
            }
            FrontendError::NoWorkers { .. } | FrontendError::Unavailable { .. } => {
                Code::Unavailable
            }
            FrontendError::Deadline => Code::DeadlineExceeded,
            FrontendError::Cancelled => Code::Cancelled,
            FrontendError::Internal { .. } | FrontendError::Startup { .. } => {
                e.log_internal();
                Code::Internal
            }
        };
        // The field to fix leads the message: gRPC has no `param`.
        let message = match &e {
            FrontendError::InvalidRequest {
                param: Some(param),
                message,
            } => format!("{param}: {message}"),
            _ => e.public_message(),
        };
        let mut status = tonic::Status::new(code, message);
        if let Some(secs) = e.retry_after_secs() {
            status
                .metadata_mut()
                .insert("retry-after", tonic::metadata::MetadataValue::from(secs));
        }
        if let FrontendError::QuotaExceeded { quota, .. } = &e {
            status.metadata_mut().insert(
                "sluice-quota",
                tonic::metadata::MetadataValue::from_static(quota),
            );
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_quota_refusal_is_a_429_naming_the_limit_with_retry_after() {
        let mut status = tonic::Status::resource_exhausted(
            "tenant \"acme\" is over its limit of 600 tokens per minute; retry after 9 s",
        );
        status.metadata_mut().insert("retry-after", 9u32.into());
        status.metadata_mut().insert(
            "sluice-quota",
            tonic::metadata::MetadataValue::from_static("tokens"),
        );
        let err = FrontendError::from_status("queue", status, "m");
        assert_eq!(err.status(), StatusCode::TOO_MANY_REQUESTS);
        let body = err.body();
        assert_eq!(body["error"]["type"], "tokens");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("600 tokens per minute"))
        );
        let resp = err.into_response();
        assert_eq!(resp.headers()[header::RETRY_AFTER], "9");

        // A plain full queue stays `queue_full`, retry in 1 s.
        let err = FrontendError::from_status(
            "queue",
            tonic::Status::resource_exhausted("queue full"),
            "m",
        );
        assert_eq!(err.body()["error"]["code"], "queue_full");
        assert_eq!(err.retry_after_secs(), Some(1));
        // Through the gRPC API the refusal keeps its retry-after.
        let status = tonic::Status::from(FrontendError::QuotaExceeded {
            message: "over".into(),
            quota: "requests",
            retry_after_secs: 3,
        });
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            status
                .metadata()
                .get("retry-after")
                .map(|v| v.to_str().ok()),
            Some(Some("3"))
        );
        assert_eq!(
            status
                .metadata()
                .get("sluice-quota")
                .map(|v| v.to_str().ok()),
            Some(Some("requests"))
        );
    }
}
