//! The kernels' PTX: compiled by NVRTC for the device's architecture
//! with the options the bits need and the tuning knobs of
//! `FATHOM_CUDA_DEFINES`, and cached on disk by source, options and
//! knobs.

use std::path::PathBuf;

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};

use crate::{CudaError, SOURCE};

fn ptx_cache_path(arch: &str, nvrtc: (i32, i32), defines: &[String]) -> Option<PathBuf> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (SOURCE, arch, nvrtc, OPTIONS, defines).hash(&mut h);
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(
        base.join("fathom/cuda")
            .join(format!("{:016x}.ptx", h.finish())),
    )
}

/// The NVRTC options `kernels_ptx` passes, in the PTX cache's key (so a
/// change of options never loads PTX compiled with the old ones): keep
/// the two in step.
const OPTIONS: &str = "ftz=false prec-div=true prec-sqrt=true fmad=false std=c++17";

/// The kernels' PTX for `arch`: from the cache, else compiled by NVRTC and
/// stored (a cache that cannot be written is skipped).
pub(super) fn kernels_ptx(
    arch: &'static str,
    nvrtc: (i32, i32),
    knobs: &Knobs,
) -> Result<Ptx, CudaError> {
    let defines = knobs.defines();
    let path = ptx_cache_path(arch, nvrtc, &defines);
    if let Some(src) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(Ptx::from_src(src));
    }
    let opts = CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        arch: Some(arch),
        options: std::iter::once("--std=c++17".to_string())
            .chain(defines.iter().map(|d| format!("-D{d}")))
            .collect(),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(SOURCE, opts).map_err(|e| CudaError::Compile {
        arch: arch.into(),
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => other.to_string(),
        },
    })?;
    if let Some(p) = path {
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        let stored = p.parent().map(std::fs::create_dir_all).transpose().is_ok()
            && std::fs::write(&tmp, ptx.to_src()).is_ok()
            && std::fs::rename(&tmp, &p).is_ok();
        if !stored {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(ptx)
}

/// The knobs, read once when a backend opens.
pub(super) struct Knobs(Vec<String>);

/// Knobs the host reads (launch shapes, which kernels it takes), not
/// macros of the sources.
const HOST_KNOBS: [&str; 3] = ["BF16_PAIRS", "TILES", "MLA_HEADS"];

impl Knobs {
    /// `FATHOM_CUDA_DEFINES` checked ([`tuning_defines`]).
    pub(super) fn from_env() -> Result<Self, CudaError> {
        let spec = std::env::var("FATHOM_CUDA_DEFINES").ok();
        tuning_defines(spec.as_deref()).map(Knobs)
    }

    /// Knob `name`'s value, if set.
    pub(super) fn get(&self, name: &str) -> Option<usize> {
        self.0
            .iter()
            .find_map(|d| d.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
    }

    /// The `NAME=N` macros NVRTC is given (and the PTX cache's key): every
    /// knob but the host's.
    fn defines(&self) -> Vec<String> {
        let host = |d: &&String| HOST_KNOBS.iter().any(|h| d.split('=').next() == Some(*h));
        self.0.iter().filter(|d| !host(d)).cloned().collect()
    }
}

/// The kernels' tuning knobs set at run time: `FATHOM_CUDA_DEFINES`, e.g.
/// `"BF16G=2 BF16_MINB=4"` (entries split by spaces or commas), each a
/// macro the sources leave to be overridden (`matmul.cu`: `BF16G`,
/// `BF16_MINB`, `MXG`, `BF16_NA`) and a whole number; `BF16_PAIRS` caps the row pairs
/// a warp of the one-position bf16 products takes (`launch.rs`; 1: a
/// block of 256 threads for every 16 rows); `TILES=0` keeps products
/// of many positions off the tiled kernels (`tile.cu`, whose `TILE_MINB`
/// is their blocks an SM); `MLA_HEADS=0` keeps MLA attention a head a
/// block (`mla.cu`); those three are the host's alone ([`Knobs::defines`]
/// leaves them out). They change how many
/// loads are in flight, how many registers a kernel may use and which warp
/// sums which row, never a sum or its order; for measuring on a device,
/// not for use.
fn tuning_defines(spec: Option<&str>) -> Result<Vec<String>, CudaError> {
    const KNOBS: [&str; 8] = [
        "BF16G",
        "BF16_MINB",
        "MXG",
        "BF16_PAIRS",
        "BF16_NA",
        "TILES",
        "TILE_MINB",
        "MLA_HEADS",
    ];
    // Switches (0: off); the others count from 1.
    const SWITCHES: [&str; 3] = ["BF16_NA", "TILES", "MLA_HEADS"];
    let mut out: Vec<String> = Vec::new();
    for entry in spec
        .unwrap_or("")
        .split([' ', ','])
        .filter(|e| !e.is_empty())
    {
        let knob = entry.split_once('=').and_then(|(name, value)| {
            let least = u32::from(!SWITCHES.contains(&name));
            let v = value
                .parse::<u32>()
                .ok()
                .filter(|v| (least..=16).contains(v))?;
            KNOBS.contains(&name).then_some((name, v))
        });
        let Some((name, v)) = knob else {
            return Err(CudaError::Setting(format!(
                "FATHOM_CUDA_DEFINES entry {entry:?}: give NAME=N with NAME one of {} and N \
                 a whole number from 1 to 16 (BF16_NA, TILES and MLA_HEADS from 0, which turns \
                 them off; or unset the variable)",
                KNOBS.join(", ")
            )));
        };
        if out.iter().any(|d| d.split('=').next() == Some(name)) {
            return Err(CudaError::Setting(format!(
                "FATHOM_CUDA_DEFINES names {name} twice: give each knob once"
            )));
        }
        // The parsed value, so the source reads the number that was checked
        // (`08` or `010` would be C's octal).
        out.push(format!("{name}={v}"));
    }
    Ok(out)
}

/// `compute_XY` for the architectures NVRTC knows by a static name.
pub(super) fn arch_name(cc: (i32, i32)) -> &'static str {
    match cc {
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        (major, _) if major >= 12 => "compute_120",
        (major, _) if major >= 10 => "compute_100",
        (major, _) if major >= 9 => "compute_90",
        _ => "compute_75",
    }
}

#[cfg(test)]
mod tests {
    use super::{Knobs, tuning_defines};

    #[test]
    fn tuning_defines_take_known_knobs_and_name_a_bad_entry() {
        assert_eq!(tuning_defines(None).unwrap(), Vec::<String>::new());
        assert_eq!(
            tuning_defines(Some("BF16G=2, BF16_MINB=4 MXG=03 BF16_NA=0")).unwrap(),
            ["BF16G=2", "BF16_MINB=4", "MXG=3", "BF16_NA=0"]
        );
        let twice = tuning_defines(Some("MXG=2 MXG=4")).unwrap_err().to_string();
        assert!(twice.contains("names MXG twice"), "{twice}");
        for bad in [
            "BF16G",
            "BF16G=0",
            "BF16G=x",
            "UNROLL=4",
            "BF16G=2;rm",
            "MXG=17",
            "BF16_PAIRS=0",
        ] {
            let e = tuning_defines(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(&format!("FATHOM_CUDA_DEFINES entry {bad:?}"))
                    && e.contains("BF16_MINB"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn the_hosts_knobs_stay_out_of_nvrtcs_defines() {
        let k = Knobs(tuning_defines(Some("BF16_PAIRS=2 TILES=0 MXG=3 MLA_HEADS=0")).unwrap());
        assert_eq!(k.defines(), ["MXG=3"]);
        assert_eq!(
            (k.get("TILES"), k.get("BF16_PAIRS"), k.get("BF16G")),
            (Some(0), Some(2), None)
        );
    }
}
