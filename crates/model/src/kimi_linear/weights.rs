//! Binding: checkpoint names → typed per-layer weights, once, at load.
//! After [`KimiLinearWeights::load`] nothing is looked up by name again.

use std::sync::Arc;

use fathom_weights::Checkpoint;

use super::config::{FfnKind, KimiLinearSpec};
use super::tensors::{LM_HEAD, PREFIX, check_tensors, layer_name};
use crate::bind::{Binder, require_none};
use crate::embedding::Embedding;
use crate::error::Result;
use crate::head::LmHead;
use crate::hybrid::AttnKind;
use crate::hybrid::kda::KdaParams;
use crate::hybrid::mla::AbsorbedKvB;
use crate::linear::{Linear, Spine};
use crate::mlp::MlpWeights;
use crate::tiers::{LayerPlan, Layers, load_layers};

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
    /// The low-rank output gate `(x W_g_aᵀ) W_g_bᵀ`.
    pub g_a_proj: Linear,
    pub g_b_proj: Linear,
    pub o_proj: Linear,
    /// `exp(A_log[h])` broadcast to every key channel: `[H·K]`.
    pub a: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub o_norm: Vec<f32>,
}

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

#[derive(Debug)]
pub struct MlaWeights {
    pub q_proj: Linear,
    pub kv_a_proj_with_mqa: Linear,
    pub kv_a_layernorm: Vec<f32>,
    /// `kv_b_proj`, laid out for absorbed attention at load.
    pub kv_b_proj: AbsorbedKvB,
    pub o_proj: Linear,
}

/// The router, its selection bias and the shared experts.
pub use crate::moe::SigmoidMoeWeights as MoeWeights;

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
    pub attn: AttnWeights,
    pub ffn: FfnWeights,
}

/// The resident spine: everything but the routed experts.
#[derive(Debug)]
pub struct KimiLinearWeights {
    pub embed_tokens: Embedding,
    pub layers: Layers<LayerWeights>,
    pub norm: Vec<f32>,
    pub lm_head: LmHead,
}

fn kda(spec: &KimiLinearSpec, b: &Binder<'_>, i: usize) -> Result<KdaWeights> {
    let n = |rest: &str| layer_name(i, &format!("self_attn.{rest}"));
    let (h, k) = (spec.kda_heads, spec.kda_head_dim);
    let a_log = b.vector(&n("A_log"))?;
    Ok(KdaWeights {
        q_proj: b.linear(&n("q_proj.weight"))?,
        k_proj: b.linear(&n("k_proj.weight"))?,
        v_proj: b.linear(&n("v_proj.weight"))?,
        q_conv1d: b.vector(&n("q_conv1d.weight"))?,
        k_conv1d: b.vector(&n("k_conv1d.weight"))?,
        v_conv1d: b.vector(&n("v_conv1d.weight"))?,
        f_a_proj: b.linear(&n("f_a_proj.weight"))?,
        f_b_proj: b.linear(&n("f_b_proj.weight"))?,
        b_proj: b.linear(&n("b_proj.weight"))?,
        g_a_proj: b.linear(&n("g_a_proj.weight"))?,
        g_b_proj: b.linear(&n("g_b_proj.weight"))?,
        o_proj: b.linear(&n("o_proj.weight"))?,
        a: (0..h * k).map(|j| a_log[j / k].exp()).collect(),
        dt_bias: b.vector(&n("dt_bias"))?,
        o_norm: b.vector(&n("o_norm.weight"))?,
    })
}

fn mla(spec: &KimiLinearSpec, b: &Binder<'_>, i: usize) -> Result<MlaWeights> {
    let n = |rest: &str| layer_name(i, &format!("self_attn.{rest}"));
    Ok(MlaWeights {
        q_proj: b.linear(&n("q_proj.weight"))?,
        kv_a_proj_with_mqa: b.linear(&n("kv_a_proj_with_mqa.weight"))?,
        kv_a_layernorm: b.vector(&n("kv_a_layernorm.weight"))?,
        kv_b_proj: AbsorbedKvB::new(&spec.mla_dims(), &b.linear(&n("kv_b_proj.weight"))?),
        o_proj: b.linear(&n("o_proj.weight"))?,
    })
}

impl KimiLinearWeights {
    /// What reading the head in row blocks has cost (zero when resident).
    pub fn head_reads(&self) -> crate::tiers::SpineReads {
        self.lm_head.reads()
    }

    /// Checks the checkpoint against the spec, then reads the spine in
    /// `spine` precision, its decoder layers placed by `plan`.
    pub fn load(
        spec: &Arc<KimiLinearSpec>,
        ck: &Arc<Checkpoint>,
        spine: Spine,
        plan: &LayerPlan,
    ) -> Result<Self> {
        require_none(&check_tensors(spec, ck))?;
        let layers = load_layers(spec, ck, spine, plan, spec.num_layers, layer)?;
        let b = Binder::new(ck);
        let lm_head = LmHead::load(ck, LM_HEAD, spine, plan.head_place(), || b.linear(LM_HEAD))?;
        Ok(KimiLinearWeights {
            embed_tokens: Embedding::load(
                ck,
                &format!("{PREFIX}embed_tokens.weight"),
                plan.embedding_on_disk,
            )?,
            layers,
            norm: b.vector(&format!("{PREFIX}norm.weight"))?,
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

/// Decoder layer `i`, read from the checkpoint (at load when resident, for
/// every pass when streamed) and quantised right away for `Spine::Int8`.
pub fn layer(
    spec: &KimiLinearSpec,
    ck: &Checkpoint,
    i: usize,
    spine: Spine,
) -> Result<LayerWeights> {
    let b = Binder::new(ck);
    let n = |rest: &str| layer_name(i, rest);
    let attn = match spec.attn_kinds[i] {
        AttnKind::Kda => AttnWeights::Kda(kda(spec, &b, i)?),
        AttnKind::Mla => AttnWeights::Mla(mla(spec, &b, i)?),
    };
    let ffn = match spec.ffn_kind(i) {
        FfnKind::Dense => FfnWeights::Dense(b.mlp(&n("mlp."))?),
        FfnKind::Moe => {
            let p = |rest: &str| n(&format!("block_sparse_moe.{rest}"));
            FfnWeights::Moe(MoeWeights {
                gate: b.linear(&p("gate.weight"))?,
                e_score_correction_bias: b.vector(&p("gate.e_score_correction_bias"))?,
                shared_experts: if spec.num_shared_experts > 0 {
                    Some(b.mlp(&p("shared_experts."))?)
                } else {
                    None
                },
            })
        }
    };
    let mut l = LayerWeights {
        input_layernorm: b.vector(&n("input_layernorm.weight"))?,
        post_attention_layernorm: b.vector(&n("post_attention_layernorm.weight"))?,
        attn,
        ffn,
    };
    if spine == Spine::Int8 {
        l.quantize_int8();
    }
    Ok(l)
}

impl LayerWeights {
    /// Quantises the layer's attention, dense-MLP and shared-expert
    /// matrices to per-row int8 (`Spine::Int8`); the router stays (it
    /// picks the experts).
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
                    &mut a.g_a_proj,
                    &mut a.g_b_proj,
                    &mut a.o_proj,
                ] {
                    l.quantize_int8();
                }
            }
            AttnWeights::Mla(a) => {
                for l in [
                    &mut a.q_proj,
                    &mut a.kv_a_proj_with_mqa,
                    &mut a.kv_b_proj.uk_t,
                    &mut a.kv_b_proj.uv,
                    &mut a.o_proj,
                ] {
                    l.quantize_int8();
                }
            }
        }
        match &mut self.ffn {
            FfnWeights::Dense(m) => m.quantize_int8(),
            FfnWeights::Moe(m) => {
                if let Some(s) = &mut m.shared_experts {
                    s.quantize_int8();
                }
            }
        }
    }
}
