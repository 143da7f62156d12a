//! A conversation's sequence state, reused across turns.
//!
//! Each turn the whole conversation is rendered again; when what the state
//! has already consumed is a prefix of the new prompt, only the new tail is
//! run through the model. Otherwise (e.g. the reply re-tokenised
//! differently) the state restarts — correctness never depends on reuse.

use std::ops::ControlFlow;

use fathom_model::kimi_k3::state::SequenceState;
use fathom_model::{K3Model, Result};

use crate::generate::{Generation, greedy_from};

pub struct Session<'m> {
    model: &'m K3Model,
    state: SequenceState,
    /// Tokens the state has consumed.
    consumed: Vec<u32>,
}

impl<'m> Session<'m> {
    pub fn new(model: &'m K3Model) -> Self {
        Session {
            model,
            state: model.new_state(),
            consumed: Vec::new(),
        }
    }

    /// Tokens the state has consumed so far.
    pub fn consumed(&self) -> &[u32] {
        &self.consumed
    }

    /// Generates a reply to the full conversation `prompt`.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        stop_ids: &[u32],
        on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Generation> {
        let reuse = self.consumed.len() < prompt.len() && prompt.starts_with(&self.consumed);
        if !reuse {
            self.state = self.model.new_state();
            self.consumed.clear();
        }
        let tail = &prompt[self.consumed.len()..];
        let g = greedy_from(
            self.model,
            &mut self.state,
            tail,
            max_new,
            stop_ids,
            on_token,
        )?;
        self.consumed.extend_from_slice(tail);
        if let Some((_, fed)) = g.output_ids.split_last() {
            self.consumed.extend_from_slice(fed);
        }
        debug_assert_eq!(self.consumed.len(), self.state.pos);
        Ok(g)
    }
}
