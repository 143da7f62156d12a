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

/// The CUDA devices `--gpus` names, in order (the first holds the spine).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpus(pub Vec<usize>);

/// The most devices `--gpus` may name.
const MAX_GPUS: usize = 64;

/// `--gpus`: a count `N` (devices 0..N) or a comma-separated list of
/// ordinals (one device alone: `1,`).
pub fn parse_gpus(s: &str) -> Result<Gpus, String> {
    let bad = |why: &str| {
        format!("{s:?}: {why}: give a count such as 2 or a list such as 0,2 (one device: 1,)")
    };
    let s = s.trim();
    let list: Vec<usize> = if s.contains(',') {
        let s = s
            .strip_suffix(',')
            .filter(|o| !o.contains(','))
            .unwrap_or(s);
        s.split(',')
            .map(|p| {
                p.trim()
                    .parse::<usize>()
                    .map_err(|_| bad("not a device number"))
            })
            .collect::<Result<_, _>>()?
    } else {
        let n: usize = s.parse().map_err(|_| bad("not a count"))?;
        (0..n.min(MAX_GPUS + 1)).collect()
    };
    if list.is_empty() {
        return Err(bad("no device"));
    }
    if list.len() > MAX_GPUS || list.iter().any(|&o| o >= MAX_GPUS) {
        return Err(bad(&format!(
            "at most {MAX_GPUS} devices, numbered below {MAX_GPUS}"
        )));
    }
    Ok(Gpus(list))
}

/// Installs the backend `device` asks for (or none, for the CPU) and
/// returns its name: one CUDA device, or several behind
/// [`fathom_kernels::multi::MultiBackend`] (`gpus`), each replaying
/// repeated calls as CUDA graphs unless `graphs` is false. The same bits
/// either way: every backend reproduces the CPU kernels' reduction order.
pub fn select(
    device: DeviceArg,
    vram_budget: Option<u64>,
    gpus: Option<&Gpus>,
    graphs: bool,
) -> Result<String> {
    backend::uninstall();
    if device == DeviceArg::Cpu {
        if vram_budget.is_some() {
            bail!("--vram-budget is for --device cuda|auto: drop it or add --device cuda");
        }
        if !graphs {
            bail!("--no-cuda-graphs is for --device cuda|auto: drop it or add --device cuda");
        }
        if gpus.is_some() {
            bail!("--gpus is for --device cuda|auto: drop it or add --device cuda");
        }
        return Ok("cpu".into());
    }
    let ordinals = gpus.map_or(vec![0], |g| g.0.clone());
    // Only a missing driver, NVRTC or device sends `auto` to the CPU; a
    // budget or device number that does not fit is the user's to fix.
    if let Err(e) = fathom_kernels_cuda::probe(0) {
        if device == DeviceArg::Auto {
            tracing::info!("device: cpu (--device auto: {e})");
            return Ok("cpu".into());
        }
        bail!("--device cuda: {e}");
    }
    match open_all(&ordinals, vram_budget) {
        Ok(devs) => {
            devs.iter().for_each(|d| d.set_graphs(graphs));
            // Streamed experts' read buffers are page-locked (portable to
            // every device's context): a VRAM miss copies them by direct DMA.
            fathom_weights::pool::install_host_pin(Arc::new(devs[0].host_pin()));
            let mut all: Vec<Arc<dyn backend::Backend>> = devs
                .into_iter()
                .map(|b| b as Arc<dyn backend::Backend>)
                .collect();
            let b = if all.len() == 1 {
                all.remove(0)
            } else {
                Arc::new(fathom_kernels::multi::MultiBackend::new(all).expect("devices"))
            };
            let name = b.name();
            backend::install(b);
            Ok(name)
        }
        Err(e) => {
            let flag = if device == DeviceArg::Auto {
                "auto"
            } else {
                "cuda"
            };
            bail!("--device {flag}: {e}")
        }
    }
}

/// Opens every device of `ordinals`: each with `vram_budget`, or by
/// default its free memory less the margin, shared by the times it is
/// listed.
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
            backend::Backend::name(&*b),
            info.compute_capability.0,
            info.compute_capability.1,
            fathom_weights::units::format_bytes(b.budget())
        );
        out.push(b);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_take_a_count_or_a_list() {
        assert_eq!(parse_gpus("3"), Ok(Gpus(vec![0, 1, 2])));
        assert_eq!(parse_gpus("0,2"), Ok(Gpus(vec![0, 2])));
        assert_eq!(parse_gpus(" 1, 1 "), Ok(Gpus(vec![1, 1])));
        assert_eq!(parse_gpus("1,"), Ok(Gpus(vec![1])));
        for bad in [
            "0",
            "",
            "a",
            "1,,2",
            "1,2,",
            ",",
            "-1",
            "65",
            "0,64",
            "99999999999999999999",
        ] {
            let e = parse_gpus(bad).unwrap_err();
            assert!(e.contains("a count such as 2"), "{bad:?}: {e}");
        }
    }
}
