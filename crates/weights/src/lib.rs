//! Checkpoint → weights: everything fathom knows about bytes on disk.
//!
//! * [`checkpoint`] opens a Hugging Face safetensors checkpoint (a single
//!   `model.safetensors` or `model.safetensors.index.json` + shards), validates
//!   every header before anything is read, and hands out [`TensorLoc`]ators:
//!   (file, absolute offset, length, dtype, shape). Nothing is loaded until a
//!   caller asks, so the same locators serve a resident load and a streamed
//!   expert read.
//! * [`mxfp4`] is the compressed-tensors `mxfp4-pack-quantized` format of the
//!   routed experts (E2M1 nibbles, E8M0 scale per 32 columns).
//! * [`convert`] turns stored bytes into fp32 (bf16 is a shift, so exact).
//! * [`mapped`] maps a tensor's bytes instead of reading them, for
//!   matrices held on a device (their pages dropped once copied up).
//! * [`units`] parses and prints byte sizes (`40GB`, `512MiB`, `63.2 MB`).

pub mod buf;
pub mod checkpoint;
pub mod convert;
pub mod direct;
pub mod error;
pub mod int8_spine;
pub mod mapped;
pub mod mxfp4;
pub mod numa;
pub mod pool;
pub mod units;

pub use buf::{AlignedBuf, IO_ALIGN};
pub use checkpoint::{
    Checkpoint, MAX_HEADER, RemoteShards, ShardData, ShardFile, TensorLoc, bytes_read,
    thread_bytes_read, thread_direct_bytes_read,
};
pub use error::WeightsError;
pub use safetensors::Dtype;
