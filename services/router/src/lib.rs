//! `sluice-router`: KV-aware placement from streamed block events.
//!
//! - [`indexer`]: the concurrent block index fed by workers' KV events.

pub mod indexer;

pub use indexer::{
    IndexError, IndexStats, KvEvent, KvEventKind, KvIndexer, OverlapScores, Target, TargetId,
};
