//! Balance scheduling (vLLM-Ascend patch 5212) against the baseline, on
//! data-parallel mocker ranks that step in lockstep (a `BalanceGroup`
//! barrier: every step lasts as long as the slowest rank's), in one process
//! run: output throughput, mean TTFT, mean TPOT, balance-held steps.
//!
//! Requests are placed as the router places on (worker, rank) targets:
//! least running + waiting (the router's report plus its own placements;
//! here exactly placed − finished), ties to the lowest rank. The balance run
//! replays the baseline's placement, so both runs see the same per-rank
//! request lists.
//!
//! Two clocks. The model clock: every rank's forward records its modelled
//! step time; a lockstep step costs its slowest rank's, and a request's
//! TTFT/TPOT come from the step counter read at arrival, first and last
//! token — what the timing model says, whatever else runs on this machine.
//! The wall clock: measured times multiplied back by the speedup ratio
//! (so also in the model's milliseconds), overhead included. "Stalled"
//! counts steps in which some rank prefilled while another only decoded
//! (the steps balance scheduling is meant to remove).
//!
//! `cargo bench -p sluice-engine --bench balance`; `BALANCE_ONLY=name,...`
//! runs only the named scenarios, `BALANCE_SPEEDUP=x` overrides the speedup
//! ratio. Writes the table between the markers of
//! `tests/bench/results/balance.md` (the rest of the file is kept).

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_engine::backend::{Backend, BeforeStep, ForwardBatch};
use sluice_engine::{
    BalanceGroup, EngineConfig, EngineHandle, GenerateStream, MockerBackend, MockerConfig, Request,
    SamplingParams, SchedulerConfig,
};

const BLOCK_SIZE: usize = 16;
/// Share of a rank's KV pool a full batch of the longest sequences fills.
const KV_FILL_AT_FULL_BATCH: f64 = 0.8;
const DEFAULT_SPEEDUP: f64 = 15.0;
const MARK_BEGIN: &str = "<!-- bench:balance:begin -->";
const MARK_END: &str = "<!-- bench:balance:end -->";

/// Output lengths of a scenario's requests.
#[derive(Debug, Clone, Copy)]
enum Lengths {
    Fixed(usize),
    /// `long` tokens for one request in `every`, `short` for the others.
    Bimodal {
        short: usize,
        long: usize,
        every: usize,
    },
}

impl Lengths {
    fn of(self, i: usize) -> usize {
        match self {
            Self::Fixed(n) => n,
            Self::Bimodal { short, long, every } => {
                if i % every == every - 1 {
                    long
                } else {
                    short
                }
            }
        }
    }

    fn max(self) -> usize {
        match self {
            Self::Fixed(n) => n,
            Self::Bimodal { short, long, .. } => short.max(long),
        }
    }

    fn describe(self) -> String {
        match self {
            Self::Fixed(n) => format!("{n}"),
            Self::Bimodal { short, long, every } => {
                format!("{short} (1 in {every}: {long})")
            }
        }
    }
}

/// When requests arrive.
#[derive(Debug, Clone, Copy)]
enum Arrivals {
    /// All at once.
    Burst,
    /// Poisson, `rate` requests per second of model time.
    Poisson { rate: f64 },
}

impl Arrivals {
    /// Arrival offsets in model seconds.
    fn offsets(self, n: usize, rng: &mut StdRng) -> Vec<f64> {
        match self {
            Self::Burst => vec![0.0; n],
            Self::Poisson { rate } => {
                let mut t = 0.0;
                (0..n)
                    .map(|_| {
                        let u: f64 = rng.random_range(f64::EPSILON..1.0);
                        t += -u.ln() / rate;
                        t
                    })
                    .collect()
            }
        }
    }

    fn describe(self) -> String {
        match self {
            Self::Burst => "burst".into(),
            Self::Poisson { rate } => format!("Poisson {rate}/s"),
        }
    }
}

#[derive(Debug, Clone)]
struct Scenario {
    name: &'static str,
    ranks: usize,
    /// Per rank.
    max_num_seqs: usize,
    /// Per rank (`max_num_batched_tokens`).
    budget: usize,
    requests: usize,
    prompt_len: usize,
    output: Lengths,
    arrivals: Arrivals,
}

fn scenarios() -> Vec<Scenario> {
    let patch = Scenario {
        name: "burst",
        ranks: 4,
        max_num_seqs: 32,
        budget: 8192,
        requests: 512,
        prompt_len: 3500,
        output: Lengths::Fixed(1500),
        arrivals: Arrivals::Burst,
    };
    vec![
        patch.clone(),
        Scenario {
            name: "poisson",
            arrivals: Arrivals::Poisson { rate: 4.0 },
            ..patch.clone()
        },
        Scenario {
            name: "poisson-2k",
            budget: 2048,
            arrivals: Arrivals::Poisson { rate: 4.0 },
            ..patch.clone()
        },
        Scenario {
            name: "uneven",
            output: Lengths::Bimodal {
                short: 150,
                long: 3000,
                every: 8,
            },
            ..patch.clone()
        },
        Scenario {
            name: "small-batch",
            max_num_seqs: 4,
            requests: 32,
            ..patch
        },
    ]
}

/// Per lockstep step: the slowest rank's modelled time and who prefilled.
#[derive(Debug, Default, Clone, Copy)]
struct StepRecord {
    slowest: Duration,
    prefill_ranks: usize,
    decode_only_ranks: usize,
    /// Sequences in the ranks' batches.
    seqs: usize,
}

#[derive(Debug, Default)]
struct ModelClock {
    steps: Mutex<Vec<StepRecord>>,
}

impl ModelClock {
    fn record(&self, step: u64, modelled: Duration, prefill: bool, seqs: usize) {
        let mut steps = self.steps.lock();
        let i = usize::try_from(step).unwrap_or(usize::MAX);
        if steps.len() <= i {
            steps.resize(i + 1, StepRecord::default());
        }
        let r = &mut steps[i];
        r.slowest = r.slowest.max(modelled);
        r.seqs += seqs;
        if prefill {
            r.prefill_ranks += 1;
        } else {
            r.decode_only_ranks += 1;
        }
    }

    /// Modelled time at the start of each lockstep step (one more entry
    /// than steps: the last is the total busy time).
    fn starts(&self) -> Vec<Duration> {
        let steps = self.steps.lock();
        let mut t = Duration::ZERO;
        let mut out = Vec::with_capacity(steps.len() + 1);
        out.push(t);
        for s in steps.iter() {
            t += s.slowest;
            out.push(t);
        }
        out
    }

    /// (steps with a prefill, steps where a prefill stalled a decode-only
    /// rank, sequences per lockstep step summed over ranks).
    fn summary(&self) -> (usize, usize, f64) {
        let steps = self.steps.lock();
        let seqs = steps.iter().map(|s| s.seqs).sum::<usize>() as f64 / steps.len().max(1) as f64;
        let prefill = steps.iter().filter(|s| s.prefill_ranks > 0).count();
        let stalled = steps
            .iter()
            .filter(|s| s.prefill_ranks > 0 && s.decode_only_ranks > 0)
            .count();
        (prefill, stalled, seqs)
    }
}

/// The mocker, recording each step's modelled time on the group's clock.
fn clocked(inner: MockerBackend, clock: Arc<ModelClock>, group: Arc<BalanceGroup>) -> impl Backend {
    BeforeStep {
        inner,
        hook: move |inner: &MockerBackend, batch: &ForwardBatch| {
            let prefill = batch
                .seqs
                .iter()
                .any(|s| !(s.tokens.len() == 1 && s.start_pos > 0 && s.needs_logits));
            // Ranks are inside the same lockstep step while they run forward.
            let step = group.lockstep_steps();
            let modelled = inner
                .step_duration(batch)
                .mul_f64(inner.config().speedup_ratio);
            clock.record(step, modelled, prefill, batch.seqs.len());
            Ok(())
        },
    }
}

/// One request's timeline: wall clock, and the lockstep step counter
/// (steps completed) read at the same moments.
#[derive(Debug, Clone, Copy)]
struct Timeline {
    arrived: Instant,
    first: Instant,
    last: Instant,
    arrived_step: u64,
    first_step: u64,
    last_step: u64,
    tokens: usize,
}

/// Means over requests, and the time from the first arrival to the last token.
#[derive(Debug, Clone, Copy)]
struct Latency {
    span: Duration,
    ttft: Duration,
    tpot: Duration,
}

impl Latency {
    fn of(timelines: &[Timeline], time: impl Fn(&Timeline) -> [Duration; 3]) -> Self {
        let n = timelines.len().max(1) as u32;
        let (mut ttft, mut tpot) = (Duration::ZERO, Duration::ZERO);
        let (mut start, mut end) = (Duration::MAX, Duration::ZERO);
        for t in timelines {
            let [arrived, first, last] = time(t);
            ttft += first.saturating_sub(arrived);
            tpot += last.saturating_sub(first) / (t.tokens.max(2) - 1) as u32;
            start = start.min(arrived);
            end = end.max(last);
        }
        Self {
            span: end.saturating_sub(start),
            ttft: ttft / n,
            tpot: tpot / n,
        }
    }
}

#[derive(Debug, Clone)]
struct RunResult {
    /// By the modelled step times.
    model: Latency,
    /// By the wall clock, multiplied by the speedup ratio.
    wall: Latency,
    tokens: usize,
    held_steps: u64,
    lockstep_steps: u64,
    /// Sequences per rank per lockstep step.
    mean_batch: f64,
    prefill_steps: usize,
    stalled_steps: usize,
    placement: Vec<usize>,
    per_rank: Vec<usize>,
}

impl RunResult {
    fn throughput(&self, l: Latency) -> f64 {
        self.tokens as f64 / l.span.as_secs_f64()
    }
}

fn spawn_ranks(
    sc: &Scenario,
    balance: bool,
    speedup: f64,
) -> (Vec<EngineHandle>, Arc<BalanceGroup>, Arc<ModelClock>) {
    let group = BalanceGroup::lockstep(sc.ranks, Duration::from_secs(30));
    let clock = Arc::new(ModelClock::default());
    let max_len = sc.prompt_len + sc.output.max();
    let full = (sc.max_num_seqs * max_len).div_ceil(BLOCK_SIZE);
    let num_blocks = (full as f64 / KV_FILL_AT_FULL_BATCH).ceil() as usize;
    let engines = (0..sc.ranks)
        .map(|rank| {
            let mocker = MockerBackend::new(MockerConfig {
                block_size: BLOCK_SIZE,
                num_blocks,
                speedup_ratio: speedup,
                ..MockerConfig::default()
            })
            .expect("valid mocker config");
            let backend = clocked(mocker, clock.clone(), group.clone());
            let cfg = EngineConfig {
                block_size: BLOCK_SIZE,
                num_blocks: Some(num_blocks),
                scheduler: SchedulerConfig {
                    max_num_seqs: sc.max_num_seqs,
                    max_num_batched_tokens: sc.budget,
                    max_model_len: max_len + BLOCK_SIZE,
                    balance_scheduling: balance,
                    ..SchedulerConfig::default()
                },
                enable_prefix_caching: false,
                balance_group: Some((group.clone(), rank)),
                ..EngineConfig::default()
            };
            EngineHandle::spawn(Box::new(backend), cfg).expect("engine starts")
        })
        .collect();
    (engines, group, clock)
}

/// Reads one request's stream to its end: when its first and last tokens
/// came, in wall time and in the group's lockstep steps.
async fn follow(
    mut stream: GenerateStream,
    group: &BalanceGroup,
    arrived: Instant,
    arrived_step: u64,
) -> Timeline {
    let mut first = None;
    let mut tokens = 0;
    while let Some(out) = stream.recv().await {
        if !out.token_ids.is_empty() {
            first.get_or_insert_with(|| (Instant::now(), group.lockstep_steps()));
            tokens += out.token_ids.len();
        }
        if out.finished.is_some() {
            break;
        }
    }
    let last = (Instant::now(), group.lockstep_steps());
    let first = first.unwrap_or(last);
    Timeline {
        arrived,
        first: first.0,
        last: last.0,
        arrived_step,
        first_step: first.1,
        last_step: last.1,
        tokens,
    }
}

/// Runs one scenario; `placement` replays a previous run's ranks.
fn run(sc: &Scenario, balance: bool, speedup: f64, placement: Option<&[usize]>) -> RunResult {
    let mut rng = StdRng::seed_from_u64(5212);
    let offsets = sc.arrivals.offsets(sc.requests, &mut rng);
    let vocab = MockerConfig::default().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..sc.requests)
        .map(|_| {
            (0..sc.prompt_len)
                .map(|_| rng.random_range(1..vocab))
                .collect()
        })
        .collect();
    let (engines, group, clock) = spawn_ranks(sc, balance, speedup);
    let outstanding: Arc<Vec<AtomicUsize>> =
        Arc::new((0..sc.ranks).map(|_| AtomicUsize::new(0)).collect());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("tokio runtime");
    let start = Instant::now();
    let (timelines, chosen) = rt.block_on(async {
        let mut tasks = Vec::with_capacity(sc.requests);
        let mut chosen = Vec::with_capacity(sc.requests);
        for (i, prompt) in prompts.into_iter().enumerate() {
            let at = start + Duration::from_secs_f64(offsets[i] / speedup);
            tokio::time::sleep_until(at.into()).await;
            let rank = match placement {
                Some(p) => p[i],
                None => (0..sc.ranks)
                    .min_by_key(|&r| (outstanding[r].load(Ordering::Relaxed), r))
                    .expect("at least one rank"),
            };
            chosen.push(rank);
            outstanding[rank].fetch_add(1, Ordering::Relaxed);
            let req = Request {
                request_id: format!("r{i}"),
                prompt,
                sampling: SamplingParams {
                    max_tokens: Some(sc.output.of(i)),
                    ignore_eos: true,
                    ..SamplingParams::greedy()
                },
                priority: 0,
                constraint: None,
                first_token_by: None,
                tpot_target: None,
            };
            let arrived = Instant::now();
            let arrived_step = group.lockstep_steps();
            let group = group.clone();
            let stream = engines[rank].generate(req).expect("request fits");
            let outstanding = outstanding.clone();
            tasks.push(tokio::spawn(async move {
                let timeline = follow(stream, &group, arrived, arrived_step).await;
                outstanding[rank].fetch_sub(1, Ordering::Relaxed);
                timeline
            }));
        }
        let mut timelines = Vec::with_capacity(tasks.len());
        for t in tasks {
            timelines.push(t.await.expect("request task"));
        }
        (timelines, chosen)
    });
    let held_steps = engines
        .iter()
        .map(|e| e.load().borrow().balance_held_steps)
        .sum();
    for e in &engines {
        e.shutdown();
    }
    let lockstep_steps = group.lockstep_steps();
    let (prefill_steps, stalled_steps, batch) = clock.summary();
    let starts = clock.starts();
    let at = |step: u64| {
        let i = usize::try_from(step).unwrap_or(usize::MAX);
        starts.get(i).or(starts.last()).copied().unwrap_or_default()
    };
    let model = Latency::of(&timelines, |t| {
        [at(t.arrived_step), at(t.first_step), at(t.last_step)]
    });
    let wall = Latency::of(&timelines, |t| {
        [t.arrived - start, t.first - start, t.last - start].map(|d| d.mul_f64(speedup))
    });
    let mut per_rank = vec![0; sc.ranks];
    for &r in &chosen {
        per_rank[r] += 1;
    }
    RunResult {
        model,
        wall,
        tokens: timelines.iter().map(|t| t.tokens).sum(),
        held_steps,
        lockstep_steps,
        mean_batch: batch / sc.ranks as f64,
        prefill_steps,
        stalled_steps,
        placement: chosen,
        per_rank,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

fn row(mode: &str, r: &RunResult) -> String {
    format!(
        "| {mode} | {:.0} | {} | {} | {:.0} | {} | {} | {} | {} | {:.1} | {} / {} | {:.1} |",
        r.throughput(r.model),
        ms(r.model.ttft),
        ms(r.model.tpot),
        r.throughput(r.wall),
        ms(r.wall.ttft),
        ms(r.wall.tpot),
        r.held_steps,
        r.lockstep_steps,
        r.mean_batch,
        r.stalled_steps,
        r.prefill_steps,
        r.model.span.as_secs_f64(),
    )
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn ratio(a: f64, b: f64) -> String {
    format!("{:+.1}%", (b / a - 1.0) * 100.0)
}

fn report(sc: &Scenario, speedup: f64, base: &RunResult, bal: &RunResult) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "### {}: {} ranks × max_num_seqs {} (total {}), budget {} tokens/step/rank, {} requests, {} in / {} out, {}\n",
        sc.name,
        sc.ranks,
        sc.max_num_seqs,
        sc.ranks * sc.max_num_seqs,
        sc.budget,
        sc.requests,
        sc.prompt_len,
        sc.output.describe(),
        sc.arrivals.describe(),
    );
    let _ = writeln!(
        s,
        "| mode | output tok/s | mean TTFT ms | mean TPOT ms | wall: output tok/s | wall: mean TTFT ms | wall: mean TPOT ms | balance-held steps | lockstep steps | mean batch per rank | stalled / prefill steps | makespan s |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    let _ = writeln!(s, "{}", row("baseline", base));
    let _ = writeln!(s, "{}", row("balance", bal));
    let _ = writeln!(
        s,
        "| balance vs baseline | {} | {} | {} | {} | {} | {} | | | | | |",
        ratio(base.throughput(base.model), bal.throughput(bal.model)),
        ratio(secs(base.model.ttft), secs(bal.model.ttft)),
        ratio(secs(base.model.tpot), secs(bal.model.tpot)),
        ratio(base.throughput(base.wall), bal.throughput(bal.wall)),
        ratio(secs(base.wall.ttft), secs(bal.wall.ttft)),
        ratio(secs(base.wall.tpot), secs(bal.wall.tpot)),
    );
    let _ = writeln!(
        s,
        "\n{} output tokens per run; requests per rank (both runs): {:?}; speedup ratio {speedup}.\n",
        base.tokens, base.per_rank
    );
    s
}

/// `YYYY-MM-DD HH:MM UTC` from the system clock.
fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}

fn write_results(body: &str) {
    let engine = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = engine
        .parent()
        .unwrap_or(engine)
        .join("tests/bench/results/balance.md");
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    let block = format!("{MARK_BEGIN}\n{body}{MARK_END}");
    let new = match (old.find(MARK_BEGIN), old.find(MARK_END)) {
        (Some(b), Some(e)) if b < e => {
            format!("{}{block}{}", &old[..b], &old[e + MARK_END.len()..])
        }
        _ => format!("# Balance scheduling across data-parallel ranks\n\n{block}\n"),
    };
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    match std::fs::write(&path, new) {
        Ok(()) => println!("wrote {}", path.display()),
        Err(e) => eprintln!("cannot write {}: {e}", path.display()),
    }
}

fn main() {
    let speedup = std::env::var("BALANCE_SPEEDUP")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .unwrap_or(DEFAULT_SPEEDUP);
    let only: Option<Vec<String>> = std::env::var("BALANCE_ONLY")
        .ok()
        .map(|s| s.split(',').map(str::to_owned).collect());
    let started = Instant::now();
    let mut body = format!(
        "Run {} with `cargo bench -p sluice-engine --bench balance`{}{}; took {{took}} s of wall time.\n\n",
        utc_now(),
        if speedup == DEFAULT_SPEEDUP {
            String::new()
        } else {
            format!(" (BALANCE_SPEEDUP={speedup})")
        },
        only.as_ref()
            .map(|o| format!(" (BALANCE_ONLY={})", o.join(",")))
            .unwrap_or_default(),
    );
    for sc in scenarios() {
        if only
            .as_ref()
            .is_some_and(|o| !o.iter().any(|n| n == sc.name))
        {
            continue;
        }
        let t = Instant::now();
        let base = run(&sc, false, speedup, None);
        let bal = run(&sc, true, speedup, Some(&base.placement));
        let text = report(&sc, speedup, &base, &bal);
        println!("{text}(scenario took {:.1} s)\n", t.elapsed().as_secs_f64());
        body.push_str(&text);
    }
    let body = body.replace("{took}", &format!("{:.0}", started.elapsed().as_secs_f64()));
    write_results(&body);
}
