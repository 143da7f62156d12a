//! DeepSeek-V3 and Kimi K2 (`model_type` `deepseek_v3` / `kimi_k2`, one
//! architecture): MLA with decoupled RoPE (low-rank queries, a compressed
//! latent key/value cache, YaRN), a dense SwiGLU MLP in the first
//! `first_k_dense_replace` layers, then a group-limited sigmoid-routed MoE
//! with a selection bias and shared experts.
//!
//! ```text
//! h = embed(ids)
//! per layer:  h += MLA(RMSNorm(h; input_layernorm))
//!             h += FFN(RMSNorm(h; post_attention_layernorm))       (dense or MoE)
//! logits = lm_head(RMSNorm(h; norm))
//! ```
//! Activations are fp32 throughout; each position's result is
//! bit-identical whatever the step holds besides it. The checkpoint's
//! first multi-token-prediction layer (`num_nextn_predict_layers`) is read
//! only when a drafter asks for it ([`mtp`], `--draft mtp`); it proposes,
//! the decoder decides.
//! The released quantized checkpoints are read as shipped (see
//! [`crate::quant`]): FP8 E4M3 with 128×128 tile scales (DeepSeek-V3 / R1,
//! Kimi K2: spine matrices and routed experts stay FP8, applied by the FP8
//! kernel) and pack-quantized INT4 routed experts (Kimi K2 Thinking);
//! other methods are refused naming what is supported.

pub mod attention;
pub mod config;
pub mod mtp;
mod step;
pub mod tensors;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use fathom_kernels::rope::Rope;
use fathom_weights::Checkpoint;

use self::config::DeepseekV3Spec;
use self::tensors::Role;
use self::weights::DeepseekV3Weights;
use crate::error::Result;
use crate::experts::{ExpertSource, ExpertStats, ExpertTable, ResidentExperts};
use crate::kv::KvPool;
use crate::kv_state::{HiddenTap, KvLayout, KvState};
use crate::linear::Spine;
use crate::lm::{CausalLm, Logits, ModelInfo, SelfDrafter, SeqState, StepError, StepInput};
use crate::registry::{Architecture, LoadOptions, MakeSource};
use crate::trace::Tracer;

/// The registry's entry for DeepSeek-V3 and Kimi K2.
pub const ARCHITECTURE: Architecture = Architecture {
    family: "DeepSeek-V3",
    model_types: &config::MODEL_TYPES,
    architectures: &["DeepseekV3ForCausalLM"],
    load: load_lm,
    memory,
    experts,
    mtp: true,
};

/// Locators of the routed experts of the checkpoint `ck` in `dir`.
fn experts(dir: &Path, ck: &fathom_weights::Checkpoint) -> Result<ExpertTable> {
    tensors::expert_table(&DeepseekV3Spec::from_dir(dir)?, ck, false)
}

fn memory(dir: &Path) -> Result<crate::memory::MemoryFacts> {
    Ok(memory_facts(&DeepseekV3Spec::from_dir(dir)?))
}

/// What the RAM ledger needs to know about a DeepSeek-V3 / Kimi K2 model.
pub fn memory_facts(spec: &DeepseekV3Spec) -> crate::memory::MemoryFacts {
    let table = tensors::tensor_table(spec);
    // The int8 spine quantises attention, dense-MLP, shared-expert and head matrices.
    let [spine, int8, emb, routed] =
        crate::memory::table_sums(table.iter().map(|t| crate::memory::TensorBytes {
            shape: &t.shape,
            bytes: t.bytes(),
            embedding: t.role == Role::Embedding,
            routed_expert: t.role == Role::RoutedExpert,
            // FP8 matrices stay FP8 under `--spine int8`.
            int8: matches!(
                t.role,
                Role::Attention | Role::DenseMlp | Role::SharedExpert | Role::Head
            ) && t.storage == tensors::Storage::Float,
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
        cache_floats_per_token: (spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim))
            as u64,
        top_k: spec.top_k,
        moe_layers,
        num_experts: spec.n_routed_experts,
        expert_bytes: routed / (moe_layers * spec.n_routed_experts).max(1) as u64,
        expert_scratch_floats: 2 * spec.moe_intermediate_size + spec.hidden_size,
        max_position_embeddings: spec.max_position_embeddings,
        // The layer's spine and, when it exists, one sequence's hidden tap.
        mtp_bytes: tensors::mtp_tensor_table(spec)
            .iter()
            .filter(|t| t.role != Role::RoutedExpert)
            .map(tensors::TensorSpec::bytes)
            .sum::<u64>()
            .checked_add(if spec.num_nextn_predict_layers > 0 {
                (mtp::TAP_ROWS * spec.hidden_size * 4) as u64
            } else {
                0
            })
            .unwrap_or(u64::MAX),
        mtp_cache_floats_per_token: if spec.num_nextn_predict_layers > 0 {
            (spec.kv_lora_rank + spec.qk_rope_head_dim) as u64
        } else {
            0
        },
    }
}

fn load_lm(dir: &Path, opts: LoadOptions) -> Result<Arc<dyn CausalLm>> {
    let make = opts
        .experts
        .unwrap_or_else(crate::registry::resident_source);
    let mut m = DeepseekV3Model::load_full(dir, make, opts.spine, opts.mtp)?;
    m.kv = KvPool::new(opts.kv);
    Ok(Arc::new(m))
}

/// A loaded DeepSeek-V3 / Kimi K2 model: spec, resident spine, and a source
/// of routed experts.
pub struct DeepseekV3Model {
    pub spec: Arc<DeepseekV3Spec>,
    pub weights: DeepseekV3Weights,
    pub experts: Arc<dyn ExpertSource>,
    /// Locators of every routed expert (what a streamed source reads).
    pub expert_table: ExpertTable,
    /// The rotation of the `qk_rope_head_dim` parts (YaRN when configured).
    pub rope: Rope,
    /// What its sequence states are shaped by: per layer one
    /// `[latent | k_rope]` row per token.
    pub layout: Arc<KvLayout>,
    /// Where every state's latent-cache blocks come from.
    pub kv: Arc<KvPool>,
    /// The multi-token-prediction layer, when loaded for drafting.
    pub mtp: Option<mtp::MtpWeights>,
    info: ModelInfo,
}

impl DeepseekV3Model {
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
        Self::load_full(dir, make_source, spine, false)
    }

    /// As [`Self::load_with_spine`]; with `mtp`, also the first
    /// multi-token-prediction layer and its experts, for `--draft mtp`.
    pub fn load_full(dir: &Path, make_source: MakeSource, spine: Spine, mtp: bool) -> Result<Self> {
        let spec = Arc::new(DeepseekV3Spec::from_dir(dir)?);
        let ck = Arc::new(Checkpoint::open(dir)?);
        let mut weights = DeepseekV3Weights::load(&spec, &ck)?;
        if spine == Spine::Int8 {
            weights.quantize_spine_int8();
        }
        let mtp = if mtp {
            Some(mtp::MtpWeights::load(&spec, &ck)?)
        } else {
            None
        };
        let expert_table = tensors::expert_table(&spec, &ck, mtp.is_some())?;
        let experts = make_source(&ck, &expert_table)?;
        let info = model_info(&spec, &expert_table);
        let layout = Arc::new(KvLayout {
            family: ARCHITECTURE.family,
            magic: *b"DSST",
            layers: spec.num_layers,
            width: spec.mla_dims().cache_width(),
        });
        Ok(DeepseekV3Model {
            rope: spec.rope.rope(spec.qk_rope_head_dim),
            spec,
            weights,
            experts,
            expert_table,
            layout,
            kv: KvPool::unlimited(),
            mtp,
            info,
        })
    }

    pub fn new_state(&self) -> KvState {
        let mut s = KvState::new(&self.layout, &self.kv);
        self.add_tap(&mut s);
        s
    }

    /// A drafter reads the rows the head reads: keep the latest ones.
    fn add_tap(&self, s: &mut KvState) {
        if self.mtp.is_some() {
            s.tap = Some(HiddenTap::new(self.spec.hidden_size, s.pos, mtp::TAP_ROWS));
        }
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

fn model_info(spec: &DeepseekV3Spec, table: &ExpertTable) -> ModelInfo {
    ModelInfo {
        family: ARCHITECTURE.family,
        model_type: spec.model_type.clone(),
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

impl CausalLm for DeepseekV3Model {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn new_state(&self) -> Box<dyn SeqState> {
        Box::new(DeepseekV3Model::new_state(self))
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
        let mut s = KvState::decode(&self.layout, &self.kv, bytes)?;
        self.add_tap(&mut s);
        Ok(Box::new(s))
    }
    fn self_drafter(self: Arc<Self>) -> Option<Box<dyn SelfDrafter>> {
        self.mtp.as_ref()?;
        let draft = mtp::MtpDraft::new(&self);
        Some(Box::new(MtpDrafter { model: self, draft }))
    }
}

/// `--draft mtp`: the model's own prediction layer, for one sequence.
struct MtpDrafter {
    model: Arc<DeepseekV3Model>,
    draft: mtp::MtpDraft,
}

impl SelfDrafter for MtpDrafter {
    fn propose(&mut self, target: &dyn SeqState, ctx: &[u32], k: usize) -> Result<Vec<u32>> {
        self.draft.propose(&self.model, target, ctx, k)
    }
}
