//! K3's projections around the shared hybrid attention cores
//! ([`crate::hybrid`]): a full-rank KDA output gate, low-rank MLA queries
//! and a sigmoid-gated MLA output (docs/k3-model.md §4, §5).

use fathom_kernels::backend::{MlaQueryProj, Then};
use fathom_kernels::ops::rms_norm_rows;

use super::config::{K3Spec, MLA_LOW_RANK_NORM_EPS};
use super::weights::{KdaWeights, MlaWeights};
use crate::batch::{Path, Segment};
use crate::error::Result;
use crate::hybrid::kda::{KdaLinears, KdaParams, KdaProjections, kda_heads, kda_heads_projected};
use crate::hybrid::mla::{MlaLinears, mla_heads, mla_heads_projected};
use crate::hybrid::state::{KdaState, MlaCache};
use crate::linear::Linear;

impl KdaWeights {
    /// The layer's own parameters, as the KDA core takes them.
    pub fn params(&self) -> KdaParams<'_> {
        KdaParams {
            conv: [&self.q_conv1d, &self.k_conv1d, &self.v_conv1d],
            a: &self.a,
            dt_bias: &self.dt_bias,
            o_norm: &self.o_norm,
        }
    }
}

impl Drop for KdaWeights {
    /// A backend may keep device copies of the parameters (the KDA core's).
    fn drop(&mut self) {
        self.params().forget();
    }
}

/// KDA attention for the rows `x [N, D]` (already `input_layernorm`ed) of
/// several sequences: `segs[i]` are sequence i's rows, `states[i]` its
/// state. Projections run once over all N rows. Returns `[N, D]`, and
/// whether a device also did `then` in the same call.
pub fn kda(
    spec: &K3Spec,
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
        &w.g_proj,
    ];
    let lin = KdaLinears {
        f_up: &w.f_b_proj,
        g_up: None,
        o_proj: &w.o_proj,
    };
    let (d, params) = (spec.kda_dims(), w.params());
    // With a device: the projections in the core's call (one round trip).
    if let Some(done) = kda_heads_projected(path, &d, &params, states, segs, x, mats, &lin, then)? {
        return Ok(done);
    }
    let [q, k, v, fa, b, g] = Linear::forward_many(mats, x, n);
    let proj = KdaProjections {
        pre: [q, k, v],
        f: fa,
        b,
        g,
    };
    Ok((
        kda_heads(path, &d, &params, states, segs, proj, &lin)?,
        false,
    ))
}

/// Gated MLA for the rows `x [N, D]` (already `input_layernorm`ed) of
/// several sequences, each attending to its own latent cache. With a
/// device that takes it, the projections, the attention and `o_proj` are
/// one call (with `then`, the rest of the layer up to its experts' choice
/// may be too). Returns `[N, D]`, and whether the device did `then`.
pub fn mla(
    spec: &K3Spec,
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
        q: MlaQueryProj::LowRank {
            a: w.q_a_proj.as_mat(),
            norm: &w.q_a_layernorm,
            eps: MLA_LOW_RANK_NORM_EPS,
            b: w.q_b_proj.as_mat(),
        },
        kv_a: &w.kv_a_proj_with_mqa,
        kv_a_layernorm: &w.kv_a_layernorm,
        gate: Some(&w.g_proj),
        o_proj: &w.o_proj,
    };
    // With a device: the projections in the attention's call (one round trip).
    if let Some(done) =
        mla_heads_projected(path, &d, &lin, &w.kv_b_proj, None, (caches, segs), x, then)?
    {
        return Ok(done);
    }
    let [mut qa, c, gate] =
        Linear::forward_many([&w.q_a_proj, &w.kv_a_proj_with_mqa, &w.g_proj], x, n);
    rms_norm_rows(
        &mut qa,
        spec.q_lora_rank,
        &w.q_a_layernorm,
        MLA_LOW_RANK_NORM_EPS,
    );
    let q = w.q_b_proj.forward(&qa, n); // [N, H·dq]
    mla_heads(
        path,
        &d,
        &w.kv_a_layernorm,
        &w.kv_b_proj,
        None,
        caches,
        segs,
        (&q, c),
        (Some(&gate), &w.o_proj),
        None,
    )
}
