//! `sluice`: one binary, a subcommand per role (docs/design.md's command line).
//! `sluice up` runs every service in one process with in-process discovery.

#![forbid(unsafe_code)]

mod bench;
mod up;

/// mimalloc: the many small per-request allocations (protobuf messages,
/// HTTP/2 frames, JSON chunks) cost a sixth of the CPU under glibc malloc.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use sluice_runtime::discovery;
use sluice_runtime::telemetry::{LogFormat, TelemetryConfig, init};
use sluice_runtime::{CommonArgs, ModelArgs, Security, ServiceContext};

/// Sluice: a distributed LLM-serving mesh.
#[derive(Debug, Parser)]
#[command(name = "sluice", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines as text (coloured only on a terminal) or JSON.
    #[arg(long, global = true, env = "SLUICE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run every service in one process and serve the OpenAI API.
    Up(Box<up::UpArgs>),
    /// The OpenAI-compatible HTTP and gRPC Inference frontend.
    Frontend {
        #[command(flatten)]
        common: CommonArgs,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        args: sluice_frontend::Args,
    },
    /// The priority admission queue.
    Queue {
        #[command(flatten)]
        common: CommonArgs,
        #[command(flatten)]
        args: sluice_queue::Args,
    },
    /// The KV-aware router.
    Router {
        #[command(flatten)]
        common: CommonArgs,
        #[command(flatten)]
        args: sluice_router::Args,
    },
    /// A prefill worker.
    Prefill {
        #[command(flatten)]
        common: CommonArgs,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        args: sluice_worker::WorkerArgs,
    },
    /// A decode (or aggregated) worker.
    Decode {
        #[command(flatten)]
        common: CommonArgs,
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        args: sluice_worker::WorkerArgs,
    },
    /// Load-test an OpenAI-compatible server: trace replay or synthetic load,
    /// TTFT/ITL/e2e and throughput per priority tier.
    Bench(Box<bench::BenchArgs>),
    /// Write a private CA and a certificate it signed, for trying TLS and
    /// mutual TLS out (`--tls-cert/--tls-key/--tls-ca`); production meshes
    /// bring their own PKI.
    Certs {
        /// Directory to write `ca.pem`, `ca-key.pem`, `<name>.pem` and
        /// `<name>-key.pem` into (created if missing; keys mode 0600).
        #[arg(long, default_value = "certs")]
        out: PathBuf,
        /// Base name of the certificate's files.
        #[arg(long, default_value = "mesh")]
        name: String,
        /// Host names and IP addresses the certificate is valid for (it
        /// serves and calls: server and client authentication).
        #[arg(long, value_delimiter = ',', default_value = "localhost,127.0.0.1,::1")]
        hosts: Vec<String>,
    },
    /// Model files.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
}

#[derive(Debug, Subcommand)]
enum ModelCommand {
    /// Write the built-in model (Hugging Face layout) into a directory.
    Init {
        /// Directory to write (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// `tiny` (the default model) or `small` (~100M parameters, for benchmarks).
        #[arg(long, default_value = "tiny", value_parser = ["tiny", "small"])]
        size: String,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Command::Model {
        command: ModelCommand::Init { out, size },
    } = &cli.command
    {
        let size = if size == "small" {
            sluice_engine::builtin::BuiltinSize::Small
        } else {
            sluice_engine::builtin::BuiltinSize::Tiny
        };
        sluice_engine::builtin::write_builtin_model(out, size)
            .with_context(|| format!("writing {}", out.display()))?;
        println!(
            "wrote the built-in {} model to {}",
            size.model_name(),
            out.display()
        );
        return Ok(());
    }
    if let Command::Certs { out, name, hosts } = &cli.command {
        let hosts: Vec<&str> = hosts.iter().map(String::as_str).collect();
        let ca = sluice_runtime::security::certs::TestCa::new("sluice mesh CA")
            .context("generating the CA")?;
        let files = ca
            .write(out, name, &hosts)
            .with_context(|| format!("writing {}", out.display()))?;
        println!(
            "CA: {} (key {})\ncertificate for {}: {} (key {})\n\
             serve with:  --tls-cert {} --tls-key {} --tls-ca {}",
            files.ca.display(),
            files.ca_key.display(),
            hosts.join(", "),
            files.cert.display(),
            files.key.display(),
            files.cert.display(),
            files.key.display(),
            files.ca.display(),
        );
        return Ok(());
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = runtime_threads(&cli.command)? {
        runtime.worker_threads(threads);
    }
    let runtime = runtime.enable_all().build()?;
    runtime.block_on(run(cli.command, cli.log_format))
}

/// How many threads the role's runtime gets (`None`: one per core). The
/// queue and the router default to one: a lease or a placement is a few
/// microseconds of work, and with a second thread most of their CPU went to
/// waking it (in the separate-process mesh at one stream, 0.36 and 0.17 ms
/// per request with one thread per core against 0.25 and 0.12 with one).
fn runtime_threads(command: &Command) -> anyhow::Result<Option<usize>> {
    let (common, role_default) = match command {
        Command::Up(args) => (&args.common, None),
        Command::Queue { common, .. } | Command::Router { common, .. } => (common, Some(1)),
        Command::Frontend { common, .. }
        | Command::Prefill { common, .. }
        | Command::Decode { common, .. } => (common, None),
        Command::Bench(_) | Command::Model { .. } | Command::Certs { .. } => return Ok(None),
    };
    common.validate()?;
    Ok(common.runtime_threads(role_default))
}

/// What a service prints on standard output once bound, before its
/// address: `listening on 127.0.0.1:40123`.
const LISTENING: &str = "listening on ";

/// Binds `--listen` and builds the service context (discovery, shutdown).
async fn listen(
    common: CommonArgs,
    shutdown: &sluice_runtime::Shutdown,
) -> anyhow::Result<(tokio::net::TcpListener, ServiceContext)> {
    common.validate()?;
    let security = Arc::new(Security::from_args(&common.security)?);
    let listener = tokio::net::TcpListener::bind(common.listen)
        .await
        .with_context(|| format!("binding --listen {}", common.listen))?;
    let bound = listener.local_addr()?;
    // On standard output, whatever the log level: whoever started this
    // process with `--listen HOST:0` learns the port it got.
    println!("{LISTENING}{bound}");
    // A line before discovery, so a start that stalls there says so.
    tracing::info!(
        listen = %bound,
        etcd = common.etcd.as_deref().unwrap_or("none"),
        "listening; joining discovery"
    );
    let discovery = discovery::from_args(&common, None).await?;
    if common.etcd.is_none() {
        tracing::warn!("no --etcd: in-process discovery only sees services in this process");
    }
    Ok((
        listener,
        ServiceContext::with_common(common, discovery, shutdown.clone(), security),
    ))
}

async fn run(command: Command, log_format: LogFormat) -> anyhow::Result<()> {
    let role = match &command {
        Command::Up(_) => "sluice",
        Command::Frontend { .. } => "sluice-frontend",
        Command::Queue { .. } => "sluice-queue",
        Command::Router { .. } => "sluice-router",
        Command::Prefill { .. } => "sluice-prefill",
        Command::Decode { .. } => "sluice-decode",
        Command::Model { .. } | Command::Certs { .. } => "sluice",
        Command::Bench(_) => "sluice-bench",
    };
    let telemetry = init(&TelemetryConfig::from_env(role, log_format))?;
    let shutdown = sluice_runtime::shutdown::on_signal();
    let result = match command {
        Command::Up(args) => up::run(*args, shutdown.clone()).await,
        Command::Frontend {
            common,
            model,
            args,
        } => {
            let (l, ctx) = listen(common, &shutdown).await?;
            sluice_frontend::serve(l, args, model, ctx)
                .await
                .map_err(Into::into)
        }
        Command::Queue { common, args } => {
            let (l, ctx) = listen(common, &shutdown).await?;
            sluice_queue::serve(l, args, ctx).await.map_err(Into::into)
        }
        Command::Router { common, args } => {
            let (l, ctx) = listen(common, &shutdown).await?;
            sluice_router::serve(l, args, ctx).await.map_err(Into::into)
        }
        Command::Prefill {
            common,
            model,
            args,
        } => {
            let (l, ctx) = listen(common, &shutdown).await?;
            sluice_prefill::serve(l, args, model, ctx)
                .await
                .map_err(Into::into)
        }
        Command::Decode {
            common,
            model,
            args,
        } => {
            let (l, ctx) = listen(common, &shutdown).await?;
            sluice_decode::serve(l, args, model, ctx)
                .await
                .map_err(Into::into)
        }
        Command::Model { .. } | Command::Certs { .. } => Ok(()),
        Command::Bench(args) => bench::run(*args, shutdown.clone()).await,
    };
    telemetry.shutdown().await;
    result
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn up_accepts_the_flags_of_every_role() {
        let cli = Cli::try_parse_from([
            "sluice",
            "up",
            "--engine",
            "mocker",
            "--workers",
            "2",
            "--router-mode",
            "round-robin",
            "--queue-policy",
            "wspt",
            "--queue-threshold",
            "0.5",
            "--scheduling-policy",
            "priority",
            "--max-num-seqs",
            "8",
            "--block-size",
            "32",
            "--speedup-ratio",
            "10",
            "--max-local-prefill-length",
            "64",
            "--default-max-tokens",
            "9",
        ]);
        assert!(cli.is_ok(), "{:?}", cli.err());
    }

    fn threads(args: &[&str]) -> anyhow::Result<Option<usize>> {
        let cli = Cli::try_parse_from(args)?;
        runtime_threads(&cli.command)
    }

    #[test]
    fn queue_and_router_run_one_thread_unless_told_otherwise() -> anyhow::Result<()> {
        assert_eq!(threads(&["sluice", "queue"])?, Some(1));
        assert_eq!(threads(&["sluice", "router"])?, Some(1));
        assert_eq!(
            threads(&["sluice", "router", "--worker-threads", "4"])?,
            Some(4)
        );
        assert_eq!(threads(&["sluice", "frontend"])?, None);
        assert_eq!(threads(&["sluice", "decode"])?, None);
        assert_eq!(threads(&["sluice", "up"])?, None);
        assert_eq!(
            threads(&["sluice", "up", "--worker-threads", "2"])?,
            Some(2)
        );
        let zero = threads(&["sluice", "queue", "--worker-threads", "0"]);
        let message = format!("{:#}", zero.expect_err("0 threads is refused"));
        assert!(message.contains("--worker-threads"), "{message}");
        Ok(())
    }
}
