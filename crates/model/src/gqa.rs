//! Grouped-query attention over each sequence's paged key/value rows, from
//! the layer's (rotated) queries, keys and values to the per-head context
//! (the family applies `o_proj`): shared by Qwen3-MoE and GPT-OSS. With a
//! device, [`gqa_projected`] takes the whole layer in one call instead.
//!
//! Each sequence's new `[K | V]` rows are appended to its cache, then its
//! queries attend causally through `fathom_kernels::gqa::GqaAccum` (with the
//! layer's sliding window and attention sinks, if any), reading the cache a
//! window of blocks at a time from the first block any query sees. The
//! per-query order is fixed by the kernel, so a position's result is the
//! same in a prefill chunk, a decode step or a verification pass, batched
//! or not.

use fathom_kernels::attention::SPLIT;
use fathom_kernels::backend::{self, Biased, GqaWork, Then};
use fathom_kernels::gqa::{GqaAccum, GqaQuery, GqaShape};
use fathom_kernels::rope::Rope;

use crate::batch::{Path, Segment};
use crate::error::Result;
use crate::kv::{PagedRows, push_step_rows, step_blocks};
use crate::linear::Proj;
use crate::rotary::Angles;

/// Attention for the rows of several sequences (`segs[i]` are sequence
/// i's rows, `caches[i]` its cache for this layer) from `q [N, heads·hd]`,
/// `k`, `v [N, kv_heads·hd]`; `sinks`: one logit per head. Returns the
/// context `[N, heads·hd]`.
pub fn gqa_heads(
    shape: GqaShape,
    sinks: Option<&[f32]>,
    caches: &mut [&mut PagedRows],
    segs: &[Segment],
    qkv: [&[f32]; 3],
) -> Result<Vec<f32>> {
    let [q, k, v] = qkv;
    let n = segs.last().map_or(0, |s| s.end);
    let (qw, kvw) = (
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    );
    // Rows cached before this step, per sequence; then append [K | V] rows.
    let mut past = Vec::with_capacity(caches.len());
    for (cache, seg) in caches.iter_mut().zip(segs) {
        past.push(cache.len());
        let mut rows = Vec::with_capacity(seg.len() * 2 * kvw);
        for r in seg.clone() {
            rows.extend_from_slice(&k[r * kvw..(r + 1) * kvw]);
            rows.extend_from_slice(&v[r * kvw..(r + 1) * kvw]);
        }
        cache.push_rows(&rows)?;
    }
    let mut ctx = vec![0f32; n * qw];
    for ((cache, seg), &p0) in caches.iter().zip(segs).zip(&past) {
        let queries: Vec<GqaQuery<'_>> = seg
            .clone()
            .enumerate()
            .map(|(i, r)| GqaQuery {
                q: &q[r * qw..(r + 1) * qw],
                // causal: this position sees itself and all before
                n: p0 + i + 1,
            })
            .collect();
        let out = &mut ctx[seg.start * qw..seg.end * qw];
        let mut acc = GqaAccum::new(shape, &queries);
        if let Some(s) = sinks {
            acc = acc.with_sinks(s);
        }
        let first = acc.first_block();
        cache.windows_from(first, p0 + seg.len(), |b, blocks| acc.add(b, blocks))?;
        acc.finish(out);
    }
    Ok(ctx)
}

/// A GQA layer's projections as [`gqa_projected`] takes them: q, k, v and
/// `o_proj` with their biases, and the heads' q/k norms (weights, epsilon)
/// where the family has them.
pub struct GqaLinears<'a> {
    pub qkv: [&'a Proj; 3],
    pub o_proj: &'a Proj,
    pub qk_norm: Option<(&'a [f32], &'a [f32], f32)>,
}

/// The whole attention layer from its normed rows `x [N, D]` in one device
/// call ([`GqaWork`]: the projections, the heads' norms, the rotary step by
/// `angles`, the attention over each cache with `shape`'s window and the
/// sinks, `o_proj`); the new rows come back with the output `[N, D]` and
/// join the caches after it. With `then`, the device may also compute the
/// rest of the layer up to its experts' choice in the same call: the flag
/// says whether it did. `None`, nothing changed, when no device takes it,
/// a cache is not all fp32 in RAM or the rotary step does not cover whole
/// heads: the caller runs the steps on the host.
#[allow(clippy::too_many_arguments)]
pub fn gqa_projected(
    path: Path,
    shape: GqaShape,
    sinks: Option<&[f32]>,
    lin: &GqaLinears<'_>,
    (rope, angles): (&Rope, &Angles),
    caches: &mut [&mut PagedRows],
    segs: &[Segment],
    x: &[f32],
    then: Option<Then<'_>>,
) -> Result<Option<(Vec<f32>, bool)>> {
    if !path.device() || rope.head_dim() != shape.head_dim {
        return Ok(None);
    }
    let n = segs.last().map_or(0, |s| s.end);
    let w = shape.width();
    fn biased(p: &Proj) -> Biased<'_> {
        Biased {
            w: p.weight.as_mat(),
            bias: p.bias.as_deref(),
        }
    }
    let done = crate::phase::timed(crate::phase::Phase::FullCore, || {
        // A sliding window: blocks before the first any query of the step
        // sees are left out (neither kept nor sent).
        let (seqs, ns) = step_blocks(caches, segs, |p0| shape.first_row(p0 + 1) / SPLIT)?;
        let rows_o = lin.o_proj.weight.rows;
        let (mut out, mut rows) = (vec![0f32; n * rows_o], vec![0f32; n * w]);
        let mut work = GqaWork {
            shape,
            seqs: &seqs,
            ns: &ns,
            x,
            qkv: lin.qkv.map(biased),
            qk_norm: lin.qk_norm,
            cos: &angles.cos,
            sin: &angles.sin,
            sinks,
            o_proj: biased(lin.o_proj),
            out: &mut out,
            rows_out: &mut rows,
            then,
        };
        let taken = backend::gqa_attend_taken(&mut work);
        let done = work.then.as_ref().is_some_and(|t| t.done);
        drop(work);
        taken.then_some((out, rows, done))
    });
    let Some((out, rows, done)) = done else {
        return Ok(None);
    };
    push_step_rows(caches, segs, &rows, w)?;
    Ok(Some((out, done)))
}
