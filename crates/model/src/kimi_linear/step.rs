//! The batched step: several sequences, each with its own hybrid state and
//! any number of new positions, advanced in one pass over the layers.
//!
//! All sequences' new rows are stacked into one `[N, D]` matrix; spine
//! matrices multiply all rows at once, the convolution, delta rule and
//! attention over the latent cache run per sequence, the MoE fetches the
//! union of the experts once. So a sequence's logits are bit-identical
//! whatever else the step holds. Atomic: each state is marked before the
//! pass (KDA state and journal copied, MLA lengths noted) and put back if
//! anything fails.

use fathom_kernels::backend::Then;
use fathom_kernels::ops::{GluAct, rms_norm_rows};

use super::KimiLinearModel;
use super::attention::{kda, mla};
use super::moe::{self, NextLayerHint};
use super::weights::{AttnWeights, FfnWeights, LayerWeights};
use crate::batch::{Head, Path, Rows, Segment, add, atomic_step};
use crate::early;
use crate::error::Result;
use crate::hybrid::state::{SequenceState, kda_layers, mla_layers};
use crate::lm::{Logits, StepError, StepInput};
use crate::moe::{Ahead, Early, Ffn};
use crate::trace::{Tracer, routed, trace};

/// Advances every entry of `batch`; see [`crate::lm::CausalLm::step`].
pub(super) fn step(
    model: &KimiLinearModel,
    batch: &mut [StepInput<'_>],
    tracer: Option<&mut dyn Tracer>,
) -> std::result::Result<Vec<Vec<f32>>, StepError> {
    atomic_step::<SequenceState>(model.spec.vocab_size, batch, |states, rows| {
        forward_rows(model, states, rows, tracer)
    })
}

/// The layers over the stacked rows; per-sequence logits rows as asked.
/// Traces `embeddings` (layer 0), each layer's output `layer_out`,
/// `final_hidden` and each MoE layer's routes.
fn forward_rows(
    model: &KimiLinearModel,
    states: &mut [&mut SequenceState],
    rows: &Rows,
    mut tracer: Option<&mut dyn Tracer>,
) -> Result<Vec<Vec<f32>>> {
    let (spec, w) = (&*model.spec, &model.weights);
    let (d, n, eps) = (spec.hidden_size, rows.tokens.len(), spec.rms_norm_eps);
    let mut h = w.embed_tokens.rows(&rows.tokens)?;
    trace(&mut tracer, 0, "embeddings", &h);
    let _pass = w.layers.pass();
    for i in 0..w.layers.len() {
        let guard = w.layers.get(i)?;
        let lw: &LayerWeights = &guard;
        let mut x = h.clone();
        rms_norm_rows(&mut x, d, &lw.input_layernorm, eps);
        // With a device and no tracer, the MLP side's norm and first
        // products may go in the attention's call (the same operations).
        let (side, norm) = (ffn_ref(&lw.ffn), &lw.post_attention_layernorm[..]);
        let mut early = Early::on_device(rows.path, &tracer, side, n, d);
        let then = early.as_mut().map(|e| e.then(side, &h, norm, eps));
        let (a, done) = attention(model, rows.path, lw, i, states, &rows.segs, &x, then)?;
        add(&mut h, &a);
        let (x, early) = early::normed(early, done, &h, norm, eps);
        let m = ffn(model, rows.path, i, lw, &x, n, early, &mut tracer)?;
        add(&mut h, &m);
        trace(&mut tracer, i, "layer_out", &h);
    }
    for (s, seg) in states.iter_mut().zip(&rows.segs) {
        s.pos += seg.len();
    }
    head(model, &h, &rows.segs, &rows.which, &mut tracer)
}

/// The layer's attention over `x`, and whether a device also did `then`
/// in the same call.
#[allow(clippy::too_many_arguments)]
fn attention(
    model: &KimiLinearModel,
    path: Path,
    lw: &LayerWeights,
    i: usize,
    states: &mut [&mut SequenceState],
    segs: &[Segment],
    x: &[f32],
    then: Option<Then<'_>>,
) -> Result<(Vec<f32>, bool)> {
    let spec = &*model.spec;
    match &lw.attn {
        AttnWeights::Kda(aw) => kda(spec, path, aw, &mut kda_layers(states, i), segs, x, then),
        AttnWeights::Mla(aw) => mla(spec, path, aw, &mut mla_layers(states, i), segs, x, then),
    }
}

/// The layer's MLP side over `x`, finishing what a device did of it in the
/// attention's call (`early`).
fn ffn(
    model: &KimiLinearModel,
    path: Path,
    i: usize,
    lw: &LayerWeights,
    x: &[f32],
    n: usize,
    early: Option<Early>,
    tracer: &mut Option<&mut dyn Tracer>,
) -> Result<Vec<f32>> {
    let (spec, w) = (&*model.spec, &model.weights);
    match (&lw.ffn, early.map(|e| e.ffn)) {
        (FfnWeights::Dense(_), Some(Ahead::Mlp(y))) => Ok(y),
        (FfnWeights::Dense(mw), _) => Ok(mw.forward(x, n, GluAct::Swiglu)),
        (FfnWeights::Moe(mw), ahead) => {
            let first = ahead.and_then(Ahead::moe);
            let next_layer = w.layers.peek(i + 1);
            let hint = next_layer.as_deref().and_then(|nl| match &nl.ffn {
                FfnWeights::Moe(nw) => Some(NextLayerHint {
                    layer: i + 1,
                    weights: nw,
                }),
                FfnWeights::Dense(_) => None,
            });
            let src = model.experts.as_ref();
            routed(tracer, i, |routes| {
                moe::moe(spec, path, i, mw, x, src, hint, routes, first)
            })
        }
    }
}

/// The layer's MLP side as [`Early`] names it.
fn ffn_ref(f: &FfnWeights) -> Ffn<'_> {
    match f {
        FfnWeights::Dense(mw) => Ffn::Dense(mw),
        FfnWeights::Moe(mw) => Ffn::Moe(mw),
    }
}

/// Final norm and head, only for the rows asked for; split per sequence.
fn head(
    model: &KimiLinearModel,
    h: &[f32],
    segs: &[Segment],
    which: &[Logits],
    tracer: &mut Option<&mut dyn Tracer>,
) -> Result<Vec<Vec<f32>>> {
    let (spec, w) = (&*model.spec, &model.weights);
    let head = Head {
        norm: &w.norm,
        eps: spec.rms_norm_eps,
        lm_head: crate::head::HeadRef::Head(&w.lm_head),
        vocab: spec.vocab_size,
    };
    head.logits(h, segs, which, tracer)
}
