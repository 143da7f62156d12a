//! What the GPU tests share: opening the device (or saying why a test
//! skips) and a deterministic generator; each test adds the value
//! distributions it needs as methods of [`Lcg`].

#![allow(dead_code)]

use std::sync::Arc;

use fathom_kernels_cuda::{CudaBackend, CudaError};

/// Device 0 with `budget` bytes for weights: a real one where the NVIDIA
/// driver is installed, else the emulated driver (`fathom-cuda-emu`: the
/// whole backend on the host emulator, with its checks of copies and
/// launch arguments); `None`, saying why, when neither is here.
pub fn open(budget: Option<u64>) -> Option<Arc<CudaBackend>> {
    let first = match CudaBackend::open(0, budget) {
        Ok(b) => return Some(b),
        Err(e) => e,
    };
    if !matches!(first, CudaError::NoDriver) {
        eprintln!("skipped: no CUDA backend here ({first})");
        return None;
    }
    if let Err(why) = fathom_cuda_emu::install_driver() {
        eprintln!("skipped: no CUDA driver here ({first}) and {why}");
        return None;
    }
    match CudaBackend::open(0, budget) {
        Ok(b) => {
            eprintln!("no CUDA driver here: running on the emulated driver (fathom-cuda-emu)");
            Some(b)
        }
        Err(e) => panic!("the emulated CUDA driver did not open: {e}"),
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
