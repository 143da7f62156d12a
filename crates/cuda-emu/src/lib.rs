//! The kernels run on the host one way only: under fathom's own CUDA
//! backend, through this crate's emulated driver — not through a second
//! backend that calls them directly. Such a backend has to restate by
//! hand what the CUDA backend decides (which products, gated MLPs, KDA
//! steps and MoE tails it takes, each launch's grid), so its checks test
//! a copy that can drift from `fathom-kernels-cuda`'s device code, and it
//! reached 18 of the 30 kernels (no grouped-query attention, no layer's
//! rest, no MLA projections, no bf16 sets). Every check it made has its
//! counterpart here — the formats, shapes and position counts of
//! `fathom-kernels-cuda`'s `parity.rs`, its KDA, MLA and gated-MLP tests
//! (with the activations at other β over a spread of values, and MLA
//! attention at a second shape with most weights underflowing), and every
//! family's model in `fathom-model`'s `emulated_kernels.rs` — while the
//! driver adds the backend's own launches with every pointer argument
//! checked against the launching device's memory, the copies and the
//! VRAM budget, graphs, and all 30 kernels.
//!
//! The emulated NVIDIA driver and NVRTC (`emu/driver.cpp`, `emu/nvrtc.cpp`,
//! built as `libcuda.so` and `libnvrtc.so`: [`driver_dir`],
//! [`install_driver`]) run the whole CUDA backend — which work it takes,
//! copies, caches, streams, graphs, budgets — with its kernels (the files
//! and kernels of `fathom-kernels-cuda/src/kernel_list.rs`) compiled for
//! the host by a small emulator of the CUDA C they use (`emu/emu.h`: every
//! CUDA thread a fiber, a block's threads switching at `__syncthreads` and
//! warp shuffles). `fathom-kernels-cuda`'s tests, `fathom-model`'s device
//! tests and `fathom --device cuda` use it where the real driver is
//! absent, so a machine without a GPU checks the kernels' bits against the
//! CPU twins through the backend's own calls. It is slow (a fiber switch
//! per thread at every shuffle); the GPU tests on a real device stay the
//! authority for what the emulator does not model (memory ordering between
//! blocks, the streams' concurrency).

use std::path::Path;

/// Why [`driver_dir`] is `None`, for a test's skip line.
pub const ABSENT: &str = "the emulated CUDA driver was not built (it builds on Linux, for \
     the build machine itself, with a C++17 compiler; install g++ and rebuild)";

/// The folder holding the emulated NVIDIA driver and NVRTC (`libcuda.so`,
/// `libnvrtc.so`: `emu/driver.cpp`, `emu/nvrtc.cpp`), which run fathom's
/// whole CUDA backend on this emulator; `None` where they were not built.
/// A child process finds them through `LD_LIBRARY_PATH`.
pub fn driver_dir() -> Option<&'static Path> {
    #[cfg(emu_driver)]
    return Some(Path::new(env!("FATHOM_EMU_DRIVER_DIR")));
    #[cfg(not(emu_driver))]
    None
}

/// Loads the emulated driver and NVRTC into this process, so that
/// `cudarc` (which opens `libcuda.so` and `libnvrtc.so` by name, and gets
/// an already loaded library of that soname) uses them. Call it before
/// anything CUDA; it cannot be undone. An error says why they are absent.
pub fn install_driver() -> Result<&'static Path, String> {
    let dir = driver_dir().ok_or_else(|| ABSENT.to_string())?;
    for lib in ["libcuda.so", "libnvrtc.so"] {
        let path = dir.join(lib);
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|e| e.to_string())?;
        // SAFETY: loads a library this crate's build script made; its
        // initialisers only set up statics. The handle is kept for the
        // process's life.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            return Err(format!("{}: dlopen failed", path.display()));
        }
    }
    Ok(dir)
}
