//! Everything a sequence carries between passes, and O(1)-in-length snapshots.
//!
//! * KDA layers: the recurrent state `S [H, K, V]` (fp32) and, per q/k/v
//!   projection, the last `kernel − 1` pre-convolution rows.
//! * MLA layers: per token, the compressed latent after `kv_a_layernorm`
//!   (`kv_lora_rank` floats) and the shared key part `kr` (`qk_rope_head_dim`
//!   floats) — not per-head K/V, which would be `H·(dq+dv)` floats per token
//!   (K3: 576 vs 30,720 floats).
//!
//! A [`Snapshot`] copies only the fixed-size KDA pieces and remembers the
//! MLA cache lengths; [`SequenceState::restore`] truncates the caches back.
//! Rows appended after a snapshot are the only thing a rollback discards.

use std::any::Any;
use std::sync::Arc;

use fathom_kernels::state_buf::{StateBuf, StateError};

use super::{AttnKind, HybridDims};
use crate::error::{ModelError, Result};
use crate::lm::{SeqState, StateSnapshot};

/// A KDA layer's state. Its buffers' newest copies may be on the
/// backend's device (after a step ran there): read them through
/// [`StateBuf::read`] / [`StateBuf::host_mut`].
#[derive(Debug, Clone)]
pub struct KdaState {
    /// Pre-convolution rows for q, k, v: `[kernel − 1, P]` each, oldest first.
    pub conv: [StateBuf; 3],
    /// `S_h ∈ R^{K×V}` per head, row-major `[H, K, V]`.
    pub s: StateBuf,
    /// Inputs recorded during a pass that may be partly rolled back.
    pub journal: Option<KdaJournal>,
}

/// What a KDA layer needs to rewind a pass to any prefix: its state at the
/// start (a fixed-size copy) and the per-position delta-rule inputs and
/// pre-convolution rows of the pass (a few rows per position).
#[derive(Debug, Clone)]
pub struct KdaJournal {
    pub s0: StateBuf,
    pub conv0: [StateBuf; 3],
    /// Pre-convolution q, k, v rows of the pass, `[T, P]` each.
    pub pre: [Vec<f32>; 3],
    /// Per head, the delta-rule inputs of the pass.
    pub heads: Vec<super::kda::HeadInputs>,
}

impl KdaJournal {
    fn start(st: &KdaState, heads: usize) -> Self {
        KdaJournal {
            s0: st.s.clone(),
            conv0: st.conv.clone(),
            pre: Default::default(),
            heads: vec![Default::default(); heads],
        }
    }

    /// Appends one forward call's positions.
    pub(crate) fn record<'a>(
        &mut self,
        pre: &[Vec<f32>; 3],
        heads: impl Iterator<Item = &'a super::kda::HeadInputs>,
    ) {
        for (dst, src) in self.pre.iter_mut().zip(pre) {
            dst.extend_from_slice(src);
        }
        for (dst, src) in self.heads.iter_mut().zip(heads) {
            dst.q.extend_from_slice(&src.q);
            dst.k.extend_from_slice(&src.k);
            dst.v.extend_from_slice(&src.v);
            dst.log_alpha.extend_from_slice(&src.log_alpha);
            dst.beta.extend_from_slice(&src.beta);
        }
    }
}

/// A layer's latent cache, `[tokens, kv_lora_rank + qk_rope_head_dim]`
/// (normalised latent, kr): the model's paged rows (blocks shared
/// copy-on-write with forks and snapshots, spilled to disk beyond the RAM
/// share).
pub use crate::kv::{BLOCK_ROWS, PagedRows as MlaCache};

#[derive(Debug, Clone)]
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaCache),
}

/// Layer `i`'s KDA states of every sequence of a step (layer kinds
/// follow the spec, so every state's layer `i` is KDA).
pub(crate) fn kda_layers<'a>(
    states: &'a mut [&mut SequenceState],
    i: usize,
) -> Vec<&'a mut KdaState> {
    states
        .iter_mut()
        .map(|s| match &mut s.layers[i] {
            LayerState::Kda(k) => k,
            LayerState::Mla(_) => unreachable!("state layer kinds follow the spec"),
        })
        .collect()
}

/// Layer `i`'s latent caches of every sequence of a step (layer kinds
/// follow the spec, so every state's layer `i` is MLA).
pub(crate) fn mla_layers<'a>(
    states: &'a mut [&mut SequenceState],
    i: usize,
) -> Vec<&'a mut MlaCache> {
    states
        .iter_mut()
        .map(|s| match &mut s.layers[i] {
            LayerState::Mla(m) => m,
            LayerState::Kda(_) => unreachable!("state layer kinds follow the spec"),
        })
        .collect()
}

/// The state of one sequence.
#[derive(Debug, Clone)]
pub struct SequenceState {
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub pos: usize,
    dims: Arc<HybridDims>,
    /// The pass [`SeqState::begin_pass`] opened, if any.
    pending: Option<PendingPass>,
    /// The last step's undo mark, whose buffers the next mark reuses.
    spare: SpareMark,
}

/// A released undo mark kept for its buffers: the next step copies into them
/// instead of allocating (and page-faulting) a fresh copy of every KDA state.
/// A fork or clone of the state starts without one.
#[derive(Debug, Default)]
struct SpareMark(Option<Snapshot>);

impl Clone for SpareMark {
    fn clone(&self) -> Self {
        SpareMark(None)
    }
}

/// Everything a failed step must put back: the state before it, journals included.
pub(crate) struct UndoMark(Snapshot);

/// A pass whose positions may be only partly kept (speculative verification).
#[derive(Debug, Clone)]
pub struct PendingPass {
    pos: usize,
    mla_len: Vec<usize>,
}

/// A restorable point in a sequence.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pos: usize,
    kda: Vec<Option<KdaState>>,
    mla_len: Vec<usize>,
}

impl Snapshot {
    /// Bytes this snapshot holds (KDA state only; independent of sequence length).
    pub fn bytes(&self) -> usize {
        self.kda
            .iter()
            .flatten()
            .map(|k| 4 * (k.s.len() + k.conv.iter().map(StateBuf::len).sum::<usize>()))
            .sum()
    }
}

impl SequenceState {
    pub fn new(dims: &Arc<HybridDims>, pool: &Arc<crate::kv::KvPool>) -> Self {
        let k = &dims.kda;
        let p = k.width();
        let layers = dims
            .attn_kinds
            .iter()
            .map(|kind| match kind {
                AttnKind::Kda => LayerState::Kda(KdaState {
                    conv: std::array::from_fn(|_| StateBuf::zeros((k.conv_kernel - 1) * p)),
                    s: StateBuf::zeros(k.heads * k.head_dim * k.head_dim),
                    journal: None,
                }),
                AttnKind::Mla => LayerState::Mla(MlaCache::new(dims.mla.cache_width(), pool)),
            })
            .collect();
        SequenceState {
            layers,
            pos: 0,
            dims: dims.clone(),
            pending: None,
            spare: SpareMark::default(),
        }
    }

    /// The dimensions this state was made for.
    pub fn dims(&self) -> &Arc<HybridDims> {
        &self.dims
    }

    /// A mark to undo a step with (KDA state and journal copied, MLA lengths).
    /// Reuses the buffers of the last released mark when it has this
    /// state's layout.
    pub(crate) fn undo_mark(&mut self) -> std::result::Result<UndoMark, StateError> {
        match self.spare.0.take() {
            Some(mut snap) if snap.kda.len() == self.layers.len() => {
                self.snapshot_into(&mut snap)?;
                Ok(UndoMark(snap))
            }
            _ => {
                let snap = self.snapshot();
                // A copy made while the device was unreachable is lost.
                for k in snap.kda.iter().flatten() {
                    k.s.check()?;
                    k.conv.iter().try_for_each(StateBuf::check)?;
                }
                Ok(UndoMark(snap))
            }
        }
    }

    /// Hands a mark that was not needed back for the next step to reuse
    /// (its state buffers; any journal it copied is dropped, so a kept
    /// spare is one copy of the fixed state, as the ledger counts it). Not
    /// counted in [`SequenceState::bytes`], which is the state itself.
    pub(crate) fn release_mark(&mut self, mut mark: UndoMark) {
        for k in mark.0.kda.iter_mut().flatten() {
            k.journal = None;
        }
        self.spare.0 = Some(mark.0);
    }

    /// [`SequenceState::snapshot`] into `snap`'s buffers (same layer count).
    fn snapshot_into(&self, snap: &mut Snapshot) -> std::result::Result<(), StateError> {
        snap.pos = self.pos;
        for (i, l) in self.layers.iter().enumerate() {
            match (l, &mut snap.kda[i]) {
                (LayerState::Kda(k), Some(saved)) => {
                    saved.s.copy_from(&k.s)?;
                    for (c, src) in saved.conv.iter_mut().zip(&k.conv) {
                        c.copy_from(src)?;
                    }
                    saved.journal.clone_from(&k.journal);
                    snap.mla_len[i] = 0;
                }
                (LayerState::Kda(k), slot) => {
                    *slot = Some(k.clone());
                    snap.mla_len[i] = 0;
                }
                (LayerState::Mla(m), slot) => {
                    *slot = None;
                    snap.mla_len[i] = m.len();
                }
            }
        }
        Ok(())
    }

    /// Puts back what `mark` saw, journals included.
    pub(crate) fn undo(&mut self, mark: &UndoMark) -> std::result::Result<(), StateError> {
        self.restore(&mark.0)?;
        for (l, saved) in self.layers.iter_mut().zip(&mark.0.kda) {
            if let (LayerState::Kda(k), Some(s)) = (l, saved) {
                k.journal.clone_from(&s.journal);
            }
        }
        Ok(())
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut kda = Vec::with_capacity(self.layers.len());
        let mut mla_len = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            match l {
                LayerState::Kda(k) => {
                    kda.push(Some(k.clone()));
                    mla_len.push(0);
                }
                LayerState::Mla(m) => {
                    kda.push(None);
                    mla_len.push(m.len());
                }
            }
        }
        Snapshot {
            pos: self.pos,
            kda,
            mla_len,
        }
    }

    /// Returns to `snap`, which must have been taken from this sequence at or
    /// before its current position.
    pub fn restore(&mut self, snap: &Snapshot) -> std::result::Result<(), StateError> {
        assert!(
            snap.pos <= self.pos,
            "snapshot is from the future of this sequence"
        );
        // Every layer is put back even when a copy fails (its buffer is
        // then marked lost, so the sequence cannot step on from a mix of
        // old and new values); the first failure is returned.
        let mut first = Ok(());
        let mut put = |dst: &mut StateBuf, src: &StateBuf| {
            if let Err(e) = dst.copy_from(src) {
                dst.mark_lost(e.0.clone());
                if first.is_ok() {
                    first = Err(e);
                }
            }
        };
        for (i, l) in self.layers.iter_mut().enumerate() {
            match l {
                LayerState::Kda(k) => {
                    let saved = snap.kda[i].as_ref().expect("layer kinds do not change");
                    put(&mut k.s, &saved.s);
                    for (c, sc) in k.conv.iter_mut().zip(&saved.conv) {
                        put(c, sc);
                    }
                }
                LayerState::Mla(m) => m.truncate(snap.mla_len[i]),
            }
        }
        self.pos = snap.pos;
        first
    }

    /// Starts a pass that [`SequenceState::keep`] may later cut short. KDA
    /// layers journal their inputs; MLA caches just remember their length.
    fn begin_pass_at(&mut self, heads: usize) -> PendingPass {
        let mut mla_len = Vec::with_capacity(self.layers.len());
        for l in &mut self.layers {
            match l {
                LayerState::Kda(k) => {
                    k.journal = Some(KdaJournal::start(k, heads));
                    mla_len.push(0);
                }
                LayerState::Mla(m) => mla_len.push(m.len()),
            }
        }
        PendingPass {
            pos: self.pos,
            mla_len,
        }
    }

    /// Keeps the first `n` positions fed since `begin_pass` and forgets the
    /// rest: MLA rows are truncated, KDA state and conv windows rewound and
    /// replayed over the kept positions. The result is bit-identical to a
    /// state that was only ever fed those `n` positions.
    fn keep_pass(&mut self, pass: PendingPass, n: usize) -> std::result::Result<(), StateError> {
        let fed = self.pos - pass.pos;
        assert!(n <= fed, "cannot keep {n} of {fed} positions");
        for (i, l) in self.layers.iter_mut().enumerate() {
            match l {
                LayerState::Kda(k) => {
                    let j = k
                        .journal
                        .take()
                        .expect("begin_pass journals every KDA layer");
                    if n < fed {
                        super::kda::replay_prefix(&self.dims.kda, k, &j, n)?;
                    }
                }
                LayerState::Mla(m) => m.truncate(pass.mla_len[i] + n),
            }
        }
        self.pos = pass.pos + n;
        Ok(())
    }

    /// Bytes held by this sequence's state.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(k) => {
                    4 * (k.s.len() + k.conv.iter().map(StateBuf::len).sum::<usize>())
                }
                LayerState::Mla(m) => m.bytes(),
            })
            .sum()
    }
}

impl crate::batch::Undo for SequenceState {
    type Mark = UndoMark;
    fn mark(&mut self) -> Result<UndoMark> {
        self.undo_mark()
            .map_err(|e| ModelError::State(e.to_string()))
    }
    fn release(&mut self, mark: UndoMark) {
        self.release_mark(mark)
    }
    fn undo(&mut self, mark: &UndoMark) -> Result<()> {
        SequenceState::undo(self, mark).map_err(|e| ModelError::State(e.to_string()))
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

impl SeqState for SequenceState {
    fn pos(&self) -> usize {
        self.pos
    }
    fn bytes(&self) -> usize {
        SequenceState::bytes(self)
    }
    fn snapshot(&self) -> Box<dyn StateSnapshot> {
        Box::new(SequenceState::snapshot(self))
    }
    fn restore(&mut self, snap: &dyn StateSnapshot) -> Result<()> {
        let snap = snap
            .as_any()
            .downcast_ref::<Snapshot>()
            .ok_or_else(|| ModelError::State("snapshot of another model".into()))?;
        if snap.pos > self.pos || snap.kda.len() != self.layers.len() {
            return Err(ModelError::State(
                "the snapshot is not from this sequence's past".into(),
            ));
        }
        SequenceState::restore(self, snap).map_err(|e| ModelError::State(e.to_string()))
    }
    fn begin_pass(&mut self) {
        self.pending = Some(self.begin_pass_at(self.dims.kda.heads));
    }
    fn keep(&mut self, n: usize) -> Result<()> {
        let pass = self
            .pending
            .take()
            .ok_or_else(|| ModelError::State("keep without begin_pass".into()))?;
        let fed = self.pos - pass.pos;
        if n > fed {
            return Err(ModelError::State(format!(
                "cannot keep {n} of the {fed} positions fed"
            )));
        }
        self.keep_pass(pass, n)
            .map_err(|e| ModelError::State(e.to_string()))
    }
    fn fork(&self) -> Box<dyn SeqState> {
        let mut s = self.clone();
        s.pending = None;
        for l in &mut s.layers {
            if let LayerState::Kda(k) = l {
                k.journal = None;
            }
        }
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
