//! Test-only engine faults (feature `fault-injection`, which only the test
//! crates enable; a release build has none of this).
//!
//! A [`StepFault`] armed by a test makes the engine's backend fail one step
//! — the way a poisoned kernel or a device error would — as soon as a step
//! computes a position past the armed one. The engine then ends the
//! sequences of that step with `FinishReason::Error` mid-stream, which is
//! what a worker sends for an internal engine failure.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use sluice_engine::EngineError;
use sluice_engine::backend::{Backend, BeforeStep, ForwardBatch};

/// One armed step failure. Share one `Arc` between workers (every worker
/// built from the same [`crate::WorkerArgs`] does) and exactly one of them
/// fails once per arming, whichever computes the position first.
#[derive(Debug, Default)]
pub struct StepFault {
    armed: AtomicBool,
    /// Fail a step that computes any position at or past this one.
    from_position: AtomicUsize,
    fired: AtomicU32,
}

impl StepFault {
    /// Arms the fault: the next step (on any engine sharing it) that
    /// computes position `from_position` or later fails.
    pub fn arm(&self, from_position: usize) {
        self.from_position.store(from_position, Ordering::SeqCst);
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Steps failed so far.
    pub fn fired(&self) -> u32 {
        self.fired.load(Ordering::SeqCst)
    }

    /// Whether this step fails (disarms the fault when it does).
    fn trips(&self, batch: &ForwardBatch) -> bool {
        let from = self.from_position.load(Ordering::SeqCst);
        let reaches = batch
            .seqs
            .iter()
            .any(|s| s.start_pos + s.tokens.len() > from);
        if reaches && self.armed.swap(false, Ordering::SeqCst) {
            self.fired.fetch_add(1, Ordering::SeqCst);
            return true;
        }
        false
    }
}

/// `inner`, failing the step a [`StepFault`] names.
pub(crate) fn faulty(inner: Box<dyn Backend>, fault: Arc<StepFault>) -> Box<dyn Backend> {
    Box::new(BeforeStep {
        inner,
        hook: move |_: &_, batch: &ForwardBatch| {
            if fault.trips(batch) {
                return Err(EngineError::StepFailed(
                    "injected engine fault (test)".into(),
                ));
            }
            Ok(())
        },
    })
}
