//! Routed experts fetched on demand (`--experts remote`): byte spans of
//! shards that are not on disk, each fetched with one Range request when
//! the model asks for it, kept in a store bounded by a disk budget (least
//! recently used spans go first), and reused across restarts. When a
//! shard's spans cover it whole, it is hashed against the Hub's SHA-256;
//! a mismatch evicts all its spans.
//!
//! Nothing here guesses: a span is fetched only by an explicit
//! [`RemoteExpertStore::fetch_span`]. Prefetchers call
//! [`RemoteExpertStore::local_span`], which never touches the network.
//!
//! The HTTP client blocks; every request runs on a thread of its own, so
//! the store can be used from any thread, one inside an async runtime
//! included.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use crate::api::{Listing, RemoteFile, fetch_listing, file_url};
use crate::cache::{source_of, write_atomic};
use crate::config::HubConfig;
use crate::error::{HubError, Result};
use crate::http::{Failure, Http, parse_content_range};
use crate::repo::RepoRef;
use crate::spans::{Key, Spans, covers_from, span_path};
use crate::verify::{hex, is_hex, sha256_hex};

/// Longest span one request may ask for.
pub const MAX_SPAN: u64 = 4 << 30;
/// Largest safetensors header [`RemoteExpertStore::fetch_header`] reads
/// (the limit fathom's checkpoint reader applies).
pub const MAX_HEADER: u64 = 100 << 20;

/// How to open a store.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    pub config: HubConfig,
    /// The model directory: a snapshot of the Hub cache or a `pull --dir`
    /// directory (it names the repository and commit); files present there
    /// whole are read from it, never fetched.
    pub model_dir: PathBuf,
    /// Where spans live (default: [`default_store_dir`]).
    pub store_dir: Option<PathBuf>,
    /// Most bytes of spans kept on disk (`--disk-budget`).
    pub disk_budget: u64,
}

/// Counters since the store opened.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StoreStats {
    /// Spans answered from the store or a local file.
    pub hits: u64,
    /// Spans fetched over the network, and their bytes.
    pub fetches: u64,
    pub fetched_bytes: u64,
    /// Spans evicted for the budget or a failed shard hash.
    pub evicted: u64,
    /// Bytes of spans on disk now.
    pub stored_bytes: u64,
}

/// A shard store filled on demand from the Hub.
pub struct RemoteExpertStore {
    http: Http,
    listing: Listing,
    files: HashMap<String, RemoteFile>,
    model_dir: PathBuf,
    dir: PathBuf,
    budget: u64,
    spans: Mutex<Spans>,
    _lock: File,
    hits: AtomicU64,
    fetches: AtomicU64,
    fetched_bytes: AtomicU64,
    evicted: AtomicU64,
    temp: AtomicU64,
}

/// `$XDG_CACHE_HOME/fathom/spans/models--ORG--NAME/COMMIT` (else
/// `~/.cache/…`): fathom's own, beside the Hub cache rather than in it.
pub fn default_store_dir(repo: &str, commit: &str) -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("fathom")
        .join("spans")
        .join(format!("models--{}", repo.replace('/', "--")))
        .join(commit)
}

impl RemoteExpertStore {
    /// Opens the store for the model in `opts.model_dir`: reads (or
    /// fetches once and keeps) the commit's listing, replays the span
    /// journal, and evicts down to the budget.
    pub fn open(opts: RemoteOptions) -> Result<RemoteExpertStore> {
        let src = source_of(&opts.model_dir)?;
        let dir = opts
            .store_dir
            .clone()
            .unwrap_or_else(|| default_store_dir(&src.repo, &src.commit));
        std::fs::create_dir_all(&dir).map_err(|e| HubError::io(&dir, e))?;
        let lock_path = dir.join("lock");
        let lock = File::create(&lock_path).map_err(|e| HubError::io(&lock_path, e))?;
        if let Err(std::fs::TryLockError::WouldBlock) = lock.try_lock() {
            return Err(HubError::Store(format!(
                "the span store {} is in use by another fathom process: stop it, or give this one another store directory",
                dir.display()
            )));
        }
        let http = off_runtime(|| Http::new(&opts.config, Arc::new(AtomicBool::new(false))))?;
        let listing = off_runtime(|| load_listing(&http, &dir, &src.repo, &src.commit))?;
        let files = listing
            .files
            .iter()
            .map(|f| (f.path.clone(), f.clone()))
            .collect();
        let spans = Spans::open(&dir)?;
        let store = RemoteExpertStore {
            http,
            listing,
            files,
            model_dir: opts.model_dir,
            dir,
            budget: opts.disk_budget,
            spans: Mutex::new(spans),
            _lock: lock,
            hits: AtomicU64::new(0),
            fetches: AtomicU64::new(0),
            fetched_bytes: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            temp: AtomicU64::new(0),
        };
        store.evict(&mut store.spans.lock().unwrap(), 0)?;
        Ok(store)
    }

    /// The commit's files (path, size, SHA-256).
    pub fn listing(&self) -> &Listing {
        &self.listing
    }

    /// A file's size as the Hub lists it.
    pub fn file_size(&self, file: &str) -> Option<u64> {
        self.files.get(file).map(|f| f.size)
    }

    /// Whether `file` is in the model directory whole (then spans of it
    /// are read from there).
    pub fn is_local(&self, file: &str) -> bool {
        self.local_file(file).is_some()
    }

    fn local_file(&self, file: &str) -> Option<PathBuf> {
        let f = self.files.get(file)?;
        let p = self.model_dir.join(file);
        std::fs::metadata(&p)
            .is_ok_and(|m| m.is_file() && m.len() == f.size)
            .then_some(p)
    }

    pub fn stats(&self) -> StoreStats {
        StoreStats {
            hits: self.hits.load(Ordering::Relaxed),
            fetches: self.fetches.load(Ordering::Relaxed),
            fetched_bytes: self.fetched_bytes.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
            stored_bytes: self.spans.lock().unwrap().used,
        }
    }

    /// Files of the model whose spans all hashed right as a whole shard.
    pub fn verified_files(&self) -> Vec<String> {
        self.spans
            .lock()
            .unwrap()
            .verified
            .iter()
            .cloned()
            .collect()
    }

    fn check_request(&self, file: &str, offset: u64, len: u64) -> Result<&RemoteFile> {
        let f = self.files.get(file).ok_or_else(|| {
            HubError::Store(format!(
                "{file} is not a file of {}@{}",
                self.listing.repo, self.listing.commit
            ))
        })?;
        let end = offset.checked_add(len);
        if len == 0 || end.is_none_or(|e| e > f.size) {
            return Err(HubError::Store(format!(
                "{file}: bytes {offset}..+{len} are not inside its {} bytes",
                f.size
            )));
        }
        Ok(f)
    }

    fn check_fits(&self, file: &str, len: u64) -> Result<()> {
        if len > MAX_SPAN || len > self.budget {
            return Err(HubError::Store(format!(
                "{file}: a span of {len} bytes is larger than the disk budget ({} bytes) or {MAX_SPAN}: raise --disk-budget",
                self.budget
            )));
        }
        Ok(())
    }

    /// The bytes `[offset, offset + len)` of `file` if they are on disk (a
    /// local file or a stored span); never fetches.
    pub fn local_span(&self, file: &str, offset: u64, len: u64) -> Result<Option<Vec<u8>>> {
        self.check_request(file, offset, len)?;
        if let Some(p) = self.local_file(file) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return read_at(&p, offset, len).map(Some);
        }
        let found = {
            let mut s = self.spans.lock().unwrap();
            match s.covering(file, offset, len) {
                Some(k) => {
                    s.touch(&k);
                    // An open handle survives a concurrent eviction.
                    let p = span_path(&self.dir, &k);
                    Some((File::open(&p).map_err(|e| HubError::io(&p, e))?, k, p))
                }
                None => None,
            }
        };
        let Some((fh, k, p)) = found else {
            return Ok(None);
        };
        let mut buf = vec![0u8; len as usize];
        fh.read_exact_at(&mut buf, offset - k.1)
            .map_err(|e| HubError::io(&p, e))?;
        self.hits.fetch_add(1, Ordering::Relaxed);
        Ok(Some(buf))
    }

    /// The bytes `[offset, offset + len)` of `file`: from disk if there,
    /// else fetched with one Range request (206 with exactly that
    /// Content-Range, else refused), stored, and returned.
    pub fn fetch_span(&self, file: &str, offset: u64, len: u64) -> Result<Vec<u8>> {
        if let Some(b) = self.local_span(file, offset, len)? {
            return Ok(b);
        }
        let f = self.check_request(file, offset, len)?.clone();
        self.check_fits(file, len)?;
        let bytes = self.fetch_remote(&f, offset, len)?;
        let key: Key = (file.to_string(), offset, len);
        self.store(&key, &bytes)?;
        self.check_whole(&f)?;
        Ok(bytes)
    }

    /// The safetensors header of `file` (its 8-byte length and the JSON
    /// after it): read from the file when it is local, else from
    /// `headers/` in the store, else fetched (two requests) and kept
    /// there. Headers are kept outside the disk budget (the checkpoint
    /// cannot open without them).
    pub fn fetch_header(&self, file: &str) -> Result<Vec<u8>> {
        let f = self.check_request(file, 0, 1)?.clone();
        let read = |at: u64, len: u64| match self.local_file(file) {
            Some(p) => read_at(&p, at, len),
            None => self.fetch_remote(&f, at, len),
        };
        if self.local_file(file).is_none()
            && let Some(b) = self.stored_header(&f)
        {
            return Ok(b);
        }
        if f.size < 8 {
            return Err(HubError::Store(format!(
                "{file}: {} bytes, too short for a safetensors header",
                f.size
            )));
        }
        let n = header_len(&read(0, 8)?).expect("8 bytes");
        if n > MAX_HEADER || 8 + n > f.size {
            return Err(HubError::Store(format!(
                "{file}: header of {n} bytes, over the {MAX_HEADER} fathom reads or the file's {} bytes",
                f.size
            )));
        }
        if n == 0 {
            return Err(HubError::Store(format!(
                "{file}: header length 0: not a safetensors file"
            )));
        }
        let mut out = n.to_le_bytes().to_vec();
        out.extend(read(8, n)?);
        if self.local_file(file).is_none() {
            let path = self.header_path(file);
            let parent = path.parent().expect("headers folder");
            std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
            write_atomic(&path, &out).map_err(store_write)?;
            self.check_whole(&f)?;
        }
        Ok(out)
    }

    fn header_path(&self, file: &str) -> PathBuf {
        self.dir
            .join("headers")
            .join(&sha256_hex(file.as_bytes())[..24])
    }

    /// `f`'s header kept in `headers/`, if there and of a header's shape.
    fn stored_header(&self, f: &RemoteFile) -> Option<Vec<u8>> {
        let b = std::fs::read(self.header_path(&f.path)).ok()?;
        header_len(&b)
            .is_some_and(|n| b.len() as u64 == 8 + n && 8 + n <= f.size)
            .then_some(b)
    }

    fn fetch_remote(&self, f: &RemoteFile, offset: u64, len: u64) -> Result<Vec<u8>> {
        let url = file_url(
            self.http.endpoint(),
            &self.listing.repo,
            &self.listing.commit,
            &f.path,
        );
        let end = offset + len - 1;
        let bytes = off_runtime(|| {
            self.http.retry(&f.path, || {
                let (head, resp) = self.http.get(&f.path, &url, Some((offset, end)))?;
                if let (Some(e), Some(want)) = (&head.etag, &f.sha256)
                    && is_hex(e, 64)
                    && e != want
                {
                    return Err(Failure::Fatal(HubError::Changed {
                        file: f.path.clone(),
                        expected: want.clone(),
                        got: e.clone(),
                    }));
                }
                let cr = head.content_range.clone();
                if head.status != 206
                    || cr.as_deref().and_then(parse_content_range) != Some((offset, end, f.size))
                    || head.content_length.is_some_and(|n| n != len)
                {
                    return Err(Failure::Fatal(HubError::BadRange {
                        file: f.path.clone(),
                        start: offset,
                        end,
                        got: format!(
                            "{} {}",
                            head.status,
                            cr.unwrap_or_else(|| "without Content-Range".into())
                        ),
                    }));
                }
                let mut buf = vec![0u8; len as usize];
                let mut got = 0usize;
                let mut resp = resp;
                while got < buf.len() {
                    match resp.read(&mut buf[got..]) {
                        Ok(0) => {
                            return Err(Failure::transient(format!(
                                "{}: span body ended after {got} of {len} bytes",
                                f.path
                            )));
                        }
                        Ok(n) => got += n,
                        Err(e) => {
                            return Err(Failure::transient(format!(
                                "{}: reading a span: {e}",
                                f.path
                            )));
                        }
                    }
                }
                Ok(buf)
            })
        })?;
        self.fetches.fetch_add(1, Ordering::Relaxed);
        self.fetched_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(bytes)
    }

    /// Writes a span's file (synced, then renamed into place), makes
    /// room, and records it.
    fn store(&self, key: &Key, bytes: &[u8]) -> Result<()> {
        let path = span_path(&self.dir, key);
        let tmp = {
            let s = self.spans.lock().unwrap();
            s.temp_path(key, self.temp.fetch_add(1, Ordering::Relaxed))
        };
        let parent = tmp.parent().expect("span folder");
        std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
        let write = || -> std::io::Result<()> {
            let mut fh = File::create(&tmp)?;
            fh.write_all(bytes)?;
            fh.sync_all()
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(store_write(HubError::io(&tmp, e)));
        }
        let mut s = self.spans.lock().unwrap();
        if s.map.contains_key(key) {
            let _ = std::fs::remove_file(&tmp);
            s.touch(key);
            return Ok(());
        }
        self.evict(&mut s, key.2)?;
        std::fs::rename(&tmp, &path).map_err(|e| HubError::io(&path, e))?;
        s.add(key.clone())
    }

    /// Evicts least recently used spans until `room` more bytes fit.
    fn evict(&self, s: &mut Spans, room: u64) -> Result<()> {
        while s.used + room > self.budget {
            let Some(k) = s.oldest() else { break };
            s.remove(&k)?;
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// When `f`'s spans (and its kept header) cover it whole and it is not
    /// yet verified, hashes it; a mismatch evicts every span of it and its
    /// header, and fails.
    fn check_whole(&self, f: &RemoteFile) -> Result<()> {
        let Some(want) = &f.sha256 else {
            return Ok(());
        };
        let header = self.stored_header(f).unwrap_or_default();
        let spans = {
            let s = self.spans.lock().unwrap();
            if s.verified.contains(&f.path) {
                return Ok(());
            }
            let spans = s.of_file(&f.path);
            if !covers_from(&spans, header.len() as u64, f.size) {
                return Ok(());
            }
            spans
        };
        let got = match self.hash_spans(&header, &spans) {
            Ok(h) => h,
            // A span evicted meanwhile: not whole any more.
            Err(_) => return Ok(()),
        };
        let mut s = self.spans.lock().unwrap();
        if &got == want {
            return s.mark_verified(&f.path);
        }
        for k in s.of_file(&f.path) {
            s.remove(&k)?;
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
        let _ = std::fs::remove_file(self.header_path(&f.path));
        Err(HubError::Digest {
            file: f.path.clone(),
            algo: "SHA-256",
            expected: want.clone(),
            got: format!("{got} over its fetched spans (all evicted)"),
        })
    }

    /// SHA-256 of `head` followed by the bytes the spans (sorted by
    /// offset, covering the rest) hold.
    fn hash_spans(&self, head: &[u8], spans: &[Key]) -> std::io::Result<String> {
        let mut h = Sha256::new();
        h.update(head);
        let mut pos = head.len() as u64;
        let mut buf = vec![0u8; 1 << 20];
        for k in spans {
            let end = k.1 + k.2;
            if end <= pos {
                continue;
            }
            let fh = File::open(span_path(&self.dir, k))?;
            while pos < end {
                let n = (end - pos).min(buf.len() as u64) as usize;
                fh.read_exact_at(&mut buf[..n], pos - k.1)?;
                h.update(&buf[..n]);
                pos += n as u64;
            }
        }
        Ok(hex(&h.finalize()))
    }

    /// The store's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Runs `f` on a thread of its own: the blocking HTTP client may neither
/// be built nor wait inside an async runtime, and a caller may be in one.
fn off_runtime<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(f)
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// A full disk while storing a span or header, said for the store (a
/// pull's advice does not apply); nothing of it is kept.
fn store_write(e: HubError) -> HubError {
    match e {
        HubError::DiskFull { path, .. } => HubError::Store(format!(
            "cannot write {}: no space left (disk full or file-size limit): lower --disk-budget or free space there",
            path.display()
        )),
        e => e,
    }
}

/// The length a safetensors header's first 8 bytes give.
fn header_len(b: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(..8)?.try_into().ok()?))
}

fn read_at(p: &Path, offset: u64, len: u64) -> Result<Vec<u8>> {
    let fh = File::open(p).map_err(|e| HubError::io(p, e))?;
    let mut buf = vec![0u8; len as usize];
    fh.read_exact_at(&mut buf, offset)
        .map_err(|e| HubError::io(p, e))?;
    Ok(buf)
}

/// The commit's listing from `dir/listing.json`, else fetched (by commit,
/// so it cannot change) and kept there.
fn load_listing(http: &Http, dir: &Path, repo: &str, commit: &str) -> Result<Listing> {
    let p = dir.join("listing.json");
    if let Ok(text) = std::fs::read(&p)
        && let Ok(l) = serde_json::from_slice::<Listing>(&text)
        && l.repo == repo
        && l.commit == commit
    {
        return Ok(l);
    }
    let r = RepoRef::parse(&format!("{repo}@{commit}"))?;
    let l = fetch_listing(http, &r)?;
    if l.commit != commit {
        return Err(HubError::protocol(
            format!("listing of {repo}@{commit}"),
            format!("it names commit {}", l.commit),
        ));
    }
    write_atomic(&p, &serde_json::to_vec(&l).expect("serialisable"))?;
    Ok(l)
}
