//! What the GPU tests share: opening the device (or saying why a test
//! skips) and a deterministic generator; each test adds the value
//! distributions it needs as methods of [`Lcg`].

#![allow(dead_code)]

use std::sync::Arc;

use fathom_kernels_cuda::CudaBackend;

/// Device 0 with `budget` bytes for weights; `None`, saying why, when
/// there is no CUDA backend here.
pub fn open(budget: Option<u64>) -> Option<Arc<CudaBackend>> {
    match CudaBackend::open(0, budget) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("skipped: no CUDA backend here ({e})");
            None
        }
    }
}

/// A 64-bit linear congruential generator.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
}
