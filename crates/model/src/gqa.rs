//! Grouped-query attention over each sequence's paged key/value rows, from
//! the layer's (rotated) queries, keys and values to the per-head context
//! (the family applies `o_proj`): shared by Qwen3-MoE and GPT-OSS.
//!
//! Each sequence's new `[K | V]` rows are appended to its cache, then its
//! queries attend causally through `fathom_kernels::gqa::GqaAccum` (with the
//! layer's sliding window and attention sinks, if any), reading the cache a
//! window of blocks at a time from the first block any query sees. The
//! per-query order is fixed by the kernel, so a position's result is the
//! same in a prefill chunk, a decode step or a verification pass, batched
//! or not.

use fathom_kernels::gqa::{GqaAccum, GqaQuery, GqaShape};

use crate::batch::Segment;
use crate::error::Result;
use crate::kv::PagedRows;

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
