//! Saved prefix states in a directory (`--state-cache-dir`): one file per
//! prefix, written atomically (a temp file renamed), each checked
//! (checksum, model fingerprint, tokens, the model's own decoder) before it
//! is used, and at most `--state-cache-max` bytes of them: the least
//! recently used go first. A file's modification time is its last use, so
//! the order survives restarts.
//!
//! At start, temp files a killed server left behind are removed, and
//! files that are not this model's states are left alone and reported in
//! one line.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use fathom_model::{CausalLm, SeqState};
use sha2::{Digest, Sha256};

use crate::prefix::prefix_hashes;

const MAGIC: &[u8; 8] = b"FATHOMPC";
const VERSION: u32 = 1;
const EXT: &str = "fps";
/// Temp files start with this (then the writer's pid and a number).
const TMP: &str = ".tmp-";
/// Share of the free space the default cap takes.
const FREE_SHARE: u64 = 10;
/// The default cap when the free space cannot be read.
const FALLBACK_MAX: u64 = 1 << 30;

/// One saved state.
#[derive(Debug, Clone)]
struct Saved {
    len: usize,
    path: PathBuf,
    size: u64,
    /// Logical time of last use (larger is later).
    used: u64,
}

/// The directory of saved states.
pub struct Disk {
    dir: PathBuf,
    fingerprint: [u8; 32],
    /// Prefix hash → its file.
    index: HashMap<u64, Saved>,
    seq: u64,
    clock: u64,
    max: u64,
    bytes: u64,
    /// Files removed to stay within `max`.
    pub evicted: u64,
}

/// What opening found, for the log.
#[derive(Debug, Default)]
pub struct Opened {
    pub orphans: usize,
    /// Reason → files ignored for it; and one example.
    pub ignored: BTreeMap<String, usize>,
    pub example: Option<String>,
    pub evicted: u64,
}

impl Disk {
    /// Opens (creating) `dir`: removes temp files left by a killed writer,
    /// indexes this model's states, and trims them to `max` bytes (`None`:
    /// a tenth of what is free for them, free space plus their own size,
    /// at most [`crate::DEFAULT_STATE_CACHE_MAX`]).
    pub fn open(
        dir: &Path,
        fingerprint: [u8; 32],
        max: Option<u64>,
    ) -> std::io::Result<(Disk, Opened)> {
        std::fs::create_dir_all(dir)?;
        let mut found = Vec::new();
        let mut o = Opened::default();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(TMP) {
                if std::fs::remove_file(&path).is_ok() {
                    o.orphans += 1;
                }
                continue;
            }
            let why = if path.extension().and_then(|e| e.to_str()) != Some(EXT) {
                Err(format!("not a .{EXT} file"))
            } else {
                read_header(&path, &fingerprint)
            };
            match why.and_then(|tokens| {
                Ok((tokens, std::fs::metadata(&path).map_err(|e| e.to_string())?))
            }) {
                Ok((tokens, meta)) => {
                    let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                    found.push((mtime, tokens, path, meta.len()));
                }
                Err(why) => {
                    o.example.get_or_insert_with(|| format!("{name}: {why}"));
                    *o.ignored.entry(why).or_default() += 1;
                }
            }
        }
        found.sort_by_key(|f| f.0);
        let held: u64 = found.iter().map(|f| f.3).sum();
        let max = max.unwrap_or_else(|| default_max(dir, held));
        let mut d = Disk {
            dir: dir.to_path_buf(),
            fingerprint,
            index: HashMap::new(),
            seq: 0,
            clock: 0,
            max,
            bytes: 0,
            evicted: 0,
        };
        for (_, tokens, path, size) in found {
            let h = *prefix_hashes(&tokens).last().expect("hash");
            d.clock += 1;
            let saved = Saved {
                len: tokens.len(),
                path,
                size,
                used: d.clock,
            };
            if let Some(old) = d.index.insert(h, saved) {
                d.bytes -= old.size;
            }
            d.bytes += size;
        }
        o.evicted = d.trim().len() as u64;
        Ok((d, o))
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// The lengths of the saved prefixes (one per file).
    pub fn lens(&self) -> impl Iterator<Item = usize> + '_ {
        self.index.values().map(|s| s.len)
    }

    pub fn contains(&self, h: u64) -> bool {
        self.index.contains_key(&h)
    }

    /// Marks the file of `h`, if there is one, used now (its state was
    /// reused from RAM).
    pub fn mark_used(&mut self, h: u64) {
        if let Some(s) = self.index.get_mut(&h) {
            self.clock += 1;
            s.used = self.clock;
            touch(&s.path);
        }
    }

    /// Removes least recently used files until the rest fit `max`; returns
    /// the (hash, length) of each removed.
    fn trim(&mut self) -> Vec<(u64, usize)> {
        let mut gone = Vec::new();
        while self.bytes > self.max {
            let Some((&h, _)) = self.index.iter().min_by_key(|(_, s)| s.used) else {
                break;
            };
            if let Some(s) = self.forget(h) {
                gone.push((h, s.len));
                self.evicted += 1;
            }
        }
        gone
    }

    /// Drops a file from the index and the directory.
    fn forget(&mut self, h: u64) -> Option<Saved> {
        let s = self.index.remove(&h)?;
        self.bytes -= s.size;
        if let Err(e) = std::fs::remove_file(&s.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(file = %s.path.display(), "cannot remove a saved prefix state: {e}");
        }
        Some(s)
    }

    /// Saves the state after `tokens`; returns the (hash, length) of the
    /// files removed to make room.
    pub fn save(&mut self, h: u64, tokens: &[u32], state: &dyn SeqState) -> Vec<(u64, usize)> {
        let path = self.dir.join(format!("{h:016x}-{}.{EXT}", tokens.len()));
        self.seq += 1;
        let tmp = self
            .dir
            .join(format!("{TMP}{}-{}", std::process::id(), self.seq));
        let body = match self.encode(tokens, state) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), "cannot save a prefix state: {e}");
                return Vec::new();
            }
        };
        let size = body.len() as u64;
        if size > self.max {
            return Vec::new();
        }
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(dir = %self.dir.display(), "cannot save a prefix state: {e}");
            return Vec::new();
        }
        self.clock += 1;
        let saved = Saved {
            len: tokens.len(),
            path,
            size,
            used: self.clock,
        };
        if let Some(old) = self.index.insert(h, saved) {
            self.bytes -= old.size;
        }
        self.bytes += size;
        self.trim()
    }

    fn encode(&self, tokens: &[u32], state: &dyn SeqState) -> Result<Vec<u8>, String> {
        let mut body = Vec::new();
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&VERSION.to_le_bytes());
        body.extend_from_slice(&self.fingerprint);
        body.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
        for t in tokens {
            body.extend_from_slice(&t.to_le_bytes());
        }
        let payload = state.encode().map_err(|e| e.to_string())?;
        body.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        body.extend_from_slice(&payload);
        let sum = Sha256::digest(&body);
        body.extend_from_slice(&sum);
        Ok(body)
    }

    /// Loads the state saved for `tokens` (hash `h`), marking it used. A
    /// file that fails its checks is removed (it was this model's, by its
    /// header, and is damaged); the error says why.
    pub fn load(
        &mut self,
        lm: &dyn CausalLm,
        h: u64,
        tokens: &[u32],
    ) -> Option<Result<Box<dyn SeqState>, (PathBuf, String)>> {
        let path = self.index.get(&h)?.path.clone();
        match self.read(lm, &path, tokens) {
            Ok(state) => {
                self.mark_used(h);
                Some(Ok(state))
            }
            Err(why) => {
                self.forget(h);
                Some(Err((path, why)))
            }
        }
    }

    fn read(
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

impl Opened {
    /// Logs what opening found: at most one line for orphans and one for
    /// ignored files, whatever their number.
    pub fn log(&self, dir: &Path) {
        if self.orphans > 0 {
            tracing::info!(dir = %dir.display(), files = self.orphans, "removed temp files of an interrupted save");
        }
        let n: usize = self.ignored.values().sum();
        if n > 0 {
            let reasons: Vec<String> = self
                .ignored
                .iter()
                .map(|(why, k)| format!("{k} {why}"))
                .collect();
            tracing::warn!(
                dir = %dir.display(),
                "ignored {n} files that are not this model's saved states ({}); e.g. {}",
                reasons.join(", "),
                self.example.as_deref().unwrap_or("")
            );
        }
        if self.evicted > 0 {
            tracing::info!(dir = %dir.display(), files = self.evicted, "removed the least recently used saved states to fit --state-cache-max");
        }
    }
}

/// Marks a file used now (its modification time orders the cache across
/// restarts).
fn touch(path: &Path) {
    let _ = std::fs::File::options()
        .append(true)
        .open(path)
        .and_then(|f| f.set_modified(SystemTime::now()));
}

/// The default cap for the states in `dir`, which already take `held`
/// bytes: [`default_max_of`] the free space there.
fn default_max(dir: &Path, held: u64) -> u64 {
    default_max_of(free_space(dir), held)
}

/// The default cap: a tenth of the space free for states (`free`, the
/// free space, plus `held`, what they already take), at most the default
/// maximum; [`FALLBACK_MAX`] when the free space is unknown.
fn default_max_of(free: Option<u64>, held: u64) -> u64 {
    match free {
        Some(free) => (free.saturating_add(held) / FREE_SHARE).min(crate::DEFAULT_STATE_CACHE_MAX),
        None => FALLBACK_MAX,
    }
}

/// Bytes available to an unprivileged user on the file system of `dir`.
// The statvfs field types are u64 on 64-bit Linux, narrower elsewhere.
#[allow(clippy::unnecessary_cast)]
pub(crate) fn free_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `path` is NUL-terminated and outlives the call; `st` is
    // writable memory of the struct's size, aliased by nothing else.
    let rc = unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0 and so filled the struct (zeroed before).
    let st = unsafe { st.assume_init() };
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Checks a header's fixed part (magic, version, fingerprint); returns
/// the token count it claims.
fn check_head(b: &[u8], fp: &[u8; 32]) -> Result<u64, String> {
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
    Ok(u64::from_le_bytes(b[44..52].try_into().expect("8")))
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
        .map_err(|_| "not a fathom prefix state".to_string())?;
    let n = check_head(&head, fp)?;
    if n.saturating_mul(4).saturating_add(52) > meta.len() {
        return Err("more tokens claimed than the file holds".into());
    }
    let mut all = head.to_vec();
    let mut toks = vec![0u8; n as usize * 4];
    f.read_exact(&mut toks)
        .map_err(|_| "more tokens claimed than the file holds".to_string())?;
    all.extend_from_slice(&toks);
    parse_header(&all, fp).map(|(t, _)| t)
}

/// Header fields; returns the tokens and the header's length.
fn parse_header(b: &[u8], fp: &[u8; 32]) -> Result<(Vec<u32>, usize), String> {
    let n = check_head(b, fp)?;
    let end = n
        .checked_mul(4)
        .and_then(|x| x.checked_add(52))
        .filter(|&e| e <= b.len() as u64);
    let Some(end) = end else {
        return Err("more tokens claimed than the file holds".into());
    };
    let tokens = b[52..end as usize]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
        .collect();
    Ok((tokens, end as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;
    const GIB: u64 = 1 << 30;

    #[test]
    fn the_default_cap_is_a_tenth_of_the_free_space_up_to_20_gib() {
        assert_eq!(crate::DEFAULT_STATE_CACHE_MAX, 20 * GIB);
        // A tenth of what is free, plus what the states already take.
        assert_eq!(default_max_of(Some(13 * GB), 0), 1_300_000_000);
        assert_eq!(default_max_of(Some(13 * GB), 2 * GB), 1_500_000_000);
        assert_eq!(default_max_of(Some(100 * GIB), 0), 10 * GIB);
        assert_eq!(default_max_of(Some(12_345), 0), 1_234);
        assert_eq!(default_max_of(Some(0), 0), 0);
        // At most 20 GiB: reached at 200 GiB free.
        assert_eq!(default_max_of(Some(200 * GIB - 10), 0), 20 * GIB - 1);
        assert_eq!(default_max_of(Some(200 * GIB), 0), 20 * GIB);
        assert_eq!(default_max_of(Some(4_000 * GB), 0), 20 * GIB);
        assert_eq!(default_max_of(Some(150 * GIB), 100 * GIB), 20 * GIB);
        assert_eq!(default_max_of(Some(u64::MAX), u64::MAX), 20 * GIB);
        // The free space unreadable: 1 GiB.
        assert_eq!(default_max_of(None, 0), GIB);
        assert_eq!(default_max_of(None, 50 * GIB), GIB);
    }

    #[test]
    fn an_opened_directory_takes_the_default_of_its_free_space() {
        let dir = std::env::temp_dir().join(format!("fathom-disk-default-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (d, _) = Disk::open(&dir, [7; 32], None).unwrap();
        let free = free_space(&dir).expect("statvfs of a temp directory");
        // The free space moves while other processes write: within 64 MB of it.
        let want = default_max_of(Some(free), 0);
        assert!(
            d.max().abs_diff(want) <= (64 << 20) / FREE_SHARE,
            "{} vs {want}",
            d.max()
        );
        let (d, _) = Disk::open(&dir, [7; 32], Some(12_345)).unwrap();
        assert_eq!(d.max(), 12_345);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
