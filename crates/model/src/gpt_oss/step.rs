//! The batched step: several sequences, each with its own key/value cache
//! and any number of new positions, advanced in one pass over the layers.
//!
//! All sequences' new rows are stacked into one `[N, D]` matrix; spine
//! matrices multiply all rows at once, the rotary angles are computed once
//! per row for every layer, attention over the cache runs per sequence (a
//! sliding layer reads only the blocks its window reaches, on the host and
//! on a device), the MoE
//! fetches the union of the experts once. So a sequence's logits are
//! bit-identical whatever else the step holds, however its prompt was
//! chunked. Atomic: a failure truncates every cache back to its position
//! before the step.

use fathom_kernels::ops::rms_norm_rows;

use super::GptOssModel;
use super::attention::attention;
use super::moe;
use super::weights::LayerWeights;
use crate::batch::{Head, Rows, Segment, add};
use crate::early;
use crate::error::Result;
use crate::kv::PagedRows;
use crate::kv_state::{self, KvState};
use crate::lm::Logits;
use crate::moe::{Early, Ffn};
use crate::trace::{Tracer, routed, trace};

/// The layers over the stacked rows; per-sequence logits rows as asked.
/// Traces `embeddings` (layer 0), each layer's output `layer_out`,
/// `final_hidden` and each layer's routes.
pub(super) fn forward_rows(
    model: &GptOssModel,
    states: &mut [&mut KvState],
    rows: &Rows,
    mut tracer: Option<&mut dyn Tracer>,
) -> Result<Vec<Vec<f32>>> {
    let (spec, w) = (&*model.spec, &model.weights);
    let (d, n, eps) = (spec.hidden_size, rows.tokens.len(), spec.rms_norm_eps);
    let segs = &rows.segs;
    let rope = &model.parts.rope;
    let (mut h, angles) = kv_state::prologue(&w.embed_tokens, rope, states, rows, &mut tracer)?;
    let _pass = w.layers.pass();
    for i in 0..w.layers.len() {
        let guard = w.layers.get(i)?;
        let lw: &LayerWeights = &guard;
        let mut x = h.clone();
        rms_norm_rows(&mut x, d, &lw.input_layernorm, eps);
        let mut caches: Vec<&mut PagedRows> = states.iter_mut().map(|s| &mut s.layers[i]).collect();
        // With a device and no tracer, the norm and the router's product
        // may go in the attention's call (the same operations).
        let (side, norm): (Ffn<'_>, _) = (
            Ffn::Router(&lw.router.weight),
            &lw.post_attention_layernorm[..],
        );
        let mut early = Early::on_device(rows.path, &tracer, side, n, d);
        let then = early.as_mut().map(|e| e.then(side, &h, norm, eps));
        let (a, done) = attention(
            spec,
            rows.path,
            i,
            &lw.self_attn,
            &model.parts.rope,
            &angles,
            &mut caches,
            segs,
            &x,
            then,
        )?;
        add(&mut h, &a);
        let (x, early) = early::normed(early, done, &h, norm, eps);
        let product = early.and_then(|e| e.ffn.router());
        let next_layer = w.layers.peek(i + 1);
        let next = next_layer.as_deref().map(|nl| (i + 1, &nl.router));
        let src = model.experts.as_ref();
        let m = routed(&mut tracer, i, |routes| {
            moe::moe(
                spec, rows.path, i, &lw.router, &x, src, next, routes, product,
            )
        })?;
        add(&mut h, &m);
        trace(&mut tracer, i, "layer_out", &h);
    }
    for (s, seg) in states.iter_mut().zip(segs) {
        s.pos += seg.len();
    }
    head(model, &h, segs, &rows.which, &mut tracer)
}

/// Final norm and head, only for the rows asked for; split per sequence.
fn head(
    model: &GptOssModel,
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
