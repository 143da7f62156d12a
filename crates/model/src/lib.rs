//! Model architectures for fathom.
//!
//! The model reads weights through typed bindings made once at load, asks an
//! [`experts::ExpertSource`] for routed experts, and never does I/O itself.

pub mod error;
pub mod eval;
pub mod experts;
pub mod kimi_k3;
pub mod linear;

pub use error::{ModelError, Result};
pub use kimi_k3::{K3Model, Logits, Tracer};
pub use linear::Spine;
