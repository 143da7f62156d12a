//! Block attention residuals: a softmax over depth (k3-model.md §3).
//!
//! `AttnRes(partial, blocks) = Σ_n p_n V_n` with `V = [blocks…, partial]`,
//! `p = softmax_n(Σ_d RMS(V_n)[d] · query[d])`, computed as
//! `rms_inv(V_n) · (V_n · query)` (both sums in the 8-lane order of
//! `dot_lanes`, which vectorises), where `query` already holds
//! the site's norm weight times its pseudo-query projection. Per token: no
//! mixing across positions, so decode needs no cache for it.

use fathom_kernels::ops::{dot_lanes, rms_inv, softmax};

use super::weights::AttnResWeights;

/// Mixes `blocks` and `partial` (each `[T, D]`) into a new `[T, D]`.
pub fn attn_res(
    partial: &[f32],
    blocks: &[Vec<f32>],
    w: &AttnResWeights,
    d: usize,
    eps: f32,
) -> Vec<f32> {
    let t = partial.len() / d;
    let n = blocks.len() + 1;
    let mut out = vec![0f32; t * d];
    let mut p = vec![0f32; n];
    for ti in 0..t {
        let row = |j: usize| -> &[f32] {
            let src = if j < blocks.len() {
                &blocks[j]
            } else {
                partial
            };
            &src[ti * d..(ti + 1) * d]
        };
        for (j, pj) in p.iter_mut().enumerate() {
            let v = row(j);
            *pj = rms_inv(v, eps) * dot_lanes(v, &w.query);
        }
        softmax(&mut p);
        let o = &mut out[ti * d..(ti + 1) * d];
        for (j, &pj) in p.iter().enumerate() {
            for (a, &x) in o.iter_mut().zip(row(j)) {
                *a += pj * x;
            }
        }
    }
    out
}
