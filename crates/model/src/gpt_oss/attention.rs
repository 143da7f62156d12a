//! GPT-OSS attention: grouped-query attention with biased projections,
//! YaRN rotary embedding (rotate-half pairs), a learned sink logit per
//! head, and a sliding window on every other layer.
//!
//! ```text
//! q = x W_qᵀ + b_q,  k = x W_kᵀ + b_k,  v = x W_vᵀ + b_v
//! q, k ← RoPE(q, k; position)
//! o_h = Σ_{s ∈ window(t)} softmax_s(q_h·k_{g(h),s} / sqrt(head_dim) ; sink_h) v_{g(h),s}
//! out = concat(o) W_oᵀ + b_o
//! ```
//! where `window(t)` is the latest `sliding_window` positions up to `t` on
//! sliding layers and all of them on full ones, and the sink is one more
//! logit in the softmax's denominator. The cache and the attention itself
//! are the shared GQA core's ([`crate::gqa::gqa_heads`]; with a device, the
//! whole layer is [`crate::gqa::gqa_projected`]).

use fathom_kernels::backend::Then;
use fathom_kernels::gqa::GqaShape;
use fathom_kernels::rope::Rope;

use super::config::GptOssSpec;
use super::weights::AttnWeights;
use crate::batch::{Path, Segment};
use crate::error::Result;
use crate::gqa::{GqaLinears, gqa_heads, gqa_projected};
use crate::kv::PagedRows;
use crate::rotary::Angles;

/// Attention of layer `layer` for the rows `x [N, D]` (already
/// `input_layernorm`ed) of several sequences (`segs[i]` are sequence i's
/// rows, `caches[i]` its cache for this layer). With a device that takes
/// it, the whole layer is one call (with `then`, the rest of the layer up
/// to its experts' choice may be too). Returns `[N, D]`, and whether the
/// device did `then`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    spec: &GptOssSpec,
    path: Path,
    layer: usize,
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
    let shape = GqaShape {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
        scale: (hd as f64).powf(-0.5) as f32,
        window: spec.window(layer),
    };
    let lin = GqaLinears {
        qkv: [&w.q_proj, &w.k_proj, &w.v_proj],
        o_proj: &w.o_proj,
        qk_norm: None,
    };
    // With a device: the whole layer in one call (one round trip).
    let sinks = Some(&w.sinks[..]);
    if let Some(done) = gqa_projected(
        path,
        shape,
        sinks,
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
    for r in 0..n {
        let (c, s) = angles.row(r);
        rope.rotate(&mut q[r * qw..(r + 1) * qw], c, s);
        rope.rotate(&mut k[r * kvw..(r + 1) * kvw], c, s);
    }
    let ctx = gqa_heads(shape, Some(&w.sinks), caches, segs, [&q, &k, &v])?;
    Ok((w.o_proj.forward(&ctx, n), false))
}
