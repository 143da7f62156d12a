//! One file, resumable: bytes go to `blobs/<etag>.incomplete`, a later
//! attempt (or run) asks for the rest with `Range: bytes=<len>-`, and the
//! whole is renamed to `blobs/<etag>` only when it hashes to the Hub's
//! digest.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::api::{RemoteFile, file_url};
use crate::cache::Layout;
use crate::error::{HubError, Result, is_disk_full};
use crate::http::{Failure, Head, Http, parse_content_range};
use crate::verify::{Expected, Hasher, is_hex, sha256_hex};

/// Bytes moved per read and write.
const CHUNK: usize = 1 << 20;

/// Counters a display reads while files download.
#[derive(Debug, Default)]
pub struct Progress {
    /// Bytes of the selected files now on disk (verified or partial).
    pub done: AtomicU64,
    /// Bytes of all selected files.
    pub total: AtomicU64,
    /// Bytes received over the network in this run.
    pub fetched: AtomicU64,
    pub files_done: AtomicU64,
    pub files_total: AtomicU64,
}

impl Progress {
    fn add(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }
    fn sub(&self, n: u64) {
        self.done.fetch_sub(n, Ordering::Relaxed);
    }
}

/// A file being written: its handle, length so far and running hash.
struct Partial<'a> {
    file: File,
    path: &'a Path,
    have: u64,
    hasher: Hasher,
}

impl Partial<'_> {
    /// Back to zero bytes (the server ignored Range, or a restart).
    fn restart(&mut self, f: &RemoteFile, progress: &Progress) -> Result<()> {
        self.file
            .set_len(0)
            .map_err(|e| HubError::io(self.path, e))?;
        self.file
            .seek(SeekFrom::Start(0))
            .map_err(|e| HubError::io(self.path, e))?;
        progress.sub(self.have);
        self.have = 0;
        self.hasher = Hasher::new(&f.expected(), f.size);
        Ok(())
    }

    fn append(&mut self, bytes: &[u8], remaining: u64) -> Result<()> {
        self.file.write_all(bytes).map_err(|e| {
            if is_disk_full(&e) {
                HubError::DiskFull {
                    path: self.path.to_path_buf(),
                    need: remaining,
                }
            } else {
                HubError::io(self.path, e)
            }
        })?;
        self.hasher.update(bytes);
        self.have += bytes.len() as u64;
        Ok(())
    }
}

/// The name a file's partial takes before its digest is known: its blob
/// name, or (a small file listed without a blob id) a name from the
/// commit and path.
pub(crate) fn partial_name(f: &RemoteFile, commit: &str) -> String {
    match f.blob_name() {
        Some(n) => n.to_string(),
        None => format!(
            "unnamed-{}",
            &sha256_hex(format!("{commit}/{}", f.path).as_bytes())[..40]
        ),
    }
}

/// Brings `f` into `layout.blobs` (unless already there) and returns its
/// blob name. `prefetched`: its bytes, already fetched (the index read
/// while planning), written without another request.
pub(crate) fn fetch_file(
    http: &Http,
    listing_repo: &str,
    commit: &str,
    layout: &Layout,
    f: &RemoteFile,
    prefetched: Option<&[u8]>,
    progress: &Progress,
) -> Result<String> {
    if let Some(name) = f.blob_name()
        && have_blob(layout, name, f.size)
    {
        progress.add(f.size);
        return Ok(name.to_string());
    }
    let pname = partial_name(f, commit);
    std::fs::create_dir_all(&layout.blobs).map_err(|e| HubError::io(&layout.blobs, e))?;
    std::fs::create_dir_all(&layout.locks).map_err(|e| HubError::io(&layout.locks, e))?;
    let lock_path = layout.lock(&pname);
    let lock = File::create(&lock_path).map_err(|e| HubError::io(&lock_path, e))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Err(HubError::Locked { path: lock_path }),
        // A filesystem without locks: go on unlocked.
        Err(std::fs::TryLockError::Error(_)) => {}
    }
    if let Some(name) = f.blob_name()
        && have_blob(layout, name, f.size)
    {
        progress.add(f.size);
        return Ok(name.to_string());
    }
    let ppath = layout.partial(&pname);
    let mut part = open_partial(&ppath, f, progress)?;
    let resumed = part.have > 0;
    let url = file_url(http.endpoint(), listing_repo, commit, &f.path);
    let got = match prefetched {
        Some(bytes) => {
            part.restart(f, progress)?;
            part.append(bytes, f.size)?;
            progress.add(bytes.len() as u64);
            Ok(())
        }
        None => http.retry(&f.path, || attempt(http, &url, f, &mut part, progress)),
    };
    if let Err(e) = got {
        if matches!(e, HubError::Changed { .. }) {
            drop(part);
            let _ = std::fs::remove_file(&ppath);
        }
        return Err(e);
    }
    match finish(layout, f, part, &ppath) {
        // A partial left by an earlier run may hold bytes that never
        // reached the disk whole: one fresh try before giving up.
        Err(HubError::Digest { .. }) if resumed => {
            progress.sub(f.size);
            let mut part = open_partial(&ppath, f, progress)?;
            http.retry(&f.path, || attempt(http, &url, f, &mut part, progress))?;
            finish(layout, f, part, &ppath)
        }
        other => other,
    }
}

fn have_blob(layout: &Layout, name: &str, size: u64) -> bool {
    std::fs::metadata(layout.blob(name)).is_ok_and(|m| m.is_file() && m.len() == size)
}

/// Opens (or makes) the partial, hashing what it already holds.
fn open_partial<'a>(path: &'a Path, f: &RemoteFile, progress: &Progress) -> Result<Partial<'a>> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| HubError::io(path, e))?;
    let mut have = file.metadata().map_err(|e| HubError::io(path, e))?.len();
    if have > f.size {
        file.set_len(0).map_err(|e| HubError::io(path, e))?;
        have = 0;
    }
    let mut hasher = Hasher::new(&f.expected(), f.size);
    let mut buf = vec![0u8; CHUNK];
    let mut left = have;
    while left > 0 {
        let n = file
            .read(&mut buf[..left.min(CHUNK as u64) as usize])
            .map_err(|e| HubError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    let have = have - left;
    file.set_len(have).map_err(|e| HubError::io(path, e))?;
    file.seek(SeekFrom::Start(have))
        .map_err(|e| HubError::io(path, e))?;
    progress.add(have);
    Ok(Partial {
        file,
        path,
        have,
        hasher,
    })
}

/// The server's word on the file must agree with the listing: the same
/// digest (when its ETag has a digest's shape) and size.
fn check_identity(f: &RemoteFile, head: &Head) -> Result<(), Failure> {
    let listed = f.expected();
    if let (Some(e), Some(want)) = (&head.etag, listed.digest()) {
        let comparable = match listed {
            Expected::Sha256(_) => is_hex(e, 64),
            Expected::GitBlob(_) => is_hex(e, 40),
        };
        if comparable && e != want {
            return Err(Failure::Fatal(HubError::Changed {
                file: f.path.clone(),
                expected: want.to_string(),
                got: e.clone(),
            }));
        }
    }
    if let Some(n) = head.linked_size
        && n != f.size
    {
        return Err(Failure::Fatal(HubError::Changed {
            file: f.path.clone(),
            expected: format!("{} bytes", f.size),
            got: format!("{n} bytes"),
        }));
    }
    Ok(())
}

/// One request for the bytes still missing, appended as they arrive.
fn attempt(
    http: &Http,
    url: &str,
    f: &RemoteFile,
    part: &mut Partial,
    progress: &Progress,
) -> Result<(), Failure> {
    if part.have == f.size && f.size > 0 {
        return Ok(());
    }
    let range = (part.have > 0).then(|| (part.have, f.size - 1));
    let (head, mut resp) = http.get(&f.path, url, range)?;
    check_identity(f, &head)?;
    match (head.status, range) {
        (206, Some((a, b))) => {
            let got = head
                .content_range
                .clone()
                .unwrap_or_else(|| "no Content-Range".into());
            if parse_content_range(&got) != Some((a, b, f.size)) {
                return Err(Failure::Fatal(HubError::BadRange {
                    file: f.path.clone(),
                    start: a,
                    end: b,
                    got: format!("{} {got}", head.status),
                }));
            }
        }
        (200, _) => {
            if head.content_length.is_some_and(|n| n != f.size) {
                return Err(Failure::Fatal(HubError::Changed {
                    file: f.path.clone(),
                    expected: format!("{} bytes", f.size),
                    got: format!("{} bytes", head.content_length.unwrap_or(0)),
                }));
            }
            if part.have > 0 {
                part.restart(f, progress)?;
            }
        }
        (s, _) => {
            return Err(Failure::Fatal(HubError::protocol(
                &f.path,
                format!(
                    "HTTP {s} to a GET{}",
                    if range.is_some() { " with Range" } else { "" }
                ),
            )));
        }
    }
    let start = part.have;
    let mut buf = vec![0u8; CHUNK];
    while part.have < f.size {
        if http.stopped() {
            return Err(Failure::Fatal(HubError::Stopped));
        }
        let want = (f.size - part.have).min(CHUNK as u64) as usize;
        let n = match resp.read(&mut buf[..want]) {
            Ok(0) => {
                return Err(Failure::Transient {
                    msg: format!("{}: body ended at byte {} of {}", f.path, part.have, f.size),
                    progressed: part.have > start,
                });
            }
            Ok(n) => n,
            Err(e) => {
                return Err(Failure::Transient {
                    msg: format!("{}: reading at byte {}: {e}", f.path, part.have),
                    progressed: part.have > start,
                });
            }
        };
        part.append(&buf[..n], f.size - part.have)?;
        progress.add(n as u64);
        progress.fetched.fetch_add(n as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// Checks the digest and renames the partial to its blob; a mismatch
/// deletes the partial.
fn finish(layout: &Layout, f: &RemoteFile, part: Partial, ppath: &Path) -> Result<String> {
    let Partial {
        file, have, hasher, ..
    } = part;
    file.sync_all().map_err(|e| HubError::io(ppath, e))?;
    drop(file);
    let got = hasher.hex();
    let expected = f.expected();
    if have != f.size || expected.digest().is_some_and(|d| d != got) {
        let _ = std::fs::remove_file(ppath);
        return Err(HubError::Digest {
            file: f.path.clone(),
            algo: expected.algo(),
            expected: expected.digest().unwrap_or("(none listed)").to_string(),
            got: if have != f.size {
                format!("{have} bytes instead of {}", f.size)
            } else {
                got
            },
        });
    }
    let final_path = layout.blob(&got);
    std::fs::rename(ppath, &final_path).map_err(|e| HubError::io(&final_path, e))?;
    Ok(got)
}
