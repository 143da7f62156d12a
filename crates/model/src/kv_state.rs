//! The sequence state of a family whose every layer keeps one cached row
//! per past token (Qwen3-MoE, GPT-OSS: keys after norm and RoPE, then
//! values; DeepSeek-V3: the normalised latent, then the rotated shared
//! key), in paged blocks shared with forks until written.
//!
//! Every layer holds exactly `pos` rows, so a snapshot, an undo mark and an
//! open speculative pass are just a position: going back truncates the
//! rows, which is bit-identical to never having fed the rest.
//!
//! Saved bytes, little-endian: the family's magic (`Q3ST`, `DSST`, `GOST`), version
//! `u32`, `pos: u64`, layer count `u32`, then per layer the row width `u32`
//! and the rows (`u64` length + f32s, `pos · width` of them). Decoding
//! checks every length against the model's dimensions before allocating.

use std::any::Any;
use std::sync::Arc;

use crate::error::{ModelError, Result};
use crate::kv::{KvPool, PagedRows};
use crate::lm::{SeqState, StateSnapshot};
use crate::state_codec::{Reader, bad, put_f32s, put_header, read_header};

const VERSION: u32 = 1;

/// What a family's states are shaped by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    /// The family, for saved-state errors (`"Qwen3-MoE"`).
    pub family: &'static str,
    /// The saved-state magic of the family.
    pub magic: [u8; 4],
    pub layers: usize,
    /// Floats cached per token per layer.
    pub width: usize,
}

/// What a loaded model of a key/value-cache family keeps besides its
/// weights: the rotation and its states' layout.
pub struct KvParts {
    pub rope: fathom_kernels::rope::Rope,
    pub layout: Arc<KvLayout>,
}

/// The state of one sequence.
#[derive(Debug, Clone)]
pub struct KvState {
    /// Per layer, one row per token.
    pub layers: Vec<PagedRows>,
    /// Tokens consumed so far.
    pub pos: usize,
    layout: Arc<KvLayout>,
    /// Where the pass [`SeqState::begin_pass`] opened started, if one is open.
    pending: Option<usize>,
    /// The final hidden rows of the latest positions, kept for a drafter
    /// that reads them (a multi-token-prediction layer); `None` unless the
    /// model was loaded for one.
    pub tap: Option<HiddenTap>,
}

/// Final hidden rows of positions `first..first + len`, at most `cap` of
/// them (the oldest go first). Rolled back with the state; not saved.
#[derive(Debug, Clone)]
pub struct HiddenTap {
    pub width: usize,
    pub first: usize,
    pub rows: Vec<f32>,
    pub cap: usize,
}

impl HiddenTap {
    pub fn new(width: usize, first: usize, cap: usize) -> Self {
        HiddenTap {
            width,
            first,
            rows: Vec::new(),
            cap: cap.max(1),
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.rows.len() / self.width.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The row of position `p`, if held.
    pub fn row(&self, p: usize) -> Option<&[f32]> {
        let i = p.checked_sub(self.first)?;
        (i < self.len()).then(|| &self.rows[i * self.width..(i + 1) * self.width])
    }

    /// Notes that the next `n` positions go by unkept (a pass longer than
    /// `cap` keeps only its last rows): everything held is older still.
    pub fn skip(&mut self, n: usize) {
        if n > 0 {
            self.first += self.len() + n;
            self.rows.clear();
        }
    }

    /// Appends the rows of the positions that follow (`rows.len()` a
    /// multiple of the width), dropping the oldest beyond `cap`.
    pub fn push(&mut self, rows: &[f32]) {
        self.rows.extend_from_slice(rows);
        let over = self.len().saturating_sub(self.cap);
        if over > 0 {
            self.rows.drain(..over * self.width);
            self.first += over;
        }
    }

    /// Forgets positions `p..`.
    fn truncate(&mut self, p: usize) {
        if p <= self.first {
            self.rows.clear();
            self.first = p;
        } else {
            let keep = (p - self.first).min(self.len());
            self.rows.truncate(keep * self.width);
        }
    }
}

/// A restorable point in a sequence: its position.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    pos: usize,
}

impl KvState {
    /// An empty state of `layout`, its blocks from `pool`.
    pub fn new(layout: &Arc<KvLayout>, pool: &Arc<KvPool>) -> Self {
        KvState {
            layers: (0..layout.layers)
                .map(|_| PagedRows::new(layout.width, pool))
                .collect(),
            pos: 0,
            layout: layout.clone(),
            pending: None,
            tap: None,
        }
    }

    /// Goes back to position `p` (at most the current one).
    fn truncate(&mut self, p: usize) {
        debug_assert!(p <= self.pos);
        for l in &mut self.layers {
            l.truncate(p);
        }
        if let Some(t) = &mut self.tap {
            t.truncate(p);
        }
        self.pos = p;
    }

    /// Bytes held (cached rows, tapped hidden rows).
    pub fn bytes(&self) -> usize {
        let tap = self.tap.as_ref().map_or(0, |t| t.rows.len() * 4);
        self.layers.iter().map(PagedRows::bytes).sum::<usize>() + tap
    }

    /// The state as bytes.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(self.bytes() + 64);
        put_header(
            &mut out,
            &self.layout.magic,
            VERSION,
            self.pos,
            self.layers.len(),
        );
        for l in &self.layers {
            out.extend_from_slice(&(l.width as u32).to_le_bytes());
            put_f32s(&mut out, &l.to_rows()?);
        }
        Ok(out)
    }

    /// A state of `layout` from [`KvState::encode`]'s bytes.
    pub fn decode(layout: &Arc<KvLayout>, pool: &Arc<KvPool>, bytes: &[u8]) -> Result<Self> {
        let mut r = Reader::new(bytes);
        let (layers, width) = (layout.layers, layout.width);
        let pos = read_header(
            &mut r,
            &layout.magic,
            layout.family,
            VERSION,
            layers,
            bytes.len(),
        )?;
        let mut s = KvState::new(layout, pool);
        s.pos = pos;
        for (i, l) in s.layers.iter_mut().enumerate() {
            let w = r.u32()? as usize;
            if w != width {
                return Err(bad(&format!("layer {i} rows are {w} wide, not {width}")));
            }
            let want = pos.checked_mul(w).ok_or_else(|| bad("size overflow"))?;
            l.push_rows(&r.f32s(want, &format!("layer {i} attention cache"))?)?;
        }
        r.finish()?;
        Ok(s)
    }
}

impl crate::batch::Undo for KvState {
    type Mark = usize;
    fn mark(&mut self) -> Result<usize> {
        Ok(self.pos)
    }
    fn undo(&mut self, mark: &usize) -> Result<()> {
        self.truncate(*mark);
        Ok(())
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
        KvState::encode(self)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::HiddenTap;

    /// Positions and rows stay paired through pushes past the cap, skips
    /// and truncation.
    #[test]
    fn the_tap_keeps_the_latest_rows_by_position() {
        let mut t = HiddenTap::new(2, 0, 3);
        let rows = |a: usize, b: usize| -> Vec<f32> {
            (a..b).flat_map(|p| [p as f32, -(p as f32)]).collect()
        };
        t.push(&rows(0, 2));
        t.push(&rows(2, 5));
        assert_eq!((t.first, t.len()), (2, 3));
        assert_eq!(t.row(4), Some(&[4.0, -4.0][..]));
        assert_eq!(t.row(1), None);
        t.skip(4); // positions 5..9 go by; 9.. follow
        t.push(&rows(9, 11));
        assert_eq!((t.first, t.len()), (9, 2));
        assert_eq!(t.row(10), Some(&[10.0, -10.0][..]));
        t.truncate(10);
        assert_eq!((t.first, t.len()), (9, 1));
        t.truncate(3);
        assert_eq!((t.first, t.len(), t.is_empty()), (3, 0, true));
    }
}

/// The rotation angles of the stacked rows `segs` of `states`, each
/// sequence's from its own position.
pub(crate) fn angles(
    rope: &fathom_kernels::rope::Rope,
    states: &[&mut KvState],
    segs: &[crate::batch::Segment],
) -> crate::rotary::Angles {
    let starts: Vec<usize> = states.iter().map(|s| s.pos).collect();
    crate::rotary::Angles::new(rope, segs, &starts)
}

impl KvParts {
    /// The parts of `layers` layers of `width` floats a token, rotated by
    /// `rope`, saved under `family`'s `magic`.
    pub fn new(
        rope: fathom_kernels::rope::Rope,
        family: &'static str,
        magic: [u8; 4],
        layers: usize,
        width: usize,
    ) -> Self {
        KvParts {
            rope,
            layout: Arc::new(KvLayout {
                family,
                magic,
                layers,
                width,
            }),
        }
    }
}

/// What a key/value-cache family's pass starts from: the rows of
/// `rows.tokens` embedded by `embed_tokens` (traced as `embeddings`) and
/// their rotation angles by `rope`.
pub(crate) fn prologue(
    embed_tokens: &crate::embedding::Embedding,
    rope: &fathom_kernels::rope::Rope,
    states: &[&mut KvState],
    rows: &crate::batch::Rows,
    tracer: &mut Option<&mut dyn crate::trace::Tracer>,
) -> crate::error::Result<(Vec<f32>, crate::rotary::Angles)> {
    let h = embed_tokens.rows(&rows.tokens)?;
    crate::trace::trace(tracer, 0, "embeddings", &h);
    Ok((h, angles(rope, states, &rows.segs)))
}
