//! Files and pages: uncached positional I/O, page-cache advice and
//! residency, free disk space, anonymous mappings.
//!
//! Uncached reads keep what fathom reads out of the page cache, so weights
//! sit once in RAM (in fathom's budgeted buffers), not twice:
//!
//! * Linux: `O_DIRECT`. The buffer address, the file offset and the length
//!   must all be multiples of the device's logical block size;
//!   [`DIRECT_ALIGN`] (4 KiB) covers every device fathom targets. Some
//!   filesystems (tmpfs, some overlays) refuse the flag at open or at the
//!   first read: callers probe and fall back to buffered I/O.
//! * macOS: `F_NOCACHE` (the unified buffer cache keeps no copy of what
//!   this descriptor reads or writes) with `F_RDAHEAD` off, and ordinary
//!   `pread`. No alignment is required, but aligned transfers of whole
//!   pages avoid a partial-page copy, so callers align the same way.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;
use std::ptr::NonNull;

#[cfg(target_os = "macos")]
use std::os::unix::io::AsRawFd;
#[cfg(target_os = "linux")]
use std::os::unix::{fs::OpenOptionsExt, io::AsRawFd};

/// Alignment of the buffer address, file offset and length of an uncached
/// transfer.
pub const DIRECT_ALIGN: usize = 4096;

/// Opens `path` for reading with the page cache bypassed.
pub fn open_uncached(path: &Path) -> io::Result<File> {
    open_uncached_with(File::options().read(true), path)
}

/// Opens `path` with `opts` (read, write, create...) and the page cache
/// bypassed for every transfer through the file. `Unsupported` on systems
/// without such a mode; on Linux the filesystem may refuse `O_DIRECT`
/// (`InvalidInput`), and some accept it here but fail the first transfer.
pub fn open_uncached_with(opts: &OpenOptions, path: &Path) -> io::Result<File> {
    #[cfg(target_os = "linux")]
    {
        let mut o = opts.clone();
        o.custom_flags(libc::O_DIRECT);
        o.open(path)
    }
    #[cfg(target_os = "macos")]
    {
        let f = opts.open(path)?;
        let fd = f.as_raw_fd();
        // SAFETY: fcntl with integer arguments on a descriptor we own.
        let ok = unsafe {
            libc::fcntl(fd, libc::F_NOCACHE, 1) == 0 && libc::fcntl(fd, libc::F_RDAHEAD, 0) == 0
        };
        if ok {
            Ok(f)
        } else {
            Err(io::Error::last_os_error())
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        let _ = (opts, path);
        Err(crate::unsupported("uncached file I/O"))
    }
}

/// Advice to the page cache about a file range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// Reads will be scattered: no read-ahead (Linux `POSIX_FADV_RANDOM`,
    /// macOS `F_RDAHEAD` off, for the whole file).
    Random,
    /// The range is done with: drop its clean pages (Linux
    /// `POSIX_FADV_DONTNEED`). macOS has no such call: unsupported there.
    DontNeed,
}

/// Gives `advice` for `[offset, offset + len)` of `file` (`len` 0: to the
/// end). Returns whether the system took it; a refused hint changes only
/// what stays cached, never what is read.
pub fn advise(file: &File, offset: u64, len: u64, advice: Advice) -> bool {
    #[cfg(target_os = "linux")]
    {
        let a = match advice {
            Advice::Random => libc::POSIX_FADV_RANDOM,
            Advice::DontNeed => libc::POSIX_FADV_DONTNEED,
        };
        let (Ok(off), Ok(n)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return false;
        };
        // SAFETY: plain fadvise on a valid descriptor; no memory is passed.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), off, n, a) == 0 }
    }
    #[cfg(target_os = "macos")]
    {
        let _ = (offset, len);
        match advice {
            // SAFETY: fcntl with an integer argument on a valid descriptor.
            Advice::Random => unsafe { libc::fcntl(file.as_raw_fd(), libc::F_RDAHEAD, 0) == 0 },
            Advice::DontNeed => false,
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        let _ = (file, offset, len, advice);
        false
    }
}

/// Whether [`Advice::DontNeed`] can drop pages on this system.
pub const fn drop_cache_support() -> crate::Support {
    crate::Support::on(cfg!(target_os = "linux"))
}

/// The system's memory page size in bytes (16 KiB on Apple Silicon).
pub fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Bytes of `path` now in the page cache (`mincore` over a read-only
/// shared map of the file).
pub fn cached_bytes(path: &Path) -> io::Result<u64> {
    let f = File::open(path)?;
    let len = usize::try_from(f.metadata()?.len())
        .map_err(|_| io::Error::other("file too large to map"))?;
    if len == 0 {
        return Ok(0);
    }
    let addr = map_file_readonly(&f, len).ok_or_else(io::Error::last_os_error)?;
    let page = page_size();
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: `vec` has one byte per page of the mapping, as mincore writes.
    let rc = unsafe { libc::mincore(addr.as_ptr().cast(), len, vec.as_mut_ptr().cast()) };
    let err = (rc != 0).then(io::Error::last_os_error);
    // SAFETY: the mapping made above, with its length, unmapped once, no
    // reference into it kept.
    unsafe { unmap(addr, len) };
    match err {
        Some(e) => Err(e),
        None => Ok(vec.iter().filter(|&&b| b & 1 == 1).count() as u64 * page as u64),
    }
}

/// Bytes available to an unprivileged user on the filesystem of `dir`.
// The statvfs field types are u64 on 64-bit Linux but narrower elsewhere.
#[allow(clippy::unnecessary_cast)]
pub fn free_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` points to writable
    // memory of the size statvfs fills; nothing else aliases it.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialised the whole struct (and
    // it was zeroed before, so no byte is uninitialised either way).
    let st = unsafe { st.assume_init() };
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

/// A fresh private anonymous mapping of `len` bytes (page-aligned,
/// zero-filled by the kernel); `None` when the system refuses it or `len`
/// is 0. Free it with [`unmap`].
pub fn map_anonymous(len: usize) -> Option<NonNull<u8>> {
    // SAFETY: a new private anonymous mapping; no existing memory is touched.
    unsafe {
        map_new(
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANON,
            -1,
        )
    }
}

/// A new mapping of `len` bytes at offset 0 of `fd` (-1: anonymous);
/// `None` when refused or `len` is 0.
///
/// # Safety
/// `prot`, `flags` and `fd` make a new mapping that touches no existing
/// memory (no `MAP_FIXED`), `fd` open or -1 with `MAP_ANON`.
unsafe fn map_new(len: usize, prot: i32, flags: i32, fd: i32) -> Option<NonNull<u8>> {
    if len == 0 {
        return None;
    }
    // SAFETY: as the caller promises: a fresh mapping chosen by the system.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        return None;
    }
    NonNull::new(p.cast())
}

/// Returns a mapping made by [`map_anonymous`] or [`map_file_readonly`] to
/// the system.
///
/// # Safety
/// `ptr` and `len` are exactly those of one live mapping made here,
/// unmapped once, with no reference into it left.
pub unsafe fn unmap(ptr: NonNull<u8>, len: usize) {
    // SAFETY: the caller hands a live mapping of exactly this length.
    unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
}

/// A read-only shared mapping of the first `len` bytes of `file`
/// (page-aligned; its pages are the page cache's, read from the file as
/// they are touched and dropped again by [`drop_mapped_pages`]); `None`
/// when the system refuses it or `len` is 0. Free it with [`unmap`].
pub fn map_file_readonly(file: &File, len: usize) -> Option<NonNull<u8>> {
    use std::os::unix::io::AsRawFd as _;
    // SAFETY: a new read-only shared mapping of an open descriptor; no
    // existing memory is touched, and nothing can write through it.
    unsafe { map_new(len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd()) }
}

/// Drops the pages of `[ptr, ptr + len)` (widened to whole pages) from this
/// process's memory: a later read of the range faults them in from the
/// file again, with the same bytes.
///
/// # Safety
/// The range lies inside one live [`map_file_readonly`] mapping (widened
/// to whole pages, it still does: mappings are page-aligned and whole pages).
pub unsafe fn drop_mapped_pages(ptr: *const u8, len: usize) {
    if len == 0 {
        return;
    }
    let page = page_size();
    let start = ptr as usize / page * page;
    let end = (ptr as usize + len).div_ceil(page) * page;
    // SAFETY: the caller's range lies in a read-only file mapping: dropping
    // its pages loses nothing (they are the file's, re-read on the next touch).
    unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target");
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(format!("platform-{name}-{}", std::process::id()))
    }

    #[test]
    fn uncached_reads_return_the_file_bytes() {
        let p = scratch("uncached");
        let data: Vec<u8> = (0..3 * DIRECT_ALIGN).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let f = match open_uncached(&p) {
            Ok(f) => f,
            Err(e) => {
                std::fs::remove_file(&p).unwrap();
                eprintln!("skipped: this filesystem refuses uncached opens ({e})");
                return;
            }
        };
        let buf = map_anonymous(DIRECT_ALIGN).unwrap();
        // SAFETY: a live mapping of DIRECT_ALIGN bytes, only used here.
        let s = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), DIRECT_ALIGN) };
        let r = f.read_at(s, DIRECT_ALIGN as u64);
        if let Err(e) = &r {
            eprintln!("skipped: this filesystem fails uncached reads ({e})");
        } else {
            assert_eq!(r.unwrap(), DIRECT_ALIGN);
            assert_eq!(&s[..], &data[DIRECT_ALIGN..2 * DIRECT_ALIGN]);
        }
        // SAFETY: the mapping above, no slice of it used after this.
        unsafe { unmap(buf, DIRECT_ALIGN) };
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn advice_is_taken_where_the_system_has_it() {
        let p = scratch("advice");
        std::fs::write(&p, vec![1u8; 1 << 16]).unwrap();
        let f = File::open(&p).unwrap();
        assert!(advise(&f, 0, 0, Advice::Random));
        assert_eq!(
            advise(&f, 0, 4096, Advice::DontNeed),
            drop_cache_support().is_available()
        );
        // An offset beyond off_t is refused, not wrapped.
        if cfg!(target_os = "linux") {
            assert!(!advise(&f, u64::MAX, 1, Advice::DontNeed));
        }
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn anonymous_maps_are_zeroed_and_aligned() {
        let len = 3 * page_size() + 5;
        let m = map_anonymous(len).unwrap();
        assert_eq!(m.as_ptr() as usize % page_size(), 0);
        // SAFETY: a live mapping of `len` bytes, only used here.
        let s = unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), len) };
        assert!(s.iter().all(|&b| b == 0));
        s[len - 1] = 9;
        // SAFETY: the mapping above, no slice of it used after this.
        unsafe { unmap(m, len) };
        assert!(map_anonymous(0).is_none());
    }

    #[test]
    fn free_space_and_residency_are_read() {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        assert!(free_space(here).is_some_and(|b| b > 0));
        assert_eq!(free_space(Path::new("/nonexistent-fathom/x")), None);
        let p = scratch("resident");
        std::fs::write(&p, vec![3u8; 1 << 20]).unwrap();
        let c = cached_bytes(&p).unwrap();
        assert!(c <= (1 << 20) + page_size() as u64, "{c}");
        std::fs::write(&p, b"").unwrap();
        assert_eq!(cached_bytes(&p).unwrap(), 0);
        std::fs::remove_file(&p).unwrap();
    }
}
