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

use fathom_kernels::backend::{self, Then, rms_norm32_rows};
use fathom_kernels::ops::rms_norm_rows;

use super::attention::{kda, mla};
use super::attn_res::attn_res;
use super::moe::{self, NextLayerHint, SpineFirst};
use super::state::{SequenceState, kda_layers, mla_layers};
use super::weights::{AttnWeights, FfnWeights, LayerWeights};
use super::{K3Model, Tracer};
use crate::batch::{Segment, add, atomic_step, gather, logit_rows, split_logits};
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
        forward_rows(model, states, &rows.segs, &rows.tokens, &rows.which, tracer)
    })
}

/// The layers over the stacked rows; per-sequence logits rows as asked.
fn forward_rows(
    model: &K3Model,
    states: &mut [&mut SequenceState],
    segs: &[Segment],
    tokens: &[u32],
    which: &[Logits],
    mut tracer: Option<&mut dyn Tracer>,
) -> Result<Vec<Vec<f32>>> {
    let (spec, w) = (&*model.spec, &model.weights);
    let (d, n, eps) = (spec.hidden_size, tokens.len(), spec.rms_norm_eps);
    let mut partial: Vec<f32> = timed(Phase::MixAndHead, || {
        tokens
            .iter()
            .flat_map(|&id| w.embed_tokens.row(id as usize))
            .collect()
    });
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
        let mut early = (tracer.is_none() && backend::installed().is_some())
            .then(|| Early::room(&lw.ffn, n, d));
        let then = early.as_mut().map(|e| e.then(model, lw, &partial, &blocks));
        let (a, done) = attention(model, lw, i, states, segs, &x, then)?;
        trace(&mut tracer, i, "attn_out", &a);

        // MLP side.
        let mix = Instant::now();
        add(&mut partial, &a);
        let (x, early) = match early.filter(|_| done) {
            Some(mut e) => (std::mem::take(&mut e.x), Some(e)),
            None => {
                let mut x = attn_res(&partial, &blocks, &lw.mlp_res, d, eps);
                trace(&mut tracer, i, "mlp_in", &x);
                rms_norm32_rows(&mut x, d, &lw.post_attention_layernorm, eps);
                (x, None)
            }
        };
        phase::add(Phase::MixAndHead, mix);
        let kind = match lw.ffn {
            FfnWeights::Dense(_) => Phase::Mlp,
            FfnWeights::Moe(_) => Phase::Moe,
        };
        let m = timed(kind, || ffn(model, i, lw, &x, n, early, &mut tracer))?;
        trace(&mut tracer, i, "mlp_out", &m);
        timed(Phase::MixAndHead, || add(&mut partial, &m));
    }
    for (s, seg) in states.iter_mut().zip(segs) {
        s.pos += seg.len();
    }
    Ok(timed(Phase::MixAndHead, || {
        head(model, &partial, &blocks, segs, which, &mut tracer)
    }))
}

/// The layer's attention over `x`, timed as its kind, and whether a
/// device also did `then` in the same call.
fn attention(
    model: &K3Model,
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
            kda(spec, aw, &mut kda_layers(states, i), segs, x, then)
        }),
        AttnWeights::Mla(aw) => timed(Phase::FullAttention, || {
            mla(spec, aw, &mut mla_layers(states, i), segs, x, then)
        }),
    }
}

fn ffn(
    model: &K3Model,
    i: usize,
    lw: &LayerWeights,
    x: &[f32],
    n: usize,
    early: Option<Early>,
    tracer: &mut Option<&mut dyn Tracer>,
) -> Result<Vec<f32>> {
    let (spec, w) = (&*model.spec, &model.weights);
    match (&lw.ffn, early) {
        (
            FfnWeights::Dense(_),
            Some(Early {
                ffn: Ahead::Mlp(y), ..
            }),
        ) => Ok(y),
        (FfnWeights::Dense(mw), _) => Ok(moe::mlp(spec, mw, x, n)),
        (FfnWeights::Moe(mw), early) => {
            let first = early.and_then(|e| match e.ffn {
                Ahead::Moe(f) => Some(f),
                Ahead::Mlp(_) => None,
            });
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
                moe::moe(spec, i, mw, x, n, src, hint, routes, first)
            })
        }
    }
}

/// What a device computed of a layer's MLP side in its attention's call
/// ([`Then`]): the normed rows `x`, and the MLP's output or the MoE's
/// products before its experts.
struct Early {
    x: Vec<f32>,
    ffn: Ahead,
}

enum Ahead {
    Mlp(Vec<f32>),
    Moe(SpineFirst),
}

impl Early {
    /// Room for `n` rows of the layer's MLP side `ffn`.
    fn room(ffn: &FfnWeights, n: usize, d: usize) -> Self {
        let ffn = match ffn {
            FfnWeights::Dense(mw) => Ahead::Mlp(vec![0f32; n * mw.down_proj.rows]),
            FfnWeights::Moe(mw) => Ahead::Moe(SpineFirst::room(mw, n)),
        };
        Early {
            x: vec![0f32; n * d],
            ffn,
        }
    }

    /// The MLP side of layer `lw` up to its experts' choice as a [`Then`]
    /// writing here: `partial + a` mixed with `blocks` by `mlp_res`,
    /// `post_attention_layernorm`, then the products.
    fn then<'a>(
        &'a mut self,
        model: &'a K3Model,
        lw: &'a LayerWeights,
        partial: &'a [f32],
        blocks: &'a [Vec<f32>],
    ) -> Then<'a> {
        let spec = &*model.spec;
        let (plain, glu) = match (&mut self.ffn, &lw.ffn) {
            (Ahead::Mlp(y), FfnWeights::Dense(mw)) => (Vec::new(), vec![mw.then_glu(y)]),
            (Ahead::Moe(f), FfnWeights::Moe(mw)) => f.then_parts(mw),
            _ => unreachable!("room is made for the layer's own MLP side"),
        };
        Then {
            d: spec.hidden_size,
            partial,
            blocks,
            query: Some(&lw.mlp_res.query),
            eps: spec.rms_norm_eps,
            norm: &lw.post_attention_layernorm,
            x: &mut self.x,
            plain,
            glu,
            act: moe::situ(spec),
            done: false,
        }
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
) -> Vec<Vec<f32>> {
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
        w.lm_head.forward(&hfin, rows.len())
    };
    split_logits(logits, segs, which, spec.vocab_size)
}
