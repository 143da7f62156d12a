//! CPU kernels. Pure functions over slices: no I/O, no model knowledge.
//!
//! Activations are fp32 row-major `[T, in]`; weights are stored `[out, in]`
//! as in the checkpoint and applied as `x Wᵀ`. Every output element is one
//! dot product whose reduction order is fixed by the kernel (eight
//! interleaved partial sums, combined pairwise), independent of the number
//! of threads: rayon only splits the output rows.

pub mod matmul;
pub mod ops;

pub use matmul::{matmul_bf16, matmul_f32, matmul_mxfp4};
