//! `sluice-router`: KV-aware placement from streamed block events.
//!
//! - [`indexer`]: the concurrent block index fed by workers' KV events.
//! - [`selector`]: the placement cost (Dynamo's form) and the choice.
//! - [`pool`]: one pool of workers (decode or prefill): members, loads,
//!   index, and the placement decision.
//! - `load`: a target's reported load plus the router's uncovered placements.
//! - `approx`: the TTL-bounded cache prediction of `approx` mode.

mod approx;
pub mod error;
pub mod indexer;
mod load;
pub mod pool;
pub mod selector;

pub use error::RouterError;
pub use indexer::{
    Applied, IndexError, IndexStats, KvEvent, KvEventKind, KvIndexer, OverlapScores, Target,
    TargetId,
};
pub use load::{EffectiveLoad, LoadReport};
pub use pool::{
    Candidate, Decision, MemberInfo, MemberLoad, PoolConfig, PoolKind, RouteInput, WorkerPool,
};
pub use selector::{CostInput, CostParams, CostTerms, RouterMode};
