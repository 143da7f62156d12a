//! Device copies of host byte segments, least recently used first out,
//! within a byte budget.

use std::collections::HashMap;
use std::ops::Range;

/// A host segment: (address, length in bytes).
pub type Key = (usize, usize);

pub struct Cache<B> {
    map: HashMap<Key, (B, u64)>,
    tick: u64,
    bytes: u64,
    budget: u64,
}

impl<B> Cache<B> {
    pub fn new(budget: u64) -> Self {
        Cache {
            map: HashMap::new(),
            tick: 0,
            bytes: 0,
            budget,
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn contains(&self, k: &Key) -> bool {
        self.map.contains_key(k)
    }

    /// Marks `k` used now; its buffer.
    pub fn touch(&mut self, k: &Key) -> Option<&B> {
        self.tick += 1;
        let tick = self.tick;
        self.map.get_mut(k).map(|(b, t)| {
            *t = tick;
            &*b
        })
    }

    pub fn get(&self, k: &Key) -> Option<&B> {
        self.map.get(k).map(|(b, _)| b)
    }

    /// Evicts least recently used entries, never one of `keep`, until
    /// `need` more bytes fit; false when they cannot.
    pub fn make_room(&mut self, need: u64, keep: &[Key]) -> bool {
        if need > self.budget {
            return false;
        }
        while self.bytes + need > self.budget {
            let victim = self
                .map
                .iter()
                .filter(|(k, _)| !keep.contains(k))
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| *k);
            match victim {
                Some(k) => {
                    self.map.remove(&k);
                    self.bytes -= k.1 as u64;
                }
                None => return false,
            }
        }
        true
    }

    pub fn insert(&mut self, k: Key, b: B) {
        self.tick += 1;
        if self.map.insert(k, (b, self.tick)).is_none() {
            self.bytes += k.1 as u64;
        }
    }

    /// Drops every entry whose host bytes lie inside `range`.
    pub fn forget(&mut self, range: Range<usize>) {
        let gone: Vec<Key> = self
            .map
            .keys()
            .filter(|(a, n)| *a >= range.start && a + n <= range.end)
            .copied()
            .collect();
        for k in gone {
            self.map.remove(&k);
            self.bytes -= k.1 as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recent_and_forgets_ranges() {
        let mut c = Cache::new(100);
        c.insert((0, 40), 'a');
        c.insert((100, 40), 'b');
        c.touch(&(0, 40));
        assert!(c.make_room(40, &[]));
        assert!(c.contains(&(0, 40)) && !c.contains(&(100, 40)));
        assert!(!c.make_room(200, &[]), "larger than the budget");
        assert!(c.contains(&(0, 40)), "a refused request evicts nothing");
        c.insert((200, 10), 'c');
        c.insert((210, 10), 'd');
        c.forget(195..215);
        assert!(!c.contains(&(200, 10)) && c.contains(&(210, 10)));
        assert_eq!(c.bytes(), 50);
        assert!(
            !c.make_room(95, &[(0, 40)]),
            "a kept entry is never evicted"
        );
        assert!(c.make_room(60, &[(0, 40)]));
        assert!(c.contains(&(0, 40)) && !c.contains(&(210, 10)));
    }
}
