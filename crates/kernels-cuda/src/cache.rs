//! Device copies of host byte segments within a byte budget. Routed
//! experts are the cache proper, least recently used first out; the spine
//! (every other matrix) stays once uploaded: an expert only ever displaces
//! experts, and a spine matrix displaces experts before other spine.
//!
//! A spine larger than the budget is the VRAM tier of the placement: every
//! pass uses every spine matrix in the same order, and for such a cyclic
//! scan the least recently used entry is the one needed soonest, so LRU
//! would copy the whole spine up every pass. Spine therefore leaves most
//! recently used first: each pass then copies up only the bytes beyond
//! the budget (for a scan, the least any policy copies), the rest staying
//! in place.

use foldhash::{HashMap, HashMapExt, HashSet};
use std::ops::Range;

/// A host segment: (address, length in bytes).
pub type Key = (usize, usize);

/// What an entry holds: a routed expert's matrix or a spine matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Expert,
    Spine,
}

pub struct Cache<B> {
    map: HashMap<Key, (B, u64, Class)>,
    /// The keys by address, so `forget` finds a range's entries without a
    /// scan (a dropped sequence forgets each of its cache blocks).
    by_addr: std::collections::BTreeSet<Key>,
    tick: u64,
    bytes: u64,
    /// Bytes held outside the cache that count against the budget
    /// (sequences' states).
    outside: u64,
    budget: u64,
    /// Whether an expert has ever been evicted or refused for room.
    crowded: bool,
}

impl<B> Cache<B> {
    pub fn new(budget: u64) -> Self {
        Cache {
            map: HashMap::new(),
            by_addr: Default::default(),
            tick: 0,
            bytes: 0,
            outside: 0,
            budget,
            crowded: false,
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Sets the bytes held outside the cache within the same budget.
    pub fn set_outside(&mut self, bytes: u64) {
        self.outside = bytes;
    }

    /// Whether routed experts have had to leave, or could not come in, for
    /// room: then not every expert a model uses stays here, and knowing the
    /// next ones early pays.
    pub fn crowded(&self) -> bool {
        self.crowded
    }

    pub fn contains(&self, k: &Key) -> bool {
        self.map.contains_key(k)
    }

    /// Marks `k` used now; its buffer.
    pub fn touch(&mut self, k: &Key) -> Option<&B> {
        self.tick += 1;
        let tick = self.tick;
        self.map.get_mut(k).map(|(b, t, _)| {
            *t = tick;
            &*b
        })
    }

    pub fn get(&self, k: &Key) -> Option<&B> {
        self.map.get(k).map(|(b, _, _)| b)
    }

    /// Makes `need` more bytes fit for an entry of `class`, never evicting
    /// one of `keep`: an expert evicts only experts (least recently used
    /// first); a spine matrix evicts experts first, then spine. Returns the
    /// evicted entries (for the caller to retire); `None`, and nothing
    /// evicted, when they cannot fit.
    pub fn make_room(&mut self, need: u64, keep: &[Key], class: Class) -> Option<Vec<B>> {
        let used = self.bytes + self.outside;
        if used.saturating_add(need) <= self.budget {
            return Some(Vec::new());
        }
        let keep: HashSet<&Key> = keep.iter().collect();
        let may_go =
            |k: &Key, c: Class| !keep.contains(k) && (class == Class::Spine || c == Class::Expert);
        let evictable: u64 = self
            .map
            .iter()
            .filter(|(k, (_, _, c))| may_go(k, *c))
            .map(|(k, _)| k.1 as u64)
            .sum();
        if used.saturating_add(need) > self.budget.saturating_add(evictable) {
            self.crowded |= class == Class::Expert;
            return None;
        }
        let mut gone = Vec::new();
        while self.bytes + self.outside + need > self.budget {
            // Experts least recently used first, then spine most recently
            // used first.
            let rank = |c: Class, t: u64| match c {
                Class::Expert => (false, t),
                Class::Spine => (true, u64::MAX - t),
            };
            let victim = self
                .map
                .iter()
                .filter(|(k, (_, _, c))| may_go(k, *c))
                .min_by_key(|(_, (_, t, c))| rank(*c, *t))
                .map(|(k, _)| *k);
            let k = victim.expect("the evictable bytes cover the need");
            if let Some((b, _, c)) = self.map.remove(&k) {
                self.by_addr.remove(&k);
                self.crowded |= c == Class::Expert;
                gone.push(b);
            }
            self.bytes -= k.1 as u64;
        }
        Some(gone)
    }

    pub fn insert(&mut self, k: Key, b: B, class: Class) {
        self.tick += 1;
        if self.map.insert(k, (b, self.tick, class)).is_none() {
            self.by_addr.insert(k);
            self.bytes += k.1 as u64;
        }
    }

    /// Drops every entry whose host bytes lie inside `range`.
    pub fn forget(&mut self, range: Range<usize>) -> Vec<B> {
        let gone: Vec<Key> = self
            .by_addr
            .range((range.start, 0)..(range.end, 0))
            .filter(|(a, n)| a + n <= range.end)
            .copied()
            .collect();
        let mut out = Vec::with_capacity(gone.len());
        for k in gone {
            self.by_addr.remove(&k);
            if let Some((b, _, _)) = self.map.remove(&k) {
                self.bytes -= k.1 as u64;
                out.push(b);
            }
        }
        out
    }

    pub fn get_mut(&mut self, k: &Key) -> Option<&mut B> {
        self.map.get_mut(k).map(|(b, _, _)| b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recent_and_forgets_ranges() {
        let e = Class::Expert;
        let mut c = Cache::new(100);
        c.insert((0, 40), 'a', e);
        c.insert((100, 40), 'b', e);
        c.touch(&(0, 40));
        assert!(!c.crowded());
        assert!(c.make_room(40, &[], e).is_some());
        assert!(c.crowded(), "an expert left for room");
        assert!(c.contains(&(0, 40)) && !c.contains(&(100, 40)));
        assert!(c.make_room(200, &[], e).is_none(), "larger than the budget");
        assert!(c.contains(&(0, 40)), "a refused request evicts nothing");
        c.insert((200, 10), 'c', e);
        c.insert((210, 10), 'd', e);
        c.forget(195..215);
        assert!(!c.contains(&(200, 10)) && c.contains(&(210, 10)));
        assert_eq!(c.bytes(), 50);
        assert!(
            c.make_room(95, &[(0, 40)], e).is_none(),
            "a kept entry is never evicted"
        );
        assert!(c.contains(&(210, 10)), "a refused request evicts nothing");
        assert!(c.make_room(60, &[(0, 40)], e).is_some());
        assert!(c.contains(&(0, 40)) && !c.contains(&(210, 10)));
    }

    #[test]
    fn bytes_held_outside_count_against_the_budget() {
        let s = Class::Spine;
        let mut c = Cache::new(100);
        c.insert((0, 50), 'w', s);
        c.set_outside(45);
        assert!(c.make_room(5, &[], s).is_some() && c.contains(&(0, 50)));
        assert!(
            c.make_room(10, &[(0, 50)], s).is_none(),
            "only a kept entry to evict"
        );
        assert!(c.make_room(10, &[], s).is_some() && !c.contains(&(0, 50)));
        c.set_outside(95);
        assert!(
            c.make_room(10, &[], s).is_none(),
            "the outside bytes cannot be evicted"
        );
    }

    #[test]
    fn experts_never_displace_the_spine() {
        let (e, s) = (Class::Expert, Class::Spine);
        let mut c = Cache::new(100);
        c.insert((0, 50), 'w', s);
        c.insert((100, 30), 'x', e);
        assert!(
            c.make_room(20, &[], e).is_some() && !c.crowded(),
            "free room"
        );
        assert!(c.make_room(80, &[], e).is_none() && c.crowded(), "refused");
        // An expert may evict the older expert, never the spine matrix,
        // however long ago the spine matrix was used.
        for i in 0..5 {
            c.touch(&(100, 30));
            assert!(c.make_room(40, &[], e).is_some(), "round {i}");
            c.insert((200 + i * 100, 40), 'y', e);
            assert!(c.contains(&(0, 50)));
        }
        assert!(
            c.make_room(60, &[], e).is_none(),
            "only 50 bytes are experts'"
        );
        assert!(c.contains(&(0, 50)) && c.bytes() == 90);
        // A spine matrix evicts experts first, then spine.
        assert!(c.make_room(50, &[], s).is_some());
        assert!(c.contains(&(0, 50)), "experts went first");
        c.insert((1000, 50), 'z', s);
        assert!(c.make_room(50, &[(1000, 50)], s).is_some());
        assert!(!c.contains(&(0, 50)) && c.contains(&(1000, 50)));
    }

    /// Passes over a spine of ten matrices with room for four: LRU would
    /// copy all ten every pass; most recently used out copies six, the
    /// least any policy can (ten used, four held).
    #[test]
    fn a_spine_larger_than_the_budget_keeps_what_fits_across_passes() {
        let s = Class::Spine;
        let mut c = Cache::new(40);
        let mut copies = Vec::new();
        for _pass in 0..4 {
            let mut n = 0;
            for m in 0..10usize {
                let k = (m * 100, 10);
                if c.touch(&k).is_none() {
                    assert!(c.make_room(10, &[k], s).is_some());
                    c.insert(k, m, s);
                    n += 1;
                }
            }
            copies.push(n);
        }
        assert_eq!(copies, [10, 6, 6, 6]);
    }
}
