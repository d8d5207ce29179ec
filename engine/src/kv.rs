//! The paged KV cache's bookkeeping: which physical block holds which part of
//! which sequence, which full blocks are cached under their chained sequence
//! hash (from `sluice_tokens`), and the event stream that tells routers about
//! it. The KV *memory* lives in the backend; this module only hands out ids.
//!
//! Invariants (checked by [`KvCache::check_invariants`] and the tests):
//! free + used == capacity; a block is free exactly when its reference count
//! is 0; a hash maps to at most one block; every event is numbered gap-free.

mod block_pool;
mod events;
mod tier;

pub use block_pool::{KvCache, SeqId, TierOp};
pub use events::{
    KvEvent, KvEventLog, KvEventRecord, KvSnapshot, KvSubscription, SnapshotRequired,
};
pub use tier::{Restored, TierStore};
