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

use std::sync::Arc;

use fathom_kernels::rope::Rope;
use fathom_weights::Checkpoint;

use self::config::DeepseekV3Spec;
use self::tensors::Role;
use self::weights::DeepseekV3Weights;
use crate::error::Result;
use crate::experts::ExpertTable;
use crate::family::{Family, Model, StepResult};
use crate::kv_state::{HiddenTap, KvLayout, KvState};
use crate::linear::Spine;
use crate::lm::{ModelInfo, SelfDrafter, SeqState, StepInput};
use crate::trace::Tracer;

/// The DeepSeek-V3 / Kimi K2 family.
pub struct DeepseekV3;

/// A loaded DeepSeek-V3 / Kimi K2 model.
pub type DeepseekV3Model = Model<DeepseekV3>;

/// What a loaded model keeps besides its weights.
pub struct DsParts {
    /// The rotation of the `qk_rope_head_dim` parts (YaRN when configured).
    pub rope: Rope,
    /// What its sequence states are shaped by: per layer one
    /// `[latent | k_rope]` row per token.
    pub layout: Arc<KvLayout>,
    /// The multi-token-prediction layer, when loaded for drafting.
    pub mtp: Option<mtp::MtpWeights>,
}

impl Family for DeepseekV3 {
    const NAME: &'static str = "DeepSeek-V3";
    const MODEL_TYPES: &'static [&'static str] = &config::MODEL_TYPES;
    const ARCHITECTURES: &'static [&'static str] = &["DeepseekV3ForCausalLM"];
    const MTP: bool = true;
    type Spec = DeepseekV3Spec;
    type Weights = DeepseekV3Weights;
    type Parts = DsParts;
    type State = KvState;

    fn spec(config: &serde_json::Value) -> Result<DeepseekV3Spec> {
        DeepseekV3Spec::from_json(config)
    }
    fn memory_facts(spec: &DeepseekV3Spec) -> crate::memory::MemoryFacts {
        memory_facts(spec)
    }
    fn expert_table(spec: &DeepseekV3Spec, ck: &Checkpoint, mtp: bool) -> Result<ExpertTable> {
        tensors::expert_table(spec, ck, mtp)
    }
    fn check_tensors(spec: &DeepseekV3Spec, ck: &Checkpoint) -> Vec<String> {
        tensors::check_tensors(spec, ck)
    }
    fn weights(
        spec: &Arc<DeepseekV3Spec>,
        ck: &Arc<Checkpoint>,
        spine: Spine,
        layers: &crate::tiers::LayerPlan,
    ) -> Result<DeepseekV3Weights> {
        DeepseekV3Weights::load(spec, ck, spine, layers)
    }
    fn spine_reads(w: &DeepseekV3Weights) -> crate::tiers::SpineReads {
        w.layers.reads().with_head(w.head_reads())
    }
    /// With `mtp`, also the first multi-token-prediction layer, for
    /// `--draft mtp` (its experts join the expert table).
    fn parts(spec: &DeepseekV3Spec, ck: &Arc<Checkpoint>, mtp: bool) -> Result<DsParts> {
        Ok(DsParts {
            rope: spec.rope.rope(spec.qk_rope_head_dim),
            layout: Arc::new(KvLayout {
                family: Self::NAME,
                magic: *b"DSST",
                layers: spec.num_layers,
                width: spec.mla_dims().cache_width(),
            }),
            mtp: if mtp {
                Some(mtp::MtpWeights::load(spec, ck)?)
            } else {
                None
            },
        })
    }
    fn info(spec: &DeepseekV3Spec) -> ModelInfo {
        ModelInfo {
            model_type: spec.model_type.clone(),
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
    fn new_state(m: &Model<Self>) -> KvState {
        let mut s = KvState::new(&m.parts.layout, &m.kv);
        add_tap(m, &mut s);
        s
    }
    fn decode_state(m: &Model<Self>, bytes: &[u8]) -> Result<KvState> {
        let mut s = KvState::decode(&m.parts.layout, &m.kv, bytes)?;
        add_tap(m, &mut s);
        Ok(s)
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
    fn self_drafter(model: Arc<Model<Self>>) -> Option<Box<dyn SelfDrafter>> {
        model.parts.mtp.as_ref()?;
        let draft = mtp::MtpDraft::new(&model);
        Some(Box::new(MtpDrafter { model, draft }))
    }
}

/// A drafter reads the rows the head reads: keep the latest ones.
fn add_tap(m: &DeepseekV3Model, s: &mut KvState) {
    if m.parts.mtp.is_some() {
        s.tap = Some(HiddenTap::new(m.spec.hidden_size, s.pos, mtp::TAP_ROWS));
    }
}

/// What the RAM ledger needs to know about a DeepSeek-V3 model.
pub fn memory_facts(spec: &DeepseekV3Spec) -> crate::memory::MemoryFacts {
    let table = tensors::tensor_table(spec);
    // The int8 spine quantises attention, dense-MLP, shared-expert and head matrices.
    // FP8 matrices stay FP8 under `--spine int8`.
    let entries = || {
        table.iter().map(|t| {
            (
                t.layer,
                &t.shape[..],
                t.bytes(),
                t.role,
                t.storage == tensors::Storage::Float,
            )
        })
    };
    let [spine, int8, emb, routed] = crate::table::ledger(entries());
    let moe_layers = spec.moe_layers().count();
    crate::memory::MemoryFacts {
        family: DeepseekV3::NAME,
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
        layers: crate::memory::layer_sums(
            spec.num_layers,
            entries().map(crate::table::tensor_bytes),
        ),
        head: crate::memory::head_sums(entries().map(crate::table::tensor_bytes)),
    }
}

/// `--draft mtp`: the model's own prediction layer, for one sequence.
struct MtpDrafter {
    model: Arc<DeepseekV3Model>,
    draft: mtp::MtpDraft,
}

impl SelfDrafter for MtpDrafter {
    fn propose(
        &mut self,
        target: &dyn SeqState,
        ctx: &[u32],
        k: usize,
    ) -> crate::error::Result<Vec<u32>> {
        self.draft.propose(&self.model, target, ctx, k)
    }
}
