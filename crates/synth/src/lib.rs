//! Synthetic Kimi K3 checkpoints of any size, byte-compatible with the
//! released files: the same tensor names, shapes and dtypes (from the model
//! crate's tensor table), MXFP4-packed routed experts, safetensors shards
//! named `model-NNNNN-of-MMMMMM.safetensors` with an index, a `config.json`
//! in the released layout, and a tiktoken-style tokenizer with the 256 K3
//! specials.
//!
//! Why: the real model is 1.5 TB and its weights say nothing about speed.
//! Streaming, caching and scheduling work needs checkpoints of controlled
//! size (10–60 GB on a laptop disk) whose byte layout is exactly the real
//! one, with weights that keep the exact forward pass numerically healthy
//! (hidden states O(1), routing spread over the experts, no logit ties), so
//! that an exactness test on a synthetic model means something.
//!
//! * [`preset`]: shapes (`tiny`, `k3`, `k3-mini`), overrides, target sizes.
//! * [`plan`]: the byte layout, decided before writing.
//! * [`init`]: seeded weights computable at any offset.
//! * [`write`]: the parallel, direct-I/O, atomic writer.
//! * [`tokenizer`]: the rank file and special tokens.

// `json!` of the released config.json layout nests deeper than the default limit.
#![recursion_limit = "256"]

pub mod error;
pub mod init;
pub mod plan;
pub mod preset;
pub mod tokenizer;
pub mod write;

pub use error::SynthError;
pub use plan::Plan;
pub use preset::{Dims, Overrides, Preset, Resolved, resolve};
pub use write::{WriteOptions, WriteReport, write_model};

/// Default shard size: a few GB, as released checkpoints use.
pub const DEFAULT_SHARD_SIZE: u64 = 4_000_000_000;
