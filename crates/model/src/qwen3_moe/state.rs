//! What a Qwen3-MoE sequence carries between passes: per layer, the keys
//! (after `k_norm` and RoPE) and values of every past token, one row
//! `[K (kv_heads·head_dim) | V (kv_heads·head_dim)]` per token, in paged
//! blocks shared with forks until written.
//!
//! Every layer holds exactly `pos` rows, so a snapshot, an undo mark and an
//! open speculative pass are just a position: going back truncates the
//! rows, which is bit-identical to never having fed the rest.

use std::any::Any;

use crate::error::{ModelError, Result};
use crate::lm::{SeqState, StateSnapshot};
use std::sync::Arc;

use crate::kv::{KvPool, PagedRows};

/// The state of one sequence.
#[derive(Debug, Clone)]
pub struct KvState {
    /// Per layer, one `[K | V]` row per token.
    pub layers: Vec<PagedRows>,
    /// Tokens consumed so far.
    pub pos: usize,
    /// Where the pass [`SeqState::begin_pass`] opened started, if one is open.
    pending: Option<usize>,
}

/// A restorable point in a sequence: its position.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    pos: usize,
}

impl KvState {
    /// An empty state for `layers` layers of `width`-float rows.
    pub fn new(layers: usize, width: usize, pool: &Arc<KvPool>) -> Self {
        KvState {
            layers: (0..layers).map(|_| PagedRows::new(width, pool)).collect(),
            pos: 0,
            pending: None,
        }
    }

    /// Goes back to position `p` (at most the current one).
    fn truncate(&mut self, p: usize) {
        debug_assert!(p <= self.pos);
        for l in &mut self.layers {
            l.truncate(p);
        }
        self.pos = p;
    }

    /// Bytes held (cached rows).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(PagedRows::bytes).sum()
    }
}

impl crate::batch::Undo for KvState {
    type Mark = usize;
    fn mark(&self) -> usize {
        self.pos
    }
    fn undo(&mut self, mark: &usize) {
        self.truncate(*mark);
    }
}

impl StateSnapshot for Snapshot {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn pos(&self) -> usize {
        self.pos
    }
}

impl SeqState for KvState {
    fn pos(&self) -> usize {
        self.pos
    }
    fn bytes(&self) -> usize {
        KvState::bytes(self)
    }
    fn snapshot(&self) -> Box<dyn StateSnapshot> {
        Box::new(Snapshot { pos: self.pos })
    }
    fn restore(&mut self, snap: &dyn StateSnapshot) -> Result<()> {
        let snap = snap
            .as_any()
            .downcast_ref::<Snapshot>()
            .ok_or_else(|| ModelError::State("snapshot of another model".into()))?;
        if snap.pos > self.pos {
            return Err(ModelError::State(
                "the snapshot is not from this sequence's past".into(),
            ));
        }
        self.truncate(snap.pos);
        Ok(())
    }
    fn begin_pass(&mut self) {
        self.pending = Some(self.pos);
    }
    fn keep(&mut self, n: usize) -> Result<()> {
        let start = self
            .pending
            .take()
            .ok_or_else(|| ModelError::State("keep without begin_pass".into()))?;
        let fed = self.pos - start;
        if n > fed {
            return Err(ModelError::State(format!(
                "cannot keep {n} of the {fed} positions fed"
            )));
        }
        self.truncate(start + n);
        Ok(())
    }
    fn fork(&self) -> Box<dyn SeqState> {
        let mut s = self.clone();
        s.pending = None;
        Box::new(s)
    }
    fn encode(&self) -> Result<Vec<u8>> {
        super::state_io::encode(self)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
