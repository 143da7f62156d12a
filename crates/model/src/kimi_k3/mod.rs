//! Kimi K3 text decoder: hybrid Kimi Delta Attention + gated NoPE MLA,
//! block attention residuals, SiTU-GLU, LatentMoE with MXFP4 experts.
//!
//! The math is `docs/k3-model.md` (checked against torchtitan's K3,
//! PR 4025, and Moonshot's `modeling_kimi_linear.py`); this module follows its
//! section numbers. Activations are fp32 throughout. A step takes any number
//! of sequences, each with any number T ≥ 1 of new tokens: prefill, decode,
//! speculative verification and batches are the same code, and each
//! position's result is bit-identical whatever the step holds besides it.

mod anatomy;
pub mod attention;
pub mod attn_res;
pub mod config;
pub mod moe;
mod step;
pub mod tensors;
pub mod weights;

/// KDA, MLA and the sequence state are shared with Kimi-Linear.
pub use crate::hybrid::{kda, mla, state};

use std::sync::Arc;

use fathom_weights::Checkpoint;

use self::config::K3Spec;
use self::state::SequenceState;
use self::weights::K3Weights;
use crate::error::Result;
use crate::family::{Family, Model, StepResult};
use crate::hybrid::{HybridParts, state_io};
use crate::lm::{ModelInfo, StepInput};

/// Observer of a pass; K3 reports `attn_in`, `attn_out`, `mlp_in`, `mlp_out`
/// per layer, `final_hidden`, and each MoE layer's routes.
pub use crate::trace::Tracer;

/// The Kimi K3 family.
pub struct KimiK3;

/// A loaded K3 model.
pub type K3Model = Model<KimiK3>;

impl Family for KimiK3 {
    const NAME: &'static str = "Kimi K3";
    const MODEL_TYPES: &'static [&'static str] = &["kimi_k3"];
    const ARCHITECTURES: &'static [&'static str] =
        &["KimiK3ForConditionalGeneration", "KimiK3ForCausalLM"];
    type Spec = K3Spec;
    type Weights = K3Weights;
    type Parts = HybridParts;
    type State = SequenceState;

    crate::family::plain_family_fns!(K3Spec, K3Weights, weights::check_tensors);
    fn anatomy(spec: &K3Spec) -> Option<crate::anatomy::Anatomy> {
        Some(anatomy::anatomy(spec))
    }
    fn parts(spec: &K3Spec, _ck: &Arc<Checkpoint>, _mtp: bool) -> Result<HybridParts> {
        Ok(Arc::new(spec.hybrid_dims()))
    }
    fn info(spec: &K3Spec) -> ModelInfo {
        ModelInfo {
            model_type: "kimi_k3".into(),
            vocab_size: spec.vocab_size,
            hidden_size: spec.hidden_size,
            num_layers: spec.num_layers,
            bos_token_id: spec.bos_token_id,
            eos_token_ids: spec.eos_token_id.into_iter().collect(),
            max_position_embeddings: spec.max_position_embeddings,
            spine_bytes: tensors::tensor_table(spec)
                .iter()
                .filter(|t| t.role.is_spine() && t.role != tensors::Role::Embedding)
                .map(tensors::TensorSpec::bytes)
                .sum(),
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

/// What the RAM ledger needs to know about a K3 model.
pub fn memory_facts(spec: &K3Spec) -> crate::memory::MemoryFacts {
    use tensors::Role;
    let table = tensors::tensor_table(spec);
    // The int8 spine quantises every 2-D projection of attention, the dense
    // MLP, the LatentMoE projections, the shared experts and the head.
    let entries = || {
        table.iter().map(|t| crate::memory::TensorBytes {
            layer: t.layer,
            shape: &t.shape,
            bytes: t.bytes(),
            embedding: t.role == Role::Embedding,
            head: t.role == Role::Head,
            routed_expert: t.role == Role::RoutedExpert,
            int8: matches!(
                t.role,
                Role::Attention | Role::DenseMlp | Role::Latent | Role::SharedExpert | Role::Head
            ),
        })
    };
    let [spine, int8, emb, _] = crate::memory::table_sums(entries());
    let dims = spec.hybrid_dims();
    crate::memory::MemoryFacts {
        family: KimiK3::NAME,
        hidden_size: spec.hidden_size,
        vocab_size: spec.vocab_size,
        spine_bytes: spine,
        spine_int8_bytes: int8,
        embedding_bytes: emb,
        fixed_state_bytes: dims.fixed_state_bytes(),
        cache_floats_per_token: dims.cache_floats_per_token(),
        top_k: spec.top_k,
        moe_layers: spec.moe_layers().count(),
        num_experts: spec.num_experts,
        expert_bytes: tensors::expert_bytes(spec),
        expert_scratch_floats: 2 * spec.moe_intermediate_size + spec.latent_size,
        max_position_embeddings: spec.max_position_embeddings,
        mtp_bytes: 0,
        mtp_cache_floats_per_token: 0,
        layers: crate::memory::layer_sums(spec.num_layers, entries()),
        head: crate::memory::head_sums(entries()),
    }
}
