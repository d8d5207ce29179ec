//! `sluice-tokens`: what the frontend, the router and the engine must agree on
//! about tokens, with no network dependency.
//!
//! - [`block_hash`]: the chained block hashes of DESIGN.md; one function, so an
//!   equal hash always means an equal prefix everywhere.

pub mod block_hash;

pub use block_hash::{BlockHashes, HASH_SEED, local_block_hash, sequence_block_hashes};
