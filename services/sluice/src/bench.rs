//! `sluice bench`: a load generator for any OpenAI-compatible server.
//!
//! It builds a workload — a Mooncake-style JSONL trace replayed on its own
//! schedule ([`trace`], [`workload::replay`]) or a seeded synthetic one
//! (normal lengths, Poisson or burst arrivals, weighted priority tiers;
//! [`workload::synthetic`]) — sends every request streamed ([`client`]),
//! and reports TTFT, inter-token latency, end-to-end latency and throughput,
//! overall and per priority tier ([`stats`], [`report`]), with
//! `results.json`, `requests.jsonl`, `results.md` and a PNG of TTFT by tier
//! ([`plot`]) under `--out`.
//!
//! Every loop is bounded: the workload is a finite list, `--concurrency`
//! caps requests in flight, each request has `--request-timeout-secs` and
//! the whole run `--timeout-secs`; when the run's time is up, requests in
//! flight are cancelled and counted as `timeout`, unsent ones as `not_sent`.

mod client;
mod plot;
mod report;
mod stats;
mod trace;
mod workload;

use std::collections::HashMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use client::{Endpoint, RequestError, RequestRecord, Target};
use workload::{Planned, ReplaySpec, SyntheticSpec, Tiers};

/// What can go wrong before or after the requests (request failures are
/// counted in the results, not raised).
#[derive(Debug, thiserror::Error)]
pub(crate) enum BenchError {
    #[error("reading the trace {path}: {source}")]
    ReadTrace {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("trace line {line}: {reason}")]
    TraceRow { line: usize, reason: String },
    #[error("the trace has no rows")]
    EmptyTrace,
    #[error("{flag}: {reason}")]
    Flag { flag: &'static str, reason: String },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("encoding {what}: {detail}")]
    Encode { what: &'static str, detail: String },
}

/// Flags of `sluice bench`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchArgs {
    /// Server base URL (`http://host:port`, with or without `/v1`).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,

    /// Model name sent in every request.
    #[arg(long, default_value = "sluice-tiny")]
    model: String,

    /// API to call: `completions` sends token ids (exact lengths and shared
    /// prefixes), `chat` sends text of one word per planned token.
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    endpoint: Endpoint,

    /// Bearer token for servers that want one.
    #[arg(long, env = "SLUICE_BENCH_API_KEY", hide_env_values = true)]
    api_key: Option<String>,

    /// Prompt token ids are drawn from 1..N; keep N within the server's vocabulary.
    #[arg(long, default_value_t = 1000)]
    vocab_size: u32,

    /// Mooncake-style JSONL trace to replay on its own schedule.
    #[arg(long, conflicts_with_all = ["requests", "isl_mean", "isl_std", "osl_mean", "osl_std", "rate", "burst"])]
    trace: Option<PathBuf>,

    /// Tokens one trace hash id stands for (512 in the Mooncake release).
    #[arg(long, default_value_t = 512, requires = "trace")]
    trace_block_size: u64,

    /// Shrink trace prompts S times: each hash id becomes block_size / S
    /// tokens and a prompt ceil(input_length / S) tokens, prefix structure kept.
    #[arg(long, default_value_t = 1, requires = "trace")]
    trace_scale: u64,

    /// Multiply trace timestamps by X (0.5 replays twice as fast, 0 sends all at once).
    #[arg(long, default_value_t = 1.0, requires = "trace")]
    time_scale: f64,

    /// Replay only the first N rows (by timestamp).
    #[arg(long, requires = "trace")]
    max_requests: Option<usize>,

    /// Cap prompts at N tokens (after --trace-scale).
    #[arg(long, requires = "trace")]
    max_isl: Option<u64>,

    /// Synthetic: number of requests.
    #[arg(long, default_value_t = 100)]
    requests: usize,

    /// Synthetic: mean prompt length in tokens.
    #[arg(long, default_value_t = 512.0)]
    isl_mean: f64,

    /// Synthetic: standard deviation of the prompt length.
    #[arg(long, default_value_t = 0.0)]
    isl_std: f64,

    /// Synthetic: mean output length in tokens (sent as max_tokens = min_tokens, ignore_eos).
    #[arg(long, default_value_t = 128.0)]
    osl_mean: f64,

    /// Synthetic: standard deviation of the output length.
    #[arg(long, default_value_t = 0.0)]
    osl_std: f64,

    /// Synthetic: Poisson arrivals, requests per second. Unset: all at t=0.
    #[arg(long, conflicts_with = "burst")]
    rate: Option<f64>,

    /// Synthetic: send every request at t=0 (the default without --rate).
    #[arg(long)]
    burst: bool,

    /// Requests in flight at most (0 = no limit). With a burst this is a
    /// closed loop of C clients.
    #[arg(long, default_value_t = 0)]
    concurrency: usize,

    /// Priority tiers with weights, `PRIORITY:WEIGHT,...` (e.g.
    /// "0:1,1:1,2:1,3:1"); with a trace, only rows without a priority get one.
    #[arg(long)]
    priority_tiers: Option<Tiers>,

    /// Seed of the synthetic workload and the tier assignment.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// The whole run's time limit in seconds.
    #[arg(long, default_value_t = 600)]
    timeout_secs: u64,

    /// One request's time limit in seconds (default: --timeout-secs).
    #[arg(long)]
    request_timeout_secs: Option<u64>,

    /// Directory for results.json, requests.jsonl, results.md and ttft_by_tier.png.
    #[arg(long)]
    out: Option<PathBuf>,

    /// No progress line on stderr.
    #[arg(long)]
    no_progress: bool,
}

impl BenchArgs {
    fn validate(&self) -> Result<(), BenchError> {
        let bad = |flag, reason: &str| {
            Err(BenchError::Flag {
                flag,
                reason: reason.into(),
            })
        };
        if self.trace.is_none() {
            if self.requests == 0 {
                return bad("--requests", "must be at least 1");
            }
            if !(self.isl_mean >= 1.0 && self.isl_mean.is_finite()) {
                return bad("--isl-mean", "must be at least 1");
            }
            if !(self.osl_mean >= 1.0 && self.osl_mean.is_finite()) {
                return bad("--osl-mean", "must be at least 1");
            }
            if !(self.isl_std >= 0.0 && self.osl_std >= 0.0) {
                return bad("--isl-std/--osl-std", "must not be negative");
            }
            if let Some(r) = self.rate
                && !(r > 0.0 && r.is_finite())
            {
                return bad("--rate", "must be a positive number of requests per second");
            }
        }
        if self.vocab_size < 2 {
            return bad("--vocab-size", "must be at least 2");
        }
        if self.timeout_secs == 0 {
            return bad("--timeout-secs", "must be at least 1");
        }
        if self.request_timeout_secs == Some(0) {
            return bad("--request-timeout-secs", "must be at least 1");
        }
        Ok(())
    }

    fn workload(&self) -> Result<Vec<Planned>, BenchError> {
        match &self.trace {
            Some(path) => {
                let rows = trace::read_trace(path, self.trace_block_size)?;
                workload::replay(
                    &rows,
                    &ReplaySpec {
                        block_size: self.trace_block_size,
                        scale: self.trace_scale,
                        time_scale: self.time_scale,
                        max_requests: self.max_requests,
                        max_isl: self.max_isl,
                        tiers: self.priority_tiers.clone(),
                        seed: self.seed,
                    },
                )
            }
            None => Ok(workload::synthetic(&SyntheticSpec {
                requests: self.requests,
                isl_mean: self.isl_mean,
                isl_std: self.isl_std,
                osl_mean: self.osl_mean,
                osl_std: self.osl_std,
                rate: self.rate,
                tiers: self.priority_tiers.clone(),
                seed: self.seed,
            })),
        }
    }

    /// The run's settings, recorded in results.json (never the API key).
    fn config_json(&self) -> serde_json::Value {
        let tiers = self.priority_tiers.as_ref().map(|t| {
            t.0.iter()
                .map(|(p, w)| format!("{p}:{w}"))
                .collect::<Vec<_>>()
                .join(",")
        });
        let mut v = json!({
            "url": self.url,
            "model": self.model,
            "endpoint": format!("{:?}", self.endpoint).to_lowercase(),
            "concurrency": self.concurrency,
            "priority_tiers": tiers,
            "seed": self.seed,
            "timeout_secs": self.timeout_secs,
        });
        let extra = match &self.trace {
            Some(path) => json!({
                "mode": "trace",
                "trace": path.display().to_string(),
                "trace_block_size": self.trace_block_size,
                "trace_scale": self.trace_scale,
                "time_scale": self.time_scale,
                "max_requests": self.max_requests,
                "max_isl": self.max_isl,
            }),
            None => json!({
                "mode": "synthetic",
                "requests": self.requests,
                "isl_mean": self.isl_mean,
                "isl_std": self.isl_std,
                "osl_mean": self.osl_mean,
                "osl_std": self.osl_std,
                "arrivals": match self.rate {
                    Some(r) => format!("poisson {r}/s"),
                    None => "burst".into(),
                },
            }),
        };
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        v
    }
}

/// Runs `sluice bench`: sends the workload, prints the table, writes `--out`.
pub(crate) async fn run(args: BenchArgs) -> anyhow::Result<()> {
    args.validate()?;
    let plan = args.workload()?;
    let target = Target::new(
        &args.url,
        args.model.clone(),
        args.endpoint,
        args.api_key.clone(),
        args.vocab_size,
    )?;
    let last = plan.last().map_or(0.0, |p| p.at.as_secs_f64());
    eprintln!(
        "sluice bench: {} requests to {} over {last:.1} s of schedule",
        plan.len(),
        args.url
    );
    let run = Run {
        concurrency: args.concurrency,
        timeout: Duration::from_secs(args.timeout_secs),
        request_timeout: Duration::from_secs(
            args.request_timeout_secs.unwrap_or(args.timeout_secs),
        ),
        progress: !args.no_progress,
    };
    let (records, duration_s) = run.execute(Arc::new(target), plan).await;
    let results = report::Results::new(args.config_json(), &records, duration_s);
    println!("{}", results.table());
    if let Some(out) = &args.out {
        results.write(out, &records)?;
        let title = format!("TTFT by priority tier, {} requests", records.len());
        plot::write_ttft_plot(
            &out.join("ttft_by_tier.png"),
            &title,
            &report::ttft_by_tier(&results),
        )?;
        eprintln!("results written to {}", out.display());
    }
    Ok(())
}

/// How the workload is sent.
#[derive(Debug, Clone, Copy)]
struct Run {
    concurrency: usize,
    timeout: Duration,
    request_timeout: Duration,
    progress: bool,
}

impl Run {
    /// Sends `plan` on its schedule; returns one record per planned request
    /// and the run's duration (first send to last answer) in seconds.
    async fn execute(self, target: Arc<Target>, plan: Vec<Planned>) -> (Vec<RequestRecord>, f64) {
        let total = plan.len();
        let start = Instant::now();
        let deadline = tokio::time::Instant::from_std(start + self.timeout);
        let permits = if self.concurrency == 0 {
            Semaphore::MAX_PERMITS
        } else {
            self.concurrency
        };
        let sem = Arc::new(Semaphore::new(permits));
        let mut tasks: JoinSet<RequestRecord> = JoinSet::new();
        let mut in_flight: HashMap<usize, RequestRecord> = HashMap::new();
        let mut records: Vec<RequestRecord> = Vec::with_capacity(total);
        let mut pending = plan.into_iter().peekable();
        let mut ticker = tokio::time::interval(Duration::from_millis(250));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut first_sent: Option<Instant> = None;
        let mut last_done = start;
        let mut failed = 0usize;
        let mut timed_out = false;
        while pending.peek().is_some() || !tasks.is_empty() {
            let next_at = pending
                .peek()
                .map(|p| tokio::time::Instant::from_std(start + p.at));
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {
                    timed_out = true;
                    break;
                }
                Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Ok(rec) = joined {
                        in_flight.remove(&rec.index);
                        last_done = Instant::now();
                        failed += usize::from(rec.error.is_some());
                        records.push(rec);
                    }
                }
                Ok(permit) = async {
                    if let Some(at) = next_at {
                        tokio::time::sleep_until(at).await;
                    }
                    Arc::clone(&sem).acquire_owned().await
                }, if next_at.is_some() => {
                    if let Some(p) = pending.next() {
                        let now = Instant::now();
                        first_sent.get_or_insert(now);
                        in_flight.insert(p.index, placeholder(&p, start, now));
                        let target = Arc::clone(&target);
                        let timeout = self.request_timeout;
                        tasks.spawn(async move {
                            let rec = target.send(&p, start, timeout).await;
                            drop(permit);
                            rec
                        });
                    }
                }
                _ = ticker.tick(), if self.progress => {
                    progress_line(records.len(), tasks.len(), failed, total, start);
                }
            }
        }
        if timed_out {
            tasks.abort_all();
            let now = Instant::now();
            for (_, mut rec) in in_flight.drain() {
                rec.e2e_ms = (now - start).as_secs_f64() * 1000.0 - rec.sent_ms;
                rec.error = Some(RequestError {
                    kind: "timeout".into(),
                    detail: format!(
                        "the run's --timeout-secs ({} s) ran out",
                        self.timeout.as_secs()
                    ),
                });
                records.push(rec);
            }
            for p in pending {
                let mut rec = placeholder(&p, start, now);
                rec.sent_ms = f64::NAN;
                rec.error = Some(RequestError {
                    kind: "not_sent".into(),
                    detail: "the run's --timeout-secs ran out first".into(),
                });
                records.push(rec);
            }
            last_done = now;
        }
        if self.progress {
            progress_line(
                records.len(),
                0,
                records.iter().filter(|r| r.error.is_some()).count(),
                total,
                start,
            );
            eprintln!();
        }
        records.sort_by_key(|r| r.index);
        let duration = last_done.saturating_duration_since(first_sent.unwrap_or(start));
        (records, duration.as_secs_f64())
    }
}

/// The record of a request that has not answered (yet).
fn placeholder(p: &Planned, start: Instant, sent: Instant) -> RequestRecord {
    RequestRecord {
        index: p.index,
        priority: p.priority,
        scheduled_ms: p.at.as_secs_f64() * 1000.0,
        sent_ms: (sent - start).as_secs_f64() * 1000.0,
        ttft_ms: None,
        e2e_ms: 0.0,
        input_tokens: p.prompt.len as u32,
        output_tokens: 0,
        cached_tokens: None,
        queue_wait_ms: None,
        worker_id: None,
        error: None,
    }
}

/// One stderr line, rewritten in place.
fn progress_line(done: usize, in_flight: usize, failed: usize, total: usize, start: Instant) {
    const WIDTH: usize = 30;
    let filled = (done * WIDTH).checked_div(total).unwrap_or(WIDTH);
    let bar = format!("{}{}", "#".repeat(filled), "-".repeat(WIDTH - filled));
    let mut err = std::io::stderr().lock();
    let _ = write!(
        err,
        "\r[{bar}] {done}/{total} done, {in_flight} in flight, {failed} failed, {:.1} s   ",
        start.elapsed().as_secs_f64()
    );
    let _ = err.flush();
}
