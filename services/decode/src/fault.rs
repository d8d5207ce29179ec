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
use sluice_engine::backend::{
    Backend, ForwardBatch, ForwardOutput, KvArena, KvBacking, KvBlockLayout,
};

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

/// A backend that fails the step a [`StepFault`] names and is otherwise
/// the backend it wraps.
pub(crate) struct Faulty {
    pub(crate) inner: Box<dyn Backend>,
    pub(crate) fault: Arc<StepFault>,
}

impl Backend for Faulty {
    fn forward(&mut self, batch: &ForwardBatch) -> Result<ForwardOutput, EngineError> {
        if self.fault.trips(batch) {
            return Err(EngineError::StepFailed(
                "injected engine fault (test)".into(),
            ));
        }
        self.inner.forward(batch)
    }
    fn kv_layout(&self) -> KvBlockLayout {
        self.inner.kv_layout()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError> {
        self.inner.read_block(id, out)
    }
    fn write_block(&mut self, id: u32, data: &[u8]) -> Result<(), EngineError> {
        self.inner.write_block(id, data)
    }
    fn kv_arena(&self) -> Option<Arc<KvArena>> {
        self.inner.kv_arena()
    }
    fn set_kv_backing(&mut self, backing: &KvBacking) -> Result<(), EngineError> {
        self.inner.set_kv_backing(backing)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
}
