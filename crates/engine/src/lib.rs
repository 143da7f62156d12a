//! Scheduling: what to run through the model, in which order, and what it
//! cost. The model computes; the engine decides (greedy decoding now;
//! speculation and batching build on the same multi-position pass).

pub mod draft;
pub mod generate;
pub mod session;
pub mod speculative;
pub mod sys;

pub use draft::{Drafter, ModelDrafter, NgramDrafter};
pub use generate::{GenStats, Generation, StopReason, argmax, greedy, greedy_from};
pub use session::Session;
pub use speculative::{DraftOptions, DraftStats, speculative, speculative_from};
