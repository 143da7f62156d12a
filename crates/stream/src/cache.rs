//! The expert cache: whole experts, least-recently-used eviction.
//!
//! All experts of a model have the same size, so capacity is a count of
//! experts. LRU was chosen by measurement: `examples/cache_policy.rs` records
//! the routed experts of 192 greedy decode steps of the trained
//! k3-code-small (its three golden prompts, 64 tokens each; 704 experts, 88
//! requested per token) and replays them. Hit rates at 25 % / 50 % of all
//! experts: LRU 0.371 / 0.675, per-layer LRU 0.307 / 0.622, a cyclic
//! layer-distance policy 0.352 / 0.672, FIFO 0.301 / 0.631, LFU 0.238 / 0.563
//! (Belady's offline optimum 0.683 / 0.858). Below one token's working set
//! (5–10 %) every online policy is near zero (LRU thrashes on the layer
//! cycle; the cyclic policy reaches 0.03–0.10): a real budget should hold at
//! least a token's experts, where LRU is best.

use std::collections::HashMap;
use std::sync::Arc;

use fathom_model::experts::ExpertWeights;

/// (layer, expert)
pub type Key = (u32, u32);

pub struct LruCache {
    capacity: usize,
    tick: u64,
    map: HashMap<Key, (Arc<ExpertWeights>, u64)>,
}

impl LruCache {
    pub fn new(capacity: usize) -> Self {
        LruCache {
            capacity,
            tick: 0,
            map: HashMap::with_capacity(capacity),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Looks up and marks as used.
    pub fn get(&mut self, k: Key) -> Option<Arc<ExpertWeights>> {
        self.tick += 1;
        let t = self.tick;
        self.map.get_mut(&k).map(|(e, used)| {
            *used = t;
            e.clone()
        })
    }

    pub fn contains(&self, k: Key) -> bool {
        self.map.contains_key(&k)
    }

    /// Inserts, evicting the least recently used entry if full. A zero-capacity
    /// cache keeps nothing.
    pub fn insert(&mut self, k: Key, e: Arc<ExpertWeights>) {
        if self.capacity == 0 {
            return;
        }
        self.tick += 1;
        if !self.map.contains_key(&k) && self.map.len() >= self.capacity {
            if let Some(victim) = self
                .map
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k)
            {
                self.map.remove(&victim);
            }
        }
        self.map.insert(k, (e, self.tick));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_weights::AlignedBuf;

    fn e() -> Arc<ExpertWeights> {
        Arc::new(ExpertWeights {
            buf: AlignedBuf::zeroed(1),
            parts: [(0, 0, [0, 0]); 3],
        })
    }

    #[test]
    fn evicts_least_recently_used() {
        let mut c = LruCache::new(2);
        c.insert((0, 1), e());
        c.insert((0, 2), e());
        assert!(c.get((0, 1)).is_some()); // 2 is now the oldest
        c.insert((0, 3), e());
        assert!(c.contains((0, 1)) && c.contains((0, 3)) && !c.contains((0, 2)));
        let mut z = LruCache::new(0);
        z.insert((0, 1), e());
        assert!(z.is_empty());
    }
}
