//! DeepSeek-V3's projections around the shared MLA core
//! ([`crate::hybrid::mla`]), with its rotary step:
//!
//! ```text
//! q = q_b_proj(RMSNorm(x W_q_aᵀ; q_a_layernorm))   (or x W_qᵀ)    per head [q_nope | q_rope]
//! c = x W_kv_aᵀ = [latent | k_rope];  latent ← RMSNorm(latent; kv_a_layernorm)
//! q_rope, k_rope ← RoPE(·, position)     (interleaved pairs, YaRN frequencies)
//! out = concat_h(attn_h) W_oᵀ                                      (no output gate)
//! ```
//! The cache holds `[latent | rotated k_rope]` per token; attention runs in
//! the absorbed form over it.

use fathom_kernels::backend::{MlaQueryProj, Then};
use fathom_kernels::ops::rms_norm_rows;

use super::config::{DeepseekV3Spec, MLA_NORM_EPS};
use super::weights::{AttnWeights, QueryProj};
use crate::batch::{Path, Segment};
use crate::error::Result;
use crate::hybrid::mla::{MlaLinears, MlaRope, mla_heads, mla_heads_projected};
use crate::kv::PagedRows;

/// The queries `[N, H·(nope + rope)]` of the rows `x [N, D]`.
fn queries(spec: &DeepseekV3Spec, q: &QueryProj, x: &[f32], n: usize) -> Vec<f32> {
    match q {
        QueryProj::LowRank {
            q_a_proj,
            q_a_layernorm,
            q_b_proj,
        } => {
            let mut qa = q_a_proj.forward(x, n);
            let r = spec.q_lora_rank.expect("low-rank queries have a rank");
            rms_norm_rows(&mut qa, r, q_a_layernorm, MLA_NORM_EPS);
            q_b_proj.forward(&qa, n)
        }
        QueryProj::Full { q_proj } => q_proj.forward(x, n),
    }
}

/// MLA for the rows `x [N, D]` (already `input_layernorm`ed) of several
/// sequences, each attending to its own latent cache. Returns `[N, D]`,
/// and whether a device also did `then` in the same call.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    spec: &DeepseekV3Spec,
    path: Path,
    w: &AttnWeights,
    rope: &MlaRope<'_>,
    caches: &mut [&mut PagedRows],
    segs: &[Segment],
    x: &[f32],
    then: Option<Then<'_>>,
) -> Result<(Vec<f32>, bool)> {
    let n = x.len() / spec.hidden_size;
    let d = spec.mla_dims();
    let q = match &w.q {
        QueryProj::LowRank {
            q_a_proj,
            q_a_layernorm,
            q_b_proj,
        } => MlaQueryProj::LowRank {
            a: q_a_proj.as_mat(),
            norm: q_a_layernorm,
            eps: MLA_NORM_EPS,
            b: q_b_proj.as_mat(),
        },
        QueryProj::Full { q_proj } => MlaQueryProj::Full(q_proj.as_mat()),
    };
    let lin = MlaLinears {
        q,
        kv_a: &w.kv_a_proj_with_mqa,
        kv_a_layernorm: &w.kv_a_layernorm,
        gate: None,
        o_proj: &w.o_proj,
    };
    // With a device: the projections in the attention's call (one round trip).
    let projected = mla_heads_projected(
        path,
        &d,
        &lin,
        &w.kv_b_proj,
        Some(rope),
        (caches, segs),
        x,
        then,
    )?;
    if let Some(done) = projected {
        return Ok(done);
    }
    let q = queries(spec, &w.q, x, n);
    let c = w.kv_a_proj_with_mqa.forward(x, n);
    mla_heads(
        path,
        &d,
        &w.kv_a_layernorm,
        &w.kv_b_proj,
        Some(rope),
        caches,
        segs,
        (&q, c),
        (None, &w.o_proj),
        None,
    )
}
