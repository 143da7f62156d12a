//! Binding: checkpoint names → typed per-layer weights, once, at load.
//! After [`GptOssWeights::load`] nothing is looked up by name again.

use std::sync::Arc;

use fathom_weights::Checkpoint;

use super::config::GptOssSpec;
use super::tensors::{LM_HEAD, PREFIX, check_tensors, layer_name};
use crate::bind::{Binder, require_none};
use crate::embedding::Embedding;
use crate::error::Result;
use crate::head::LmHead;
use crate::linear::{Linear, Proj, Spine};
use crate::tiers::{LayerPlan, Layers, load_layers};

#[derive(Debug)]
pub struct AttnWeights {
    pub q_proj: Proj,
    pub k_proj: Proj,
    pub v_proj: Proj,
    pub o_proj: Proj,
    /// One extra softmax logit per head (carries no value).
    pub sinks: Vec<f32>,
}

/// The router: `x Wᵀ + b` over the experts.
#[derive(Debug)]
pub struct RouterWeights {
    /// `[E, D]`, kept in its stored precision (it picks experts).
    pub weight: Linear,
    pub bias: Vec<f32>,
}

#[derive(Debug)]
pub struct LayerWeights {
    pub input_layernorm: Vec<f32>,
    pub post_attention_layernorm: Vec<f32>,
    pub self_attn: AttnWeights,
    pub router: RouterWeights,
}

/// The resident spine: everything but the routed experts (and their
/// biases, which travel with them).
#[derive(Debug)]
pub struct GptOssWeights {
    pub embed_tokens: Embedding,
    pub layers: Layers<LayerWeights>,
    pub norm: Vec<f32>,
    pub lm_head: LmHead,
}

impl GptOssWeights {
    /// What reading the head in row blocks has cost (zero when resident).
    pub fn head_reads(&self) -> crate::tiers::SpineReads {
        self.lm_head.reads()
    }

    /// Checks the checkpoint against the spec, then reads the spine in
    /// `spine` precision, its decoder layers placed by `plan`.
    pub fn load(
        spec: &Arc<GptOssSpec>,
        ck: &Arc<Checkpoint>,
        spine: Spine,
        plan: &LayerPlan,
    ) -> Result<Self> {
        require_none(&check_tensors(spec, ck))?;
        let layers = load_layers(spec, ck, spine, plan, spec.num_layers, layer)?;
        let b = Binder::new(ck);
        let lm_head = LmHead::load(ck, LM_HEAD, spine, plan.head_place(), || b.linear(LM_HEAD))?;
        Ok(GptOssWeights {
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
pub fn layer(spec: &GptOssSpec, ck: &Checkpoint, i: usize, spine: Spine) -> Result<LayerWeights> {
    let b = Binder::new(ck);
    let n = |rest: &str| layer_name(i, rest);
    let proj = |name: &str| -> Result<Proj> {
        Ok(Proj {
            weight: b.linear(&n(&format!("self_attn.{name}.weight")))?,
            bias: if spec.attention_bias {
                Some(b.vector(&n(&format!("self_attn.{name}.bias")))?)
            } else {
                None
            },
        })
    };
    let mut l = LayerWeights {
        input_layernorm: b.vector(&n("input_layernorm.weight"))?,
        post_attention_layernorm: b.vector(&n("post_attention_layernorm.weight"))?,
        self_attn: AttnWeights {
            q_proj: proj("q_proj")?,
            k_proj: proj("k_proj")?,
            v_proj: proj("v_proj")?,
            o_proj: proj("o_proj")?,
            sinks: b.vector(&n("self_attn.sinks"))?,
        },
        router: RouterWeights {
            weight: b.linear(&n("mlp.router.weight"))?,
            bias: b.vector(&n("mlp.router.bias"))?,
        },
    };
    if spine == Spine::Int8 {
        l.quantize_int8();
    }
    Ok(l)
}

impl LayerWeights {
    /// Quantises the layer's attention projections to per-row int8
    /// (`Spine::Int8`); the router stays (it picks the experts).
    pub fn quantize_int8(&mut self) {
        let a = &mut self.self_attn;
        for p in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj] {
            p.weight.quantize_int8();
        }
    }
}
