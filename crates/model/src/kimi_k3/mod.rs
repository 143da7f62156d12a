//! Kimi K3 text decoder: hybrid Kimi Delta Attention + gated NoPE MLA,
//! block attention residuals, SiTU-GLU, LatentMoE with MXFP4 experts.
//!
//! The math is `docs/k3-model.md` (checked against torchtitan's K3,
//! PR 4025, and Moonshot's `modeling_kimi_linear.py`); this module follows its
//! section numbers. Activations are fp32 throughout. A step takes any number
//! of sequences, each with any number T ≥ 1 of new tokens: prefill, decode,
//! speculative verification and batches are the same code, and each
//! position's result is bit-identical whatever the step holds besides it.

pub mod attention;
pub mod attn_res;
pub mod config;
pub mod moe;
mod step;
pub mod tensors;
pub mod weights;

/// KDA, MLA and the sequence state are shared with Kimi-Linear.
pub use crate::hybrid::{kda, mla, state};

use std::path::Path;
use std::sync::Arc;

use fathom_weights::Checkpoint;

use self::config::{AttnKind, K3Spec};
use self::state::SequenceState;
use self::weights::K3Weights;
use crate::error::Result;
use crate::experts::{ExpertSource, ExpertStats, ExpertTable, ResidentExperts};
use crate::hybrid::{HybridDims, state_io};
use crate::kv::KvPool;
use crate::linear::Spine;
use crate::lm::{CausalLm, Logits, ModelInfo, SeqState, StepError, StepInput};
use crate::registry::{Architecture, LoadOptions};

/// The registry's entry for Kimi K3.
pub const ARCHITECTURE: Architecture = Architecture {
    family: "Kimi K3",
    model_types: &["kimi_k3"],
    architectures: &["KimiK3ForConditionalGeneration", "KimiK3ForCausalLM"],
    load: load_lm,
    memory,
    experts,
    mtp: false,
};

/// Locators of the routed experts of the checkpoint `ck` in `dir`.
fn experts(dir: &Path, ck: &fathom_weights::Checkpoint) -> Result<ExpertTable> {
    tensors::expert_table(&K3Spec::from_dir(dir)?, ck)
}

fn memory(dir: &Path) -> Result<crate::memory::MemoryFacts> {
    Ok(memory_facts(&K3Spec::from_dir(dir)?))
}

/// What the RAM ledger needs to know about a K3 model.
pub fn memory_facts(spec: &K3Spec) -> crate::memory::MemoryFacts {
    use tensors::Role;
    let table = tensors::tensor_table(spec);
    // The int8 spine quantises every 2-D projection of attention, the dense
    // MLP, the LatentMoE projections, the shared experts and the head.
    let [spine, int8, emb, _] =
        crate::memory::table_sums(table.iter().map(|t| crate::memory::TensorBytes {
            shape: &t.shape,
            bytes: t.bytes(),
            embedding: t.role == Role::Embedding,
            routed_expert: t.role == Role::RoutedExpert,
            int8: matches!(
                t.role,
                Role::Attention | Role::DenseMlp | Role::Latent | Role::SharedExpert | Role::Head
            ),
        }));
    let kinds = |k: AttnKind| spec.attn_kinds.iter().filter(|x| **x == k).count() as u64;
    let kda_layer = 4
        * (spec.kda_heads * spec.kda_head_dim * spec.kda_head_dim
            + 3 * (spec.conv_kernel - 1) * spec.kda_width()) as u64;
    crate::memory::MemoryFacts {
        family: ARCHITECTURE.family,
        hidden_size: spec.hidden_size,
        vocab_size: spec.vocab_size,
        spine_bytes: spine,
        spine_int8_bytes: int8,
        embedding_bytes: emb,
        fixed_state_bytes: kinds(AttnKind::Kda) * kda_layer,
        cache_floats_per_token: kinds(AttnKind::Mla) * spec.mla_cache_width() as u64,
        top_k: spec.top_k,
        moe_layers: spec.moe_layers().count(),
        num_experts: spec.num_experts,
        expert_bytes: tensors::expert_bytes(spec),
        expert_scratch_floats: 2 * spec.moe_intermediate_size + spec.latent_size,
        max_position_embeddings: spec.max_position_embeddings,
        mtp_bytes: 0,
        mtp_cache_floats_per_token: 0,
    }
}

fn load_lm(dir: &Path, opts: LoadOptions) -> Result<Arc<dyn CausalLm>> {
    let make = opts
        .experts
        .unwrap_or_else(crate::registry::resident_source);
    let mut m = K3Model::load_with_spine(dir, make, opts.spine)?;
    m.kv = KvPool::new(opts.kv);
    Ok(Arc::new(m))
}

/// Observer of a pass; K3 reports `attn_in`, `attn_out`, `mlp_in`, `mlp_out`
/// per layer, `final_hidden`, and each MoE layer's routes.
pub use crate::trace::Tracer;

/// A loaded K3 model: spec, resident spine, and a source of routed experts.
pub struct K3Model {
    pub spec: Arc<K3Spec>,
    /// What its sequence states are shaped by.
    pub dims: Arc<HybridDims>,
    pub weights: K3Weights,
    pub experts: Arc<dyn ExpertSource>,
    /// Locators of every routed expert (what a streamed source reads).
    pub expert_table: ExpertTable,
    /// Where every state's latent-cache blocks come from.
    pub kv: Arc<KvPool>,
    info: ModelInfo,
}

impl K3Model {
    /// Loads a model with every expert resident in RAM.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(
            dir,
            Box::new(|ck, table| Ok(Arc::new(ResidentExperts::load(ck, table)?))),
        )
    }

    /// Loads a model with every expert resident and the spine in `spine` precision.
    pub fn load_spine(dir: &Path, spine: Spine) -> Result<Self> {
        Self::load_with_spine(dir, crate::registry::resident_source(), spine)
    }

    /// Loads the spine and builds the expert source with `make_source`.
    pub fn load_with(dir: &Path, make_source: crate::registry::MakeSource) -> Result<Self> {
        Self::load_with_spine(dir, make_source, Spine::Bf16)
    }

    /// As [`Self::load_with`], with the spine in `spine` precision: an int8
    /// spine is quantised before the expert source loads, so the stored
    /// matrices are freed before resident experts arrive (peak RSS is the
    /// larger of the two, not their sum).
    pub fn load_with_spine(
        dir: &Path,
        make_source: crate::registry::MakeSource,
        spine: Spine,
    ) -> Result<Self> {
        let spec = Arc::new(K3Spec::from_dir(dir)?);
        let ck = Arc::new(Checkpoint::open(dir)?);
        let mut weights = K3Weights::load(&spec, &ck)?;
        if spine == Spine::Int8 {
            weights.quantize_spine_int8();
        }
        let expert_table = tensors::expert_table(&spec, &ck)?;
        let experts = make_source(&ck, &expert_table)?;
        let info = model_info(&spec, &expert_table);
        Ok(K3Model {
            dims: Arc::new(spec.hybrid_dims()),
            spec,
            weights,
            experts,
            expert_table,
            kv: KvPool::unlimited(),
            info,
        })
    }

    pub fn new_state(&self) -> SequenceState {
        SequenceState::new(&self.dims, &self.kv)
    }

    /// One sequence's pass (what [`CausalLm::forward`] does, on the concrete state).
    pub fn forward(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        which: Logits,
    ) -> Result<Vec<f32>> {
        self.forward_traced(state, tokens, which, None)
    }

    /// One sequence's pass, observed by `tracer` (reference comparisons).
    pub fn forward_traced(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        which: Logits,
        tracer: Option<&mut dyn Tracer>,
    ) -> Result<Vec<f32>> {
        let mut b = [StepInput {
            state,
            tokens,
            logits: which,
        }];
        let mut out = step::step(self, &mut b, tracer).map_err(|e| e.error)?;
        Ok(out.pop().unwrap_or_default())
    }
}

fn model_info(spec: &K3Spec, table: &ExpertTable) -> ModelInfo {
    ModelInfo {
        family: ARCHITECTURE.family,
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
        expert_bytes: table.expert_bytes(),
        experts_per_token: spec.top_k,
        moe_layers: table.moe_layers(),
    }
}

impl CausalLm for K3Model {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn new_state(&self) -> Box<dyn SeqState> {
        Box::new(SequenceState::new(&self.dims, &self.kv))
    }
    fn step(&self, batch: &mut [StepInput<'_>]) -> std::result::Result<Vec<Vec<f32>>, StepError> {
        step::step(self, batch, None)
    }
    fn expert_stats(&self) -> ExpertStats {
        self.experts.stats()
    }
    fn kv_stats(&self) -> crate::kv::KvStats {
        self.kv.stats()
    }
    fn decode_state(&self, bytes: &[u8]) -> Result<Box<dyn SeqState>> {
        Ok(Box::new(state_io::decode(&self.dims, &self.kv, bytes)?))
    }
    fn synthetic_state(&self, depth: usize, seed: u64) -> Result<Box<dyn SeqState>> {
        Ok(Box::new(state_io::synthetic(
            &self.dims, &self.kv, depth, seed,
        )?))
    }
}
