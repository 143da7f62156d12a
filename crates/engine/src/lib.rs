//! Scheduling: what to run through the model, in which order, and what it
//! cost. The model computes; the engine decides — which sequences share a
//! step ([`Engine`]), how tokens are chosen ([`sampling`]), when drafts are
//! proposed and verified ([`speculative`]), and what a run reports
//! ([`report`]). It speaks only the family-neutral [`fathom_model::CausalLm`].

pub mod constraint;
pub mod draft;
pub mod generate;
mod plan;
pub mod report;
pub mod sampling;
pub mod scheduler;
pub mod session;
pub mod speculative;
pub mod stop;
pub mod sys;

pub use constraint::Constraint;
pub use draft::{Drafter, ModelDrafter, MtpDrafter, NgramDrafter};
pub use generate::{GenError, generate, generate_with, greedy};
pub use report::{RunReport, RunStats, SeqStats};
pub use sampling::{SamplingParams, argmax};
pub use scheduler::{
    Decoder, Engine, EngineOptions, Event, FinishReason, Finished, Request, SeqId, TokenEvent,
};
pub use session::Session;
pub use speculative::{DraftOptions, DraftStats};
