//! A conversation's sequence state, reused across turns.
//!
//! Each turn the whole conversation is rendered again. The state is reused
//! in one of two ways:
//!
//! * what the state has consumed is a prefix of the new prompt: only the new
//!   tail is run;
//! * otherwise, a snapshot taken at the end of the previous turn's *stable*
//!   part (the conversation before the generation prompt, whose rendering
//!   does not change) is restored if it is a prefix of the new prompt —
//!   the reply as generated and the reply as re-rendered usually differ
//!   (channels, closing tags), so this is the common case from turn two on.
//!
//! Failing both, the state restarts. Correctness never depends on reuse:
//! a restored snapshot is bit-identical to having fed its tokens.

use std::ops::ControlFlow;

use fathom_model::kimi_k3::state::{SequenceState, Snapshot};
use fathom_model::{K3Model, Logits, Result};

use crate::generate::{Generation, greedy_from};

pub struct Session<'m> {
    model: &'m K3Model,
    state: SequenceState,
    /// Tokens the state has consumed.
    consumed: Vec<u32>,
    /// The state after the last turn's stable prefix, and that prefix.
    stable: Option<(Snapshot, Vec<u32>)>,
}

impl<'m> Session<'m> {
    pub fn new(model: &'m K3Model) -> Self {
        Session {
            model,
            state: model.new_state(),
            consumed: Vec::new(),
            stable: None,
        }
    }

    /// Tokens the state has consumed so far.
    pub fn consumed(&self) -> &[u32] {
        &self.consumed
    }

    /// Moves the state to the longest reusable prefix of `prompt`; returns its length.
    fn reuse(&mut self, prompt: &[u32]) -> usize {
        if self.consumed.len() < prompt.len() && prompt.starts_with(&self.consumed) {
            return self.consumed.len();
        }
        if let Some((snap, ids)) = &self.stable {
            if ids.len() < prompt.len() && prompt.starts_with(ids) {
                self.state.restore(snap);
                self.consumed = ids.clone();
                return ids.len();
            }
        }
        self.state = self.model.new_state();
        self.consumed.clear();
        0
    }

    /// Generates a reply to the full conversation `prompt`, whose first
    /// `stable_len` tokens (the conversation without the generation prompt)
    /// will render identically next turn. Returns the generation and how many
    /// prompt tokens were reused.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        stable_len: usize,
        max_new: usize,
        stop_ids: &[u32],
        on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<(Generation, usize)> {
        let reused = self.reuse(prompt);
        let stable_len = stable_len.min(prompt.len() - 1);
        if reused < stable_len {
            self.model
                .forward(&mut self.state, &prompt[reused..stable_len], Logits::Last)?;
            self.consumed.extend_from_slice(&prompt[reused..stable_len]);
        }
        if self.consumed.len() == stable_len {
            self.stable = Some((self.state.snapshot(), prompt[..stable_len].to_vec()));
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
        Ok((g, reused))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::greedy;

    fn tiny() -> K3Model {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/data/k3-tiny/checkpoint");
        K3Model::load(&p).unwrap()
    }

    #[test]
    fn reused_turns_give_the_same_tokens_as_fresh_ones() {
        let m = tiny();
        let go = |_| ControlFlow::Continue(());
        let mut s = Session::new(&m);
        // Turn 1: stable part [1, 5, 9], generation prompt [7].
        let p1 = [1, 5, 9, 7];
        let (g1, r1) = s.generate(&p1, 3, 4, &[], go).unwrap();
        assert_eq!(r1, 0);
        assert_eq!(
            g1.output_ids,
            greedy(&m, &p1, 4, &[], go).unwrap().output_ids
        );
        // Turn 2 re-renders the reply differently: only the stable part is shared.
        let p2 = [1, 5, 9, 8, 8, 3, 7];
        let (g2, r2) = s.generate(&p2, 6, 4, &[], go).unwrap();
        assert_eq!(r2, 3, "the snapshot after the stable part is reused");
        assert_eq!(
            g2.output_ids,
            greedy(&m, &p2, 4, &[], go).unwrap().output_ids
        );
        // Turn 3 extends what was consumed: the tail alone is fed.
        let mut p3 = p2[..6].to_vec();
        p3.extend([7, 2]);
        let (g3, r3) = s.generate(&p3, 7, 3, &[], go).unwrap();
        assert_eq!(r3, 6);
        assert_eq!(
            g3.output_ids,
            greedy(&m, &p3, 3, &[], go).unwrap().output_ids
        );
    }
}
