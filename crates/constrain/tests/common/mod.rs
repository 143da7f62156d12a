//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use fathom_constrain::{Grammar, Matcher};
use serde_json::Value;

pub fn obj() -> Arc<Grammar> {
    Arc::new(Grammar::json_object())
}

pub fn schema(v: Value) -> Arc<Grammar> {
    Arc::new(Grammar::from_schema(&v).expect("schema compiles"))
}

/// Feeds `doc` in one call; `Some(is_complete)` if accepted.
pub fn run(g: &Arc<Grammar>, doc: &[u8]) -> Option<bool> {
    let mut m = Matcher::new(g);
    m.feed(doc).then(|| m.is_complete())
}

/// The whole of `doc` is accepted and complete.
pub fn valid(g: &Arc<Grammar>, doc: &str) -> bool {
    run(g, doc.as_bytes()) == Some(true)
}

/// Small deterministic PRNG (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
