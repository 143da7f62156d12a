//! `--device` and `--vram-budget`: which backend computes the matrix
//! products. Chosen before any weight is read, so an explicit
//! `--device cuda` on a machine without CUDA fails at once, naming what
//! is missing.

use std::sync::Arc;

use anyhow::{Result, bail};
use clap::ValueEnum;
use fathom_kernels::backend;

/// Where matrix products run.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceArg {
    /// The CPU kernels.
    #[default]
    Cpu,
    /// An NVIDIA GPU (device 0), the driver and NVRTC loaded at run time.
    Cuda,
    /// CUDA when a device, its driver and NVRTC are present, else the CPU;
    /// says which.
    Auto,
}

/// Installs the backend `device` asks for (or none, for the CPU) and
/// returns its name. The same bits either way: the backend reproduces the
/// CPU kernels' reduction order.
pub fn select(device: DeviceArg, vram_budget: Option<u64>) -> Result<String> {
    backend::uninstall();
    if device == DeviceArg::Cpu {
        if vram_budget.is_some() {
            bail!("--vram-budget is for --device cuda|auto: drop it or add --device cuda");
        }
        return Ok("cpu".into());
    }
    match fathom_kernels_cuda::CudaBackend::open(0, vram_budget) {
        Ok(b) => {
            let info = b.info();
            if let Some(v) = vram_budget
                && v > info.free_bytes
            {
                bail!(
                    "--vram-budget {} is more than the {} free on {}: lower it",
                    fathom_weights::units::format_bytes(v),
                    fathom_weights::units::format_bytes(info.free_bytes),
                    info.name
                );
            }
            let name = backend::Backend::name(&*b);
            tracing::info!(
                "device: {name} (compute {}.{}, {} for weights)",
                info.compute_capability.0,
                info.compute_capability.1,
                fathom_weights::units::format_bytes(b.budget())
            );
            // Streamed experts' read buffers are page-locked: a VRAM miss
            // copies them by direct DMA.
            fathom_weights::pool::install_host_pin(Arc::new(b.host_pin()));
            backend::install(b as Arc<dyn backend::Backend>);
            Ok(name)
        }
        Err(e) if device == DeviceArg::Auto => {
            tracing::info!("device: cpu (--device auto: {e})");
            Ok("cpu".into())
        }
        Err(e) => bail!("--device cuda: {e}"),
    }
}
