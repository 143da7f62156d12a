//! Binding: checkpoint names → typed per-layer weights, once, at load.
//! After [`DeepseekV3Weights::load`] nothing is looked up by name again.

use std::sync::Arc;

use fathom_weights::Checkpoint;

use super::config::{DeepseekV3Spec, FfnKind};
use super::tensors::{LM_HEAD, PREFIX, check_tensors, layer_name};
use crate::bind::{Binder, require_none};
use crate::embedding::Embedding;
use crate::error::Result;
use crate::head::LmHead;
use crate::hybrid::mla::AbsorbedKvB;
use crate::linear::{Linear, Spine};
use crate::mlp::MlpWeights;
use crate::moe::SigmoidMoeWeights;
use crate::tiers::{LayerPlan, Layers, load_layers};

/// How the queries are made.
#[derive(Debug)]
pub enum QueryProj {
    /// `q_b_proj(RMSNorm(q_a_proj x; q_a_layernorm))`.
    LowRank {
        q_a_proj: Linear,
        q_a_layernorm: Vec<f32>,
        q_b_proj: Linear,
    },
    /// `q_proj x` (`q_lora_rank` null).
    Full { q_proj: Linear },
}

#[derive(Debug)]
pub struct AttnWeights {
    pub q: QueryProj,
    pub kv_a_proj_with_mqa: Linear,
    pub kv_a_layernorm: Vec<f32>,
    /// `kv_b_proj`, laid out for absorbed attention at load.
    pub kv_b_proj: AbsorbedKvB,
    pub o_proj: Linear,
}

#[derive(Debug)]
pub enum FfnWeights {
    Dense(MlpWeights),
    /// Router, selection bias and shared experts (routed experts come from
    /// the expert source).
    Moe(SigmoidMoeWeights),
}

#[derive(Debug)]
pub struct LayerWeights {
    pub input_layernorm: Vec<f32>,
    pub post_attention_layernorm: Vec<f32>,
    pub self_attn: AttnWeights,
    pub mlp: FfnWeights,
}

/// The resident spine: everything but the routed experts.
#[derive(Debug)]
pub struct DeepseekV3Weights {
    pub embed_tokens: Embedding,
    pub layers: Layers<LayerWeights>,
    pub norm: Vec<f32>,
    pub lm_head: LmHead,
}

fn attention(spec: &DeepseekV3Spec, b: &Binder<'_>, i: usize) -> Result<AttnWeights> {
    let n = |rest: &str| layer_name(i, &format!("self_attn.{rest}"));
    let q = match spec.q_lora_rank {
        Some(_) => QueryProj::LowRank {
            q_a_proj: b.linear(&n("q_a_proj.weight"))?,
            q_a_layernorm: b.vector(&n("q_a_layernorm.weight"))?,
            q_b_proj: b.linear(&n("q_b_proj.weight"))?,
        },
        None => QueryProj::Full {
            q_proj: b.linear(&n("q_proj.weight"))?,
        },
    };
    Ok(AttnWeights {
        q,
        kv_a_proj_with_mqa: b.linear(&n("kv_a_proj_with_mqa.weight"))?,
        kv_a_layernorm: b.vector(&n("kv_a_layernorm.weight"))?,
        kv_b_proj: AbsorbedKvB::new(&spec.mla_dims(), &b.linear(&n("kv_b_proj.weight"))?),
        o_proj: b.linear(&n("o_proj.weight"))?,
    })
}

/// Decoder layer `i`'s spine (the multi-token-prediction layer's too).
pub(super) fn layer(spec: &DeepseekV3Spec, b: &Binder<'_>, i: usize) -> Result<LayerWeights> {
    let n = |rest: &str| layer_name(i, rest);
    let mlp = match spec.ffn_kind(i) {
        FfnKind::Dense => FfnWeights::Dense(b.mlp(&n("mlp."))?),
        FfnKind::Moe => FfnWeights::Moe(SigmoidMoeWeights {
            gate: b.linear(&n("mlp.gate.weight"))?,
            e_score_correction_bias: b.vector(&n("mlp.gate.e_score_correction_bias"))?,
            shared_experts: if spec.n_shared_experts > 0 {
                Some(b.mlp(&n("mlp.shared_experts."))?)
            } else {
                None
            },
        }),
    };
    Ok(LayerWeights {
        input_layernorm: b.vector(&n("input_layernorm.weight"))?,
        post_attention_layernorm: b.vector(&n("post_attention_layernorm.weight"))?,
        self_attn: attention(spec, b, i)?,
        mlp,
    })
}

impl DeepseekV3Weights {
    /// What reading the head in row blocks has cost (zero when resident).
    pub fn head_reads(&self) -> crate::tiers::SpineReads {
        self.lm_head.reads()
    }

    /// Checks the checkpoint against the spec, then reads the spine in
    /// `spine` precision (FP8 matrices stay FP8 with their tile scales),
    /// its decoder layers placed by `plan`.
    pub fn load(
        spec: &Arc<DeepseekV3Spec>,
        ck: &Arc<Checkpoint>,
        spine: Spine,
        plan: &LayerPlan,
    ) -> Result<Self> {
        require_none(&check_tensors(spec, ck))?;
        let layers = load_layers(spec, ck, spine, plan, spec.num_layers, load_layer)?;
        let b = Binder {
            ck,
            fp8_block: spec.fp8_block(),
        };
        let lm_head = LmHead::load(ck, LM_HEAD, spine, plan.head_place(), || b.linear(LM_HEAD))?;
        Ok(DeepseekV3Weights {
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
pub fn load_layer(
    spec: &DeepseekV3Spec,
    ck: &Checkpoint,
    i: usize,
    spine: Spine,
) -> Result<LayerWeights> {
    let b = Binder {
        ck,
        fp8_block: spec.fp8_block(),
    };
    let mut l = layer(spec, &b, i)?;
    if spine == Spine::Int8 {
        l.quantize_int8();
    }
    Ok(l)
}

impl LayerWeights {
    /// Quantises the layer's float spine matrices to per-row int8
    /// (`Spine::Int8`), except the router (it picks the experts); FP8
    /// matrices stay FP8.
    pub fn quantize_int8(&mut self) {
        let a = &mut self.self_attn;
        match &mut a.q {
            QueryProj::LowRank {
                q_a_proj, q_b_proj, ..
            } => {
                q_a_proj.quantize_int8();
                q_b_proj.quantize_int8();
            }
            QueryProj::Full { q_proj } => q_proj.quantize_int8(),
        }
        for l in [
            &mut a.kv_a_proj_with_mqa,
            &mut a.kv_b_proj.uk_t,
            &mut a.kv_b_proj.uv,
            &mut a.o_proj,
        ] {
            l.quantize_int8();
        }
        match &mut self.mlp {
            FfnWeights::Dense(m) => m.quantize_int8(),
            FfnWeights::Moe(m) => {
                if let Some(s) = &mut m.shared_experts {
                    s.quantize_int8();
                }
            }
        }
    }
}
