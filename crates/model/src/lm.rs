//! The family-neutral causal-LM interface: everything above the model
//! (engine, CLI, bench, server) speaks only this.
//!
//! A [`CausalLm`] owns its weights and its expert source; a sequence's state
//! is a [`SeqState`] made by the model and owned by whoever drives the
//! sequence. One [`CausalLm::step`] advances several sequences at once, each
//! by any number of new positions (prefill chunk, decode token, draft
//! verification), reading each spine matrix once for all rows and each
//! selected expert once for all rows routed to it. Per sequence the result is
//! bit-identical whatever else is in the batch: every reduction runs in an
//! order fixed by the model's dimensions, never by the batch.

use std::any::Any;

use crate::error::{ModelError, Result};
use crate::experts::ExpertStats;

/// Which positions' logits a pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last new position (prefill, decode).
    Last,
    /// Every new position (verification of proposed tokens).
    All,
    /// None (a prefill chunk that is not the prompt's last).
    None,
}

impl Logits {
    /// Rows of logits returned for `t` new positions.
    pub fn rows(self, t: usize) -> usize {
        match self {
            Logits::Last => t.min(1),
            Logits::All => t,
            Logits::None => 0,
        }
    }
}

/// What the layers above need to know about a model, whatever its family.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ModelInfo {
    /// Human name of the family (`"Kimi K3"`).
    pub family: &'static str,
    /// `config.json`'s top-level `model_type`.
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// The longest context the checkpoint declares, if it does.
    pub max_position_embeddings: Option<usize>,
    /// Bytes of resident spine weights read per decoded row (all of them).
    pub spine_bytes: u64,
    /// Bytes of one routed expert.
    pub expert_bytes: u64,
    /// Routed experts each token uses per MoE layer, and the MoE layer count.
    pub experts_per_token: usize,
    pub moe_layers: usize,
}

/// The state of one sequence: made by [`CausalLm::new_state`], advanced only
/// by that model's [`CausalLm::step`].
pub trait SeqState: Send + Any {
    /// Tokens consumed so far.
    fn pos(&self) -> usize;
    /// Bytes the state holds.
    fn bytes(&self) -> usize;
    /// A restorable copy of this point of the sequence.
    fn snapshot(&self) -> Box<dyn StateSnapshot>;
    /// Returns to `snap`, taken from this sequence at or before its position.
    fn restore(&mut self, snap: &dyn StateSnapshot) -> Result<()>;
    /// Positions fed from now on may be partly discarded by [`SeqState::keep`].
    fn begin_pass(&mut self);
    /// Keeps the first `n` positions fed since `begin_pass` and forgets the
    /// rest; bit-identical to a state that was only ever fed those `n`.
    fn keep(&mut self, n: usize) -> Result<()>;
    /// An independent copy at the current position (for prefix caches); an
    /// open pass is not carried over.
    fn fork(&self) -> Box<dyn SeqState>;
    /// The state as bytes; [`CausalLm::decode_state`] reads them back.
    fn encode(&self) -> Result<Vec<u8>>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A saved point of a sequence.
pub trait StateSnapshot: Send + Sync + Any {
    fn as_any(&self) -> &dyn Any;
    /// Tokens the sequence had consumed.
    fn pos(&self) -> usize;
}

/// One sequence's part of a step.
pub struct StepInput<'a> {
    pub state: &'a mut dyn SeqState,
    /// New tokens (≥ 1).
    pub tokens: &'a [u32],
    pub logits: Logits,
}

/// A failed step. Every state is exactly as it was before the call —
/// except when a device holding a state's newest copy was lost: such a
/// state cannot be put back, its buffers are marked lost and it fails
/// every later step (the error says so). `seq` names the batch entry at
/// fault when the failure is one sequence's own (bad token, non-finite
/// values, its lost state), `None` when it is the step's (I/O).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct StepError {
    pub seq: Option<usize>,
    #[source]
    pub error: ModelError,
}

/// A causal language model of any family.
pub trait CausalLm: Send + Sync {
    fn info(&self) -> &ModelInfo;
    fn new_state(&self) -> Box<dyn SeqState>;
    /// Advances every entry of `batch` by its tokens and returns, per entry,
    /// the logits `[rows, vocab]` its [`Logits`] asks for. Atomic: on error
    /// no state has changed.
    fn step(&self, batch: &mut [StepInput<'_>]) -> std::result::Result<Vec<Vec<f32>>, StepError>;
    /// Cumulative counters of the expert source.
    fn expert_stats(&self) -> ExpertStats;
    /// Where the attention cache's blocks are (RAM, disk) and what was read back.
    fn kv_stats(&self) -> crate::kv::KvStats {
        crate::kv::KvStats::default()
    }
    /// What reading the spine's streamed layers has cost so far (zero when
    /// every layer is resident).
    fn spine_reads(&self) -> crate::tiers::SpineReads {
        crate::tiers::SpineReads::default()
    }
    /// A state from [`SeqState::encode`]'s bytes; an error names what does
    /// not fit this model (never trusted blindly).
    fn decode_state(&self, bytes: &[u8]) -> Result<Box<dyn SeqState>>;
    /// A state as if `depth` tokens had been read, filled with synthetic
    /// values (for step-time benchmarks at depths a CPU cannot prefill in
    /// minutes; a step's cost does not depend on the values).
    fn synthetic_state(&self, depth: usize, seed: u64) -> Result<Box<dyn SeqState>> {
        let _ = (depth, seed);
        Err(crate::error::ModelError::Unsupported(format!(
            "{} has no synthetic states",
            self.info().family
        )))
    }

    /// A drafter made of the checkpoint's own prediction layer for one
    /// sequence, when the model was loaded with one (`--draft mtp`).
    fn self_drafter(self: std::sync::Arc<Self>) -> Option<Box<dyn SelfDrafter>> {
        None
    }

    /// One sequence, one pass.
    fn forward(&self, state: &mut dyn SeqState, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let mut b = [StepInput {
            state,
            tokens,
            logits: which,
        }];
        let mut out = self.step(&mut b).map_err(|e| e.error)?;
        Ok(out.pop().unwrap_or_default())
    }
}

/// A family's own drafter for one sequence (a multi-token-prediction
/// layer). It only proposes; the full model verifies every token.
pub trait SelfDrafter: Send {
    /// Up to `k` guesses at the tokens after `ctx` (every committed token;
    /// `target`, the sequence's state, has read all but the last).
    fn propose(&mut self, target: &dyn SeqState, ctx: &[u32], k: usize) -> Result<Vec<u32>>;
}

/// Downcasts a state made by the family's own `new_state`.
pub fn state_mut<T: SeqState>(s: &mut dyn SeqState) -> Result<&mut T> {
    s.as_any_mut()
        .downcast_mut::<T>()
        .ok_or_else(|| ModelError::State("it was made by another model".into()))
}
