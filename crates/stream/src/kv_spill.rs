//! Attention-cache blocks beyond the RAM share, kept in one file.
//!
//! [`FileSpill`] implements [`fathom_model::KvSpill`]: a file created under
//! `--kv-dir` and unlinked at once (it lives as long as the process; a crash
//! leaves nothing behind), cut into fixed slots of the first block's size
//! rounded up to 4 KiB. Writes and reads bypass the page cache where the
//! filesystem allows (`O_DIRECT`, `F_NOCACHE` on macOS), so spilled blocks
//! do not sit in the page cache outside the budget. Reads run on one reader thread per file (the caller asks for the
//! next window before using the current one), each merging runs of
//! consecutive slots into one positional read.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};

use fathom_model::kv::{KvPending, KvSpill};
use fathom_weights::{AlignedBuf, IO_ALIGN};

struct Slots {
    /// Slot size in bytes (fixed by the first write).
    size: u64,
    next: u64,
    free: Vec<u64>,
}

struct Inner {
    file: File,
    direct: bool,
    slots: Mutex<Slots>,
    /// The slot size, for the reader thread.
    size: Arc<AtomicU64>,
    /// Jobs for the one reader thread (it ends when this is dropped).
    jobs: Mutex<mpsc::Sender<Job>>,
}

/// Slots to read, and where their bytes go.
type Job = (
    Vec<(u64, usize)>,
    mpsc::Sender<std::io::Result<Vec<Vec<u8>>>>,
);

/// The spill file of one process, made when first needed.
pub struct FileSpill {
    dir: PathBuf,
    want_direct: bool,
    inner: std::sync::OnceLock<Arc<Inner>>,
}

impl FileSpill {
    /// Creates the spill file in `dir` (made if missing) now, uncached
    /// when `direct` and the filesystem allows it.
    pub fn create(dir: &Path, direct: bool) -> std::io::Result<Self> {
        let s = Self::lazy(dir, direct);
        s.inner()?;
        Ok(s)
    }

    /// A spill file in `dir` created at the first write (nothing is made
    /// while every block fits the RAM share).
    pub fn lazy(dir: &Path, direct: bool) -> Self {
        FileSpill {
            dir: dir.to_path_buf(),
            want_direct: direct,
            inner: std::sync::OnceLock::new(),
        }
    }

    fn inner(&self) -> std::io::Result<&Arc<Inner>> {
        if let Some(i) = self.inner.get() {
            return Ok(i);
        }
        let made = Arc::new(open_file(&self.dir, self.want_direct)?);
        Ok(self.inner.get_or_init(|| made))
    }

    /// Whether reads and writes bypass the page cache (`None`: not made yet).
    pub fn is_direct(&self) -> Option<bool> {
        self.inner.get().map(|i| i.direct)
    }
}

fn open_file(dir: &Path, direct: bool) -> std::io::Result<Inner> {
    {
        std::fs::create_dir_all(dir)?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = dir.join(format!("fathom-kv-{}-{nanos}.blocks", std::process::id()));
        let mut opts = File::options();
        opts.read(true).write(true).create_new(true);
        let uncached = || fathom_platform::io::open_uncached_with(&opts, &path);
        let (file, direct) = match direct.then(uncached) {
            Some(Ok(f)) if probe(&f) => (f, true),
            Some(Ok(f)) => {
                drop(f);
                std::fs::remove_file(&path)?;
                (opts.open(&path)?, false)
            }
            _ => (opts.open(&path)?, false),
        };
        // The file lives while it is open; nothing is left after the process.
        std::fs::remove_file(&path)?;
        let size = Arc::new(AtomicU64::new(0));
        let (tx, rx) = mpsc::channel::<Job>();
        let (rfile, rsize) = (file.try_clone()?, size.clone());
        std::thread::Builder::new()
            .name("fathom-kv-read".into())
            .spawn(move || {
                for (slots, reply) in rx {
                    let _ = reply.send(read_slots(&rfile, rsize.load(Ordering::Acquire), &slots));
                }
            })?;
        Ok(Inner {
            file,
            direct,
            slots: Mutex::new(Slots {
                size: 0,
                next: 0,
                free: Vec::new(),
            }),
            size,
            jobs: Mutex::new(tx),
        })
    }
}

/// Some filesystems accept an uncached open and fail the I/O.
fn probe(f: &File) -> bool {
    let buf = AlignedBuf::zeroed(IO_ALIGN);
    let ok = f.write_at(&buf, 0).is_ok();
    ok && f.set_len(0).is_ok()
}

fn round_up(n: u64) -> u64 {
    n.div_ceil(IO_ALIGN as u64) * IO_ALIGN as u64
}

impl KvSpill for FileSpill {
    fn write(&self, bytes: &[u8]) -> std::io::Result<u64> {
        let inner = self.inner()?;
        let (slot, size) = {
            let mut s = inner.slots.lock().unwrap_or_else(|p| p.into_inner());
            if s.size == 0 {
                s.size = round_up(bytes.len() as u64).max(IO_ALIGN as u64);
                inner.size.store(s.size, Ordering::Release);
            }
            if bytes.len() as u64 > s.size {
                return Err(std::io::Error::other(format!(
                    "a block of {} bytes does not fit the {}-byte slots",
                    bytes.len(),
                    s.size
                )));
            }
            let slot = match s.free.pop() {
                Some(f) => f,
                None => {
                    s.next += 1;
                    s.next - 1
                }
            };
            (slot, s.size)
        };
        let mut buf = AlignedBuf::zeroed(size as usize);
        buf[..bytes.len()].copy_from_slice(bytes);
        inner.file.write_all_at(&buf, slot * size)?;
        Ok(slot)
    }

    fn read(&self, slots: Vec<(u64, usize)>) -> Box<dyn KvPending> {
        let inner = match self.inner() {
            Ok(i) => i,
            Err(e) => return Box::new(Failed(Some(e))),
        };
        let (tx, rx) = mpsc::channel();
        let jobs = inner.jobs.lock().unwrap_or_else(|p| p.into_inner());
        if jobs.send((slots, tx)).is_err() {
            return Box::new(Failed(Some(std::io::Error::other(
                "the cache reader thread ended",
            ))));
        }
        Box::new(Pending(rx))
    }

    fn free(&self, slot: u64) {
        if let Some(i) = self.inner.get() {
            let mut s = i.slots.lock().unwrap_or_else(|p| p.into_inner());
            s.free.push(slot);
        }
    }

    fn location(&self) -> String {
        format!("(spill file in --kv-dir {})", self.dir.display())
    }
}

/// Reads `slots` in order, one positional read per run of consecutive slots.
fn read_slots(file: &File, size: u64, slots: &[(u64, usize)]) -> std::io::Result<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(slots.len());
    let mut i = 0;
    while i < slots.len() {
        let mut j = i + 1;
        while j < slots.len() && slots[j].0 == slots[j - 1].0 + 1 {
            j += 1;
        }
        let mut buf = AlignedBuf::zeroed((size * (j - i) as u64) as usize);
        file.read_exact_at(&mut buf, slots[i].0 * size)?;
        for (k, &(_, len)) in slots[i..j].iter().enumerate() {
            let at = k * size as usize;
            out.push(buf[at..at + len].to_vec());
        }
        i = j;
    }
    Ok(out)
}

struct Failed(Option<std::io::Error>);

impl KvPending for Failed {
    fn wait(mut self: Box<Self>) -> std::io::Result<Vec<Vec<u8>>> {
        Err(self
            .0
            .take()
            .unwrap_or_else(|| std::io::Error::other("no spill file")))
    }
}

struct Pending(mpsc::Receiver<std::io::Result<Vec<Vec<u8>>>>);

impl KvPending for Pending {
    fn wait(self: Box<Self>) -> std::io::Result<Vec<Vec<u8>>> {
        self.0
            .recv()
            .unwrap_or_else(|_| Err(std::io::Error::other("the cache reader thread failed")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_and_slots_are_reused() {
        let dir = std::env::temp_dir().join(format!("fathom-kv-test-{}", std::process::id()));
        let s = FileSpill::create(&dir, true).unwrap();
        let a: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let sa = s.write(&a).unwrap();
        let sb = s.write(&b).unwrap();
        assert_eq!((sa, sb), (0, 1));
        let got = s.read(vec![(sb, b.len()), (sa, a.len())]).wait().unwrap();
        assert_eq!(got, vec![b.clone(), a.clone()]);
        s.free(sa);
        assert_eq!(s.write(&b).unwrap(), sa, "a freed slot is reused");
        assert!(
            s.write(&vec![0u8; 9000]).is_err(),
            "a larger block is refused"
        );
        // The file was unlinked at creation: the directory holds nothing of it.
        let left = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(left, 0);
        let _ = std::fs::remove_dir(&dir);
    }
}
