//! Block attention residuals: a softmax over depth (docs/k3-model.md §3).
//!
//! `AttnRes(partial, blocks) = Σ_n p_n V_n` with `V = [blocks…, partial]`,
//! `p = softmax_n(Σ_d RMS(V_n)[d] · query[d])`, computed as
//! `rms_inv(V_n) · (V_n · query)` (both sums in the matrix products'
//! 32-lane order, `dot32`), where `query` already holds the site's norm
//! weight times its pseudo-query projection. Per token: no mixing across
//! positions, so decode needs no cache for it. The softmax uses the
//! hand-written `exp_fixed`, so a device repeats it bit for bit
//! ([`fathom_kernels::backend::depth_mix`]); the RMSNorm after the MLP
//! side's mix uses the same 32-lane sum (`rms_norm32_rows`).

use fathom_kernels::backend::depth_mix;

use super::weights::AttnResWeights;

/// Mixes `blocks` and `partial` (each `[T, D]`) into a new `[T, D]`.
pub fn attn_res(
    partial: &[f32],
    blocks: &[Vec<f32>],
    w: &AttnResWeights,
    d: usize,
    eps: f32,
) -> Vec<f32> {
    depth_mix(partial, blocks, &w.query, d, eps)
}
