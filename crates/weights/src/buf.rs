//! An owned byte buffer aligned for direct I/O.
//!
//! Uncached reads (`O_DIRECT`) need the buffer address, file offset and
//! length aligned to the device's logical block size; 4 KiB covers every
//! device we target ([`fathom_platform::io::DIRECT_ALIGN`]).
//!
//! Buffers of [`MMAP_MIN`] bytes or more are mapped straight from the kernel
//! and unmapped on drop. Streamed experts are allocated and freed all the
//! time from many I/O threads; through malloc, freed buffers would linger in
//! per-thread arenas and the process would hold more than the RAM budget
//! says. A mapping is returned to the system the moment it is dropped.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment of every [`AlignedBuf`].
pub const IO_ALIGN: usize = fathom_platform::io::DIRECT_ALIGN;

/// Buffers at least this large are anonymous mappings (page-aligned).
pub const MMAP_MIN: usize = 256 << 10;

pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// A read buffer ([`AlignedBuf::for_reading`]): returns to the pool on
    /// drop; whether it is page-locked.
    read: Option<bool>,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes, 4 KiB-aligned.
    pub fn zeroed(len: usize) -> Self {
        if len == 0 {
            return AlignedBuf {
                ptr: NonNull::<u64>::dangling().cast(),
                len: 0,
                read: None,
            };
        }
        if len >= MMAP_MIN {
            // A fresh anonymous mapping: page-aligned, zero-filled by the kernel.
            let ptr = fathom_platform::io::map_anonymous(len).unwrap_or_else(|| {
                std::alloc::handle_alloc_error(
                    Layout::from_size_align(len, IO_ALIGN).expect("buffer size overflows"),
                )
            });
            return AlignedBuf {
                ptr,
                len,
                read: None,
            };
        }
        let layout = Layout::from_size_align(len, IO_ALIGN).expect("buffer size overflows");
        // SAFETY: layout has non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf {
            ptr,
            len,
            read: None,
        }
    }

    /// A buffer of `len` bytes, 4 KiB-aligned, for a read that fills it:
    /// one of the same length from the pool of freed read buffers when
    /// there is one (its old bytes still in it), else a fresh mapping,
    /// page-locked when a device backend asked for that
    /// ([`crate::pool`]) — never on unified memory, where the device reads
    /// RAM in place ([`fathom_platform::unified_memory`]). Small lengths
    /// are plain zeroed buffers.
    pub fn for_reading(len: usize) -> Self {
        if len < MMAP_MIN {
            return Self::zeroed(len);
        }
        if let Some((ptr, pinned)) = crate::pool::take(len) {
            return AlignedBuf {
                ptr,
                len,
                read: Some(pinned),
            };
        }
        let mut b = Self::zeroed(len);
        b.read = Some(!fathom_platform::unified_memory() && crate::pool::pin(b.ptr, len));
        b
    }

    /// Whether this buffer is page-locked for a device.
    pub fn is_pinned(&self) -> bool {
        self.read == Some(true)
    }

    pub fn from_slice(data: &[u8]) -> Self {
        let mut b = Self::zeroed(data.len());
        b.copy_from_slice(data);
        b
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(pinned) = self.read {
            if crate::pool::give(self.ptr, self.len, pinned) {
                return;
            }
            if pinned && !crate::pool::unpin(self.ptr, self.len) {
                // Still locked: unmapping would leave the driver a stale
                // registration at this address. Leak the mapping instead.
                return;
            }
        }
        if self.len >= MMAP_MIN {
            // SAFETY: mapped in `zeroed` with exactly this length, unmapped once.
            unsafe { fathom_platform::io::unmap(self.ptr, self.len) };
        } else if self.len > 0 {
            // SAFETY: allocated in `zeroed` with exactly this layout.
            unsafe {
                dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, IO_ALIGN),
                )
            }
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> Self {
        Self::from_slice(self)
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_writable() {
        for len in [10_000, MMAP_MIN + 5] {
            let mut b = AlignedBuf::zeroed(len);
            assert_eq!(b.as_ptr() as usize % IO_ALIGN, 0);
            assert!(b.iter().all(|&x| x == 0));
            b[len - 1] = 7;
            assert_eq!(b.clone()[len - 1], 7);
        }
        assert!(AlignedBuf::zeroed(0).is_empty());
    }

    #[test]
    fn read_buffers_are_recycled_within_the_pool_bounds() {
        // A length no other test uses, so the pool's entries are ours.
        let len = MMAP_MIN + 3 * IO_ALIGN;
        let mut a = AlignedBuf::for_reading(len);
        a[5] = 9;
        let addr = a.as_ptr() as usize;
        drop(a);
        let b = AlignedBuf::for_reading(len);
        assert_eq!(b.as_ptr() as usize, addr, "the freed buffer is taken back");
        assert_eq!(b[5], 9, "a recycled buffer keeps its old bytes");
        assert!(!b.is_pinned(), "no pinner installed");
        // Dropping more buffers than the pool keeps unmaps the rest.
        let many: Vec<AlignedBuf> = (0..crate::pool::POOL_MAX + 3)
            .map(|_| AlignedBuf::for_reading(len))
            .collect();
        drop(b);
        drop(many);
        assert!(crate::pool::pooled_bytes() <= crate::pool::POOL_BYTES);
        // Small read buffers are plain zeroed ones.
        assert!(AlignedBuf::for_reading(100).iter().all(|&x| x == 0));
    }
}
