//! Kimi-Linear (`model_type` `kimi_linear`), K3's precursor: hybrid Kimi
//! Delta Attention + NoPE MLA layers (the shared cores of
//! [`crate::hybrid`]), plain residuals, a dense SwiGLU MLP in the first
//! layers and then a group-limited sigmoid-routed MoE with shared experts.
//!
//! ```text
//! h = embed(ids)
//! per layer:  h += Attn(RMSNorm(h; input_layernorm))               (KDA or MLA)
//!             h += FFN(RMSNorm(h; post_attention_layernorm))       (dense or MoE)
//! logits = lm_head(RMSNorm(h; norm))
//! ```
//! Activations are fp32 throughout; each position's result is
//! bit-identical whatever the step holds besides it.

pub mod attention;
pub mod config;
pub mod moe;
mod step;
pub mod tensors;
pub mod weights;

use std::sync::Arc;

use fathom_weights::Checkpoint;

use self::config::KimiLinearSpec;
use self::weights::KimiLinearWeights;
use crate::error::Result;
use crate::family::{Family, Model, StepResult};
use crate::hybrid::state::SequenceState;
use crate::hybrid::{HybridParts, state_io};
use crate::lm::{ModelInfo, StepInput};
use crate::trace::Tracer;

/// The Kimi-Linear family.
pub struct KimiLinear;

/// A loaded Kimi-Linear model.
pub type KimiLinearModel = Model<KimiLinear>;

impl Family for KimiLinear {
    const NAME: &'static str = "Kimi-Linear";
    const MODEL_TYPES: &'static [&'static str] = &["kimi_linear"];
    const ARCHITECTURES: &'static [&'static str] = &["KimiLinearForCausalLM"];
    type Spec = KimiLinearSpec;
    type Weights = KimiLinearWeights;
    type Parts = HybridParts;
    type State = SequenceState;

    crate::family::plain_family_fns!(KimiLinearSpec, KimiLinearWeights);
    fn parts(spec: &KimiLinearSpec, _ck: &Arc<Checkpoint>, _mtp: bool) -> Result<HybridParts> {
        Ok(Arc::new(spec.hybrid_dims()))
    }
    fn info(spec: &KimiLinearSpec) -> ModelInfo {
        ModelInfo {
            model_type: "kimi_linear".into(),
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
                false,
            ),
            experts_per_token: spec.top_k,
            ..ModelInfo::default()
        }
    }
    fn new_state(m: &Model<Self>) -> SequenceState {
        SequenceState::new(&m.parts, &m.kv)
    }
    fn decode_state(m: &Model<Self>, bytes: &[u8]) -> Result<SequenceState> {
        state_io::decode(&m.parts, &m.kv, bytes)
    }
    fn synthetic_state(m: &Model<Self>, depth: usize, seed: u64) -> Result<SequenceState> {
        state_io::synthetic(&m.parts, &m.kv, depth, seed)
    }
    fn step(
        m: &Model<Self>,
        batch: &mut [StepInput<'_>],
        tracer: Option<&mut dyn Tracer>,
    ) -> StepResult {
        step::step(m, batch, tracer)
    }
}

/// What the RAM ledger needs to know about a Kimi-Linear model.
pub fn memory_facts(spec: &KimiLinearSpec) -> crate::memory::MemoryFacts {
    let table = tensors::tensor_table(spec);
    // The int8 spine quantises attention, dense-MLP, shared-expert and head matrices.
    let entries = || {
        table
            .iter()
            .map(|t| (t.layer, &t.shape[..], t.bytes(), t.role, true))
    };
    let [spine, int8, emb, routed] = crate::table::ledger(entries());
    let dims = spec.hybrid_dims();
    let moe_layers = spec.moe_layers().count();
    crate::memory::MemoryFacts {
        family: KimiLinear::NAME,
        hidden_size: spec.hidden_size,
        vocab_size: spec.vocab_size,
        spine_bytes: spine,
        spine_int8_bytes: int8,
        embedding_bytes: emb,
        fixed_state_bytes: dims.fixed_state_bytes(),
        cache_floats_per_token: dims.cache_floats_per_token(),
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
