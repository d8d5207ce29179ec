//! The frontend's errors, classified where they happen and rendered here:
//! once as an OpenAI-shaped JSON error for HTTP, once as a `tonic::Status`.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

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
    #[error("the model `{model}` does not exist; this server serves `{served}`")]
    UnknownModel { model: String, served: String },
    #[error("the queue refused the request: {message}")]
    Overloaded {
        message: String,
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
    #[error("internal error")]
    Internal { detail: String },
}

impl FrontendError {
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
            Code::ResourceExhausted => Self::Overloaded {
                message: s.message().to_string(),
                retry_after_secs: 1,
            },
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
            _ => Self::Internal {
                detail: format!("{component}: {s}"),
            },
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
            Self::UnknownModel { .. } => StatusCode::NOT_FOUND,
            Self::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::NoWorkers { .. } | Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Deadline => StatusCode::GATEWAY_TIMEOUT,
            Self::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Self::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
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
            Self::UnknownModel { .. } => ("invalid_request_error", "model_not_found"),
            Self::Overloaded { .. } => ("rate_limit_error", "queue_full"),
            Self::NoWorkers { .. } => ("service_unavailable", "no_workers"),
            Self::Unavailable { .. } => ("service_unavailable", "unavailable"),
            Self::Deadline => ("timeout", "deadline_exceeded"),
            Self::Cancelled => ("cancelled", "cancelled"),
            Self::Internal { .. } => ("server_error", "internal_error"),
        }
    }

    /// The user-facing message: detail of internal errors stays in the logs.
    pub(crate) fn public_message(&self) -> String {
        match self {
            Self::Tokens(e) => format!("cannot tokenize the input: {e}"),
            other => other.to_string(),
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
        if let Self::Internal { detail } = &self {
            tracing::error!(%detail, "internal error");
        }
        let mut resp = (self.status(), Json(self.body())).into_response();
        if let Self::Overloaded {
            retry_after_secs, ..
        } = &self
        {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_secs));
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
            FrontendError::UnknownModel { .. } => Code::NotFound,
            FrontendError::Overloaded { .. } => Code::ResourceExhausted,
            FrontendError::NoWorkers { .. } | FrontendError::Unavailable { .. } => {
                Code::Unavailable
            }
            FrontendError::Deadline => Code::DeadlineExceeded,
            FrontendError::Cancelled => Code::Cancelled,
            FrontendError::Internal { detail } => {
                tracing::error!(%detail, "internal error");
                Code::Internal
            }
        };
        tonic::Status::new(code, e.public_message())
    }
}
