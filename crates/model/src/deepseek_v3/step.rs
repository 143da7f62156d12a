//! The batched step: several sequences, each with its own latent cache and
//! any number of new positions, advanced in one pass over the layers.
//!
//! All sequences' new rows are stacked into one `[N, D]` matrix; spine
//! matrices multiply all rows at once, the rotary angles are computed once
//! per row for every layer, attention over the latent cache runs per
//! sequence, the MoE fetches the union of the experts once. So a sequence's
//! logits are bit-identical whatever else the step holds, however its
//! prompt was chunked. Atomic: a failure truncates every cache back to its
//! position before the step.

use fathom_kernels::ops::{GluAct, rms_norm_rows};

use super::DeepseekV3Model;
use super::attention::attention;
use super::weights::{FfnWeights, LayerWeights};
use crate::batch::{Head, Path, Rows, Segment, add};
use crate::early;
use crate::error::Result;
use crate::hybrid::mla::MlaRope;
use crate::kv::PagedRows;
use crate::kv_state::{self, KvState};
use crate::lm::Logits;
use crate::moe::{Ahead, Early, Ffn};
use crate::trace::{Tracer, routed, trace};

/// The layers over the stacked rows; per-sequence logits rows as asked.
/// Traces `embeddings` (layer 0), each layer's output `layer_out`,
/// `final_hidden` and each MoE layer's routes.
pub(super) fn forward_rows(
    model: &DeepseekV3Model,
    states: &mut [&mut KvState],
    rows: &Rows,
    mut tracer: Option<&mut dyn Tracer>,
) -> Result<Vec<Vec<f32>>> {
    let (spec, w) = (&*model.spec, &model.weights);
    let (d, n, eps) = (spec.hidden_size, rows.tokens.len(), spec.rms_norm_eps);
    let segs = &rows.segs;
    let rope = &model.parts.rope;
    let (mut h, angles) = kv_state::prologue(&w.embed_tokens, rope, states, rows, &mut tracer)?;
    let rope = MlaRope {
        rope: &model.parts.rope,
        angles: &angles,
        interleaved: spec.rope_interleave,
    };
    let _pass = w.layers.pass();
    for i in 0..w.layers.len() {
        let guard = w.layers.get(i)?;
        let lw: &LayerWeights = &guard;
        let mut x = h.clone();
        rms_norm_rows(&mut x, d, &lw.input_layernorm, eps);
        let mut caches: Vec<&mut PagedRows> = states.iter_mut().map(|s| &mut s.layers[i]).collect();
        // With a device and no tracer, the MLP side's norm and first
        // products may go in the attention's call (the same operations).
        let (side, norm) = (ffn_ref(&lw.mlp), &lw.post_attention_layernorm[..]);
        let mut early = Early::on_device(rows.path, &tracer, side, n, d);
        let then = early.as_mut().map(|e| e.then(side, &h, norm, eps));
        let (a, done) = attention(
            spec,
            rows.path,
            &lw.self_attn,
            &rope,
            &mut caches,
            segs,
            &x,
            then,
        )?;
        add(&mut h, &a);
        let (x, early) = early::normed(early, done, &h, norm, eps);
        let m = ffn(model, rows.path, i, lw, &x, n, early, &mut tracer)?;
        add(&mut h, &m);
        trace(&mut tracer, i, "layer_out", &h);
    }
    tap(model, states, segs, &h);
    for (s, seg) in states.iter_mut().zip(segs) {
        s.pos += seg.len();
    }
    head(model, &h, segs, &rows.which, &mut tracer)
}

/// Keeps the rows the head reads (after the final norm) for the
/// sequences whose drafter reads them (see [`super::mtp`]).
fn tap(model: &DeepseekV3Model, states: &mut [&mut KvState], segs: &[Segment], h: &[f32]) {
    let d = model.spec.hidden_size;
    for (s, seg) in states.iter_mut().zip(segs) {
        if let Some(t) = &mut s.tap {
            // Only the last `cap` rows of a long pass are kept.
            let skip = seg.len().saturating_sub(t.cap);
            t.skip(skip);
            let mut rows = h[(seg.start + skip) * d..seg.end * d].to_vec();
            rms_norm_rows(&mut rows, d, &model.weights.norm, model.spec.rms_norm_eps);
            t.push(&rows);
        }
    }
}

fn ffn(
    model: &DeepseekV3Model,
    path: Path,
    i: usize,
    lw: &LayerWeights,
    x: &[f32],
    n: usize,
    early: Option<Early>,
    tracer: &mut Option<&mut dyn Tracer>,
) -> Result<Vec<f32>> {
    let (spec, w) = (&*model.spec, &model.weights);
    match (&lw.mlp, early.map(|e| e.ffn)) {
        (FfnWeights::Dense(_), Some(Ahead::Mlp(y))) => Ok(y),
        (FfnWeights::Dense(mw), _) => Ok(mw.forward(x, n, GluAct::Swiglu)),
        (FfnWeights::Moe(mw), ahead) => {
            let first = ahead.and_then(Ahead::moe);
            let next_layer = w.layers.peek(i + 1);
            let next = next_layer.as_deref().and_then(|nl| match &nl.mlp {
                FfnWeights::Moe(nw) => Some((i + 1, nw)),
                FfnWeights::Dense(_) => None,
            });
            let src = model.experts.as_ref();
            routed(tracer, i, |routes| {
                spec.sparse_block()
                    .forward(path, i, mw, x, src, next, routes, first)
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
    model: &DeepseekV3Model,
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
