//! The family-neutral part of a batched step: input checks, stacking the
//! sequences' new rows, atomicity (every state marked before the pass and
//! put back on any failure), the non-finite check, and which rows get
//! logits.

use std::ops::Range;

use crate::error::{ModelError, Result};
use crate::lm::{Logits, SeqState, StepError, StepInput, state_mut};

/// A run of rows of the step's input belonging to one sequence.
pub type Segment = Range<usize>;

/// What the step driver needs of a family's state: a mark taken before
/// the pass that puts everything back, journals included. Both fail only
/// when a device holding the state's newest copy can no longer be reached.
pub(crate) trait Undo: SeqState + Sized {
    type Mark;
    fn mark(&mut self) -> Result<Self::Mark>;
    fn undo(&mut self, mark: &Self::Mark) -> Result<()>;
    /// A mark the step did not need; a state may keep its buffers for the
    /// next mark.
    fn release(&mut self, _mark: Self::Mark) {}
}

/// Where a step's work may go: [`Path::Device`] when a device backend is
/// installed as the step starts, else [`Path::Host`]. Decided once a step
/// ([`atomic_step`]; a drafter's pass) and handed down, so every part of
/// one step takes the same side and model code does not ask the global
/// backend itself. On the device path the seam's functions still decline
/// what they cannot take, which the host then computes: the bits are the
/// same either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    Host,
    Device,
}

impl Path {
    /// The path of a step starting now.
    pub fn now() -> Path {
        if fathom_kernels::backend::installed().is_some() {
            Path::Device
        } else {
            Path::Host
        }
    }

    /// Whether a device may take the step's work.
    pub fn device(self) -> bool {
        self == Path::Device
    }
}

/// The step's rows: every sequence's new tokens, stacked.
pub(crate) struct Rows {
    /// Sequence i's rows.
    pub(crate) segs: Vec<Segment>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) which: Vec<Logits>,
    /// Where the step's work may go.
    pub(crate) path: Path,
}

fn seq_err(i: usize, error: ModelError) -> StepError {
    StepError {
        seq: Some(i),
        error,
    }
}

/// Checks the batch, runs `forward` over the stacked rows and keeps its
/// result only if it succeeded with finite logits; otherwise every state is
/// put back and the error names the sequence at fault, if one is.
pub(crate) fn atomic_step<S: Undo>(
    vocab: usize,
    batch: &mut [StepInput<'_>],
    forward: impl FnOnce(&mut [&mut S], &Rows) -> Result<Vec<Vec<f32>>>,
) -> std::result::Result<Vec<Vec<f32>>, StepError> {
    let mut segs = Vec::with_capacity(batch.len());
    let mut tokens = Vec::new();
    for (i, b) in batch.iter().enumerate() {
        if b.tokens.is_empty() {
            return Err(seq_err(i, ModelError::EmptyInput));
        }
        if let Some(&id) = b.tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(seq_err(i, ModelError::TokenOutOfRange { id, vocab }));
        }
        segs.push(tokens.len()..tokens.len() + b.tokens.len());
        tokens.extend_from_slice(b.tokens);
    }
    let which: Vec<Logits> = batch.iter().map(|b| b.logits).collect();
    let mut states = Vec::with_capacity(batch.len());
    for (i, b) in batch.iter_mut().enumerate() {
        states.push(state_mut::<S>(&mut *b.state).map_err(|e| seq_err(i, e))?);
    }
    let mut marks: Vec<S::Mark> = Vec::with_capacity(states.len());
    for (i, s) in states.iter_mut().enumerate() {
        match s.mark() {
            Ok(m) => marks.push(m),
            Err(e) => {
                for (s, m) in states.iter_mut().zip(marks) {
                    s.release(m);
                }
                return Err(seq_err(i, e));
            }
        }
    }
    // Puts every state back. States that cannot be (their device is gone;
    // their buffers are then marked lost) turn the step's error into one
    // that says so: naming the sequence when it is one, else the step's.
    let undo = |states: &mut [&mut S], error: StepError| -> StepError {
        let failed: Vec<(usize, ModelError)> = states
            .iter_mut()
            .zip(&marks)
            .enumerate()
            .filter_map(|(i, (s, m))| s.undo(m).err().map(|e| (i, e)))
            .collect();
        match failed.as_slice() {
            [] => error,
            [(i, e)] => seq_err(*i, ModelError::State(format!("{}; then {e}", error.error))),
            [(_, e), ..] => StepError {
                seq: None,
                error: ModelError::State(format!(
                    "{}; then {} sequences could not be put back: {e}",
                    error.error,
                    failed.len()
                )),
            },
        }
    };
    let rows = Rows {
        segs,
        tokens,
        which,
        path: Path::now(),
    };
    let out = match forward(&mut states, &rows) {
        Ok(out) => out,
        Err(error) => return Err(undo(&mut states, StepError { seq: None, error })),
    };
    if let Some(i) = out.iter().position(|l| !fathom_kernels::ops::all_finite(l)) {
        let what = format!("sequence {i} of the step (at position {})", states[i].pos());
        return Err(undo(
            &mut states,
            seq_err(i, ModelError::NonFinite { what }),
        ));
    }
    for (s, m) in states.iter_mut().zip(marks) {
        s.release(m);
    }
    Ok(out)
}

/// The stacked rows whose logits are asked for, in batch order.
pub(crate) fn logit_rows(segs: &[Segment], which: &[Logits]) -> Vec<usize> {
    segs.iter()
        .zip(which)
        .flat_map(|(s, wh)| s.end - wh.rows(s.len())..s.end)
        .collect()
}

/// Rows `rows` of `m` (`d` wide), stacked.
pub(crate) fn gather(m: &[f32], rows: &[usize], d: usize) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| m[r * d..(r + 1) * d].iter().copied())
        .collect()
}

/// Splits the logits of [`logit_rows`] (`[rows, vocab]`) per sequence (one
/// sequence keeps the vector as it is).
pub(crate) fn split_logits(
    logits: Vec<f32>,
    segs: &[Segment],
    which: &[Logits],
    vocab: usize,
) -> Vec<Vec<f32>> {
    if let ([s], [wh]) = (segs, which) {
        debug_assert_eq!(logits.len(), wh.rows(s.len()) * vocab);
        return vec![logits];
    }
    let mut out = Vec::with_capacity(segs.len());
    let mut at = 0;
    for (s, wh) in segs.iter().zip(which) {
        let r = wh.rows(s.len());
        out.push(logits[at * vocab..(at + r) * vocab].to_vec());
        at += r;
    }
    out
}

/// Adds `b` to `a`, element-wise (residual connections).
pub(crate) fn add(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}

/// The last pass of a plain-residual stack: the final RMSNorm (weight
/// `norm`) and `lm_head`, only over the rows `which` asks for, split per
/// sequence. Traces `final_hidden`.
pub(crate) struct Head<'a> {
    pub norm: &'a [f32],
    pub eps: f32,
    pub lm_head: crate::head::HeadRef<'a>,
    pub vocab: usize,
}

impl Head<'_> {
    /// The logits of `h`'s rows as asked, per sequence.
    pub(crate) fn logits(
        &self,
        h: &[f32],
        segs: &[Segment],
        which: &[Logits],
        tracer: &mut Option<&mut dyn crate::trace::Tracer>,
    ) -> crate::error::Result<Vec<Vec<f32>>> {
        let d = self.norm.len();
        let rows = logit_rows(segs, which);
        let mut hfin = gather(h, &rows, d);
        fathom_kernels::ops::rms_norm_rows(&mut hfin, d, self.norm, self.eps);
        crate::trace::trace(tracer, usize::MAX, "final_hidden", &hfin);
        let logits = if rows.is_empty() {
            Vec::new()
        } else {
            self.lm_head.forward(&hfin, rows.len())?
        };
        Ok(split_logits(logits, segs, which, self.vocab))
    }
}
