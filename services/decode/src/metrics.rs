//! Worker metrics: requests by finish reason, tokens, time to first token,
//! remote prefill outcomes, and each rank's scheduler load.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry};

/// Every metric one worker exports, in its own registry.
#[derive(Debug, Clone)]
pub struct WorkerMetrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub generated_tokens: IntCounter,
    pub ttft: Histogram,
    pub remote_prefill: IntCounterVec,
}

impl WorkerMetrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "sluice_worker_requests_total",
                "Finished requests by reason",
            ),
            &["reason"],
        )?;
        let generated_tokens =
            IntCounter::new("sluice_worker_generated_tokens_total", "Tokens generated")?;
        let ttft = Histogram::with_opts(
            HistogramOpts::new(
                "sluice_worker_ttft_seconds",
                "Time from Generate to the first token on this worker",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
        )?;
        let remote_prefill = IntCounterVec::new(
            Opts::new(
                "sluice_worker_remote_prefill_total",
                "Remote prefill attempts by outcome (ok, fallback reason)",
            ),
            &["outcome"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(generated_tokens.clone()))?;
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(remote_prefill.clone()))?;
        Ok(Self {
            registry,
            requests,
            generated_tokens,
            ttft,
            remote_prefill,
        })
    }
}
