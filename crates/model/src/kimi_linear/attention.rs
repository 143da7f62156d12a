//! Kimi-Linear's projections around the shared hybrid attention cores
//! ([`crate::hybrid`]): a low-rank KDA output gate, full-rank MLA queries
//! and an ungated MLA output.
//!
//! ```text
//! KDA: g = (x W_g_aᵀ) W_g_bᵀ;  out = concat_h(RMSNorm(o_h; o_norm) ⊙ σ(g_h)) W_oᵀ
//! MLA: q = x W_qᵀ;  c = x W_kvaᵀ;  out = concat_h(attn_h) W_oᵀ       (NoPE)
//! ```

use super::config::KimiLinearSpec;
use super::weights::{KdaWeights, MlaWeights};
use crate::batch::{Path, Segment};
use crate::error::Result;
use crate::hybrid::kda::{KdaLinears, KdaProjections, kda_heads, kda_heads_projected};
use crate::hybrid::mla::{MlaLinears, mla_heads, mla_heads_projected};
use crate::hybrid::state::{KdaState, MlaCache};
use crate::linear::Linear;
use fathom_kernels::backend::{MlaQueryProj, Then};

/// KDA attention for the rows `x [N, D]` (already `input_layernorm`ed) of
/// several sequences: `segs[i]` are sequence i's rows, `states[i]` its
/// state. With a device that takes it, the six projections, the gates'
/// up-projections, the core and `o_proj` are one call (with `then`, the
/// rest of the layer up to its experts' choice may be too). Returns
/// `[N, D]`, and whether the device did `then`.
pub fn kda(
    spec: &KimiLinearSpec,
    path: Path,
    w: &KdaWeights,
    states: &mut [&mut KdaState],
    segs: &[Segment],
    x: &[f32],
    then: Option<Then<'_>>,
) -> Result<(Vec<f32>, bool)> {
    let n = x.len() / spec.hidden_size;
    let mats = [
        &w.q_proj,
        &w.k_proj,
        &w.v_proj,
        &w.f_a_proj,
        &w.b_proj,
        &w.g_a_proj,
    ];
    let lin = KdaLinears {
        f_up: &w.f_b_proj,
        g_up: Some(&w.g_b_proj),
        o_proj: &w.o_proj,
    };
    let (d, params) = (spec.kda_dims(), w.params());
    if let Some(done) = kda_heads_projected(path, &d, &params, states, segs, x, mats, &lin, then)? {
        return Ok(done);
    }
    let [q, k, v, fa, b, ga] = Linear::forward_many(mats, x, n);
    let proj = KdaProjections {
        pre: [q, k, v],
        f: fa,
        b,
        g: ga,
    };
    Ok((
        kda_heads(path, &d, &params, states, segs, proj, &lin)?,
        false,
    ))
}

/// MLA for the rows `x [N, D]` (already `input_layernorm`ed) of several
/// sequences, each attending to its own latent cache. With a device that
/// takes it, the projections, the attention and `o_proj` are one call
/// (with `then`, the rest of the layer up to its experts' choice may be
/// too). Returns `[N, D]`, and whether the device did `then`.
pub fn mla(
    spec: &KimiLinearSpec,
    path: Path,
    w: &MlaWeights,
    caches: &mut [&mut MlaCache],
    segs: &[Segment],
    x: &[f32],
    then: Option<Then<'_>>,
) -> Result<(Vec<f32>, bool)> {
    let n = x.len() / spec.hidden_size;
    let d = spec.mla_dims();
    let lin = MlaLinears {
        q: MlaQueryProj::Full(w.q_proj.as_mat()),
        kv_a: &w.kv_a_proj_with_mqa,
        kv_a_layernorm: &w.kv_a_layernorm,
        gate: None,
        o_proj: &w.o_proj,
    };
    // With a device: the projections in the attention's call (one round trip).
    if let Some(done) =
        mla_heads_projected(path, &d, &lin, &w.kv_b_proj, None, (caches, segs), x, then)?
    {
        return Ok(done);
    }
    let [q, c] = Linear::forward_many([&w.q_proj, &w.kv_a_proj_with_mqa], x, n);
    mla_heads(
        path,
        &d,
        &w.kv_a_layernorm,
        &w.kv_b_proj,
        None,
        caches,
        segs,
        (&q, c),
        (None, &w.o_proj),
        None,
    )
}
