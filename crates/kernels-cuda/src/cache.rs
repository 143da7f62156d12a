//! Device copies of host byte segments within a byte budget. Routed
//! experts are the cache proper, least recently used first out; the spine
//! (every other matrix, and the attention caches' blocks) stays once
//! uploaded: a weight displaces only experts. Sequence state, which a
//! step cannot run without, displaces experts and then spine.
//!
//! A spine matrix held on the device (`fathom_weights::mapped`: its host
//! bytes are the checkpoint's, mapped and dropped from RAM once copied)
//! outranks one whose bytes stay in RAM: it may push that one out (which
//! the CPU then computes from RAM), and only sequence state pushes it out.
//!
//! A spine larger than the budget is the spine's VRAM tier: what came
//! first stays and the rest is computed on the CPU, call by call. Every
//! pass uses every spine matrix in one order, so evicting spine for spine
//! would copy the bytes beyond the budget up every pass (LRU: the whole
//! spine) from pageable memory, where a decode step's CPU product reads
//! them at RAM bandwidth (`docs/cuda.md`, "Residency").

use foldhash::{HashMap, HashMapExt, HashSet};
use std::ops::Range;

/// A host segment: (address, length in bytes).
pub type Key = (usize, usize);

/// What an entry holds: a routed expert's matrix, a spine matrix, or a
/// spine matrix held on the device (no copy of it in RAM); or, asking for
/// room only, sequence state (held outside the entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Expert,
    Spine,
    Held,
    State,
}

impl Class {
    /// Whether an entry of class `victim` may leave to make room for this
    /// class: experts for anything, spine for held spine and state, held
    /// spine for state only.
    fn may_evict(self, victim: Class) -> bool {
        match victim {
            Class::Expert => true,
            Class::Spine => matches!(self, Class::Held | Class::State),
            Class::Held | Class::State => self == Class::State,
        }
    }
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
    /// one of `keep`: weights evict experts (least recently used first),
    /// held spine also spine, state also held spine (spine most recently
    /// used first: in a pass's order that keeps the most of the spine's
    /// start; RAM-backed spine before held).
    /// Returns the evicted entries (for the caller to retire); `None`, and
    /// nothing evicted, when they cannot fit (an expert that cannot come
    /// in marks the cache crowded).
    pub fn make_room(&mut self, need: u64, keep: &[Key], class: Class) -> Option<Vec<B>> {
        let used = self.bytes + self.outside;
        if used.saturating_add(need) <= self.budget {
            return Some(Vec::new());
        }
        let keep: HashSet<&Key> = keep.iter().collect();
        let may_go = |k: &Key, c: Class| !keep.contains(k) && class.may_evict(c);
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
            let rank = |c: Class, t: u64| match c {
                Class::Expert => (0, t),
                Class::Spine => (1, u64::MAX - t),
                _ => (2, u64::MAX - t),
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
        let (e, s) = (Class::Expert, Class::Spine);
        let mut c = Cache::new(100);
        c.insert((0, 50), 'w', e);
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
        // A spine matrix evicts experts, never spine.
        assert!(c.make_room(50, &[], s).is_some());
        assert!(c.contains(&(0, 50)), "experts went");
        c.insert((1000, 50), 'z', s);
        assert!(c.make_room(10, &[], s).is_none(), "only spine is left");
        assert!(c.contains(&(0, 50)) && c.contains(&(1000, 50)));
        // Sequence state may push out spine, the most recently used first.
        c.touch(&(0, 50));
        assert!(c.make_room(10, &[], Class::State).is_some());
        assert!(c.contains(&(1000, 50)) && !c.contains(&(0, 50)));
    }

    #[test]
    fn held_spine_pushes_out_ram_spine_and_only_state_pushes_it_out() {
        let (s, h) = (Class::Spine, Class::Held);
        let mut c = Cache::new(100);
        c.insert((0, 40), 'a', s);
        c.insert((100, 40), 'b', s);
        c.insert((200, 20), 'e', Class::Expert);
        assert!(
            c.make_room(20, &[], s).is_some(),
            "a spine matrix evicts the expert"
        );
        assert!(!c.contains(&(200, 20)));
        c.insert((300, 20), 'c', s);
        assert!(
            c.make_room(40, &[], s).is_none(),
            "spine never evicts spine"
        );
        // Held spine evicts RAM spine, the most recently used first.
        c.touch(&(0, 40));
        assert!(c.make_room(40, &[], h).is_some());
        assert!(!c.contains(&(0, 40)) && c.contains(&(100, 40)));
        c.insert((400, 40), 'h', h);
        assert!(
            c.make_room(80, &[(100, 40)], h).is_none(),
            "held never evicts held"
        );
        assert!(c.contains(&(400, 40)));
        // State evicts RAM spine before held spine.
        assert!(c.make_room(60, &[], Class::State).is_some());
        assert!(c.contains(&(400, 40)) && !c.contains(&(100, 40)) && !c.contains(&(300, 20)));
        assert!(c.make_room(70, &[], Class::State).is_some());
        assert!(!c.contains(&(400, 40)));
    }

    /// Passes over a spine of ten matrices with room for four: the first
    /// four stay and the other six are refused (computed on the CPU) every
    /// pass, never copied; LRU would copy all ten every pass.
    #[test]
    fn a_spine_larger_than_the_budget_keeps_what_came_first() {
        let s = Class::Spine;
        let mut c = Cache::new(40);
        let mut copies = Vec::new();
        for _pass in 0..3 {
            let mut n = 0;
            for m in 0..10usize {
                let k = (m * 100, 10);
                if c.touch(&k).is_none() && c.make_room(10, &[k], s).is_some() {
                    c.insert(k, m, s);
                    n += 1;
                }
            }
            copies.push(n);
        }
        assert_eq!(copies, [4, 0, 0]);
        assert!((0..4).all(|m| c.contains(&(m * 100, 10))));
        assert!(!c.crowded(), "no expert was turned away");
    }
}
