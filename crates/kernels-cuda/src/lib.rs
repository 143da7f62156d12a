//! The CUDA backend: matrix products on an NVIDIA GPU, bit-identical to
//! the CPU kernels (see `matmul.cu` for the order), behind
//! [`fathom_kernels::backend::Backend`].
//!
//! Nothing CUDA is needed to build: `cudarc` loads the driver
//! (`libcuda.so`) and NVRTC (`libnvrtc.so`) when a backend is opened. The
//! kernels are CUDA C in this crate, compiled by NVRTC for the device's
//! architecture on first use and cached as PTX under the user cache
//! directory (keyed by the source, the architecture and NVRTC's version).
//!
//! Weights are copied to device memory on first use (or ahead of it, when
//! the caller names its next products) and kept there, least recently used
//! first out, within the VRAM budget; a batch of products sends its
//! activations up and its results back in one round trip. A product whose
//! weights cannot fit is declined and runs on the CPU.

// The kernels' one list (also read by fathom-cuda-emu's build script).
include!("kernel_list.rs");

/// The files named, joined.
macro_rules! joined {
    ($($file:literal),*) => {
        concat!($(include_str!($file)),*)
    };
}

mod cache;
mod device;
mod guess;
mod pin;
mod probe_bw;

pub use device::{CudaBackend, DEFAULT_MARGIN, DeviceInfo, probe, spine_copy_min_t};
pub use pin::CudaHostPin;

/// Why the CUDA backend is not available.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "the NVIDIA driver library (libcuda.so / libcuda.so.1) was not found: install the \
         NVIDIA driver, or run with --device cpu"
    )]
    NoDriver,
    #[error(
        "NVRTC (libnvrtc.so or libnvrtc.so.12, from the CUDA toolkit or the nvidia-cuda-nvrtc \
         package) was not found on the library path: it compiles fathom's GPU kernels at run \
         time; install it and set LD_LIBRARY_PATH, or run with --device cpu"
    )]
    NoNvrtc,
    #[error("no CUDA device is visible (the driver reports {0}): run with --device cpu")]
    NoDevice(String),
    #[error("CUDA device {ordinal} does not exist: {count} visible")]
    BadOrdinal { ordinal: usize, count: usize },
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A setting of the environment the backend reads is malformed.
    #[error("{0}")]
    Setting(String),
    #[error("NVRTC could not compile fathom's kernels for {arch}: {log}")]
    Compile { arch: String, log: String },
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

/// The kernels' CUDA C source: matrix products, the KDA core, gated
/// activations, MLA attention over a latent cache, grouped-query attention
/// (the files of `kernel_list.rs`, joined in its order).
pub const SOURCE: &str = cu_files!(joined);

#[cfg(test)]
mod tests {
    macro_rules! names {
        ($($(#[$doc:meta])* $field:ident: $name:ident,)*) => {
            [$(stringify!($name)),*]
        };
    }

    /// The kernel list names exactly the source's entry points (`extern
    /// "C" __global__` functions), each once: a kernel added to a `.cu`
    /// file and not to `kernel_list.rs` (or the reverse) fails here.
    #[test]
    fn the_kernel_list_is_the_sources_entry_points() {
        let mut defined: Vec<&str> = super::SOURCE
            .lines()
            .filter_map(|l| l.split("extern \"C\" __global__ void").nth(1))
            .map(|rest| {
                // After the qualifiers (`BF16_BOUNDS`, `__launch_bounds__(n)`).
                let rest = match rest.split_once("__launch_bounds__(") {
                    Some((_, after)) => after.split_once(')').map_or(after, |(_, r)| r),
                    None => rest,
                };
                let head = rest.split('(').next().unwrap_or("");
                head.split_whitespace().last().unwrap_or("")
            })
            .collect();
        let mut listed: Vec<&str> = kernels!(names).to_vec();
        assert_eq!(defined.len(), 37, "{defined:?}");
        defined.sort_unstable();
        listed.sort_unstable();
        let n = listed.len();
        listed.dedup();
        assert_eq!(listed.len(), n, "a kernel listed twice");
        assert_eq!(listed, defined);
    }
}
