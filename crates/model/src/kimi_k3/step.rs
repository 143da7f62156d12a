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

use fathom_kernels::ops::rms_norm_rows;

use super::attn_res::attn_res;
use super::kda::{self, Segment};
use super::mla;
use super::moe::{self, NextLayerHint};
use super::state::{KdaState, LayerState, MlaCache, SequenceState};
use super::weights::{AttnWeights, FfnWeights, LayerWeights};
use super::{K3Model, Tracer};
use crate::error::{ModelError, Result};
use crate::lm::{Logits, StepError, StepInput, state_mut};

fn seq_err(i: usize, error: ModelError) -> StepError {
    StepError {
        seq: Some(i),
        error,
    }
}

/// Advances every entry of `batch`; see [`crate::lm::CausalLm::step`].
pub(super) fn step(
    model: &K3Model,
    batch: &mut [StepInput<'_>],
    tracer: Option<&mut dyn Tracer>,
) -> std::result::Result<Vec<Vec<f32>>, StepError> {
    let vocab = model.spec.vocab_size;
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
        states.push(state_mut::<SequenceState>(&mut *b.state).map_err(|e| seq_err(i, e))?);
    }
    let marks: Vec<_> = states.iter().map(|s| s.undo_mark()).collect();
    let undo = |states: &mut [&mut SequenceState]| {
        for (s, m) in states.iter_mut().zip(&marks) {
            s.undo(m);
        }
    };
    let out = match forward_rows(model, &mut states, &segs, &tokens, &which, tracer) {
        Ok(out) => out,
        Err(error) => {
            undo(&mut states);
            return Err(StepError { seq: None, error });
        }
    };
    if let Some(i) = out.iter().position(|l| l.iter().any(|v| !v.is_finite())) {
        undo(&mut states);
        let what = format!("sequence {i} of the step (at position {})", states[i].pos);
        return Err(seq_err(i, ModelError::NonFinite { what }));
    }
    Ok(out)
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
    let mut partial: Vec<f32> = tokens
        .iter()
        .flat_map(|&id| w.embed_tokens.row(id as usize))
        .collect();
    let mut blocks: Vec<Vec<f32>> = Vec::new();
    for (i, lw) in w.layers.iter().enumerate() {
        // Attention side (§3): mix, maybe open a block, attend.
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
        let a = attention(model, lw, i, states, segs, &x)?;
        trace(&mut tracer, i, "attn_out", &a);
        add(&mut partial, &a);

        // MLP side.
        let mut x = attn_res(&partial, &blocks, &lw.mlp_res, d, eps);
        trace(&mut tracer, i, "mlp_in", &x);
        rms_norm_rows(&mut x, d, &lw.post_attention_layernorm, eps);
        let m = ffn(model, i, &x, n, &mut tracer)?;
        trace(&mut tracer, i, "mlp_out", &m);
        add(&mut partial, &m);
    }
    for (s, seg) in states.iter_mut().zip(segs) {
        s.pos += seg.len();
    }
    Ok(head(model, &partial, &blocks, segs, which, &mut tracer))
}

fn attention(
    model: &K3Model,
    lw: &LayerWeights,
    i: usize,
    states: &mut [&mut SequenceState],
    segs: &[Segment],
    x: &[f32],
) -> Result<Vec<f32>> {
    let spec = &*model.spec;
    match &lw.attn {
        AttnWeights::Kda(aw) => {
            let mut st: Vec<&mut KdaState> = states
                .iter_mut()
                .map(|s| match &mut s.layers[i] {
                    LayerState::Kda(k) => k,
                    LayerState::Mla(_) => unreachable!("state layer kinds follow the spec"),
                })
                .collect();
            Ok(kda::kda(spec, aw, &mut st, segs, x))
        }
        AttnWeights::Mla(aw) => {
            let mut st: Vec<&mut MlaCache> = states
                .iter_mut()
                .map(|s| match &mut s.layers[i] {
                    LayerState::Mla(m) => m,
                    LayerState::Kda(_) => unreachable!("state layer kinds follow the spec"),
                })
                .collect();
            mla::mla(spec, aw, &mut st, segs, x)
        }
    }
}

fn ffn(
    model: &K3Model,
    i: usize,
    x: &[f32],
    n: usize,
    tracer: &mut Option<&mut dyn Tracer>,
) -> Result<Vec<f32>> {
    let (spec, w) = (&*model.spec, &model.weights);
    match &w.layers[i].ffn {
        FfnWeights::Dense(mw) => Ok(moe::mlp(spec, mw, x, n)),
        FfnWeights::Moe(mw) => {
            let hint = w.layers.get(i + 1).and_then(|nl| match &nl.ffn {
                FfnWeights::Moe(nw) => Some(NextLayerHint {
                    layer: i + 1,
                    weights: nw,
                }),
                FfnWeights::Dense(_) => None,
            });
            let mut routes = tracer.as_ref().map(|_| Vec::new());
            let src = model.experts.as_ref();
            let out = moe::moe(spec, i, mw, x, n, src, hint, routes.as_mut())?;
            if let (Some(tr), Some(r)) = (tracer.as_deref_mut(), routes) {
                tr.routes(i, &r);
            }
            Ok(out)
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
    let rows: Vec<usize> = segs
        .iter()
        .zip(which)
        .flat_map(|(s, wh)| s.end - wh.rows(s.len())..s.end)
        .collect();
    let gather = |m: &[f32]| -> Vec<f32> {
        rows.iter()
            .flat_map(|&r| m[r * d..(r + 1) * d].iter().copied())
            .collect()
    };
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
    let v = spec.vocab_size;
    let mut out = Vec::with_capacity(segs.len());
    let mut at = 0;
    for (s, wh) in segs.iter().zip(which) {
        let r = wh.rows(s.len());
        out.push(logits[at * v..(at + r) * v].to_vec());
        at += r;
    }
    out
}

fn add(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}

fn trace(tracer: &mut Option<&mut dyn Tracer>, layer: usize, name: &str, rows: &[f32]) {
    if let Some(t) = tracer.as_deref_mut() {
        t.tensor(layer, name, rows);
    }
}
