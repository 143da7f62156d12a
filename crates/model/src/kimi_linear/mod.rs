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

use std::path::Path;
use std::sync::Arc;

use fathom_weights::Checkpoint;

use self::config::KimiLinearSpec;
use self::tensors::Role;
use self::weights::KimiLinearWeights;
use crate::error::Result;
use crate::experts::{ExpertSource, ExpertStats, ExpertTable, ResidentExperts};
use crate::hybrid::state::SequenceState;
use crate::hybrid::{HybridDims, state_io};
use crate::kv::KvPool;
use crate::linear::Spine;
use crate::lm::{CausalLm, Logits, ModelInfo, SeqState, StepError, StepInput};
use crate::registry::{Architecture, LoadOptions, MakeSource};
use crate::trace::Tracer;

/// The registry's entry for Kimi-Linear.
pub const ARCHITECTURE: Architecture = Architecture {
    family: "Kimi-Linear",
    model_types: &["kimi_linear"],
    architectures: &["KimiLinearForCausalLM"],
    load: load_lm,
    memory,
    experts,
    mtp: false,
};

/// Locators of the routed experts of the checkpoint `ck` in `dir`.
fn experts(dir: &Path, ck: &fathom_weights::Checkpoint) -> Result<ExpertTable> {
    tensors::expert_table(&KimiLinearSpec::from_dir(dir)?, ck)
}

fn memory(dir: &Path) -> Result<crate::memory::MemoryFacts> {
    Ok(memory_facts(&KimiLinearSpec::from_dir(dir)?))
}

/// What the RAM ledger needs to know about a Kimi-Linear model.
pub fn memory_facts(spec: &KimiLinearSpec) -> crate::memory::MemoryFacts {
    use crate::hybrid::AttnKind;
    let table = tensors::tensor_table(spec);
    // The int8 spine quantises attention, dense-MLP, shared-expert and head matrices.
    let [spine, int8, emb, routed] =
        crate::memory::table_sums(table.iter().map(|t| crate::memory::TensorBytes {
            shape: &t.shape,
            bytes: t.bytes(),
            embedding: t.role == Role::Embedding,
            routed_expert: t.role == Role::RoutedExpert,
            int8: matches!(
                t.role,
                Role::Attention | Role::DenseMlp | Role::SharedExpert | Role::Head
            ),
        }));
    let dims = spec.hybrid_dims();
    let kinds = |k: AttnKind| dims.attn_kinds.iter().filter(|x| **x == k).count() as u64;
    let k = &dims.kda;
    let kda_layer =
        4 * (k.heads * k.head_dim * k.head_dim + 3 * (k.conv_kernel - 1) * k.width()) as u64;
    let moe_layers = spec.moe_layers().count();
    crate::memory::MemoryFacts {
        family: ARCHITECTURE.family,
        hidden_size: spec.hidden_size,
        vocab_size: spec.vocab_size,
        spine_bytes: spine,
        spine_int8_bytes: int8,
        embedding_bytes: emb,
        fixed_state_bytes: kinds(AttnKind::Kda) * kda_layer,
        cache_floats_per_token: kinds(AttnKind::Mla) * dims.mla.cache_width() as u64,
        top_k: spec.top_k,
        moe_layers,
        num_experts: spec.num_experts,
        expert_bytes: routed / (moe_layers * spec.num_experts).max(1) as u64,
        expert_scratch_floats: 2 * spec.moe_intermediate_size + spec.hidden_size,
        max_position_embeddings: spec.max_position_embeddings,
        mtp_bytes: 0,
        mtp_cache_floats_per_token: 0,
    }
}

fn load_lm(dir: &Path, opts: LoadOptions) -> Result<Arc<dyn CausalLm>> {
    let make = opts
        .experts
        .unwrap_or_else(crate::registry::resident_source);
    let mut m = KimiLinearModel::load_with_spine(dir, make, opts.spine)?;
    m.kv = KvPool::new(opts.kv);
    Ok(Arc::new(m))
}

/// A loaded Kimi-Linear model: spec, resident spine, and a source of routed experts.
pub struct KimiLinearModel {
    pub spec: Arc<KimiLinearSpec>,
    /// What its sequence states are shaped by.
    pub dims: Arc<HybridDims>,
    pub weights: KimiLinearWeights,
    pub experts: Arc<dyn ExpertSource>,
    /// Locators of every routed expert (what a streamed source reads).
    pub expert_table: ExpertTable,
    /// Where every state's latent-cache blocks come from.
    pub kv: Arc<KvPool>,
    info: ModelInfo,
}

impl KimiLinearModel {
    /// Loads a model with every expert resident in RAM.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(
            dir,
            Box::new(|ck, table| Ok(Arc::new(ResidentExperts::load(ck, table)?))),
        )
    }

    /// Loads the spine and builds the expert source with `make_source`.
    pub fn load_with(dir: &Path, make_source: MakeSource) -> Result<Self> {
        Self::load_with_spine(dir, make_source, Spine::Bf16)
    }

    /// As [`Self::load_with`], with the spine in `spine` precision: an int8
    /// spine is quantised before the expert source loads, so the stored
    /// matrices are freed before resident experts arrive (peak RSS is the
    /// larger of the two, not their sum).
    pub fn load_with_spine(dir: &Path, make_source: MakeSource, spine: Spine) -> Result<Self> {
        let spec = Arc::new(KimiLinearSpec::from_dir(dir)?);
        let ck = Arc::new(Checkpoint::open(dir)?);
        let mut weights = KimiLinearWeights::load(&spec, &ck)?;
        if spine == Spine::Int8 {
            weights.quantize_spine_int8();
        }
        let expert_table = tensors::expert_table(&spec, &ck)?;
        let experts = make_source(&ck, &expert_table)?;
        let info = model_info(&spec, &expert_table);
        Ok(KimiLinearModel {
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

fn model_info(spec: &KimiLinearSpec, table: &ExpertTable) -> ModelInfo {
    ModelInfo {
        family: ARCHITECTURE.family,
        model_type: "kimi_linear".into(),
        vocab_size: spec.vocab_size,
        hidden_size: spec.hidden_size,
        num_layers: spec.num_layers,
        bos_token_id: spec.bos_token_id,
        eos_token_ids: spec.eos_token_ids.clone(),
        max_position_embeddings: spec.max_position_embeddings,
        spine_bytes: tensors::tensor_table(spec)
            .iter()
            .filter(|t| t.role.is_spine() && t.role != Role::Embedding)
            .map(tensors::TensorSpec::bytes)
            .sum(),
        expert_bytes: table.expert_bytes(),
        experts_per_token: spec.top_k,
        moe_layers: table.moe_layers(),
    }
}

impl CausalLm for KimiLinearModel {
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
