//! Writing a planned checkpoint: fast, deterministic, and never half-done
//! in a way that looks done.
//!
//! * **Pipeline.** The calling thread fills large buffers with rayon (the
//!   bytes of any range are a pure function of the plan, see `init.rs`)
//!   while one writer thread writes the previous buffer; buffers circulate
//!   through two channels, so generation and I/O overlap.
//! * **Direct I/O.** Shards are written with the page cache bypassed
//!   (`O_DIRECT`; `F_NOCACHE` on macOS) from 4 KiB-aligned buffers at
//!   aligned offsets: on virtual disks the page cache path reaches a
//!   fraction of the device's sequential bandwidth (`dd … conv=fdatasync`
//!   vs `oflag=direct`). The last block of a file is zero-padded and the
//!   file truncated back. Where the file system refuses `O_DIRECT` (tmpfs)
//!   the writer falls back to buffered writes.
//! * **Atomicity.** Shards are written as `.model-…safetensors.partial`,
//!   fsynced, and renamed to their final names only when all of them are
//!   complete; then the tokenizer, `config.json` and, last,
//!   `model.safetensors.index.json` (each through a temp file and rename).
//!   An interrupted run leaves only dot-files ending in `.partial`, which the
//!   next run removes. An existing model is replaced only with `force`.

use sha2::Digest;
use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Instant;

use rayon::prelude::*;

use crate::error::{Result, SynthError};
use crate::plan::{Plan, ShardPlan};
use crate::tokenizer;

/// Alignment of direct I/O buffers, offsets and lengths.
const ALIGN: usize = fathom_platform::io::DIRECT_ALIGN;
/// Granularity of parallel generation inside one buffer.
const FILL_CHUNK: usize = 1 << 20;

/// How to write.
#[derive(Debug, Clone)]
pub struct WriteOptions {
    /// Replace an existing model in the directory.
    pub force: bool,
    /// Size of each pipeline buffer (rounded up to 4 KiB); three circulate.
    pub buffer_size: usize,
    /// Try `O_DIRECT` for shards (falls back to buffered writes if refused).
    pub direct_io: bool,
    /// Test hook: fail with an I/O error once this many shard bytes have
    /// been written, to prove that an interrupted run leaves nothing that
    /// looks complete.
    pub fail_after_bytes: Option<u64>,
    /// A released tokenizer's files (name, bytes) to write instead of the
    /// synthetic `tiktoken.model` / `tokenizer_config.json` (see
    /// [`crate::tokenizer::released_files`]).
    pub tokenizer: Option<Vec<(String, Vec<u8>)>>,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            force: false,
            buffer_size: 64 << 20,
            direct_io: true,
            fail_after_bytes: None,
            tokenizer: None,
        }
    }
}

/// What a write did.
#[derive(Debug, Clone)]
pub struct WriteReport {
    /// Bytes of shard files written.
    pub shard_bytes: u64,
    /// Seconds spent writing shards (generation overlapped), fsyncs included.
    pub shard_seconds: f64,
    /// Whether every shard was written with `O_DIRECT`.
    pub direct_io: bool,
}

/// Files whose presence means "a model is here".
fn is_model_file(name: &str) -> bool {
    name == "config.json"
        || name == "model.safetensors.index.json"
        || (name.starts_with("model") && name.ends_with(".safetensors"))
}

/// Files this writer produces or leaves behind, removed under `force`.
fn is_ours(name: &str) -> bool {
    is_model_file(name)
        || name == "tiktoken.model"
        || name == "tokenizer_config.json"
        || name == "generation_config.json"
        || name == "chat_template.jinja"
        || (name.starts_with("tokenization_") && name.ends_with(".py"))
}

fn partial_name(name: &str) -> String {
    format!(".{name}.partial")
}

/// Creates the directory; refuses or clears an existing model; removes
/// leftovers of interrupted runs.
fn prepare_dir(dir: &Path, force: bool) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| SynthError::io(dir, e))?;
    let entries = fs::read_dir(dir).map_err(|e| SynthError::io(dir, e))?;
    let mut found = Vec::new();
    let mut ours = Vec::new();
    for e in entries {
        let e = e.map_err(|e| SynthError::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.ends_with(".partial") {
            ours.push(e.path());
        } else if is_ours(&name) {
            if is_model_file(&name) {
                found.push(name);
            }
            ours.push(e.path());
        }
    }
    if !found.is_empty() && !force {
        found.sort();
        let more = if found.len() > 3 { ", …" } else { "" };
        found.truncate(3);
        return Err(SynthError::Exists {
            path: dir.to_path_buf(),
            found: format!("{}{more}", found.join(", ")),
        });
    }
    for p in ours {
        fs::remove_file(&p).map_err(|e| SynthError::io(&p, e))?;
    }
    Ok(())
}

/// Writes `bytes` to `dir/name` through a temp file, fsync and rename.
fn atomic_write(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(partial_name(name));
    let f = File::create(&tmp).map_err(|e| SynthError::io(&tmp, e))?;
    f.write_all_at(bytes, 0)
        .and_then(|_| f.sync_all())
        .map_err(|e| SynthError::io(&tmp, e))?;
    let dst = dir.join(name);
    fs::rename(&tmp, &dst).map_err(|e| SynthError::io(&dst, e))
}

/// A heap buffer whose usable part starts on a 4 KiB boundary.
struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let raw = vec![0u8; len + ALIGN];
        let start = raw.as_ptr().align_offset(ALIGN).min(ALIGN);
        AlignedBuf { raw, start, len }
    }
    fn slice(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }
    fn slice_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}

/// Messages from the generator to the writer thread.
enum Job {
    /// Start shard `i`.
    Open(usize),
    /// Write `len` bytes of `buf` at `offset` of the current shard.
    Data {
        buf: AlignedBuf,
        offset: u64,
        len: usize,
    },
    /// The current shard is complete: truncate, fsync, close.
    Close,
}

/// The writer thread's side of the pipeline.
struct Writer<'a> {
    dir: &'a Path,
    plan: &'a Plan,
    opts: &'a WriteOptions,
    progress: &'a (dyn Fn(u64) + Sync),
    written: u64,
    all_direct: bool,
    /// SHA-256 of the shard being written (its bytes arrive in order), and
    /// `(file, digest)` of the finished ones, for `SHA256SUMS`.
    hash: Option<(sha2::Sha256, u64)>,
    digests: Vec<(String, String)>,
}

impl Writer<'_> {
    fn open(&mut self, shard: &ShardPlan) -> Result<(File, PathBuf, bool)> {
        let path = self.dir.join(partial_name(&shard.file_name));
        let mut o = OpenOptions::new();
        o.write(true).create_new(true);
        if self.opts.direct_io
            && let Ok(f) = fathom_platform::io::open_uncached_with(&o, &path)
        {
            return Ok((f, path, true));
        }
        let f = o.open(&path).map_err(|e| SynthError::io(&path, e))?;
        Ok((f, path, false))
    }

    fn run(&mut self, jobs: Receiver<Job>, free: SyncSender<AlignedBuf>) -> Result<()> {
        let mut cur: Option<(File, PathBuf, bool, u64)> = None;
        for job in jobs {
            match job {
                Job::Open(i) => {
                    let shard = &self.plan.shards[i];
                    let (f, p, direct) = self.open(shard)?;
                    self.all_direct &= direct;
                    cur = Some((f, p, direct, shard.len));
                    self.hash = Some((sha2::Sha256::new(), 0));
                }
                Job::Data { buf, offset, len } => {
                    let (f, path, direct, _) = cur.as_mut().expect("Open precedes Data");
                    if let Some(limit) = self.opts.fail_after_bytes
                        && self.written + len as u64 > limit
                    {
                        let e = std::io::Error::other("injected failure (test hook)");
                        return Err(SynthError::io(path.clone(), e));
                    }
                    // Direct writes need an aligned length: the buffer's
                    // tail beyond `len` is zero and is truncated at Close.
                    let n = if *direct {
                        len.next_multiple_of(ALIGN)
                    } else {
                        len
                    };
                    match f.write_all_at(&buf.slice()[..n], offset) {
                        Ok(()) => {}
                        Err(e) if *direct && e.kind() == ErrorKind::InvalidInput => {
                            // The file system accepted O_DIRECT at open but
                            // not for writes: continue buffered.
                            let g = OpenOptions::new()
                                .write(true)
                                .open(&*path)
                                .map_err(|e| SynthError::io(path.clone(), e))?;
                            g.write_all_at(&buf.slice()[..len], offset)
                                .map_err(|e| SynthError::io(path.clone(), e))?;
                            *f = g;
                            *direct = false;
                            self.all_direct = false;
                        }
                        Err(e) => return Err(SynthError::io(path.clone(), e)),
                    }
                    self.written += len as u64;
                    (self.progress)(len as u64);
                    // Bytes come in file order; anything else drops the digest.
                    self.hash = match self.hash.take() {
                        Some((mut h, at)) if at == offset => {
                            h.update(&buf.slice()[..len]);
                            Some((h, at + len as u64))
                        }
                        _ => None,
                    };
                    // The generator may have stopped; then nobody needs it.
                    let _ = free.send(buf);
                }
                Job::Close => {
                    let (f, path, _, len) = cur.take().expect("Open precedes Close");
                    f.set_len(len)
                        .and_then(|_| f.sync_all())
                        .map_err(|e| SynthError::io(&path, e))?;
                    if let Some((h, at)) = self.hash.take().filter(|(_, at)| *at == len) {
                        let _ = at;
                        let name = self
                            .plan
                            .shards
                            .get(self.digests.len())
                            .map(|s| s.file_name.clone());
                        if let Some(name) = name {
                            self.digests.push((name, format!("{:x}", h.finalize())));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Generates every shard into the pipeline. Stops quietly when the writer
/// has gone (its error is what gets reported).
fn generate(plan: &Plan, buf_size: usize, jobs: SyncSender<Job>, free: Receiver<AlignedBuf>) {
    for (i, shard) in plan.shards.iter().enumerate() {
        if jobs.send(Job::Open(i)).is_err() {
            return;
        }
        let mut offset = 0u64;
        while offset < shard.len {
            let Ok(mut buf) = free.recv() else { return };
            let len = (shard.len - offset).min(buf_size as u64) as usize;
            let s = buf.slice_mut();
            s[len..].fill(0);
            s[..len]
                .par_chunks_mut(FILL_CHUNK)
                .enumerate()
                .for_each(|(k, c)| shard.fill(offset + (k * FILL_CHUNK) as u64, c));
            if jobs.send(Job::Data { buf, offset, len }).is_err() {
                return;
            }
            offset += len as u64;
        }
        if jobs.send(Job::Close).is_err() {
            return;
        }
    }
}

/// Writes the planned model into `dir`. `progress` is called with the
/// number of shard bytes each time a buffer reaches the disk.
pub fn write_model(
    plan: &Plan,
    dir: &Path,
    opts: &WriteOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<WriteReport> {
    prepare_dir(dir, opts.force)?;
    let vocab = plan.model.vocab_size();
    let ranks = tokenizer::rank_file(&tokenizer::rank_tokens(vocab - tokenizer::NUM_SPECIALS));
    let need = plan.file_bytes() + ranks.len() as u64 + (1 << 20);
    if let Some(free) = fathom_platform::io::free_space(dir).filter(|&f| f < need) {
        return Err(SynthError::NoSpace {
            path: dir.to_path_buf(),
            need,
            free,
        });
    }

    let t0 = Instant::now();
    let result = write_shards(plan, dir, opts, progress);
    let (direct, mut digests) = match result {
        Ok(d) => d,
        Err(e) => {
            for s in &plan.shards {
                let _ = fs::remove_file(dir.join(partial_name(&s.file_name)));
            }
            return Err(e);
        }
    };
    for s in &plan.shards {
        let from = dir.join(partial_name(&s.file_name));
        let to = dir.join(&s.file_name);
        fs::rename(&from, &to).map_err(|e| SynthError::io(&to, e))?;
    }
    let shard_seconds = t0.elapsed().as_secs_f64();

    // The small files a released checkpoint has beside its shards.
    let tok_files = opts.tokenizer.clone().unwrap_or_else(|| {
        vec![
            ("tiktoken.model".to_string(), ranks.into_bytes()),
            (
                "tokenizer_config.json".to_string(),
                pretty(&tokenizer::tokenizer_config(vocab)),
            ),
            (
                tokenizer::MODULE_FILE.to_string(),
                tokenizer::MODULE_SOURCE.as_bytes().to_vec(),
            ),
        ]
    });
    let config = plan.model.config_json();
    let mut small = tok_files;
    small.push((
        "generation_config.json".into(),
        pretty(&generation_config(&config)),
    ));
    small.push(("config.json".into(), pretty(&config)));
    small.push(("model.safetensors.index.json".into(), plan.index_bytes()));
    // config.json and the index last: their presence means "complete".
    for (name, bytes) in &small {
        atomic_write(dir, name, bytes)?;
    }
    // A manifest `fathom verify --digest` (and sha256sum -c) compares with.
    for (name, bytes) in &small {
        digests.push((
            name.to_string(),
            format!("{:x}", sha2::Sha256::digest(bytes)),
        ));
    }
    if digests.len() == plan.shards.len() + small.len() {
        digests.sort();
        let sums: String = digests.iter().map(|(n, d)| format!("{d}  {n}\n")).collect();
        atomic_write(dir, "SHA256SUMS", sums.as_bytes())?;
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| SynthError::io(dir, e))?;
    Ok(WriteReport {
        shard_bytes: plan.file_bytes(),
        shard_seconds,
        direct_io: direct,
    })
}

/// `generation_config.json` as releases ship it: the special ids the
/// config names (top level, else `text_config`), greedy by default.
fn generation_config(config: &serde_json::Value) -> serde_json::Value {
    let pick = |k: &str| {
        config
            .get(k)
            .or_else(|| config.get("text_config").and_then(|t| t.get(k)))
            .cloned()
            .unwrap_or(serde_json::Value::Null)
    };
    serde_json::json!({
        "_from_model_config": true,
        "bos_token_id": pick("bos_token_id"),
        "eos_token_id": pick("eos_token_id"),
        "pad_token_id": pick("pad_token_id"),
        "do_sample": false
    })
}

fn pretty(v: &serde_json::Value) -> Vec<u8> {
    let mut b = serde_json::to_vec_pretty(v).expect("JSON values serialise");
    b.push(b'\n');
    b
}

/// Runs the generator on this thread and the writer on another; returns
/// whether every shard went through `O_DIRECT`.
fn write_shards(
    plan: &Plan,
    dir: &Path,
    opts: &WriteOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(bool, Vec<(String, String)>)> {
    let buf_size = opts.buffer_size.max(ALIGN).next_multiple_of(ALIGN);
    let (job_tx, job_rx) = sync_channel::<Job>(1);
    let (free_tx, free_rx) = sync_channel::<AlignedBuf>(3);
    for _ in 0..3 {
        free_tx.send(AlignedBuf::new(buf_size)).expect("room for 3");
    }
    std::thread::scope(|s| {
        let writer = s.spawn(move || {
            let mut w = Writer {
                dir,
                plan,
                opts,
                progress,
                written: 0,
                all_direct: true,
                hash: None,
                digests: Vec::new(),
            };
            w.run(job_rx, free_tx).map(|()| (w.all_direct, w.digests))
        });
        generate(plan, buf_size, job_tx, free_rx);
        writer.join().expect("the writer thread does not panic")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_file_names() {
        assert!(is_model_file("model-00001-of-000002.safetensors"));
        assert!(is_model_file("model.safetensors"));
        assert!(is_model_file("config.json"));
        assert!(!is_model_file("tiktoken.model"));
        assert!(!is_model_file(".model-00001-of-000002.safetensors.partial"));
        assert!(is_ours("tokenizer_config.json"));
    }

    #[test]
    fn aligned_buffers_are_aligned() {
        let mut b = AlignedBuf::new(8192);
        assert_eq!(b.slice_mut().as_ptr() as usize % ALIGN, 0);
        assert_eq!(b.slice().len(), 8192);
    }
}
