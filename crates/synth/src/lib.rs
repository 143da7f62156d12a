//! Synthetic checkpoints of any size for every family fathom runs — Kimi
//! K3, DeepSeek-V3 / Kimi K2 (FP8, or INT4 experts), Qwen3-MoE, gpt-oss
//! (MXFP4 experts) and Kimi-Linear — byte-compatible with the released
//! files: the same tensor names, shapes and dtypes (from each family's
//! tensor table in the model crate), the released quantized formats,
//! safetensors shards named `model-NNNNN-of-MMMMMM.safetensors` with an
//! index, a `config.json` in the released layout, and a tiktoken-style
//! tokenizer with 256 specials at the top of the vocabulary.
//!
//! Why: the real models are hundreds of GB to 1.5 TB and their weights say
//! nothing about speed. Streaming, caching and scheduling work needs
//! checkpoints of controlled size (10–60 GB on a laptop disk) whose byte
//! layout is exactly the real one, with weights that keep the exact
//! forward pass numerically healthy (hidden states O(1), routing spread
//! over the experts, no logit ties), so that an exactness test on a
//! synthetic model means something.
//!
//! * [`preset`]: the named presets, overrides, target sizes.
//! * [`model`]: what every family provides (config, stored tensors).
//! * [`families`]: one module per family.
//! * [`plan`]: the byte layout, decided before writing.
//! * [`init`]: seeded weights computable at any offset.
//! * [`write`]: the parallel, direct-I/O, atomic writer.
//! * [`tokenizer`]: the rank file and special tokens.

// `json!` of the released config.json layout nests deeper than the default limit.
#![recursion_limit = "256"]

pub mod error;
pub mod families;
pub mod init;
pub mod model;
pub mod plan;
pub mod preset;
pub mod tokenizer;
pub mod write;

pub use error::SynthError;
pub use model::{Model, Shape};
pub use plan::Plan;
pub use preset::{Dims, Overrides, Preset, Resolved, resolve};
pub use write::{WriteOptions, WriteReport, write_model};

/// Default shard size: a few GB, as released checkpoints use.
pub const DEFAULT_SHARD_SIZE: u64 = 4_000_000_000;
