//! Prefix reuse: sequence states saved at prompt checkpoints, keyed by the
//! tokens before them, LRU within a byte budget; optionally kept on disk so
//! they survive restarts.
//!
//! A recurrent state cannot be cut back to an earlier token, so states are
//! saved where reuse may start: after every `block` prompt tokens and after
//! a chat's stable part (the conversation before the generation prompt). A
//! restored state is a copy bit-identical to having read its tokens, so
//! output never depends on the cache.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use fathom_model::{CausalLm, SeqState};
use sha2::{Digest, Sha256};

pub use crate::disk::Disk;

/// Hash of every prefix: `h[i]` covers `tokens[..i]`.
pub fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = Vec::with_capacity(tokens.len() + 1);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    h.push(x);
    for &t in tokens {
        x = (x ^ u64::from(t))
            .wrapping_mul(0x0100_0000_01B3)
            .rotate_left(29);
        x ^= x >> 31;
        h.push(x);
    }
    h
}

struct Entry {
    tokens: Vec<u32>,
    state: Box<dyn SeqState>,
    bytes: u64,
    last: u64,
}

/// Counters for `/metrics`.
#[derive(Debug, Default, Clone, Copy)]
pub struct PrefixStats {
    pub lookups: u64,
    pub hits: u64,
    pub hit_tokens: u64,
    pub stored: u64,
    pub evicted: u64,
    pub bytes: u64,
    pub entries: u64,
    pub disk_loaded: u64,
    pub disk_rejected: u64,
    /// Files removed to stay within the directory's cap.
    pub disk_evicted: u64,
    /// Bytes of saved states in the directory.
    pub disk_bytes: u64,
}

pub struct PrefixCache {
    block: usize,
    budget: u64,
    entries: HashMap<u64, Entry>,
    /// Stored lengths (memory and disk) and how many entries have each.
    lens: BTreeMap<usize, usize>,
    tick: u64,
    disk: Option<Disk>,
    pub stats: PrefixStats,
}

impl PrefixCache {
    /// `block` = 0 turns block checkpoints off; `budget` = 0 the whole cache.
    pub fn new(block: usize, budget: u64, disk: Option<Disk>) -> Self {
        let mut c = PrefixCache {
            block,
            budget,
            entries: HashMap::new(),
            lens: BTreeMap::new(),
            tick: 0,
            disk,
            stats: PrefixStats::default(),
        };
        let lens: Vec<usize> = c.disk.iter().flat_map(|d| d.lens()).collect();
        for l in lens {
            *c.lens.entry(l).or_default() += 1;
        }
        c.disk_stats();
        c
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// Where a prompt of `len` tokens should report its state.
    pub fn checkpoints(&self, len: usize, stable_len: usize) -> Vec<usize> {
        if !self.enabled() {
            return Vec::new();
        }
        let mut c: Vec<usize> = if self.block > 0 {
            (1..)
                .map(|k| k * self.block)
                .take_while(|&p| p < len)
                .collect()
        } else {
            Vec::new()
        };
        if stable_len > 0 && stable_len < len && !c.contains(&stable_len) {
            c.push(stable_len);
        }
        c
    }

    /// The longest saved prefix of `prompt` (shorter than it): a fresh copy
    /// of its state and its length.
    pub fn lookup(
        &mut self,
        lm: &dyn CausalLm,
        prompt: &[u32],
    ) -> Option<(Box<dyn SeqState>, usize)> {
        if !self.enabled() {
            return None;
        }
        self.stats.lookups += 1;
        let hashes = prefix_hashes(prompt);
        let lens: Vec<usize> = self
            .lens
            .range(1..prompt.len())
            .rev()
            .map(|(&l, _)| l)
            .collect();
        for len in lens {
            let h = hashes[len];
            if !self.entries.contains_key(&h) {
                self.load_from_disk(lm, h, &prompt[..len]);
            }
            if let Some(e) = self.entries.get_mut(&h)
                && e.tokens == prompt[..len]
            {
                self.tick += 1;
                e.last = self.tick;
                let state = e.state.fork();
                if let Some(d) = &mut self.disk {
                    d.mark_used(h);
                }
                self.stats.hits += 1;
                self.stats.hit_tokens += len as u64;
                return Some((state, len));
            }
        }
        None
    }

    /// Saves the state after `tokens`.
    pub fn insert(&mut self, tokens: Vec<u32>, state: Box<dyn SeqState>) {
        let h = *prefix_hashes(&tokens).last().expect("one hash per prefix");
        if self.entries.get(&h).is_some_and(|e| e.tokens == tokens) {
            return;
        }
        // A state larger than the whole share is neither kept nor saved.
        if state.bytes() as u64 + 4 * tokens.len() as u64 > self.budget {
            return;
        }
        // A prefix on disk only is counted in `lens` already; `put` counts it again.
        let on_disk = self.disk.as_ref().is_some_and(|d| d.contains(h));
        if on_disk {
            self.forget_len(tokens.len());
        }
        if let Some(d) = &mut self.disk {
            for (gone, len) in d.save(h, &tokens, state.as_ref()) {
                if !self.entries.contains_key(&gone) {
                    self.forget_len(len);
                }
            }
        }
        self.disk_stats();
        self.put(h, tokens, state);
    }

    fn disk_stats(&mut self) {
        if let Some(d) = &self.disk {
            self.stats.disk_evicted = d.evicted;
            self.stats.disk_bytes = d.bytes();
        }
    }

    fn put(&mut self, h: u64, tokens: Vec<u32>, state: Box<dyn SeqState>) {
        let bytes = state.bytes() as u64 + 4 * tokens.len() as u64;
        if bytes > self.budget {
            return;
        }
        while self.stats.bytes + bytes > self.budget {
            let Some((&old, _)) = self.entries.iter().min_by_key(|(_, e)| e.last) else {
                break;
            };
            self.remove(old);
            self.stats.evicted += 1;
        }
        self.tick += 1;
        let len = tokens.len();
        if let Some(prev) = self.entries.insert(
            h,
            Entry {
                tokens,
                state,
                bytes,
                last: self.tick,
            },
        ) {
            self.stats.bytes -= prev.bytes;
            self.forget_len(prev.tokens.len());
        }
        *self.lens.entry(len).or_default() += 1;
        self.stats.bytes += bytes;
        self.stats.stored += 1;
        self.stats.entries = self.entries.len() as u64;
    }

    fn remove(&mut self, h: u64) {
        if let Some(e) = self.entries.remove(&h) {
            self.stats.bytes -= e.bytes;
            let on_disk = self.disk.as_ref().is_some_and(|d| d.contains(h));
            if !on_disk {
                self.forget_len(e.tokens.len());
            }
        }
        self.stats.entries = self.entries.len() as u64;
    }

    fn forget_len(&mut self, len: usize) {
        if let Some(n) = self.lens.get_mut(&len) {
            *n -= 1;
            if *n == 0 {
                self.lens.remove(&len);
            }
        }
    }

    fn load_from_disk(&mut self, lm: &dyn CausalLm, h: u64, tokens: &[u32]) {
        let Some(d) = &mut self.disk else { return };
        let Some(loaded) = d.load(lm, h, tokens) else {
            return;
        };
        match loaded {
            Ok(state) => {
                self.stats.disk_loaded += 1;
                // Counted in `lens` already through the disk index.
                self.forget_len(tokens.len());
                self.put(h, tokens.to_vec(), state);
            }
            Err((path, why)) => {
                tracing::warn!(file = %path.display(), "removed a damaged saved prefix state: {why}");
                self.stats.disk_rejected += 1;
                self.forget_len(tokens.len());
            }
        }
        self.disk_stats();
    }
}

/// A model's identity for saved states: its config and its shard names and sizes.
pub fn fingerprint(dir: &Path) -> std::io::Result<[u8; 32]> {
    let mut h = Sha256::new();
    h.update(std::fs::read(dir.join("config.json"))?);
    let mut shards: Vec<(String, u64)> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .filter_map(|e| {
            Some((
                e.file_name().to_string_lossy().into_owned(),
                std::fs::metadata(e.path()).ok()?.len(),
            ))
        })
        .collect();
    shards.sort();
    for (name, len) in shards {
        h.update(name.as_bytes());
        h.update(len.to_le_bytes());
    }
    Ok(h.finalize().into())
}
