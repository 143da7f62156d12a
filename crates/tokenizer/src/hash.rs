//! A fast hasher for the byte-string → rank table.
//!
//! The merge loop does one table lookup per candidate pair, so hashing dominates; the
//! standard SipHash is several times slower on short keys. The table is fixed at load
//! time (it never grows from input), so there is no hash-flooding attack to defend
//! against: an adversarial lookup can at worst probe a collision chain of stored keys.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Rank table keyed by token bytes.
pub type RankMap = HashMap<Vec<u8>, u32, BuildHasherDefault<FxLikeHasher>>;

/// Word-at-a-time multiply-rotate hasher.
#[derive(Default, Clone, Copy)]
pub struct FxLikeHasher {
    state: u64,
}

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxLikeHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.state = (self.state.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxLikeHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.state
    }
}
