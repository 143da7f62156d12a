//! Which backend computes the matrix products. Chosen before any weight is
//! read, so an explicit CUDA request on a machine without CUDA fails at
//! once, naming what is missing.

use std::sync::Arc;

use anyhow::{Result, bail};
use fathom_kernels::backend::{self, Backend};

/// Where matrix products run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU kernels.
    #[default]
    Cpu,
    /// NVIDIA GPUs, the driver and NVRTC loaded at run time.
    Cuda,
    /// CUDA when a device, its driver and NVRTC are present, else the CPU.
    Auto,
}

impl Device {
    /// The flag value that asked for it.
    pub fn flag(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
            Device::Auto => "auto",
        }
    }
}

/// The chosen backend.
#[derive(Clone)]
pub struct Selected {
    /// `cpu`, or the backend's name.
    pub name: String,
    /// Why `auto` chose what it chose (`None` for an explicit choice).
    pub reason: Option<String>,
    /// The backend the model's products run on (installed for the model
    /// code); `None` on the CPU.
    pub backend: Option<Arc<dyn Backend>>,
    /// The first device's VRAM budget for weights (where the spine goes);
    /// `None` on the CPU.
    pub vram: Option<u64>,
}

impl Selected {
    fn cpu(reason: Option<String>) -> Selected {
        Selected {
            name: "cpu".into(),
            reason,
            backend: None,
            vram: None,
        }
    }
}

/// Opens and installs the backend `device` names, with `vram_budget` for
/// weights on each of the `gpus` (default: device 0), or refuses the
/// device flags when running on the CPU.
pub fn select(
    device: Device,
    vram_budget: Option<u64>,
    gpus: Option<&[usize]>,
    graphs: bool,
) -> Result<Selected> {
    backend::uninstall();
    if device == Device::Cpu {
        if vram_budget.is_some() {
            bail!("--vram-budget is for --device cuda|auto: drop it or add --device cuda");
        }
        if !graphs {
            bail!("--no-cuda-graphs is for --device cuda|auto: drop it or add --device cuda");
        }
        if gpus.is_some() {
            bail!("--gpus is for --device cuda|auto: drop it or add --device cuda");
        }
        return Ok(Selected::cpu(None));
    }
    let ordinals = gpus.map_or(vec![0], <[usize]>::to_vec);
    if let Err(e) = fathom_kernels_cuda::probe(0) {
        if device == Device::Auto {
            return Ok(Selected::cpu(Some(format!("no usable CUDA device: {e}"))));
        }
        bail!("--device cuda: {e}");
    }
    let devs = open_all(&ordinals, vram_budget)
        .map_err(|e| anyhow::anyhow!("--device {}: {e}", device.flag()))?;
    devs.iter().for_each(|d| d.set_graphs(graphs));
    fathom_weights::pool::install_host_pin(Arc::new(devs[0].host_pin()));
    let vram = devs.first().map(|d| d.budget());
    let mut all: Vec<Arc<dyn Backend>> = devs.into_iter().map(|b| b as Arc<dyn Backend>).collect();
    let b: Arc<dyn Backend> = if all.len() == 1 {
        all.remove(0)
    } else {
        Arc::new(
            fathom_kernels::multi::MultiBackend::new(all)
                .ok_or_else(|| anyhow::anyhow!("--gpus: no device"))?,
        )
    };
    let name = b.name();
    backend::install(b.clone());
    Ok(Selected {
        reason: (device == Device::Auto).then(|| "a CUDA device is present".to_string()),
        name,
        backend: Some(b),
        vram,
    })
}

/// Opens each listed device with its share of the VRAM budget (a device
/// listed twice gets two caches sharing its memory).
fn open_all(
    ordinals: &[usize],
    vram_budget: Option<u64>,
) -> Result<Vec<Arc<fathom_kernels_cuda::CudaBackend>>> {
    use fathom_kernels_cuda::{CudaBackend, DEFAULT_MARGIN, probe};
    let mut out = Vec::with_capacity(ordinals.len());
    for &o in ordinals {
        let times = ordinals.iter().filter(|&&p| p == o).count() as u64;
        let info = probe(o)?;
        let budget =
            vram_budget.unwrap_or_else(|| info.free_bytes.saturating_sub(DEFAULT_MARGIN) / times);
        if budget.saturating_mul(times) > info.free_bytes {
            let shared = if times > 1 {
                format!(" times the {times} listings in --gpus")
            } else {
                String::new()
            };
            bail!(
                "--vram-budget {}{shared} is more than the {} free on device {o} ({}): lower it",
                fathom_weights::units::format_bytes(budget),
                fathom_weights::units::format_bytes(info.free_bytes),
                info.name
            );
        }
        let b = CudaBackend::open(o, Some(budget))?;
        tracing::info!(
            "device: {} (compute {}.{}, {} for weights)",
            Backend::name(&*b),
            info.compute_capability.0,
            info.compute_capability.1,
            fathom_weights::units::format_bytes(b.budget())
        );
        out.push(b);
    }
    Ok(out)
}
