//! Uncached reads of any byte range of a shard.
//!
//! `O_DIRECT` (and macOS's `F_NOCACHE`, where aligning is cheaper but not
//! required) wants the buffer address, file offset and length aligned to
//! [`DIRECT_ALIGN`]; a tensor's range and its destination vector are not.
//! So a range is read in aligned spans into an aligned bounce
//! buffer and copied out: one memory copy (tens of GB/s) per byte read from
//! storage (a few GB/s), and no byte of it left in the page cache. This is
//! how a streamed spine reads each pass without the page cache serving some
//! of it or holding a second copy outside the budget.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use fathom_platform::io::DIRECT_ALIGN;

use crate::buf::AlignedBuf;

/// Reads shorter than this stay buffered (headers, norms, biases): the
/// aligned over-read (up to 8 KiB a read) would cost more than it saves.
/// From here up it is at most an eighth of the read.
pub const DIRECT_MIN: usize = 64 << 10;

/// A bounce buffer's size. A read holds one while it runs; up to
/// [`PARTS`] idle buffers are kept for the next reads (part of the process
/// allowance the RAM ledger sets aside), so idle threads hold none.
pub const BOUNCE: usize = 2 << 20;

/// A range this long or longer is read as up to [`PARTS`] parts side by
/// side: one transfer at a time leaves most of an SSD's queues idle.
pub const PARALLEL_MIN: usize = 4 * BOUNCE;

/// The most parts of one range read at once.
pub const PARTS: usize = 4;

/// The idle bounce buffers.
static IDLE: Mutex<Vec<AlignedBuf>> = Mutex::new(Vec::new());

/// Takes an idle bounce buffer, or maps a new one.
fn take_bounce() -> AlignedBuf {
    IDLE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop()
        .unwrap_or_else(|| AlignedBuf::zeroed(BOUNCE))
}

/// Keeps `b` for a later read unless [`PARTS`] are kept already (then it
/// is unmapped).
fn give_bounce(b: AlignedBuf) {
    let mut idle = IDLE.lock().unwrap_or_else(|e| e.into_inner());
    if idle.len() < PARTS {
        idle.push(b);
    }
}

/// One shard's uncached handle: opened on first use; refused (every read
/// buffered from then on) when the filesystem refuses uncached I/O at open
/// or at a transfer. Any other failure to open is tried again next read.
#[derive(Default)]
pub(crate) struct Uncached {
    file: OnceLock<File>,
    refused: AtomicBool,
}

impl std::fmt::Debug for Uncached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.refused.load(Ordering::Relaxed) {
            "refused"
        } else if self.file.get().is_some() {
            "open"
        } else {
            "unopened"
        })
    }
}

/// Whether an error says the filesystem does not take uncached I/O.
fn refusal(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::InvalidInput | io::ErrorKind::Unsupported
    )
}

impl Uncached {
    /// Reads `buf.len()` bytes at `offset` of `path` uncached; the range
    /// must lie inside the file (the caller checks). `Ok(false)` when
    /// uncached reads are not possible there (the caller reads buffered);
    /// an error for a failed read.
    pub fn read(&self, path: &Path, offset: u64, buf: &mut [u8]) -> io::Result<bool> {
        if self.refused.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let file = match self.file.get() {
            Some(f) => f,
            None => match fathom_platform::io::open_uncached(path) {
                Ok(f) => self.file.get_or_init(|| f),
                Err(e) => {
                    if refusal(&e) {
                        self.refused.store(true, Ordering::Relaxed);
                    }
                    return Ok(false);
                }
            },
        };
        match read_spans(file, offset, buf) {
            Ok(()) => Ok(true),
            // Accepted at open, refused at a transfer (tmpfs and some
            // overlays): buffered from now on.
            Err(e) if refusal(&e) => {
                self.refused.store(true, Ordering::Relaxed);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

/// Reads `[offset, offset + buf.len())` of `file`: a long range as up to
/// [`PARTS`] consecutive parts on their own threads, each in aligned spans
/// through its own bounce buffer. The bytes are the same however it is
/// split; the first error is returned.
fn read_spans(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    if buf.len() < PARALLEL_MIN {
        return read_part(file, offset, buf);
    }
    let each = buf.len().div_ceil(PARTS);
    // Parts are claimed in turn by this thread and helpers (a helper that
    // cannot be started leaves its share to the others).
    let slots: Vec<Mutex<&mut [u8]>> = buf.chunks_mut(each).map(Mutex::new).collect();
    let next = AtomicUsize::new(0);
    let work = || {
        let mut r = Ok(());
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(slot) = slots.get(i) else { return r };
            let mut part = slot.lock().unwrap_or_else(|e| e.into_inner());
            r = r.and(read_part(file, offset + (i * each) as u64, &mut part));
        }
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = (1..slots.len())
            .filter_map(|_| {
                std::thread::Builder::new()
                    .name("fathom-read-part".into())
                    .spawn_scoped(s, work)
                    .ok()
            })
            .collect();
        let mut r = work();
        for h in helpers {
            let part = h
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("a read thread panicked")));
            r = r.and(part);
        }
        r
    })
}

/// One part of [`read_spans`], on the calling thread.
fn read_part(file: &File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut bounce = take_bounce();
    let r = read_spans_with(file, offset, buf, &mut bounce);
    give_bounce(bounce);
    r
}

fn read_spans_with(
    file: &File,
    offset: u64,
    buf: &mut [u8],
    bounce: &mut AlignedBuf,
) -> io::Result<()> {
    let a = DIRECT_ALIGN as u64;
    let mut done = 0usize;
    while done < buf.len() {
        let pos = offset + done as u64;
        let start = pos / a * a;
        let skip = (pos - start) as usize;
        let want = (BOUNCE - skip).min(buf.len() - done);
        let span = (skip + want).next_multiple_of(DIRECT_ALIGN);
        let mut got = 0usize;
        while got < skip + want {
            // Only the file's end gives a short read, so `got` stays
            // aligned until the bytes wanted are in.
            let n = match file.read_at(&mut bounce[got..span], start + got as u64) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the file ends before byte {}", pos + want as u64),
                ));
            }
            got += n;
        }
        buf[done..done + want].copy_from_slice(&bounce[skip..skip + want]);
        done += want;
    }
    Ok(())
}
