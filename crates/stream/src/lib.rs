//! Streaming the routed experts: the job fathom exists for.
//!
//! A K3 token needs 16 routed experts per MoE layer (25.8 GB of MXFP4 per
//! token out of 1.45 TB); everything else (the spine) stays resident. This
//! crate implements [`fathom_model::experts::ExpertSource`] by reading each
//! requested expert straight from the original safetensors shards:
//!
//! * [`reader`]: one positional read per expert (its six tensors are adjacent
//!   in the released files), page cache bypassed (`O_DIRECT`, `F_NOCACHE`
//!   on macOS) where the filesystem allows (else `fadvise`), on a pool of
//!   I/O threads.
//! * [`cache`]: an LRU cache of whole experts sized by the RAM budget.
//! * [`store`]: the source itself — hits, misses, next-layer prefetch that
//!   only schedules I/O (never changes routing), cancellation of wrong guesses.
//! * [`heat`]: request counts kept across runs, to warm and pin the cache.
//! * [`budget`]: the RAM ledger that decides the cache size before loading.

pub mod budget;
pub mod cache;
pub mod heat;
pub mod kv_spill;
pub mod reader;
pub mod spine_tiers;
pub mod store;

pub use budget::{Ledger, default_budget};
pub use heat::Heat;
pub use kv_spill::FileSpill;
pub use store::{StreamConfig, StreamedExperts};
