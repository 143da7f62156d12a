//! Checkpoint bytes mapped instead of read, for matrices that live on a
//! device: a spine layer held in VRAM (`fathom_model::tiers`, the device
//! tier) keeps a read-only map of its matrices' bytes as their host copy.
//! The backend copies them up once and then drops their pages
//! ([`release_copied`]), so they cost no RAM; a product the device does
//! not take (its copy pushed out, a shape it declines) reads them on the
//! CPU, the pages faulting in from the file with the same bytes.
//!
//! The held ranges are registered here ([`hold`]) so the backend knows
//! which host bytes have no RAM behind them once copied (their device
//! copies outrank copies of bytes that stay in RAM).

use std::collections::BTreeMap;
use std::fs::File;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A whole shard mapped read-only.
pub struct ShardMap {
    ptr: NonNull<u8>,
    len: usize,
    file: Arc<File>,
}

// SAFETY: the mapping is read-only and lives until the last `Arc` drops;
// any thread may read it.
unsafe impl Send for ShardMap {}
// SAFETY: as above: shared reads of read-only memory.
unsafe impl Sync for ShardMap {}

impl std::fmt::Debug for ShardMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShardMap({} bytes)", self.len)
    }
}

impl ShardMap {
    /// Maps the first `len` bytes of `file`; `None` when the system refuses.
    pub fn new(file: Arc<File>, len: usize) -> Option<Arc<ShardMap>> {
        let ptr = fathom_platform::io::map_file_readonly(&file, len)?;
        Some(Arc::new(ShardMap { ptr, len, file }))
    }
}

impl Drop for ShardMap {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are this mapping's; every `Mapped` into it
        // holds the `Arc`, so no reference into it is left.
        unsafe { fathom_platform::io::unmap(self.ptr, self.len) };
    }
}

/// One tensor's bytes inside a mapped shard.
#[derive(Clone, Debug)]
pub struct Mapped {
    map: Arc<ShardMap>,
    off: usize,
    len: usize,
}

/// Element types a mapped tensor can be viewed as (any bit pattern is a
/// value).
pub trait Word: Copy + 'static {}
impl Word for u8 {}
impl Word for i8 {}
impl Word for u16 {}
impl Word for f32 {}

impl Mapped {
    /// `len` bytes at `off` of `map`; `None` past its end.
    pub fn new(map: Arc<ShardMap>, off: usize, len: usize) -> Option<Mapped> {
        (off.checked_add(len)? <= map.len).then_some(Mapped { map, off, len })
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `off + len` lies inside the live, read-only mapping
        // (checked in `new`), which the held `Arc` keeps mapped.
        unsafe { std::slice::from_raw_parts(self.map.ptr.as_ptr().add(self.off), self.len) }
    }

    /// The bytes as `T`s; `None` when they are not aligned for `T` or not
    /// a whole number of them (the caller then reads them instead).
    pub fn words<T: Word>(&self) -> Option<&[T]> {
        let b = self.bytes();
        let size = std::mem::size_of::<T>();
        if !(b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
            || !b.len().is_multiple_of(size)
            || cfg!(target_endian = "big")
        {
            return None;
        }
        // SAFETY: aligned for `T`, a whole number of `T`s, every bit
        // pattern a `T` (`Word`), the files little-endian as the target;
        // the bytes live as long as `self`.
        Some(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<T>(), b.len() / size) })
    }
}

/// A held range: its length, its file and the file offset of its start.
struct Held {
    len: usize,
    file: Arc<File>,
    file_off: u64,
}

static HELD: Mutex<BTreeMap<usize, Held>> = Mutex::new(BTreeMap::new());
static HELD_COUNT: AtomicUsize = AtomicUsize::new(0);

fn held_map() -> std::sync::MutexGuard<'static, BTreeMap<usize, Held>> {
    HELD.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers `m`'s bytes as the host copy of a matrix held on the device.
pub fn hold(m: &Mapped) {
    let start = m.bytes().as_ptr() as usize;
    let h = Held {
        len: m.len,
        file: m.map.file.clone(),
        file_off: m.off as u64,
    };
    if held_map().insert(start, h).is_none() {
        HELD_COUNT.fetch_add(1, Ordering::Relaxed);
    }
}

/// Forgets `m`'s registration (its owner drops it).
pub fn unhold(m: &Mapped) {
    if held_map().remove(&(m.bytes().as_ptr() as usize)).is_some() {
        HELD_COUNT.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The held range `[addr, addr + len)` lies in: its start and record.
fn held_at(m: &BTreeMap<usize, Held>, addr: usize, len: usize) -> Option<(usize, &Held)> {
    let (&s, h) = m.range(..=addr).next_back()?;
    (addr + len <= s + h.len).then_some((s, h))
}

/// Whether `[addr, addr + len)` lies inside one held range.
pub fn is_held(addr: usize, len: usize) -> bool {
    HELD_COUNT.load(Ordering::Relaxed) > 0 && held_at(&held_map(), addr, len).is_some()
}

/// Called once `[addr, addr + len)` has been copied to a device (or
/// otherwise read through): when it lies in a held range, its pages leave
/// this process (and the page cache where the system can), read from the
/// file again if the CPU ever needs them. Returns whether it was held.
pub fn release_copied(addr: usize, len: usize) -> bool {
    if HELD_COUNT.load(Ordering::Relaxed) == 0 {
        return false;
    }
    let m = held_map();
    let Some((s, h)) = held_at(&m, addr, len) else {
        return false;
    };
    // SAFETY: the range lies in a held tensor's bytes, inside a live
    // read-only shard mapping (the holder keeps its `Arc` until `unhold`,
    // which needs this lock).
    unsafe { fathom_platform::io::drop_mapped_pages(addr as *const u8, len) };
    let off = h.file_off + (addr - s) as u64;
    fathom_platform::io::advise(
        &h.file,
        off,
        len as u64,
        fathom_platform::io::Advice::DontNeed,
    );
    true
}

/// Bytes of the held ranges now registered.
pub fn held_bytes() -> u64 {
    held_map().values().map(|h| h.len as u64).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The resident bytes of the mapping that starts at `start`, from
    /// `/proc/self/smaps` (Linux); `None` elsewhere.
    fn mapping_rss(start: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((a, _)) = range.split_once('-')
                && let Ok(a) = usize::from_str_radix(a, 16)
                && range.contains('-')
                && !line.starts_with(|c: char| c.is_ascii_uppercase())
            {
                inside = a == start;
                continue;
            }
            if inside && let Some(v) = line.strip_prefix("Rss:") {
                return v
                    .trim()
                    .trim_end_matches(" kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .map(|k| k * 1024);
            }
        }
        None
    }

    #[test]
    fn held_bytes_read_as_the_file_and_leave_ram_once_copied() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("mapped-held-{}", std::process::id()));
        let data: Vec<u8> = (0..(8usize << 20) + 8192)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        std::fs::write(&path, &data).unwrap();
        let file = Arc::new(File::open(&path).unwrap());
        let map = ShardMap::new(file, data.len()).expect("the file maps");
        let start = map.ptr.as_ptr() as usize;
        // An odd offset: the bytes, but no u16 view of them.
        let odd = Mapped::new(map.clone(), 1, 6).unwrap();
        assert_eq!(odd.bytes(), &data[1..7]);
        assert!(odd.words::<u16>().is_none());
        assert!(
            Mapped::new(map.clone(), data.len() - 2, 4).is_none(),
            "past the end"
        );
        let m = Mapped::new(map.clone(), 4096, 8 << 20).unwrap();
        let w = m.words::<u16>().unwrap();
        assert_eq!(w[0], u16::from_le_bytes([data[4096], data[4097]]));
        assert_eq!(m.bytes(), &data[4096..4096 + (8 << 20)]);
        let (addr, len) = (m.bytes().as_ptr() as usize, m.bytes().len());
        assert!(!is_held(addr, len) && !release_copied(addr, len));
        hold(&m);
        assert!(is_held(addr, len) && is_held(addr + 10, 100));
        assert!(!is_held(addr, len + 1), "past the held range");
        if cfg!(target_os = "linux") {
            assert!(
                mapping_rss(start).is_some(),
                "the mapping is in /proc/self/smaps"
            );
        }
        if let Some(before) = mapping_rss(start) {
            assert!(before >= 8 << 20, "the pages were read: {before}");
        }
        assert!(release_copied(addr, len));
        if let Some(after) = mapping_rss(start) {
            assert!(after <= 2 * 4096 * 4, "{after} bytes still mapped");
        } else {
            eprintln!("no /proc/self/smaps here: the pages' release is not checked");
        }
        // The CPU reads them again from the file, the same bytes.
        assert_eq!(m.bytes(), &data[4096..4096 + (8 << 20)]);
        unhold(&m);
        assert!(!is_held(addr, len));
        drop((m, odd, map));
        std::fs::remove_file(&path).unwrap();
    }
}
