//! Qwen3-MoE (`model_type` `qwen3_moe`): grouped-query attention with
//! per-head q/k RMSNorm and rotary position embedding, and softmax-routed
//! SwiGLU experts (bf16) on the sparse layers, dense SwiGLU MLPs elsewhere.
//!
//! ```text
//! h = embed(ids)
//! per layer:  h += Attn(RMSNorm(h; input_layernorm))
//!             h += FFN(RMSNorm(h; post_attention_layernorm))   (MoE or dense)
//! logits = lm_head(RMSNorm(h; norm))                           (or the tied embedding)
//! ```
//! Activations are fp32 throughout. A step takes any number of sequences,
//! each with any number T ≥ 1 of new tokens, and each position's result is
//! bit-identical whatever the step holds besides it.

pub mod attention;
pub mod config;
pub mod moe;
mod step;
pub mod tensors;
pub mod weights;

use std::sync::Arc;

use fathom_weights::Checkpoint;

use self::config::Qwen3MoeSpec;
use self::weights::Qwen3MoeWeights;
use crate::error::Result;
use crate::family::{Family, Model, StepResult};
use crate::kv_state::{KvParts, KvState};
use crate::lm::{ModelInfo, StepInput};
use crate::trace::Tracer;

/// The Qwen3-MoE family.
pub struct Qwen3Moe;

/// A loaded Qwen3-MoE model.
pub type Qwen3MoeModel = Model<Qwen3Moe>;

impl Family for Qwen3Moe {
    const NAME: &'static str = "Qwen3-MoE";
    const MODEL_TYPES: &'static [&'static str] = &["qwen3_moe"];
    const ARCHITECTURES: &'static [&'static str] = &["Qwen3MoeForCausalLM"];
    type Spec = Qwen3MoeSpec;
    type Weights = Qwen3MoeWeights;
    type Parts = KvParts;
    type State = KvState;

    crate::family::plain_family_fns!(Qwen3MoeSpec, Qwen3MoeWeights);
    fn parts(spec: &Qwen3MoeSpec, _ck: &Arc<Checkpoint>, _mtp: bool) -> Result<KvParts> {
        Ok(KvParts::new(
            spec.rope.rope(spec.head_dim),
            Self::NAME,
            *b"Q3ST",
            spec.num_layers,
            spec.kv_width(),
        ))
    }
    fn info(spec: &Qwen3MoeSpec) -> ModelInfo {
        // The embedding is a row lookup, except when it is also the head.
        let tied = spec.tie_word_embeddings;
        ModelInfo {
            model_type: "qwen3_moe".into(),
            vocab_size: spec.vocab_size,
            hidden_size: spec.hidden_size,
            num_layers: spec.num_layers,
            bos_token_id: spec.bos_token_id,
            eos_token_ids: spec.eos_token_ids.clone(),
            max_position_embeddings: spec.max_position_embeddings,
            spine_bytes: crate::table::spine_bytes(
                tensors::tensor_table(spec)
                    .iter()
                    .map(|t| (t.role, t.bytes())),
                tied,
            ),
            experts_per_token: spec.top_k,
            ..ModelInfo::default()
        }
    }
    fn new_state(m: &Model<Self>) -> KvState {
        KvState::new(&m.parts.layout, &m.kv)
    }
    fn decode_state(m: &Model<Self>, bytes: &[u8]) -> Result<KvState> {
        KvState::decode(&m.parts.layout, &m.kv, bytes)
    }
    fn step(
        m: &Model<Self>,
        batch: &mut [StepInput<'_>],
        tracer: Option<&mut dyn Tracer>,
    ) -> StepResult {
        crate::batch::atomic_step::<KvState>(m.spec.vocab_size, batch, |states, rows| {
            step::forward_rows(m, states, rows, tracer)
        })
    }
}

/// What the RAM ledger needs to know about a Qwen3-MoE model.
pub fn memory_facts(spec: &Qwen3MoeSpec) -> crate::memory::MemoryFacts {
    let table = tensors::tensor_table(spec);
    // The int8 spine quantises the attention projections, dense MLPs and head.
    let entries = || {
        table
            .iter()
            .map(|t| (t.layer, &t.shape[..], t.bytes(), t.role, true))
    };
    let [spine, int8, emb, routed] = crate::table::ledger(entries());
    let moe_layers = spec.moe_layers().count();
    crate::memory::MemoryFacts {
        family: Qwen3Moe::NAME,
        hidden_size: spec.hidden_size,
        vocab_size: spec.vocab_size,
        spine_bytes: spine,
        spine_int8_bytes: int8,
        // A head tied to the embedding reads all of it: none of it is a
        // row lookup alone.
        embedding_bytes: if spec.tie_word_embeddings { 0 } else { emb },
        fixed_state_bytes: 0,
        cache_floats_per_token: (spec.num_layers * spec.kv_width()) as u64,
        top_k: spec.top_k,
        moe_layers,
        num_experts: spec.num_experts,
        expert_bytes: routed / (moe_layers * spec.num_experts).max(1) as u64,
        expert_scratch_floats: 2 * spec.moe_intermediate_size + spec.hidden_size,
        max_position_embeddings: spec.max_position_embeddings,
        mtp_bytes: 0,
        mtp_cache_floats_per_token: 0,
        layers: crate::memory::layer_sums(
            spec.num_layers,
            entries().map(crate::table::tensor_bytes),
        ),
        head: crate::memory::head_sums(entries().map(crate::table::tensor_bytes)),
    }
}
