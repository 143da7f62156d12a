//! CPU kernels. Pure functions over slices: no I/O, no model knowledge.
//!
//! Activations are fp32 row-major `[T, in]`; weights are stored `[out, in]`
//! as in the checkpoint and applied as `x Wᵀ` (GPT-OSS's stacked experts,
//! stored `[in, out]`, have their own input-major product). Every output element is one
//! dot product whose reduction order is fixed by the kernel (32 interleaved
//! partial sums folded in halves, see `formats`), independent of the number
//! of threads, of T and of the instruction set: rayon only splits the output
//! rows, and each SIMD table reproduces the scalar reference bit for bit.

/// Calls `$impl` (an `#[inline(always)]` function) in a build with fused
/// multiply-adds as instructions where this CPU has them (the kernel table
/// is AVX2 or AVX-512 only on CPUs with AVX2 and FMA): the same bits as the
/// baseline build, whose `mul_add` is the library's `fmaf`, fused too —
/// only faster. (A macro, not a closure: a closure passed to a
/// `target_feature` function is not compiled with its features, so it
/// loses the speed this is for.)
macro_rules! fma_build {
    ($impl:ident($($arg:ident: $ty:ty),*) -> $ret:ty) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn fma($($arg: $ty),*) -> $ret {
            $impl($($arg),*)
        }
        #[cfg(target_arch = "x86_64")]
        if matches!(crate::kernels().isa, crate::Isa::Avx2 | crate::Isa::Avx512) {
            // SAFETY: the kernel table is AVX2 or AVX-512 only on CPUs with AVX2 and FMA.
            return unsafe { fma($($arg),*) };
        }
        $impl($($arg),*)
    }};
}

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_x86;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod backend;
pub mod dispatch;
pub mod expf;
pub mod formats;
pub mod fp8;
pub mod gqa;
pub mod kda;
pub mod matmul;
pub mod multi;
#[cfg(target_arch = "aarch64")]
mod neon;
pub mod ops;
pub mod quant;
pub mod rope;
pub mod state_buf;

pub use dispatch::{Isa, Kernels, kernels, supported_isas};
pub use matmul::{
    matmul_bf16, matmul_bf16_bytes, matmul_bf16_in_major_bytes, matmul_f32, matmul_f32_bytes,
    matmul_fp8, matmul_int4, matmul_int8, matmul_mxfp4,
};
