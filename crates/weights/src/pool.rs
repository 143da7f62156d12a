//! Read buffers kept for reuse, and page-locking them for a device.
//!
//! Streamed experts are read into fresh buffers and dropped when the cache
//! evicts them, over and over. A fresh anonymous mapping costs a page fault
//! and a zeroed page per 4 KiB when first written; a handful of recently
//! freed read buffers is kept here instead, and a read of the same length
//! takes one back. The pool is small (a few buffers, [`POOL_BYTES`] at most)
//! so that what it holds stays within the slack of a RAM budget.
//!
//! A device backend may install a [`HostPin`]: read buffers are then
//! page-locked when first mapped (and unlocked when finally unmapped), so
//! copying an expert to the device is a direct DMA rather than a staged
//! copy. Recycling is what makes that affordable: a buffer is locked once,
//! not once per read.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, RwLock};

/// Most buffers the pool holds.
pub const POOL_MAX: usize = 4;
/// Most bytes the pool holds.
pub const POOL_BYTES: usize = 64 << 20;

/// Page-locks host memory for a device (see the module docs).
///
/// # Safety
/// Implementations may only lock and unlock the range they are given; the
/// callers (this module) guarantee that a range passed to `pin` is a live
/// mapping they own, and that it is passed to `unpin` before it is unmapped,
/// with no device copy from it in flight (owners `forget` their device
/// copies before freeing the bytes).
pub unsafe trait HostPin: Send + Sync {
    /// Locks `[ptr, ptr + len)`; `false` when it could not (the buffer is
    /// then used as ordinary memory).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is a live mapping owned by the caller.
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> bool;
    /// Unlocks a range [`HostPin::pin`] locked; `false` when it could not
    /// (the caller must then not unmap it).
    ///
    /// # Safety
    /// The range was locked by `pin` and is still mapped.
    unsafe fn unpin(&self, ptr: *mut u8, len: usize) -> bool;
}

struct Free {
    ptr: NonNull<u8>,
    len: usize,
    pinned: bool,
}

// SAFETY: a free buffer is owned by the pool alone until `take` hands it out.
unsafe impl Send for Free {}

static POOL: Mutex<Vec<Free>> = Mutex::new(Vec::new());
static PIN: RwLock<Option<Arc<dyn HostPin>>> = RwLock::new(None);

/// Makes `p` lock every read buffer mapped from now on.
pub fn install_host_pin(p: Arc<dyn HostPin>) {
    *PIN.write().unwrap_or_else(|e| e.into_inner()) = Some(p);
}

fn pinner() -> Option<Arc<dyn HostPin>> {
    PIN.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Locks a freshly mapped buffer when a pinner is installed.
pub(crate) fn pin(ptr: NonNull<u8>, len: usize) -> bool {
    // SAFETY: `AlignedBuf::for_reading` passes the mapping it just made.
    pinner().is_some_and(|p| unsafe { p.pin(ptr.as_ptr(), len) })
}

/// Unlocks a buffer about to be unmapped; `false` when it stays locked
/// (the caller then leaks the mapping rather than unmap locked memory).
pub(crate) fn unpin(ptr: NonNull<u8>, len: usize) -> bool {
    // SAFETY: only buffers `pin` locked reach here, still mapped.
    pinner().is_some_and(|p| unsafe { p.unpin(ptr.as_ptr(), len) })
}

/// A free buffer of exactly `len` bytes, if the pool has one; whether it is locked.
pub(crate) fn take(len: usize) -> Option<(NonNull<u8>, bool)> {
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let i = pool.iter().position(|f| f.len == len)?;
    let f = pool.swap_remove(i);
    Some((f.ptr, f.pinned))
}

/// Offers a buffer to the pool; `false` when it is full (the caller unmaps it).
pub(crate) fn give(ptr: NonNull<u8>, len: usize, pinned: bool) -> bool {
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let held: usize = pool.iter().map(|f| f.len).sum();
    if pool.len() >= POOL_MAX || held + len > POOL_BYTES {
        return false;
    }
    pool.push(Free { ptr, len, pinned });
    true
}

/// Bytes the pool holds now.
pub fn pooled_bytes() -> usize {
    POOL.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|f| f.len)
        .sum()
}
