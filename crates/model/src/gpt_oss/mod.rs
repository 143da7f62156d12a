//! GPT-OSS (`model_type` `gpt_oss`): grouped-query attention with biases,
//! YaRN rotary embedding, a learned attention sink per head and a sliding
//! window on alternate layers; every layer's feed-forward is a
//! softmax-over-top-k routed MoE of clamped-SwiGLU experts with biases,
//! stacked per layer in the checkpoint.
//!
//! ```text
//! h = embed(ids)
//! per layer:  h += Attn(RMSNorm(h; input_layernorm))          (sliding or full)
//!             h += MoE(RMSNorm(h; post_attention_layernorm))
//! logits = lm_head(RMSNorm(h; norm))
//! ```
//! Activations are fp32 throughout; each position's result is
//! bit-identical whatever the step holds besides it. Sliding layers keep
//! every row like full ones (a state's layers all hold `pos` rows) but read
//! only the blocks their window reaches. The released MXFP4 checkpoint is
//! read as shipped: its experts stay MXFP4 (`_blocks` / `_scales`,
//! output-major) and run through the MXFP4 kernel, plus their bf16 biases.

pub mod attention;
pub mod config;
pub mod moe;
mod step;
pub mod tensors;
pub mod weights;

use std::sync::Arc;

use fathom_weights::Checkpoint;

use self::config::GptOssSpec;
use self::tensors::Role;
use self::weights::GptOssWeights;
use crate::error::Result;
use crate::family::{Family, Model, StepResult};
use crate::kv_state::{KvParts, KvState};
use crate::lm::{ModelInfo, StepInput};
use crate::trace::Tracer;

/// The GPT-OSS family.
pub struct GptOss;

/// A loaded GPT-OSS model.
pub type GptOssModel = Model<GptOss>;

impl Family for GptOss {
    const NAME: &'static str = "GPT-OSS";
    const MODEL_TYPES: &'static [&'static str] = &["gpt_oss"];
    const ARCHITECTURES: &'static [&'static str] = &["GptOssForCausalLM"];
    type Spec = GptOssSpec;
    type Weights = GptOssWeights;
    type Parts = KvParts;
    type State = KvState;

    crate::family::plain_family_fns!(GptOssSpec, GptOssWeights);
    fn parts(spec: &GptOssSpec, _ck: &Arc<Checkpoint>, _mtp: bool) -> Result<KvParts> {
        // The rotation of every head (YaRN when configured).
        Ok(KvParts::new(
            spec.rope.rope(spec.head_dim),
            Self::NAME,
            *b"GOST",
            spec.num_layers,
            spec.kv_width(),
        ))
    }
    fn info(spec: &GptOssSpec) -> ModelInfo {
        ModelInfo {
            model_type: "gpt_oss".into(),
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

/// What the RAM ledger needs to know about a GPT-OSS model.
pub fn memory_facts(spec: &GptOssSpec) -> crate::memory::MemoryFacts {
    let table = tensors::tensor_table(spec);
    // The int8 spine quantises the attention projections and the head.
    let entries = || {
        table.iter().map(|t| crate::memory::TensorBytes {
            layer: t.layer,
            shape: &t.shape,
            bytes: t.bytes(),
            embedding: t.role == Role::Embedding,
            head: t.role == Role::Head,
            routed_expert: t.role == Role::RoutedExpert,
            int8: matches!(t.role, Role::Attention | Role::Head),
        })
    };
    let [spine, int8, emb, routed] = crate::memory::table_sums(entries());
    let experts = spec.num_layers * spec.num_experts;
    crate::memory::MemoryFacts {
        family: GptOss::NAME,
        hidden_size: spec.hidden_size,
        vocab_size: spec.vocab_size,
        spine_bytes: spine,
        spine_int8_bytes: int8,
        embedding_bytes: emb,
        fixed_state_bytes: 0,
        cache_floats_per_token: (spec.num_layers * spec.kv_width()) as u64,
        top_k: spec.top_k,
        moe_layers: spec.num_layers,
        num_experts: spec.num_experts,
        expert_bytes: routed / experts.max(1) as u64,
        expert_scratch_floats: 2 * spec.intermediate_size + spec.hidden_size,
        max_position_embeddings: spec.max_position_embeddings,
        mtp_bytes: 0,
        mtp_cache_floats_per_token: 0,
        layers: crate::memory::layer_sums(spec.num_layers, entries()),
        head: crate::memory::head_sums(entries()),
    }
}
