//! The batched step: several sequences, each with its own state and any
//! number of new positions, advanced in one pass over the layers.
//!
//! All sequences' new rows are stacked into one `[N, D]` matrix. Every spine
//! matrix multiplies all N rows at once (the kernels fix each row's
//! reduction order, so a row's result does not depend on N); attention
//! projections too, while the convolution, delta rule and attention over the
//! cache run per sequence; the MoE routes every row and fetches the union of
//! the experts once. Block attention residuals and norms are per row. So a
//! sequence's logits are bit-identical whatever else the step holds.
//!
//! Atomic: each state is marked before the pass (KDA state and journal
//! copied, MLA lengths noted) and put back if anything fails — an expert
//! read, a bad token, non-finite logits.

use std::time::Instant;

use fathom_kernels::backend::Then;
use fathom_kernels::ops::rms_norm_rows;

use super::attention::{kda, mla};
use super::attn_res::attn_res;
use super::moe::{self, NextLayerHint, SpineFirst};
use super::state::{SequenceState, kda_layers, mla_layers};
use super::weights::{AttnWeights, FfnWeights, LayerWeights};
use super::{K3Model, Tracer};
use crate::batch::{Path, Rows, Segment, add, atomic_step, gather, logit_rows, split_logits};
use crate::early::{self, Ahead, Early, Ffn, Residual};
use crate::error::Result;
use crate::lm::{Logits, StepError, StepInput};
use crate::phase::{self, Phase, timed};
use crate::trace::{routed, trace};

/// Advances every entry of `batch`; see [`crate::lm::CausalLm::step`].
pub(super) fn step(
    model: &K3Model,
    batch: &mut [StepInput<'_>],
    tracer: Option<&mut dyn Tracer>,
) -> std::result::Result<Vec<Vec<f32>>, StepError> {
    atomic_step::<SequenceState>(model.spec.vocab_size, batch, |states, rows| {
        forward_rows(model, states, rows, tracer)
    })
}

/// The layers over the stacked rows; per-sequence logits rows as asked.
fn forward_rows(
    model: &K3Model,
    states: &mut [&mut SequenceState],
    rows: &Rows,
    mut tracer: Option<&mut dyn Tracer>,
) -> Result<Vec<Vec<f32>>> {
    let (segs, tokens, which) = (&rows.segs[..], &rows.tokens[..], &rows.which[..]);
    let (spec, w) = (&*model.spec, &model.weights);
    let (d, n, eps) = (spec.hidden_size, tokens.len(), spec.rms_norm_eps);
    let mut partial: Vec<f32> = timed(Phase::MixAndHead, || w.embed_tokens.rows(tokens))?;
    let mut blocks: Vec<Vec<f32>> = Vec::new();
    let _pass = w.layers.pass();
    for i in 0..w.layers.len() {
        let guard = w.layers.get(i)?;
        let lw: &LayerWeights = &guard;
        // Attention side (§3): mix, maybe open a block, attend.
        let mix = Instant::now();
        let h = if blocks.is_empty() {
            partial.clone()
        } else {
            attn_res(&partial, &blocks, &lw.self_attention_res, d, eps)
        };
        if i % spec.attn_res_block_size == 0 {
            blocks.push(std::mem::replace(&mut partial, vec![0.0; n * d]));
        }
        trace(&mut tracer, i, "attn_in", &h);
        let mut x = h;
        rms_norm_rows(&mut x, d, &lw.input_layernorm, eps);
        phase::add(Phase::MixAndHead, mix);
        // With a device and no tracer, the MLP side's mix, norm and first
        // products may go in the attention's call (the same operations).
        let (side, norm) = (ffn_ref(&lw.ffn), &lw.post_attention_layernorm[..]);
        let mut early = Early::on_device(rows.path, &tracer, side, n, d);
        let res = Residual {
            partial: &partial,
            blocks: &blocks,
            query: Some(&lw.mlp_res.query),
        };
        let act = moe::situ(spec);
        let then = early
            .as_mut()
            .map(|e| e.then_mixed(side, res, norm, eps, act));
        let (a, done) = attention(model, rows.path, lw, i, states, segs, &x, then)?;
        trace(&mut tracer, i, "attn_out", &a);

        // MLP side.
        let mix = Instant::now();
        add(&mut partial, &a);
        let mlp_in = || {
            let x = attn_res(&partial, &blocks, &lw.mlp_res, d, eps);
            trace(&mut tracer, i, "mlp_in", &x);
            x
        };
        let (x, early) = early::normed_mixed(early, done, mlp_in, norm, eps);
        phase::add(Phase::MixAndHead, mix);
        let kind = match lw.ffn {
            FfnWeights::Dense(_) => Phase::Mlp,
            FfnWeights::Moe(_) => Phase::Moe,
        };
        let m = timed(kind, || {
            ffn(model, rows.path, i, lw, &x, n, early, &mut tracer)
        })?;
        trace(&mut tracer, i, "mlp_out", &m);
        timed(Phase::MixAndHead, || add(&mut partial, &m));
    }
    for (s, seg) in states.iter_mut().zip(segs) {
        s.pos += seg.len();
    }
    timed(Phase::MixAndHead, || {
        head(model, &partial, &blocks, segs, which, &mut tracer)
    })
}

/// The layer's attention over `x`, timed as its kind, and whether a
/// device also did `then` in the same call.
#[allow(clippy::too_many_arguments)]
fn attention(
    model: &K3Model,
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
        AttnWeights::Kda(aw) => timed(Phase::LinearAttention, || {
            kda(spec, path, aw, &mut kda_layers(states, i), segs, x, then)
        }),
        AttnWeights::Mla(aw) => timed(Phase::FullAttention, || {
            mla(spec, path, aw, &mut mla_layers(states, i), segs, x, then)
        }),
    }
}

fn ffn(
    model: &K3Model,
    path: Path,
    i: usize,
    lw: &LayerWeights,
    x: &[f32],
    n: usize,
    early: Option<Early<SpineFirst>>,
    tracer: &mut Option<&mut dyn Tracer>,
) -> Result<Vec<f32>> {
    let (spec, w) = (&*model.spec, &model.weights);
    match (&lw.ffn, early.map(|e| e.ffn)) {
        (FfnWeights::Dense(_), Some(Ahead::Mlp(y))) => Ok(y),
        (FfnWeights::Dense(mw), _) => Ok(moe::mlp(spec, mw, x, n)),
        (FfnWeights::Moe(mw), ahead) => {
            let first = ahead.and_then(Ahead::moe);
            let next = w.layers.peek(i + 1);
            let hint = next.as_deref().and_then(|nl| match &nl.ffn {
                FfnWeights::Moe(nw) => Some(NextLayerHint {
                    layer: i + 1,
                    weights: nw,
                }),
                FfnWeights::Dense(_) => None,
            });
            let src = model.experts.as_ref();
            routed(tracer, i, |routes| {
                moe::moe(spec, path, i, mw, x, n, src, hint, routes, first)
            })
        }
    }
}

/// The layer's MLP side as [`Early`] names it.
fn ffn_ref(f: &FfnWeights) -> Ffn<'_, SpineFirst> {
    match f {
        FfnWeights::Dense(mw) => Ffn::Dense(mw),
        FfnWeights::Moe(mw) => Ffn::Moe(mw),
    }
}

/// Output mix, final norm and head, only for the rows asked for; split per sequence.
fn head(
    model: &K3Model,
    partial: &[f32],
    blocks: &[Vec<f32>],
    segs: &[Segment],
    which: &[Logits],
    tracer: &mut Option<&mut dyn Tracer>,
) -> Result<Vec<Vec<f32>>> {
    let (spec, w) = (&*model.spec, &model.weights);
    let (d, eps) = (spec.hidden_size, spec.rms_norm_eps);
    let rows = logit_rows(segs, which);
    let gather = |m: &[f32]| gather(m, &rows, d);
    let part = gather(partial);
    let blk: Vec<Vec<f32>> = blocks.iter().map(|b| gather(b)).collect();
    let mut hfin = attn_res(&part, &blk, &w.output_attn_res, d, eps);
    rms_norm_rows(&mut hfin, d, &w.norm, eps);
    trace(tracer, usize::MAX, "final_hidden", &hfin);
    let logits = if rows.is_empty() {
        Vec::new()
    } else {
        w.lm_head.forward(&hfin, rows.len())?
    };
    Ok(split_logits(logits, segs, which, spec.vocab_size))
}
