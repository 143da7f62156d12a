//! Run-time choice of the kernel set, made once per process.
//!
//! [`kernels()`] detects the best instruction set on first use and keeps its
//! function table in a `OnceLock`. `FATHOM_KERNELS=scalar|avx2|avx512|neon`
//! overrides the choice; it is read here and nowhere else, and exists for
//! tests and benchmarks (every table gives bit-identical results, so it never
//! changes an output, only the speed). Tests that compare paths use
//! [`Kernels::for_isa`] directly instead of the environment.

use std::ops::Range;
use std::sync::OnceLock;

use crate::formats::{Bf16Rows, F32Rows, Fp8Rows, Int4Rows, Int8Rows, Mxfp4Rows, block_scalar};

// One kernel: computes `out[k·t + j]` for row `rows.start + k` and position `j`.
type F32Fn = for<'a> fn(&F32Rows<'a>, &[f32], usize, Range<usize>, &mut [f32]);
type Bf16Fn = for<'a> fn(&Bf16Rows<'a>, &[f32], usize, Range<usize>, &mut [f32]);
type Int8Fn = for<'a> fn(&Int8Rows<'a>, &[f32], usize, Range<usize>, &mut [f32]);
type Mxfp4Fn = for<'a> fn(&Mxfp4Rows<'a>, &[f32], usize, Range<usize>, &mut [f32]);
type Fp8Fn = for<'a> fn(&Fp8Rows<'a>, &[f32], usize, Range<usize>, &mut [f32]);
type Int4Fn = for<'a> fn(&Int4Rows<'a>, &[f32], usize, Range<usize>, &mut [f32]);

/// A table whose six entries are the generic kernel `$f` at each format.
macro_rules! table {
    ($isa:expr, $f:path) => {
        Kernels {
            isa: $isa,
            f32: |w: &F32Rows<'_>, x, t, r, o| $f(w, x, t, r, o),
            bf16: |w: &Bf16Rows<'_>, x, t, r, o| $f(w, x, t, r, o),
            int8: |w: &Int8Rows<'_>, x, t, r, o| $f(w, x, t, r, o),
            mxfp4: |w: &Mxfp4Rows<'_>, x, t, r, o| $f(w, x, t, r, o),
            fp8: |w: &Fp8Rows<'_>, x, t, r, o| $f(w, x, t, r, o),
            int4: |w: &Int4Rows<'_>, x, t, r, o| $f(w, x, t, r, o),
        }
    };
}

/// An instruction set with its own kernel table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
    Neon,
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// Whether this CPU can run the table.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            // The AVX-512 table also runs AVX2 + FMA code (attention, KDA).
            Isa::Avx512 => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && Isa::Avx2.supported()
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

/// The function table of one instruction set.
pub struct Kernels {
    pub isa: Isa,
    pub f32: F32Fn,
    pub bf16: Bf16Fn,
    pub int8: Int8Fn,
    pub mxfp4: Mxfp4Fn,
    /// FP8 E4M3 with block scales (DeepSeek-V3's release).
    pub fp8: Fp8Fn,
    /// Symmetric group-scaled INT4 (compressed-tensors `pack-quantized`).
    pub int4: Int4Fn,
}

static SCALAR: Kernels = table!(Isa::Scalar, block_scalar);

#[cfg(target_arch = "x86_64")]
static AVX2: Kernels = table!(Isa::Avx2, crate::avx2::entry);

#[cfg(target_arch = "x86_64")]
static AVX512: Kernels = Kernels {
    mxfp4: crate::avx512::entry_mxfp4,
    ..table!(Isa::Avx512, crate::avx512::entry)
};

#[cfg(target_arch = "aarch64")]
static NEON: Kernels = table!(Isa::Neon, crate::neon::entry);

impl Kernels {
    /// The table of `isa`, or `None` when this CPU (or build target) lacks it.
    pub fn for_isa(isa: Isa) -> Option<&'static Kernels> {
        if !isa.supported() {
            return None;
        }
        match isa {
            Isa::Scalar => Some(&SCALAR),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Some(&AVX2),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Some(&AVX512),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => Some(&NEON),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }
}

/// The instruction sets this CPU supports, best last.
pub fn supported_isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.supported()).collect()
}

/// The process-wide kernel table (best supported, or `FATHOM_KERNELS`).
///
/// # Panics
/// When `FATHOM_KERNELS` names an unknown or unsupported instruction set: a
/// benchmark silently measuring another path would be worse than stopping.
pub fn kernels() -> &'static Kernels {
    static CHOSEN: OnceLock<&'static Kernels> = OnceLock::new();
    CHOSEN.get_or_init(|| match std::env::var("FATHOM_KERNELS") {
        Ok(want) => {
            let isa = Isa::ALL
                .into_iter()
                .find(|i| i.name() == want.trim())
                .unwrap_or_else(|| {
                    panic!("FATHOM_KERNELS={want:?}: expected scalar, avx2, avx512 or neon")
                });
            Kernels::for_isa(isa)
                .unwrap_or_else(|| panic!("FATHOM_KERNELS={want:?}: this CPU does not support it"))
        }
        Err(_) => {
            let best = *supported_isas().last().expect("scalar is always supported");
            Kernels::for_isa(best).expect("detected as supported")
        }
    })
}
