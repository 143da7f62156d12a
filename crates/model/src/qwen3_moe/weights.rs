//! Binding: checkpoint names → typed per-layer weights, once, at load.
//! After [`Qwen3MoeWeights::load`] nothing is looked up by name again.

use std::sync::Arc;

use fathom_weights::Checkpoint;

use super::config::{FfnKind, Qwen3MoeSpec};
use super::tensors::{LM_HEAD, PREFIX, check_tensors, layer_name};
use crate::bind::{Binder, require_none};
use crate::embedding::Embedding;
use crate::error::Result;
use crate::head::{HeadRef, LmHead};
use crate::linear::{Linear, Spine};
use crate::mlp::MlpWeights;
use crate::tiers::{LayerPlan, Layers, load_layers};

pub use crate::linear::Proj;

#[derive(Debug)]
pub struct AttnWeights {
    pub q_proj: Proj,
    pub k_proj: Proj,
    pub v_proj: Proj,
    pub o_proj: Proj,
    /// Per-head RMSNorm weights over `head_dim`, applied before RoPE.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

#[derive(Debug)]
pub struct MoeWeights {
    /// The router, `[E, D]` (kept in its stored precision: it picks experts).
    pub gate: Linear,
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
    pub self_attn: AttnWeights,
    pub mlp: FfnWeights,
}

/// The resident spine: everything but the routed experts.
#[derive(Debug)]
pub struct Qwen3MoeWeights {
    pub embed_tokens: Embedding,
    pub layers: Layers<LayerWeights>,
    pub norm: Vec<f32>,
    /// `lm_head`, or `None` when tied to `embed_tokens`.
    pub lm_head: Option<LmHead>,
}

impl Qwen3MoeWeights {
    /// What reading the head in row blocks has cost (zero when resident).
    pub fn head_reads(&self) -> crate::tiers::SpineReads {
        self.lm_head
            .as_ref()
            .map_or_else(Default::default, LmHead::reads)
    }

    /// Checks the checkpoint against the spec, then reads the spine in
    /// `spine` precision, its decoder layers placed by `plan`.
    pub fn load(
        spec: &Arc<Qwen3MoeSpec>,
        ck: &Arc<Checkpoint>,
        spine: Spine,
        plan: &LayerPlan,
    ) -> Result<Self> {
        require_none(&check_tensors(spec, ck))?;
        let layers = load_layers(spec, ck, spine, plan, spec.num_layers, layer)?;
        let b = Binder::new(ck);
        let lm_head = if spec.tie_word_embeddings {
            None
        } else {
            Some(LmHead::load(ck, LM_HEAD, spine, plan.head_place(), || {
                b.linear(LM_HEAD)
            })?)
        };
        Ok(Qwen3MoeWeights {
            embed_tokens: Embedding::load(
                ck,
                &format!("{PREFIX}embed_tokens.weight"),
                plan.embedding_on_disk && !spec.tie_word_embeddings,
            )?,
            layers,
            norm: b.vector(&format!("{PREFIX}norm.weight"))?,
            lm_head,
        })
    }

    /// The output head (the embedding when tied).
    pub fn head(&self) -> HeadRef<'_> {
        match (&self.lm_head, self.embed_tokens.resident()) {
            (Some(h), _) => HeadRef::Head(h),
            (None, Some(t)) => HeadRef::Tied(t),
            (None, None) => unreachable!("a head tied to the embedding keeps it resident"),
        }
    }

    /// Quantises every resident spine matrix to per-row int8 (see
    /// [`LayerWeights::quantize_int8`]) and an untied head.
    pub fn quantize_spine_int8(&mut self) {
        for (_, layer) in self.layers.resident_mut() {
            layer.quantize_int8();
        }
        if let Some(h) = &mut self.lm_head {
            h.quantize_int8();
        }
    }
}

/// Decoder layer `i`, read from the checkpoint (at load when resident, for
/// every pass when streamed) and quantised right away for `Spine::Int8`.
pub fn layer(spec: &Qwen3MoeSpec, ck: &Checkpoint, i: usize, spine: Spine) -> Result<LayerWeights> {
    let b = Binder::new(ck);
    let proj = |name: &str| -> Result<Proj> {
        Ok(Proj {
            weight: b.linear(&format!("{name}.weight"))?,
            bias: if spec.attention_bias {
                Some(b.vector(&format!("{name}.bias"))?)
            } else {
                None
            },
        })
    };
    let n = |rest: &str| layer_name(i, rest);
    let self_attn = AttnWeights {
        q_proj: proj(&n("self_attn.q_proj"))?,
        k_proj: proj(&n("self_attn.k_proj"))?,
        v_proj: proj(&n("self_attn.v_proj"))?,
        o_proj: proj(&n("self_attn.o_proj"))?,
        q_norm: b.vector(&n("self_attn.q_norm.weight"))?,
        k_norm: b.vector(&n("self_attn.k_norm.weight"))?,
    };
    let mlp = match spec.ffn_kind(i) {
        FfnKind::Dense => FfnWeights::Dense(b.mlp(&n("mlp."))?),
        FfnKind::Moe => FfnWeights::Moe(MoeWeights {
            gate: b.linear(&n("mlp.gate.weight"))?,
        }),
    };
    let mut l = LayerWeights {
        input_layernorm: b.vector(&n("input_layernorm.weight"))?,
        post_attention_layernorm: b.vector(&n("post_attention_layernorm.weight"))?,
        self_attn,
        mlp,
    };
    if spine == Spine::Int8 {
        l.quantize_int8();
    }
    Ok(l)
}

impl LayerWeights {
    /// Quantises the layer's attention projections and dense MLP to
    /// per-row int8 (`Spine::Int8`); the router stays (it picks the
    /// experts), as does the embedding (a row lookup; also the head when
    /// tied).
    pub fn quantize_int8(&mut self) {
        let a = &mut self.self_attn;
        for p in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj] {
            p.weight.quantize_int8();
        }
        if let FfnWeights::Dense(m) = &mut self.mlp {
            m.quantize_int8();
        }
    }
}
