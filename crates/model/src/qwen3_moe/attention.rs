//! Grouped-query attention with per-head q/k RMSNorm and rotary position
//! embedding, over the rows of several sequences.
//!
//! ```text
//! q = RMSNorm_head(x W_qᵀ (+b_q); q_norm),  k = RMSNorm_head(x W_kᵀ (+b_k); k_norm),  v = x W_vᵀ (+b_v)
//! q, k ← RoPE(q, k; position)          (rotate-half pairs i, i + head_dim/2)
//! o_h = Σ_{s ≤ t} softmax_s(q_h·k_{g(h),s} / sqrt(head_dim)) v_{g(h),s}
//! out = concat(o) W_oᵀ (+b_o)
//! ```
//! Projections run once over all the step's rows; each sequence's rows are
//! appended to its cache and attend to it through the shared core
//! ([`crate::gqa::gqa_heads`]), whose per-query order is fixed, so a
//! position's result is the same in a prefill chunk, a decode step or a
//! verification pass, batched or not.

use fathom_kernels::backend::Then;
use fathom_kernels::gqa::GqaShape;
use fathom_kernels::ops::rms_norm_rows;
use fathom_kernels::rope::Rope;

use super::config::Qwen3MoeSpec;
use super::weights::AttnWeights;
use crate::batch::{Path, Segment};
use crate::error::Result;
use crate::gqa::{GqaLinears, gqa_heads, gqa_projected};
use crate::kv::PagedRows;
use crate::rotary::Angles;

/// Attention for the rows `x [N, D]` (already `input_layernorm`ed) of
/// several sequences (`segs[i]` are sequence i's rows, `caches[i]` its
/// cache for this layer). With a device that takes it, the whole layer is
/// one call (with `then`, the rest of the layer up to its experts' choice
/// may be too). Returns `[N, D]`, and whether the device did `then`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    spec: &Qwen3MoeSpec,
    path: Path,
    w: &AttnWeights,
    rope: &Rope,
    angles: &Angles,
    caches: &mut [&mut PagedRows],
    segs: &[Segment],
    x: &[f32],
    then: Option<Then<'_>>,
) -> Result<(Vec<f32>, bool)> {
    let n = x.len() / spec.hidden_size;
    let (h, kvh, hd) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
    let (qw, kvw) = (h * hd, kvh * hd);
    let eps = spec.rms_norm_eps;
    let shape = GqaShape {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
        scale: (hd as f64).powf(-0.5) as f32,
        window: None,
    };
    let lin = GqaLinears {
        qkv: [&w.q_proj, &w.k_proj, &w.v_proj],
        o_proj: &w.o_proj,
        qk_norm: Some((&w.q_norm, &w.k_norm, eps)),
    };
    // With a device: the whole layer in one call (one round trip).
    if let Some(done) = gqa_projected(
        path,
        shape,
        None,
        &lin,
        (rope, angles),
        caches,
        segs,
        x,
        then,
    )? {
        return Ok(done);
    }
    let mut q = w.q_proj.forward(x, n);
    let mut k = w.k_proj.forward(x, n);
    let v = w.v_proj.forward(x, n);
    rms_norm_rows(&mut q, hd, &w.q_norm, eps);
    rms_norm_rows(&mut k, hd, &w.k_norm, eps);
    for r in 0..n {
        let (c, s) = angles.row(r);
        rope.rotate(&mut q[r * qw..(r + 1) * qw], c, s);
        rope.rotate(&mut k[r * kvw..(r + 1) * kvw], c, s);
    }
    let ctx = gqa_heads(shape, None, caches, segs, [&q, &k, &v])?;
    Ok((w.o_proj.forward(&ctx, n), false))
}
