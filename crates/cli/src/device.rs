//! The `--device` and `--gpus` flags' values (the library opens the device:
//! `fathom_runtime::device`).

use clap::ValueEnum;

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

impl From<DeviceArg> for fathom_runtime::Device {
    fn from(d: DeviceArg) -> Self {
        match d {
            DeviceArg::Cpu => fathom_runtime::Device::Cpu,
            DeviceArg::Cuda => fathom_runtime::Device::Cuda,
            DeviceArg::Auto => fathom_runtime::Device::Auto,
        }
    }
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
