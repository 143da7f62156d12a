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
use std::sync::Arc;

use fathom_model::{CausalLm, Logits, SeqState, StateSnapshot};

use crate::generate::{GenError, generate};
use crate::scheduler::{Decoder, Finished, Request, TokenEvent};

pub struct Session {
    model: Arc<dyn CausalLm>,
    state: Box<dyn SeqState>,
    /// Tokens the state has consumed.
    consumed: Vec<u32>,
    /// The state after the last turn's stable prefix, and that prefix.
    stable: Option<(Box<dyn StateSnapshot>, Vec<u32>)>,
}

impl Session {
    pub fn new(model: Arc<dyn CausalLm>) -> Self {
        Session {
            state: model.new_state(),
            model,
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
            if ids.len() < prompt.len()
                && prompt.starts_with(ids)
                && self.state.restore(snap.as_ref()).is_ok()
            {
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
    /// will render identically next turn. `req` carries everything but the
    /// prompt and state (sampling, limits, stops). Returns the generation and
    /// how many prompt tokens were reused.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        stable_len: usize,
        mut req: Request,
        decoder: Option<Decoder>,
        on_token: impl FnMut(&TokenEvent) -> ControlFlow<()>,
    ) -> Result<(Finished, usize), GenError> {
        let reused = self.reuse(prompt);
        let stable_len = stable_len.min(prompt.len() - 1);
        if reused < stable_len {
            let part = &prompt[reused..stable_len];
            self.model
                .forward(self.state.as_mut(), part, Logits::None)
                .map_err(|e| GenError::Failed(e.to_string()))?;
            self.consumed.extend_from_slice(part);
        }
        if self.consumed.len() == stable_len {
            self.stable = Some((self.state.snapshot(), prompt[..stable_len].to_vec()));
        }
        let state = std::mem::replace(&mut self.state, self.model.new_state());
        req.prompt = prompt.to_vec();
        req.state = Some((state, self.consumed.len()));
        let mut done = generate(&self.model, req, decoder, on_token);
        match &mut done {
            Ok(f) => {
                self.state = std::mem::replace(&mut f.state, self.model.new_state());
                self.consumed = std::mem::take(&mut f.consumed);
            }
            Err(_) => {
                self.consumed.clear();
                self.stable = None;
            }
        }
        debug_assert_eq!(self.consumed.len(), self.state.pos());
        Ok((done?, reused))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::greedy;

    fn tiny() -> Arc<dyn CausalLm> {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/data/k3-tiny/checkpoint");
        fathom_model::load(&p, Default::default()).unwrap()
    }

    fn req(max_new: usize) -> Request {
        Request::new(Vec::new(), max_new)
    }

    #[test]
    fn reused_turns_give_the_same_tokens_as_fresh_ones() {
        let m = tiny();
        let go = |_: &TokenEvent| ControlFlow::Continue(());
        let mut s = Session::new(m.clone());
        // Turn 1: stable part [1, 5, 9], generation prompt [7].
        let p1 = [1, 5, 9, 7];
        let (g1, r1) = s.generate(&p1, 3, req(4), None, go).unwrap();
        assert_eq!(r1, 0);
        assert_eq!(g1.output_ids, greedy(&m, &p1, 4, &[]).unwrap());
        // Turn 2 re-renders the reply differently: only the stable part is shared.
        let p2 = [1, 5, 9, 8, 8, 3, 7];
        let (g2, r2) = s.generate(&p2, 6, req(4), None, go).unwrap();
        assert_eq!(r2, 3, "the snapshot after the stable part is reused");
        assert_eq!(g2.output_ids, greedy(&m, &p2, 4, &[]).unwrap());
        // Turn 3 extends what was consumed: the tail alone is fed.
        let mut p3 = p2[..6].to_vec();
        p3.extend([7, 2]);
        let (g3, r3) = s.generate(&p3, 7, req(3), None, go).unwrap();
        assert_eq!(r3, 6);
        assert_eq!(g3.output_ids, greedy(&m, &p3, 3, &[]).unwrap());
    }
}
