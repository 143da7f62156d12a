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

use std::path::Path;
use std::sync::Arc;

use fathom_kernels::rope::Rope;
use fathom_weights::Checkpoint;

use self::config::Qwen3MoeSpec;
use self::tensors::Role;
use self::weights::Qwen3MoeWeights;
use crate::error::Result;
use crate::experts::{ExpertSource, ExpertStats, ExpertTable, ResidentExperts};
use crate::kv::KvPool;
use crate::kv_state::{KvLayout, KvState};
use crate::linear::Spine;
use crate::lm::{CausalLm, Logits, ModelInfo, SeqState, StepError, StepInput};
use crate::registry::{Architecture, LoadOptions, MakeSource};
use crate::trace::Tracer;

/// The registry's entry for Qwen3-MoE.
pub const ARCHITECTURE: Architecture = Architecture {
    family: "Qwen3-MoE",
    model_types: &["qwen3_moe"],
    architectures: &["Qwen3MoeForCausalLM"],
    load: load_lm,
    memory,
    experts,
    mtp: false,
};

/// Locators of the routed experts of the checkpoint `ck` in `dir`.
fn experts(dir: &Path, ck: &fathom_weights::Checkpoint) -> Result<ExpertTable> {
    tensors::expert_table(&Qwen3MoeSpec::from_dir(dir)?, ck)
}

fn memory(dir: &Path) -> Result<crate::memory::MemoryFacts> {
    Ok(memory_facts(&Qwen3MoeSpec::from_dir(dir)?))
}

/// What the RAM ledger needs to know about a Qwen3-MoE model.
pub fn memory_facts(spec: &Qwen3MoeSpec) -> crate::memory::MemoryFacts {
    let table = tensors::tensor_table(spec);
    // The int8 spine quantises the attention projections, dense MLPs and head.
    let [spine, int8, emb, routed] =
        crate::memory::table_sums(table.iter().map(|t| crate::memory::TensorBytes {
            shape: &t.shape,
            bytes: t.bytes(),
            embedding: t.role == Role::Embedding,
            routed_expert: t.role == Role::RoutedExpert,
            int8: matches!(t.role, Role::Attention | Role::DenseMlp | Role::Head),
        }));
    let moe_layers = spec.moe_layers().count();
    crate::memory::MemoryFacts {
        family: ARCHITECTURE.family,
        hidden_size: spec.hidden_size,
        vocab_size: spec.vocab_size,
        spine_bytes: spine,
        spine_int8_bytes: int8,
        embedding_bytes: emb,
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
    }
}

fn load_lm(dir: &Path, opts: LoadOptions) -> Result<Arc<dyn CausalLm>> {
    let make = opts
        .experts
        .unwrap_or_else(crate::registry::resident_source);
    let mut m = Qwen3MoeModel::load_with_spine(dir, make, opts.spine)?;
    m.kv = KvPool::new(opts.kv);
    Ok(Arc::new(m))
}

/// A loaded Qwen3-MoE model: spec, resident spine, and a source of routed experts.
pub struct Qwen3MoeModel {
    pub spec: Arc<Qwen3MoeSpec>,
    pub weights: Qwen3MoeWeights,
    pub experts: Arc<dyn ExpertSource>,
    /// Locators of every routed expert (what a streamed source reads).
    pub expert_table: ExpertTable,
    pub rope: Rope,
    /// What its sequence states are shaped by: per layer one `[K | V]` row
    /// per token.
    pub layout: Arc<KvLayout>,
    /// Where every state's key/value blocks come from.
    pub kv: Arc<KvPool>,
    info: ModelInfo,
}

impl Qwen3MoeModel {
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
        let spec = Arc::new(Qwen3MoeSpec::from_dir(dir)?);
        let ck = Arc::new(Checkpoint::open(dir)?);
        let mut weights = Qwen3MoeWeights::load(&spec, &ck)?;
        if spine == Spine::Int8 {
            weights.quantize_spine_int8();
        }
        let expert_table = tensors::expert_table(&spec, &ck)?;
        let experts = make_source(&ck, &expert_table)?;
        let info = model_info(&spec, &expert_table);
        let rope = spec.rope.rope(spec.head_dim);
        let layout = Arc::new(KvLayout {
            family: ARCHITECTURE.family,
            magic: *b"Q3ST",
            layers: spec.num_layers,
            width: spec.kv_width(),
        });
        Ok(Qwen3MoeModel {
            layout,
            spec,
            weights,
            experts,
            expert_table,
            rope,
            kv: KvPool::unlimited(),
            info,
        })
    }

    pub fn new_state(&self) -> KvState {
        KvState::new(&self.layout, &self.kv)
    }

    /// One sequence's pass, observed by `tracer` (reference comparisons).
    pub fn forward_traced(
        &self,
        state: &mut KvState,
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

fn model_info(spec: &Qwen3MoeSpec, table: &ExpertTable) -> ModelInfo {
    let table_bytes = |keep: &dyn Fn(Role) -> bool| -> u64 {
        tensors::tensor_table(spec)
            .iter()
            .filter(|t| keep(t.role))
            .map(tensors::TensorSpec::bytes)
            .sum()
    };
    // The embedding is a row lookup, except when it is also the head.
    let tied = spec.tie_word_embeddings;
    ModelInfo {
        family: ARCHITECTURE.family,
        model_type: "qwen3_moe".into(),
        vocab_size: spec.vocab_size,
        hidden_size: spec.hidden_size,
        num_layers: spec.num_layers,
        bos_token_id: spec.bos_token_id,
        eos_token_ids: spec.eos_token_ids.clone(),
        max_position_embeddings: spec.max_position_embeddings,
        spine_bytes: table_bytes(&|r| r.is_spine() && (tied || r != Role::Embedding)),
        expert_bytes: table.expert_bytes(),
        experts_per_token: spec.top_k,
        moe_layers: table.moe_layers(),
    }
}

impl CausalLm for Qwen3MoeModel {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn new_state(&self) -> Box<dyn SeqState> {
        Box::new(Qwen3MoeModel::new_state(self))
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
        Ok(Box::new(KvState::decode(&self.layout, &self.kv, bytes)?))
    }
}
