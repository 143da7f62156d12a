//! One module per model family: its presets' shapes, its `config.json`,
//! and its stored tensors (from the family's own tensor table) with the
//! distribution of each.

pub mod deepseek;
pub mod gpt_oss;
pub mod k3;
pub mod kimi_linear;
pub mod qwen3;
