//! Binding: checkpoint names → typed per-layer weights, once, at load.
//!
//! [`check_tensors`] compares the checkpoint with the tensor table and lists
//! every missing, unexpected, mis-shaped or mis-typed tensor by name. After
//! [`K3Weights::load`] nothing is looked up by name again.

use std::sync::Arc;

use fathom_weights::{Checkpoint, Dtype};

use super::config::{AttnKind, FfnKind, K3Spec};
use super::tensors::{LM_HEAD, PREFIX, TensorSpec, layer_name, tensor_table};
use crate::bind::{Binder, is_float, require_none};
use crate::embedding::Embedding;
use crate::error::Result;
use crate::head::LmHead;
use crate::linear::{Linear, Spine};
pub use crate::mlp::MlpWeights;
use crate::tiers::{LayerPlan, Layers, load_layers};

/// Whether a stored tensor is acceptable for an expected one. Float tensors may
/// be stored in any float dtype; MXFP4 parts must be U8. `A_log` may hold
/// either `num_heads` entries (as Moonshot's modelling code declares) or the
/// released `head_dim` entries (the first `num_heads` are used).
fn acceptable(
    want: &TensorSpec,
    dtype: Dtype,
    shape: &[usize],
    spec: &K3Spec,
) -> Result<(), String> {
    let dtype_ok = if want.dtype == Dtype::U8 {
        dtype == Dtype::U8
    } else {
        is_float(dtype)
    };
    if !dtype_ok {
        return Err(format!("dtype {dtype:?}, expected {:?}", want.dtype));
    }
    let shape_ok = if want.name.ends_with(".A_log") {
        shape.len() == 1 && shape[0] >= spec.kda_heads
    } else {
        shape == want.shape.as_slice()
    };
    if !shape_ok {
        return Err(format!("shape {shape:?}, expected {:?}", want.shape));
    }
    Ok(())
}

/// Every disagreement between the checkpoint and the spec, one line each.
pub fn check_tensors(spec: &K3Spec, ck: &Checkpoint) -> Vec<String> {
    let table = tensor_table(spec);
    let mut problems = Vec::new();
    let mut expected = std::collections::HashSet::with_capacity(table.len());
    for t in &table {
        expected.insert(t.name.as_str());
        match ck.get(&t.name) {
            None => problems.push(format!("missing tensor {}", t.name)),
            Some(loc) => {
                if let Err(e) = acceptable(t, loc.dtype, &loc.shape, spec) {
                    problems.push(format!("tensor {}: {e}", t.name));
                }
            }
        }
    }
    for (name, _) in ck.tensors() {
        // The multimodal wrapper's vision weights are not the text decoder's business.
        let vision = name.contains("vision_tower.") || name.contains("mm_projector.");
        if !expected.contains(name) && !vision {
            problems.push(format!("unexpected tensor {name}"));
        }
    }
    problems
}

/// Fails with the full list of problems, if any.
pub fn require_tensors(spec: &K3Spec, ck: &Checkpoint) -> Result<()> {
    require_none(&check_tensors(spec, ck))
}

/// Pseudo-query of one attention-residual site, with its RMSNorm weight folded
/// in: `query[d] = norm[d] · proj[d]` (docs/k3-model.md §3).
#[derive(Debug, Clone)]
pub struct AttnResWeights {
    pub query: Vec<f32>,
}

#[derive(Debug)]
pub struct KdaWeights {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    /// Depthwise conv taps `[P, kernel]`.
    pub q_conv1d: Vec<f32>,
    pub k_conv1d: Vec<f32>,
    pub v_conv1d: Vec<f32>,
    pub f_a_proj: Linear,
    pub f_b_proj: Linear,
    pub b_proj: Linear,
    pub g_proj: Linear,
    pub o_proj: Linear,
    /// `exp(A_log[h])` broadcast to every key channel: `[H·K]`. Stored per
    /// (head, channel) so the per-head reading is a load-time fact.
    pub a: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub o_norm: Vec<f32>,
}

#[derive(Debug)]
pub struct MlaWeights {
    pub q_a_proj: Linear,
    pub q_a_layernorm: Vec<f32>,
    pub q_b_proj: Linear,
    pub kv_a_proj_with_mqa: Linear,
    pub kv_a_layernorm: Vec<f32>,
    /// `kv_b_proj`, laid out for absorbed attention at load.
    pub kv_b_proj: super::mla::AbsorbedKvB,
    pub g_proj: Linear,
    pub o_proj: Linear,
}

#[derive(Debug)]
pub struct MoeWeights {
    pub gate: Linear,
    pub e_score_correction_bias: Vec<f32>,
    pub routed_expert_down_proj: Linear,
    pub routed_expert_norm: Vec<f32>,
    pub routed_expert_up_proj: Linear,
    pub shared_experts: Option<MlpWeights>,
}

#[derive(Debug)]
pub enum AttnWeights {
    Kda(KdaWeights),
    Mla(MlaWeights),
}

#[derive(Debug)]
pub enum FfnWeights {
    Dense(MlpWeights),
    Moe(MoeWeights),
}

#[derive(Debug)]
pub struct LayerWeights {
    pub input_layernorm: Vec<f32>,
    pub post_attention_layernorm: Vec<f32>,
    pub self_attention_res: AttnResWeights,
    pub mlp_res: AttnResWeights,
    pub attn: AttnWeights,
    pub ffn: FfnWeights,
}

/// The resident spine: everything but the routed experts.
#[derive(Debug)]
pub struct K3Weights {
    pub embed_tokens: Embedding,
    pub layers: Layers<LayerWeights>,
    pub norm: Vec<f32>,
    pub output_attn_res: AttnResWeights,
    pub lm_head: LmHead,
}

/// A site's pseudo-query with its norm weight folded in.
fn attn_res(b: &Binder<'_>, norm: &str, proj: &str) -> Result<AttnResWeights> {
    let n = b.vector(norm)?;
    let p = b.vector(proj)?;
    Ok(AttnResWeights {
        query: n.iter().zip(&p).map(|(a, b)| a * b).collect(),
    })
}

impl K3Weights {
    /// What reading the head in row blocks has cost (zero when resident).
    pub fn head_reads(&self) -> crate::tiers::SpineReads {
        self.lm_head.reads()
    }

    /// Checks the checkpoint against the spec, then reads the spine in
    /// `spine` precision, its decoder layers placed by `plan`.
    pub fn load(
        spec: &Arc<K3Spec>,
        ck: &Arc<Checkpoint>,
        spine: Spine,
        plan: &LayerPlan,
    ) -> Result<Self> {
        require_tensors(spec, ck)?;
        let layers = load_layers(spec, ck, spine, plan, spec.num_layers, layer)?;
        let b = Binder::new(ck);
        let lm_head = LmHead::load(ck, LM_HEAD, spine, plan.head_place(), || b.linear(LM_HEAD))?;
        Ok(K3Weights {
            embed_tokens: Embedding::load(
                ck,
                &format!("{PREFIX}embed_tokens.weight"),
                plan.embedding_on_disk,
            )?,
            layers,
            norm: b.vector(&format!("{PREFIX}norm.weight"))?,
            output_attn_res: attn_res(
                &b,
                &format!("{PREFIX}output_attn_res_norm.weight"),
                &format!("{PREFIX}output_attn_res_proj.weight"),
            )?,
            lm_head,
        })
    }

    /// Quantises every resident spine matrix to per-row int8 (see
    /// [`LayerWeights::quantize_int8`]) and the head.
    pub fn quantize_spine_int8(&mut self) {
        for (_, layer) in self.layers.resident_mut() {
            layer.quantize_int8();
        }
        self.lm_head.quantize_int8();
    }
}

fn kda_weights(spec: &K3Spec, b: &Binder<'_>, i: usize) -> Result<KdaWeights> {
    let n = |rest: &str| layer_name(i, rest);
    let (h, k) = (spec.kda_heads, spec.kda_head_dim);
    let a_log = b.vector(&n("self_attn.A_log"))?;
    let a = (0..h * k).map(|j| a_log[j / k].exp()).collect();
    Ok(KdaWeights {
        q_proj: b.linear(&n("self_attn.q_proj.weight"))?,
        k_proj: b.linear(&n("self_attn.k_proj.weight"))?,
        v_proj: b.linear(&n("self_attn.v_proj.weight"))?,
        q_conv1d: b.vector(&n("self_attn.q_conv1d.weight"))?,
        k_conv1d: b.vector(&n("self_attn.k_conv1d.weight"))?,
        v_conv1d: b.vector(&n("self_attn.v_conv1d.weight"))?,
        f_a_proj: b.linear(&n("self_attn.f_a_proj.weight"))?,
        f_b_proj: b.linear(&n("self_attn.f_b_proj.weight"))?,
        b_proj: b.linear(&n("self_attn.b_proj.weight"))?,
        g_proj: b.linear(&n("self_attn.g_proj.weight"))?,
        o_proj: b.linear(&n("self_attn.o_proj.weight"))?,
        a,
        dt_bias: b.vector(&n("self_attn.dt_bias"))?,
        o_norm: b.vector(&n("self_attn.o_norm.weight"))?,
    })
}

fn mla_weights(spec: &K3Spec, b: &Binder<'_>, i: usize) -> Result<MlaWeights> {
    let n = |rest: &str| layer_name(i, rest);
    Ok(MlaWeights {
        q_a_proj: b.linear(&n("self_attn.q_a_proj.weight"))?,
        q_a_layernorm: b.vector(&n("self_attn.q_a_layernorm.weight"))?,
        q_b_proj: b.linear(&n("self_attn.q_b_proj.weight"))?,
        kv_a_proj_with_mqa: b.linear(&n("self_attn.kv_a_proj_with_mqa.weight"))?,
        kv_a_layernorm: b.vector(&n("self_attn.kv_a_layernorm.weight"))?,
        kv_b_proj: super::mla::AbsorbedKvB::new(
            &spec.mla_dims(),
            &b.linear(&n("self_attn.kv_b_proj.weight"))?,
        ),
        g_proj: b.linear(&n("self_attn.g_proj.weight"))?,
        o_proj: b.linear(&n("self_attn.o_proj.weight"))?,
    })
}

fn ffn_weights(spec: &K3Spec, b: &Binder<'_>, i: usize) -> Result<FfnWeights> {
    let n = |rest: &str| layer_name(i, rest);
    Ok(match spec.ffn_kind(i) {
        FfnKind::Dense => FfnWeights::Dense(b.mlp(&n("mlp."))?),
        FfnKind::Moe => {
            let p = |rest: &str| n(&format!("block_sparse_moe.{rest}"));
            FfnWeights::Moe(MoeWeights {
                gate: b.linear(&p("gate.weight"))?,
                e_score_correction_bias: b.vector(&p("gate.e_score_correction_bias"))?,
                routed_expert_down_proj: b.linear(&p("routed_expert_down_proj.weight"))?,
                routed_expert_norm: b.vector(&p("routed_expert_norm.weight"))?,
                routed_expert_up_proj: b.linear(&p("routed_expert_up_proj.weight"))?,
                shared_experts: if spec.num_shared_experts > 0 {
                    Some(b.mlp(&p("shared_experts."))?)
                } else {
                    None
                },
            })
        }
    })
}

/// Decoder layer `i`, read from the checkpoint (at load when resident, for
/// every pass when streamed) and quantised right away for `Spine::Int8`.
pub fn layer(spec: &K3Spec, ck: &Checkpoint, i: usize, spine: Spine) -> Result<LayerWeights> {
    let b = Binder::new(ck);
    let n = |rest: &str| layer_name(i, rest);
    let attn = match spec.attn_kinds[i] {
        AttnKind::Kda => AttnWeights::Kda(kda_weights(spec, &b, i)?),
        AttnKind::Mla => AttnWeights::Mla(mla_weights(spec, &b, i)?),
    };
    let mut l = LayerWeights {
        input_layernorm: b.vector(&n("input_layernorm.weight"))?,
        post_attention_layernorm: b.vector(&n("post_attention_layernorm.weight"))?,
        self_attention_res: attn_res(
            &b,
            &n("self_attention_res_norm.weight"),
            &n("self_attention_res_proj.weight"),
        )?,
        mlp_res: attn_res(&b, &n("mlp_res_norm.weight"), &n("mlp_res_proj.weight"))?,
        attn,
        ffn: ffn_weights(spec, &b, i)?,
    };
    if spine == Spine::Int8 {
        l.quantize_int8();
    }
    Ok(l)
}

impl LayerWeights {
    /// Quantises the layer's spine matrices to per-row int8 (`Spine::Int8`),
    /// except the router: a router is ~0.3% of the spine bytes but its
    /// scores pick the experts, so an error there changes which weights
    /// run rather than perturbing a sum. (The embedding, a row lookup, is
    /// never quantised; the head is, by [`K3Weights::load`].)
    pub fn quantize_int8(&mut self) {
        match &mut self.attn {
            AttnWeights::Kda(a) => {
                for l in [
                    &mut a.q_proj,
                    &mut a.k_proj,
                    &mut a.v_proj,
                    &mut a.f_a_proj,
                    &mut a.f_b_proj,
                    &mut a.b_proj,
                    &mut a.g_proj,
                    &mut a.o_proj,
                ] {
                    l.quantize_int8();
                }
            }
            AttnWeights::Mla(a) => {
                for l in [
                    &mut a.q_a_proj,
                    &mut a.q_b_proj,
                    &mut a.kv_a_proj_with_mqa,
                    &mut a.kv_b_proj.uk_t,
                    &mut a.kv_b_proj.uv,
                    &mut a.g_proj,
                    &mut a.o_proj,
                ] {
                    l.quantize_int8();
                }
            }
        }
        match &mut self.ffn {
            FfnWeights::Dense(m) => m.quantize_int8(),
            FfnWeights::Moe(m) => {
                m.routed_expert_down_proj.quantize_int8();
                m.routed_expert_up_proj.quantize_int8();
                if let Some(s) = &mut m.shared_experts {
                    s.quantize_int8();
                }
            }
        }
    }
}
