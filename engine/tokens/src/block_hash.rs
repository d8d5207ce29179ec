//! Chained block hashes, the values Dynamo's KV router uses.
//!
//! A prompt is cut into full blocks of `block_size` tokens; the partial tail
//! is not hashed. Block i's *local* hash is XXH3-64 (seed 1337) over its token
//! ids as little-endian `u32`; its *sequence* hash chains the previous one:
//! `seq[0] = local[0]`, `seq[i] = xxh3_64_with_seed(le(seq[i-1]) ++ le(local[i]), 1337)`.
//! Two prompts share sequence hash i exactly when they share their first
//! `(i + 1) * block_size` tokens (up to hash collisions).

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed of every block hash in Sluice (and Dynamo).
pub const HASH_SEED: u64 = 1337;

/// The local hash of one block: XXH3-64 over its token ids as LE `u32`.
pub fn local_block_hash(tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, HASH_SEED)
}

/// Chains a block's local hash onto its parent's sequence hash.
pub fn chain_hash(parent: Option<u64>, local: u64) -> u64 {
    match parent {
        None => local,
        Some(p) => {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&p.to_le_bytes());
            buf[8..].copy_from_slice(&local.to_le_bytes());
            xxh3_64_with_seed(&buf, HASH_SEED)
        }
    }
}

/// Sequence hashes of every full block of `tokens`.
///
/// # Panics
/// Never; a `block_size` of 0 yields no blocks.
pub fn sequence_block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut hasher = BlockHashes::new(block_size);
    hasher.extend(tokens);
    hasher.into_hashes()
}

/// Incremental sequence hashing: feed tokens as they arrive (a decoding
/// sequence), read the hashes of the full blocks so far.
#[derive(Debug, Clone)]
pub struct BlockHashes {
    block_size: usize,
    pending: Vec<u32>,
    hashes: Vec<u64>,
}

impl BlockHashes {
    /// An empty chain for blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            pending: Vec::with_capacity(block_size),
            hashes: Vec::new(),
        }
    }

    /// Appends tokens; every block they complete is hashed.
    pub fn extend(&mut self, tokens: &[u32]) {
        if self.block_size == 0 {
            return;
        }
        for &t in tokens {
            self.pending.push(t);
            if self.pending.len() == self.block_size {
                let local = local_block_hash(&self.pending);
                let seq = chain_hash(self.hashes.last().copied(), local);
                self.hashes.push(seq);
                self.pending.clear();
            }
        }
    }

    /// Sequence hashes of the full blocks seen so far.
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }

    /// Consumes the chain, returning its hashes.
    pub fn into_hashes(self) -> Vec<u64> {
        self.hashes
    }

    /// Block size in tokens.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Test vectors computed independently with Python's `xxhash` package:
    /// `xxh3_64_intdigest(struct.pack("<4I", 1, 2, 3, 4), seed=1337)` etc.
    #[test]
    fn local_hash_matches_reference_vectors() {
        assert_eq!(local_block_hash(&[1, 2, 3, 4]), REF_LOCAL_1234);
        assert_eq!(local_block_hash(&[5, 6, 7, 8]), REF_LOCAL_5678);
    }

    #[test]
    fn sequence_hash_chains_reference_vectors() {
        let h = sequence_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4);
        assert_eq!(h, vec![REF_LOCAL_1234, REF_SEQ_1]);
    }

    const REF_LOCAL_1234: u64 = 0xcb38_e4d7_fb2d_ca5c;
    const REF_LOCAL_5678: u64 = 0xe8d3_ec39_b907_b74c;
    const REF_SEQ_1: u64 = 0x44a2_b237_9d6d_3c3d;

    #[test]
    fn partial_tail_is_not_hashed() {
        assert_eq!(sequence_block_hashes(&[1, 2, 3], 4), Vec::<u64>::new());
        assert_eq!(sequence_block_hashes(&[1, 2, 3, 4, 5], 4).len(), 1);
    }

    proptest! {
        #[test]
        fn equal_hash_iff_equal_prefix(a in proptest::collection::vec(0u32..50, 0..64),
                                       b in proptest::collection::vec(0u32..50, 0..64)) {
            let ha = sequence_block_hashes(&a, 4);
            let hb = sequence_block_hashes(&b, 4);
            for i in 0..ha.len().min(hb.len()) {
                let same_prefix = a[..(i + 1) * 4] == b[..(i + 1) * 4];
                prop_assert_eq!(ha[i] == hb[i], same_prefix);
            }
        }

        #[test]
        fn incremental_equals_batch(t in proptest::collection::vec(any::<u32>(), 0..100),
                                    split in 0usize..100) {
            let split = split.min(t.len());
            let mut inc = BlockHashes::new(8);
            inc.extend(&t[..split]);
            inc.extend(&t[split..]);
            let batch = sequence_block_hashes(&t, 8);
            prop_assert_eq!(inc.hashes(), batch.as_slice());
        }
    }
}
