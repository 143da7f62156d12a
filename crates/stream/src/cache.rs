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

const NIL: usize = usize::MAX;

struct Node {
    key: Key,
    value: Arc<ExpertWeights>,
    prev: usize,
    next: usize,
    /// Outside the recency list: never evicted (the heat-pinned tier).
    pinned: bool,
}

/// LRU over a slab of nodes in a doubly linked recency list (head: most
/// recent): lookup, touch, insert and eviction are all O(1). Pinned entries
/// (see [`LruCache::insert_pinned`]) count against the capacity but are
/// kept out of the list, so they are never evicted.
pub struct LruCache {
    capacity: usize,
    map: HashMap<Key, usize>,
    nodes: Vec<Node>,
    head: usize,
    tail: usize,
    pinned: usize,
}

impl LruCache {
    pub fn new(capacity: usize) -> Self {
        LruCache {
            capacity,
            map: HashMap::with_capacity(capacity.min(1 << 20)),
            nodes: Vec::with_capacity(capacity.min(1 << 20)),
            head: NIL,
            tail: NIL,
            pinned: 0,
        }
    }

    /// Entries that are pinned.
    pub fn pinned(&self) -> usize {
        self.pinned
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

    fn unlink(&mut self, i: usize) {
        let (p, n) = (self.nodes[i].prev, self.nodes[i].next);
        if p == NIL {
            self.head = n;
        } else {
            self.nodes[p].next = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.nodes[n].prev = p;
        }
    }

    fn push_front(&mut self, i: usize) {
        self.nodes[i].prev = NIL;
        self.nodes[i].next = self.head;
        if self.head != NIL {
            self.nodes[self.head].prev = i;
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    /// Looks up and marks as used.
    pub fn get(&mut self, k: Key) -> Option<Arc<ExpertWeights>> {
        let i = *self.map.get(&k)?;
        if !self.nodes[i].pinned {
            self.unlink(i);
            self.push_front(i);
        }
        Some(self.nodes[i].value.clone())
    }

    /// Looks up without marking as used.
    pub fn peek(&self, k: Key) -> Option<Arc<ExpertWeights>> {
        self.map.get(&k).map(|&i| self.nodes[i].value.clone())
    }

    pub fn contains(&self, k: Key) -> bool {
        self.map.contains_key(&k)
    }

    /// Inserts (or refreshes) as most recent, evicting the least recently
    /// used entry if full. A zero-capacity cache keeps nothing, nor does a
    /// cache whose every entry is pinned.
    pub fn insert(&mut self, k: Key, e: Arc<ExpertWeights>) {
        self.put(k, e, false);
    }

    /// Inserts `k` pinned (an existing entry becomes pinned). Refused (false)
    /// when pinning it would leave fewer than `keep_free` unpinned places.
    pub fn insert_pinned(&mut self, k: Key, e: Arc<ExpertWeights>, keep_free: usize) -> bool {
        let already = self.map.get(&k).is_some_and(|&i| self.nodes[i].pinned);
        if !already && self.pinned + 1 + keep_free > self.capacity {
            return false;
        }
        self.put(k, e, true)
    }

    fn put(&mut self, k: Key, e: Arc<ExpertWeights>, pin: bool) -> bool {
        if let Some(&i) = self.map.get(&k) {
            self.nodes[i].value = e;
            if !self.nodes[i].pinned {
                self.unlink(i);
                if pin {
                    self.nodes[i].pinned = true;
                    self.pinned += 1;
                } else {
                    self.push_front(i);
                }
            }
            return true;
        }
        if self.capacity == 0 {
            return false;
        }
        let i = if self.map.len() >= self.capacity {
            if self.tail == NIL {
                return false; // everything is pinned
            }
            // Reuse the least recently used node.
            let i = self.tail;
            self.unlink(i);
            self.map.remove(&self.nodes[i].key);
            self.nodes[i].key = k;
            self.nodes[i].value = e;
            i
        } else {
            self.nodes.push(Node {
                key: k,
                value: e,
                prev: NIL,
                next: NIL,
                pinned: false,
            });
            self.nodes.len() - 1
        };
        self.map.insert(k, i);
        if pin {
            self.nodes[i].pinned = true;
            self.pinned += 1;
        } else {
            self.push_front(i);
        }
        true
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
            format: fathom_model::experts::ExpertFormat::Mxfp4,
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
        // Refreshing an entry makes it most recent; eviction follows use order.
        c.insert((0, 1), e());
        c.insert((0, 4), e()); // evicts 3
        assert!(c.contains((0, 1)) && c.contains((0, 4)) && !c.contains((0, 3)));
        for i in 5..100 {
            c.insert((1, i), e());
            assert_eq!(c.len(), 2);
        }
        assert!(c.contains((1, 98)) && c.contains((1, 99)));
        let mut z = LruCache::new(0);
        z.insert((0, 1), e());
        assert!(z.is_empty());
    }

    #[test]
    fn pinned_entries_are_never_evicted() {
        let mut c = LruCache::new(3);
        assert!(c.insert_pinned((0, 1), e(), 1));
        assert!(c.insert_pinned((0, 2), e(), 1));
        // A third pin would leave no unpinned place.
        assert!(!c.insert_pinned((0, 3), e(), 1));
        assert_eq!(c.pinned(), 2);
        for i in 10..20 {
            c.insert((1, i), e());
            assert_eq!(c.len(), 3);
        }
        assert!(c.contains((0, 1)) && c.contains((0, 2)) && c.contains((1, 19)));
        // Touching a pinned entry keeps it pinned; an unpinned one can be pinned.
        assert!(c.get((0, 1)).is_some());
        c.insert((0, 1), e());
        assert_eq!(c.pinned(), 2);
        assert!(c.insert_pinned((1, 19), e(), 0));
        assert_eq!(c.pinned(), 3);
        c.insert((2, 0), e()); // full of pins: not kept
        assert!(!c.contains((2, 0)) && c.len() == 3);
    }
}
