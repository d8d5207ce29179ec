//! `sluice-frontend`: what users and their services touch. An
//! OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`, `/health`, `/live`, `/ready`, `/metrics`) and the gRPC
//! `Inference` API, on one port.
//!
//! Owns: request validation, chat templating, tokenization and block hashing
//! (once per request), the admission lease, the worker call, incremental
//! detokenization and stop strings, the OpenAI response shapes. Does not own
//! placement (the queue and router) or compute (the workers).

#![forbid(unsafe_code)]

mod auth;
mod error;
mod grpc;
mod http;
mod lease;
mod mesh;
mod metrics;
mod openai;
mod pipeline;
mod prompt;
mod responses;
mod worker_session;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sluice_runtime::grpc::GrpcServer;
use sluice_runtime::{ModelArgs, ServiceContext};
use sluice_tokens::{ChatTemplate, Tokenizer};
use tokio::net::TcpListener;

pub use error::FrontendError;

/// The frontend's own flags.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "frontend-args")]
#[command(next_help_heading = "Frontend")]
pub struct Args {
    /// Default `max_tokens` when a request sets none.
    #[arg(long, env = "SLUICE_DEFAULT_MAX_TOKENS", default_value_t = 256)]
    pub default_max_tokens: u32,

    /// Deadline of a request from receipt to its last token, in seconds (504 after).
    #[arg(long, env = "SLUICE_REQUEST_TIMEOUT", default_value_t = 600)]
    pub request_timeout: u64,

    /// How many times a request whose decode worker fails mid-stream (dies,
    /// resets the stream, ends it unfinished) moves to another worker and
    /// goes on from the tokens already streamed; 0 = the client gets the error.
    #[arg(long, env = "SLUICE_MIGRATION_LIMIT", default_value_t = 3)]
    pub migration_limit: u32,

    /// Milliseconds a queue has to answer an admission (open the lease;
    /// it answers within 20 ms, before any hold) before it is suspected and
    /// the request is admitted at another queue: a frozen or hung queue
    /// whose connections are still open costs a request this much, not its
    /// whole deadline. At least 100.
    #[arg(long, env = "SLUICE_QUEUE_ANSWER_TIMEOUT_MS", default_value_t = 2000)]
    pub queue_answer_timeout_ms: u64,

    /// A file of API keys, one per line (`#` comments): every OpenAI route
    /// and `Inference` RPC then needs `Authorization: Bearer <key>`
    /// (probes and `/metrics` stay open). Unset: no authentication.
    #[arg(long, env = "SLUICE_API_KEY_FILE")]
    pub api_key_file: Option<std::path::PathBuf>,

    /// Largest HTTP request body, in bytes; a larger one is a 413 (an
    /// OpenAI-shaped error) before it is read.
    #[arg(long, env = "SLUICE_MAX_BODY_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Prompts tokenized at once, on a pool off the async runtime (a long
    /// prompt never delays other requests' I/O); others wait their turn.
    /// Prompts of at most 128 bytes are tokenized in place, outside this
    /// bound. Default: the machine's cores.
    #[arg(long, env = "SLUICE_TOKENIZE_CONCURRENCY")]
    pub tokenize_concurrency: Option<usize>,

    /// How the model writes tool calls: hermes, llama3_json or mistral.
    /// Default: read from the chat template (each family's template writes
    /// its own markers), else hermes.
    #[arg(long, env = "SLUICE_TOOL_CALL_PARSER")]
    pub tool_call_parser: Option<sluice_tokens::tools::ToolFormat>,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            default_max_tokens: 256,
            request_timeout: 600,
            migration_limit: 3,
            queue_answer_timeout_ms: 2000,
            api_key_file: None,
            max_body_bytes: 4 * 1024 * 1024,
            tokenize_concurrency: None,
            tool_call_parser: None,
        }
    }
}

impl Args {
    /// Checks the flags; errors name the flag.
    pub fn validate(&self) -> Result<(), FrontendError> {
        if self.default_max_tokens == 0 {
            return Err(FrontendError::invalid(
                "--default-max-tokens",
                "must be at least 1",
            ));
        }
        if self.request_timeout == 0 {
            return Err(FrontendError::invalid(
                "--request-timeout",
                "must be at least 1 second",
            ));
        }
        if self.queue_answer_timeout_ms < 100 {
            return Err(FrontendError::invalid(
                "--queue-answer-timeout-ms",
                "must be at least 100 (a queue answers a lease it holds within 20 ms)",
            ));
        }
        if self.max_body_bytes < 1024 {
            return Err(FrontendError::invalid(
                "--max-body-bytes",
                "must be at least 1024",
            ));
        }
        if self.tokenize_concurrency == Some(0) {
            return Err(FrontendError::invalid(
                "--tokenize-concurrency",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Serves HTTP and gRPC on `listener` until `ctx.shutdown`.
pub async fn serve(
    listener: TcpListener,
    args: Args,
    model: ModelArgs,
    ctx: ServiceContext,
) -> Result<(), FrontendError> {
    args.validate()?;
    let dir = model
        .dir()
        .map_err(|e| FrontendError::invalid("--model", e.to_string()))?;
    let api_keys = args
        .api_key_file
        .as_deref()
        .map(auth::ApiKeys::from_file)
        .transpose()?;
    let tokenizer = Tokenizer::from_path(dir)?;
    let template = ChatTemplate::from_path(dir)?;
    let template_tool_format = template.tool_format();
    let limits = prompt::PromptLimits::new(dir, &tokenizer);
    let tokenize_concurrency = args.tokenize_concurrency.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
    });
    let metrics = metrics::Metrics::new()
        .map_err(FrontendError::startup("registering the frontend metrics"))?;
    let queues = mesh::Members::follow(&ctx, "queue").await?;
    let workers =
        mesh::Members::follow(&ctx, sluice_runtime::discovery::WorkerRole::Decode.as_str()).await?;
    let routers = mesh::Members::follow(&ctx, "router").await?;
    let pipeline = Arc::new(pipeline::Pipeline {
        model: model.name(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0),
        tokenizer,
        template,
        queues,
        workers,
        routers,
        channels: mesh::Channels::new(Arc::clone(&ctx.security)),
        metrics: metrics.clone(),
        default_max_tokens: args.default_max_tokens,
        request_timeout: Duration::from_secs(args.request_timeout),
        migration_limit: args.migration_limit,
        queue_answer_timeout: Duration::from_millis(args.queue_answer_timeout_ms),
        leases: lease::LeaseSessions::new(ctx.tasks().clone(), ctx.background().clone()),
        generations: worker_session::GenerateSessions::new(
            ctx.tasks().clone(),
            ctx.background().clone(),
        ),
        api_keys,
        prompt_limits: limits,
        tokenize_slots: Arc::new(tokio::sync::Semaphore::new(tokenize_concurrency)),
        max_body_bytes: args.max_body_bytes,
        grammars: std::sync::OnceLock::new(),
        tool_format: args.tool_call_parser.unwrap_or(template_tool_format),
    });
    let server = GrpcServer::new()
        .map_err(FrontendError::startup("building the gRPC server"))?
        .add_service(
            sluice_proto::inference::v1::inference_server::InferenceServer::new(
                grpc::InferenceService {
                    pipeline: Arc::clone(&pipeline),
                },
            ),
        )
        .with_metrics(vec![metrics.registry.clone()])
        .with_http(http::router(pipeline));
    let instance = ctx
        .instance("frontend", &listener)
        .map_err(FrontendError::startup("reading the listener's address"))?
        .with_model(model.name());
    tracing::info!(model = %model.name(), "frontend starting");
    ctx.run(server, listener, instance)
        .await
        .map_err(FrontendError::startup("serving"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_answer_timeout_leaves_room_for_a_held_lease_to_be_answered() {
        let args = |ms| Args {
            queue_answer_timeout_ms: ms,
            ..Args::default()
        };
        let err = args(50).validate().expect_err("under the queue's 20 ms");
        assert!(err.to_string().contains("at least 100"), "{err}");
        assert!(args(100).validate().is_ok());
        assert!(Args::default().validate().is_ok());
    }
}
