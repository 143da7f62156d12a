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
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use fathom_model::{CausalLm, SeqState};
use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"FATHOMPC";
const VERSION: u32 = 1;
const EXT: &str = "fps";

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
        let lens: Vec<usize> = c
            .disk
            .iter()
            .flat_map(|d| d.index.values().map(|e| e.0))
            .collect();
        for l in lens {
            *c.lens.entry(l).or_default() += 1;
        }
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
                self.stats.hits += 1;
                self.stats.hit_tokens += len as u64;
                return Some((e.state.fork(), len));
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
        if let Some(d) = &mut self.disk {
            d.save(h, &tokens, state.as_ref());
        }
        self.put(h, tokens, state);
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
            let on_disk = self.disk.as_ref().is_some_and(|d| d.index.contains_key(&h));
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
        let Some((_, path)) = d.index.get(&h).cloned() else {
            return;
        };
        match d.load(lm, &path, tokens) {
            Ok(state) => {
                self.stats.disk_loaded += 1;
                // Counted in `lens` already through the disk index.
                self.forget_len(tokens.len());
                self.put(h, tokens.to_vec(), state);
            }
            Err(why) => {
                tracing::warn!(file = %path.display(), "ignoring saved prefix state: {why}");
                self.stats.disk_rejected += 1;
                d.index.remove(&h);
                self.forget_len(tokens.len());
            }
        }
    }
}

/// Saved states in a directory: one file per prefix, written atomically,
/// each checked (checksum, model fingerprint, tokens, the model's own
/// decoder) before it is used.
pub struct Disk {
    dir: PathBuf,
    fingerprint: [u8; 32],
    /// Prefix hash → (length, file).
    index: HashMap<u64, (usize, PathBuf)>,
    seq: u64,
}

impl Disk {
    /// Opens (creating) `dir` and indexes the files saved for this model.
    pub fn open(dir: &Path, fingerprint: [u8; 32]) -> std::io::Result<Disk> {
        std::fs::create_dir_all(dir)?;
        let mut index = HashMap::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.extension().and_then(|e| e.to_str()) != Some(EXT) {
                continue;
            }
            match read_header(&path, &fingerprint) {
                Ok(tokens) => {
                    let h = *prefix_hashes(&tokens).last().expect("hash");
                    index.insert(h, (tokens.len(), path));
                }
                Err(why) => {
                    tracing::warn!(file = %path.display(), "ignoring saved prefix state: {why}")
                }
            }
        }
        Ok(Disk {
            dir: dir.to_path_buf(),
            fingerprint,
            index,
            seq: 0,
        })
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    fn save(&mut self, h: u64, tokens: &[u32], state: &dyn SeqState) {
        let path = self.dir.join(format!("{h:016x}-{}.{EXT}", tokens.len()));
        self.seq += 1;
        let tmp = self
            .dir
            .join(format!(".tmp-{}-{}", std::process::id(), self.seq));
        let mut body = Vec::new();
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&VERSION.to_le_bytes());
        body.extend_from_slice(&self.fingerprint);
        body.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
        for t in tokens {
            body.extend_from_slice(&t.to_le_bytes());
        }
        let payload = match state.encode() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), "cannot save a prefix state: {e}");
                return;
            }
        };
        body.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        body.extend_from_slice(&payload);
        let sum = Sha256::digest(&body);
        body.extend_from_slice(&sum);
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        match write() {
            Ok(()) => {
                self.index.insert(h, (tokens.len(), path));
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                tracing::warn!(dir = %self.dir.display(), "cannot save a prefix state: {e}");
            }
        }
    }

    fn load(
        &self,
        lm: &dyn CausalLm,
        path: &Path,
        tokens: &[u32],
    ) -> Result<Box<dyn SeqState>, String> {
        let mut body = Vec::new();
        std::fs::File::open(path)
            .and_then(|mut f| f.read_to_end(&mut body))
            .map_err(|e| e.to_string())?;
        if body.len() < 32 {
            return Err("truncated".into());
        }
        let (data, sum) = body.split_at(body.len() - 32);
        if Sha256::digest(data).as_slice() != sum {
            return Err("checksum mismatch (damaged file)".into());
        }
        let saved = parse_header(data, &self.fingerprint)?;
        if saved.0 != tokens {
            return Err("its tokens differ from the prefix asked for".into());
        }
        let rest = &data[saved.1..];
        if rest.len() < 8 {
            return Err("truncated".into());
        }
        let n = u64::from_le_bytes(rest[..8].try_into().expect("8")) as usize;
        if rest.len() - 8 != n {
            return Err(format!(
                "payload of {} bytes, header says {n}",
                rest.len() - 8
            ));
        }
        let state = lm.decode_state(&rest[8..]).map_err(|e| e.to_string())?;
        if state.pos() != tokens.len() {
            return Err(format!(
                "state at position {}, expected {}",
                state.pos(),
                tokens.len()
            ));
        }
        Ok(state)
    }
}

/// Reads only a file's header (magic, version, fingerprint, tokens).
fn read_header(path: &Path, fp: &[u8; 32]) -> Result<Vec<u32>, String> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut head = [0u8; 52];
    f.read_exact(&mut head)
        .map_err(|_| "truncated header".to_string())?;
    let n = u64::from_le_bytes(head[44..52].try_into().expect("8"));
    if n.saturating_mul(4) > meta.len() {
        return Err(format!("claims {n} tokens, more than the file holds"));
    }
    let mut all = head.to_vec();
    let mut toks = vec![0u8; n as usize * 4];
    f.read_exact(&mut toks)
        .map_err(|_| "truncated tokens".to_string())?;
    all.extend_from_slice(&toks);
    parse_header(&all, fp).map(|(t, _)| t)
}

/// Header fields; returns the tokens and the header's length.
fn parse_header(b: &[u8], fp: &[u8; 32]) -> Result<(Vec<u32>, usize), String> {
    if b.len() < 52 || &b[..8] != MAGIC {
        return Err("not a fathom prefix state".into());
    }
    let v = u32::from_le_bytes(b[8..12].try_into().expect("4"));
    if v != VERSION {
        return Err(format!("format version {v}, this build reads {VERSION}"));
    }
    if &b[12..44] != fp {
        return Err("saved for another model".into());
    }
    let n = u64::from_le_bytes(b[44..52].try_into().expect("8"));
    let end = n
        .checked_mul(4)
        .and_then(|x| x.checked_add(52))
        .filter(|&e| e <= b.len() as u64);
    let Some(end) = end else {
        return Err(format!("claims {n} tokens, more than the file holds"));
    };
    let tokens = b[52..end as usize]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
        .collect();
    Ok((tokens, end as usize))
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
