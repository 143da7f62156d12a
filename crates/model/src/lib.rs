//! Model architectures for fathom.
//!
//! The model reads weights through typed bindings made once at load, asks an
//! [`experts::ExpertSource`] for routed experts, and never does I/O itself.

pub mod anatomy;
pub mod batch;
mod bind;
pub mod config;
pub mod deepseek_v3;
pub mod early;
pub mod embedding;
pub mod error;
pub mod eval;
pub mod experts;
pub mod family;
mod fields;
pub mod glu;
pub mod gpt_oss;
pub mod gqa;
pub mod head;
pub mod hybrid;
pub mod int8_record;
pub mod kimi_k3;
pub mod kimi_linear;
pub mod kv;
pub mod kv_state;
pub mod linear;
pub mod lm;
pub mod memory;
pub mod mlp;
pub mod moe;
pub mod phase;
pub mod quant;
pub mod qwen3_moe;
pub mod registry;
pub mod rotary;
mod state_codec;
pub mod table;
#[cfg(test)]
mod testing;
pub mod tiers;
pub mod trace;
pub mod words;

pub use config::ModelConfig;
pub use deepseek_v3::DeepseekV3Model;
pub use error::{ModelError, Result};
pub use family::{Family, Model};
pub use gpt_oss::GptOssModel;
pub use kimi_k3::K3Model;
pub use kimi_linear::KimiLinearModel;
pub use kv::{KvConfig, KvDtype, KvPool, KvSpill, KvStats};
pub use linear::Spine;
pub use lm::{CausalLm, Logits, ModelInfo, SeqState, StateSnapshot, StepError, StepInput};
pub use qwen3_moe::Qwen3MoeModel;
pub use registry::{LoadOptions, load, load_config};
pub use tiers::{HeadPlace, LayerPlan, SpineReads};
pub use trace::Tracer;

/// Minimum items per rayon task for `n` items of `work_each` multiply-adds:
/// below ~64k multiply-adds per task, thread wakeups cost more than they save,
/// so small work runs as one task on the calling thread.
pub(crate) fn par_min_len(n: usize, work_each: usize) -> usize {
    const MIN_TASK_WORK: usize = 1 << 16;
    MIN_TASK_WORK.div_ceil(work_each.max(1)).clamp(1, n.max(1))
}
