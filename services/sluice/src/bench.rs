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
mod tls;
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

/// `--ttft-targets` and `--tpot-targets`: milliseconds by priority.
pub(crate) type TargetsMs = std::collections::BTreeMap<i32, u32>;

fn parse_targets_ms(s: &str) -> Result<TargetsMs, String> {
    let pairs = sluice_runtime::config::parse_pairs::<i32, u32>(s, '=', "PRIORITY=MS")?;
    if let Some((priority, _)) = pairs.iter().find(|(_, ms)| *ms == 0) {
        return Err(format!(
            "target of priority {priority} must be milliseconds > 0"
        ));
    }
    Ok(pairs.into_iter().collect())
}

/// Flags of `sluice bench`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchArgs {
    /// Server base URL (`http://host:port` or `https://host:port`, with or
    /// without `/v1`).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,

    /// PEM CA certificate to verify an `https://` server against (e.g. the
    /// `ca.pem` of `sluice certs`).
    #[arg(long, env = "SLUICE_BENCH_CA")]
    ca: Option<PathBuf>,

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

    /// TTFT targets by priority, `PRIORITY=MS,...` (e.g. "3=1000,0=120000"):
    /// requests of a listed priority carry `nvext.agent_hints.ttft_target_ms`.
    /// Others get the server's default, which it reports in `nvext`.
    /// Attainment and goodput count a request within target when its first
    /// token came within its target.
    #[arg(long, value_parser = parse_targets_ms)]
    ttft_targets: Option<TargetsMs>,

    /// TPOT targets by priority, `PRIORITY=MS,...` (e.g. "3=50,0=200"):
    /// requests of a listed priority carry
    /// `nvext.agent_hints.tpot_target_ms`. Attainment and goodput count a
    /// request within target only when its mean time per output token after
    /// the first was within this one too.
    #[arg(long, value_parser = parse_targets_ms)]
    tpot_targets: Option<TargetsMs>,

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
            "ttft_targets_ms": self.ttft_targets,
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
/// A signal (`stop`) ends the run early: what finished is reported, the
/// rest counts as interrupted.
pub(crate) async fn run(args: BenchArgs, stop: sluice_runtime::Shutdown) -> anyhow::Result<()> {
    args.validate()?;
    let plan = args.workload()?;
    let target = Target::new(
        &args.url,
        args.model.clone(),
        args.endpoint,
        args.api_key.clone(),
        args.vocab_size,
        args.ca.as_deref(),
    )?
    .with_ttft_targets(args.ttft_targets.clone().unwrap_or_default())
    .with_tpot_targets(args.tpot_targets.clone().unwrap_or_default());
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
    let (records, duration_s) = run.execute(Arc::new(target), plan, &stop).await;
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
    async fn execute(
        self,
        target: Arc<Target>,
        plan: Vec<Planned>,
        stop: &sluice_runtime::Shutdown,
    ) -> (Vec<RequestRecord>, f64) {
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
        // Why the run ended early: (error kind, detail) for what was cut short.
        let mut cut: Option<(&str, String)> = None;
        while pending.peek().is_some() || !tasks.is_empty() {
            let next_at = pending
                .peek()
                .map(|p| tokio::time::Instant::from_std(start + p.at));
            tokio::select! {
                () = tokio::time::sleep_until(deadline) => {
                    let limit = format!("the run's --timeout-secs ({} s) ran out", self.timeout.as_secs());
                    cut = Some(("timeout", limit));
                    break;
                }
                () = stop.cancelled() => {
                    cut = Some(("interrupted", "the run was stopped by a signal".into()));
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
                        in_flight.insert(p.index, RequestRecord::unanswered(&p, start, now));
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
        if let Some((kind, detail)) = cut {
            tasks.abort_all();
            last_done = Instant::now();
            records.extend(cut_short(
                in_flight, pending, kind, &detail, start, last_done,
            ));
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

/// The records of a run cut short at `now` (by its deadline or a signal):
/// the requests in flight fail with `kind`, those never sent fail as
/// `not_sent`, both saying why.
fn cut_short(
    in_flight: HashMap<usize, RequestRecord>,
    pending: impl Iterator<Item = Planned>,
    kind: &str,
    detail: &str,
    start: Instant,
    now: Instant,
) -> Vec<RequestRecord> {
    let error = |kind: &str, detail: String| {
        Some(RequestError {
            kind: kind.into(),
            detail,
            retry_after: None,
        })
    };
    let mut records = Vec::new();
    for (_, mut rec) in in_flight {
        rec.e2e_ms = (now - start).as_secs_f64() * 1000.0 - rec.sent_ms;
        rec.error = error(kind, detail.to_string());
        records.push(rec);
    }
    for p in pending {
        let mut rec = RequestRecord::unanswered(&p, start, now);
        rec.sent_ms = f64::NAN;
        rec.error = error("not_sent", format!("{detail} first"));
        records.push(rec);
    }
    records
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

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::bench::trace::PromptSpec;

    /// Reads one HTTP/1.1 request and returns its JSON body.
    async fn read_request(sock: &mut tokio::net::TcpStream) -> serde_json::Value {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = sock.read(&mut chunk).await.expect("read");
            assert!(n > 0, "client closed early");
            buf.extend_from_slice(&chunk[..n]);
            let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().expect("length"));
            if buf.len() >= end + 4 + len {
                return serde_json::from_slice(&buf[end + 4..end + 4 + len]).expect("json");
            }
        }
    }

    /// A server that streams three tokens for priority 0, answers 429 for
    /// priority 1 and never answers priority 2.
    async fn fake_server() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let body = read_request(&mut sock).await;
                    let prio = body["nvext"]["agent_hints"]["priority"]
                        .as_i64()
                        .unwrap_or(0);
                    match prio {
                        0 => {
                            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
                            sock.write_all(head.as_bytes()).await.expect("write");
                            let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
                            sock.write_all(format!("data: {role}\n\n").as_bytes())
                                .await
                                .expect("write");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            for t in ["a", "b", "c"] {
                                let c = format!(
                                    "{{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{t}\"}}}}]}}"
                                );
                                sock.write_all(format!("data: {c}\n\n").as_bytes())
                                    .await
                                    .expect("write");
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            let fin = r#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3},"nvext":{"worker_id":"w1","queue_wait_ms":1.5,"routed_overlap_tokens":64}}"#;
                            sock.write_all(format!("data: {fin}\n\ndata: [DONE]\n\n").as_bytes())
                                .await
                                .expect("write");
                        }
                        1 => {
                            let resp = "HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}";
                            sock.write_all(resp.as_bytes()).await.expect("write");
                        }
                        _ => tokio::time::sleep(Duration::from_secs(30)).await,
                    }
                });
            }
        });
        format!("http://{addr}")
    }

    fn planned(index: usize, priority: i32, at_ms: u64) -> Planned {
        Planned {
            index,
            at: Duration::from_millis(at_ms),
            prompt: PromptSpec {
                len: 4,
                hash_ids: vec![],
                block_tokens: 1,
                tail_seed: index as u64,
            },
            output_tokens: 3,
            priority,
        }
    }

    #[tokio::test]
    async fn run_measures_streams_and_counts_errors_and_timeouts() {
        let url = fake_server().await;
        let target =
            Target::new(&url, "m".into(), Endpoint::Chat, None, 100, None).expect("target");
        let plan = vec![
            planned(0, 0, 0),
            planned(1, 1, 0),
            planned(2, 2, 0),
            planned(3, 0, 100),
            // Scheduled after the run's time limit: never sent.
            planned(4, 0, 5_000),
        ];
        let run = Run {
            concurrency: 0,
            timeout: Duration::from_millis(1_500),
            request_timeout: Duration::from_millis(700),
            progress: false,
        };
        let (records, duration) = run
            .execute(Arc::new(target), plan, &sluice_runtime::Shutdown::new())
            .await;
        assert_eq!(records.len(), 5);
        assert!(duration > 0.0);
        for r in [&records[0], &records[3]] {
            assert!(r.error.is_none(), "{r:?}");
            let ttft = r.ttft_ms.expect("ttft");
            assert!(ttft >= 45.0 && ttft <= r.e2e_ms, "{r:?}");
            assert_eq!(r.output_tokens, 3);
            assert_eq!(r.input_tokens, 4);
            assert_eq!(r.worker_id.as_deref(), Some("w1"));
            assert_eq!(r.queue_wait_ms, Some(1.5));
            assert_eq!(r.routed_overlap_tokens, Some(64));
            assert!(r.itl_ms().expect("itl") > 0.0);
        }
        assert!(records[3].sent_ms >= 100.0);
        let kind = |i: usize| records[i].error.as_ref().map(|e| e.kind.as_str());
        assert_eq!(kind(1), Some("429"));
        assert_eq!(kind(2), Some("timeout"));
        assert_eq!(kind(4), Some("not_sent"));
        let stats = stats::GroupStats::of(&records, duration);
        assert_eq!((stats.completed, stats.failed), (2, 3));
    }

    #[tokio::test]
    async fn a_signal_ends_the_run_and_reports_what_finished() {
        let url = fake_server().await;
        let target =
            Target::new(&url, "m".into(), Endpoint::Completions, None, 100, None).expect("target");
        // One answered at once, one scheduled long after the signal.
        let plan = vec![planned(0, 0, 0), planned(1, 0, 60_000)];
        let run = Run {
            concurrency: 0,
            timeout: Duration::from_secs(120),
            request_timeout: Duration::from_secs(5),
            progress: false,
        };
        let stop = sluice_runtime::Shutdown::new();
        let signal = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            signal.cancel();
        });
        let started = Instant::now();
        let (records, _) = run.execute(Arc::new(target), plan, &stop).await;
        assert!(started.elapsed() < Duration::from_secs(10), "stopped early");
        assert!(records[0].error.is_none(), "{:?}", records[0]);
        let e = records[1].error.as_ref().expect("not sent");
        assert_eq!(e.kind, "not_sent");
        assert!(e.detail.contains("signal"), "{e:?}");
    }

    #[tokio::test]
    async fn concurrency_caps_requests_in_flight() {
        let url = fake_server().await;
        let target =
            Target::new(&url, "m".into(), Endpoint::Completions, None, 100, None).expect("target");
        let plan: Vec<Planned> = (0..4).map(|i| planned(i, 0, 0)).collect();
        let run = Run {
            concurrency: 1,
            timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(5),
            progress: false,
        };
        let (records, _) = run
            .execute(Arc::new(target), plan, &sluice_runtime::Shutdown::new())
            .await;
        assert!(records.iter().all(|r| r.error.is_none()));
        // One at a time: each is sent after the previous one finished.
        for w in records.windows(2) {
            assert!(w[1].sent_ms >= w[0].sent_ms + w[0].e2e_ms - 1.0, "{w:?}");
        }
    }

    #[test]
    fn flags_are_validated_with_the_flag_named() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: BenchArgs,
        }
        let parse = |a: &[&str]| {
            Cli::try_parse_from(std::iter::once("bench").chain(a.iter().copied())).map(|c| c.args)
        };
        let args = parse(&["--requests", "0"]).expect("parses");
        assert!(
            args.validate()
                .expect_err("invalid")
                .to_string()
                .contains("--requests")
        );
        let args = parse(&["--rate", "0"]).expect("parses");
        assert!(
            args.validate()
                .expect_err("invalid")
                .to_string()
                .contains("--rate")
        );
        assert!(parse(&["--trace", "x.jsonl", "--requests", "5"]).is_err());
        assert!(
            parse(&["--max-isl", "5"]).is_err(),
            "trace-only flag without --trace"
        );
        assert!(parse(&["--burst", "--rate", "3"]).is_err());
        let ok = parse(&["--priority-tiers", "0:1,3:2", "--rate", "4"]).expect("parses");
        assert!(ok.validate().is_ok());
        assert_eq!(ok.workload().expect("workload").len(), 100);
    }
}
