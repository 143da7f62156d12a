//! Page-locking streamed experts' read buffers for the device, so that a
//! VRAM miss copies them by direct DMA (see `fathom_weights::pool`).

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use fathom_weights::pool::HostPin;

/// Locks host ranges with `cuMemHostRegister` (portable to every context).
pub struct CudaHostPin {
    ctx: Arc<CudaContext>,
}

impl CudaHostPin {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        CudaHostPin { ctx }
    }
}

// SAFETY: locks and unlocks exactly the ranges it is given (see `HostPin`).
unsafe impl HostPin for CudaHostPin {
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> bool {
        if self.ctx.bind_to_thread().is_err() {
            return false;
        }
        // SAFETY: [ptr, ptr + len) is a live mapping owned by the caller,
        // which unpins it before unmapping it.
        let r =
            unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) };
        r.result().is_ok()
    }

    unsafe fn unpin(&self, ptr: *mut u8, _len: usize) -> bool {
        if self.ctx.bind_to_thread().is_err() {
            return false;
        }
        // SAFETY: `ptr` was registered by `pin` and is still mapped.
        let r = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
        r.result().is_ok()
    }
}
