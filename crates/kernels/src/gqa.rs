//! Grouped-query attention over a key/value cache, every head of a query
//! in one pass over the rows.
//!
//! The cache holds per token one row `[K (kv_heads·head_dim) | V
//! (kv_heads·head_dim)]`. A query brings `q [heads, head_dim]`; query head
//! `h` reads key/value head `h / (heads / kv_heads)`. For each head
//!
//! ```text
//! s_r = (k_r[g] · q[h]) · scale                  r in lo..n
//! out[h] = Σ_r softmax(s, sink[h])_r · v_r[g]
//! ```
//! where `lo = n − window` with sliding-window attention (a query sees its
//! latest `window` rows, itself included; else `lo = 0`), and the optional
//! per-head sink (GPT-OSS) is one more logit in the softmax's denominator
//! that carries no value.
//!
//! # Reduction order (fixed by the shapes and the row index only)
//!
//! The same as the latent-cache kernel ([`crate::attention`]): dot products
//! in [`dot_lanes`] order; rows cut into splits of [`SPLIT`] rows at
//! absolute offsets, read in place from blocks of `SPLIT` rows; within a
//! split the scores, the split's max, then in row order `p = exp(s − m)`
//! ([`crate::expf::exp_softmax`], which a device repeats),
//! `l += p`, `c += p · v`; splits merged in order with the online-softmax
//! rule. A window skips the splits before `lo` and the rows before it in
//! its first split; a sink is merged last, as a split with `m = sink`,
//! `l = 1`, `c = 0`. A query's result depends only on its own inputs, `n`,
//! the window and the sinks.
//! [`gqa_attend_scalar`] is the twin that defines this order; [`gqa_attend`]
//! must equal it bit for bit.

use rayon::prelude::*;

use crate::attention::{Merged, Partial, SPLIT, dot_lanes};
use crate::expf::exp_softmax;

/// Splits computed at a time for one query (bounds scratch memory).
const WINDOW: usize = 64;

/// The dimensions of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct GqaShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Applied to every score.
    pub scale: f32,
    /// Sliding-window attention: a query sees at most its latest `window`
    /// rows (itself included); `None`: every row.
    pub window: Option<usize>,
}

impl GqaShape {
    /// Floats per cached row: keys then values.
    pub fn width(&self) -> usize {
        2 * self.kv_heads * self.head_dim
    }

    /// The first row a query seeing rows `..n` attends to.
    pub fn first_row(&self, n: usize) -> usize {
        self.window.map_or(0, |w| n.saturating_sub(w))
    }

    /// (split, first row, end) of every split a query seeing rows `..n`
    /// attends to, rows counted within the split.
    fn seen(&self, n: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let lo = self.first_row(n);
        (lo / SPLIT..n.div_ceil(SPLIT)).map(move |k| {
            let base = k * SPLIT;
            (k, lo.max(base) - base, ((k + 1) * SPLIT).min(n) - base)
        })
    }
}

/// The sink as a last split: `m = sink`, `l = 1`, nothing to the context.
fn sink_partial(sinks: &[f32], dim: usize) -> Partial {
    Partial {
        m: sinks.to_vec(),
        l: vec![1.0; sinks.len()],
        c: vec![0.0; sinks.len() * dim],
    }
}

/// One query: `q [heads, head_dim]`, attending rows `0..n`.
#[derive(Debug, Clone, Copy)]
pub struct GqaQuery<'a> {
    pub q: &'a [f32],
    pub n: usize,
}

/// The partial of split `k` (its rows `from..to` seen) for query `q`; compiled for AVX2 + FMA when the process's kernel set allows
/// it (the dot products are fused multiply-adds in every build, the
/// context update plain multiplies and adds: same bits everywhere).
fn split_partial(
    sh: &GqaShape,
    blocks: &[&[f32]],
    q: &GqaQuery<'_>,
    k: usize,
    from: usize,
    to: usize,
) -> Partial {
    #[cfg(target_arch = "x86_64")]
    if matches!(crate::kernels().isa, crate::Isa::Avx2 | crate::Isa::Avx512) {
        // SAFETY: the kernel table is AVX2 or AVX-512 only on CPUs that report AVX2 and FMA.
        return unsafe { split_partial_avx2(sh, blocks, q, k, from, to) };
    }
    split_partial_impl(sh, blocks, q, k, from, to)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn split_partial_avx2(
    sh: &GqaShape,
    blocks: &[&[f32]],
    q: &GqaQuery<'_>,
    k: usize,
    from: usize,
    to: usize,
) -> Partial {
    split_partial_impl(sh, blocks, q, k, from, to)
}

#[inline(always)]
fn split_partial_impl(
    sh: &GqaShape,
    blocks: &[&[f32]],
    q: &GqaQuery<'_>,
    k: usize,
    from: usize,
    to: usize,
) -> Partial {
    let (h, d, w) = (sh.heads, sh.head_dim, sh.width());
    let kvw = sh.kv_heads * d;
    let group = h / sh.kv_heads;
    let rows = &blocks[k][from * w..to * w];
    let len = to - from;
    let mut s = vec![0f32; h * len];
    let mut m = vec![f32::NEG_INFINITY; h];
    for (j, r) in rows.chunks_exact(w).enumerate() {
        for hh in 0..h {
            let key = &r[(hh / group) * d..][..d];
            let v = dot_lanes(key, &q.q[hh * d..(hh + 1) * d]) * sh.scale;
            s[hh * len + j] = v;
            m[hh] = m[hh].max(v);
        }
    }
    let mut l = vec![0f32; h];
    let mut c = vec![0f32; h * d];
    for (j, r) in rows.chunks_exact(w).enumerate() {
        let vals = &r[kvw..];
        for hh in 0..h {
            let p = exp_softmax(s[hh * len + j] - m[hh]);
            l[hh] += p;
            let v = &vals[(hh / group) * d..][..d];
            for (cv, &x) in c[hh * d..(hh + 1) * d].iter_mut().zip(v) {
                *cv += p * x;
            }
        }
    }
    Partial { m, l, c }
}

fn check(sh: &GqaShape, blocks: &[&[f32]], queries: &[GqaQuery<'_>], out: &[f32]) {
    let w = sh.width();
    assert!(
        sh.kv_heads >= 1 && sh.heads.is_multiple_of(sh.kv_heads),
        "kv_heads divides heads"
    );
    assert_eq!(
        out.len(),
        queries.len() * sh.heads * sh.head_dim,
        "out is [T, heads, head_dim]"
    );
    let full = blocks.iter().rev().skip(1).all(|b| b.len() == SPLIT * w);
    assert!(full, "every block but the last holds SPLIT rows");
    let rows = blocks.iter().map(|b| b.len()).sum::<usize>() / w.max(1);
    for q in queries {
        assert!(q.n >= 1 && q.n <= rows, "a query sees 1..=cached rows");
        assert_eq!(q.q.len(), sh.heads * sh.head_dim);
    }
}

/// Every query's output `[T, heads, head_dim]` into `out`; `blocks` are the
/// cache rows in blocks of [`SPLIT`]; `sinks`, if any, one logit per head.
/// Queries run in parallel; a single query's splits too.
pub fn gqa_attend(
    sh: &GqaShape,
    blocks: &[&[f32]],
    queries: &[GqaQuery<'_>],
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    check(sh, blocks, queries, out);
    let mut acc = GqaAccum::new(*sh, queries);
    if let Some(s) = sinks {
        acc = acc.with_sinks(s);
    }
    let first = acc.first_block();
    for (i, win) in blocks[first.min(blocks.len())..].chunks(WINDOW).enumerate() {
        acc.add(first + i * WINDOW, win);
    }
    acc.finish(out);
}

/// [`gqa_attend`] over a cache handed in windows of consecutive blocks (a
/// cache read back from disk a window at a time), starting at
/// [`GqaAccum::first_block`] (earlier blocks are outside every query's
/// window): `add` them in order, then `finish`. The same bits however the
/// blocks are windowed.
pub struct GqaAccum<'q> {
    sh: GqaShape,
    queries: &'q [GqaQuery<'q>],
    sinks: Option<&'q [f32]>,
    merged: Vec<Merged>,
    /// The first block any query attends to.
    start: usize,
    next: usize,
    rows: usize,
}

impl<'q> GqaAccum<'q> {
    pub fn new(sh: GqaShape, queries: &'q [GqaQuery<'q>]) -> Self {
        assert!(
            sh.kv_heads >= 1 && sh.heads.is_multiple_of(sh.kv_heads),
            "kv_heads divides heads"
        );
        assert!(sh.window != Some(0), "a window holds at least one row");
        for q in queries {
            assert!(q.n >= 1, "a query sees at least one row");
            assert_eq!(q.q.len(), sh.heads * sh.head_dim);
        }
        let first = queries
            .iter()
            .map(|q| sh.first_row(q.n) / SPLIT)
            .min()
            .unwrap_or(0);
        GqaAccum {
            merged: queries
                .iter()
                .map(|_| Merged::new(sh.heads, sh.head_dim))
                .collect(),
            sh,
            queries,
            sinks: None,
            start: first,
            next: first,
            rows: first * SPLIT,
        }
    }

    /// Adds one sink logit per head to every query's softmax.
    pub fn with_sinks(mut self, sinks: &'q [f32]) -> Self {
        assert_eq!(sinks.len(), self.sh.heads, "one sink per head");
        self.sinks = Some(sinks);
        self
    }

    /// The first block any query attends to: blocks are added from here.
    pub fn first_block(&self) -> usize {
        self.start
    }

    /// Blocks `first..first + blocks.len()` (each [`SPLIT`] rows but the
    /// cache's last), following the previous call's (the first call's
    /// `first` is [`GqaAccum::first_block`]).
    pub fn add(&mut self, first: usize, blocks: &[&[f32]]) {
        assert_eq!(first, self.next, "blocks are added in order");
        let w = self.sh.width();
        assert_eq!(
            self.rows,
            first * SPLIT,
            "only the cache's last block is short"
        );
        for (i, b) in blocks.iter().enumerate() {
            let last = i + 1 == blocks.len();
            assert!(
                last || b.len() == SPLIT * w,
                "every block but the last holds SPLIT rows"
            );
        }
        self.rows += blocks.iter().map(|b| b.len()).sum::<usize>() / w.max(1);
        self.next += blocks.len();
        let sh = &self.sh;
        let seen = |q: &GqaQuery<'_>| {
            sh.seen(q.n)
                .filter(move |&(k, _, _)| k >= first && k < first + blocks.len())
        };
        if self.queries.len() == 1 {
            let q = &self.queries[0];
            let all: Vec<(usize, usize, usize)> = seen(q).collect();
            let parts: Vec<Partial> = all
                .par_iter()
                .map(|&(k, a, b)| split_partial(sh, blocks, q, k - first, a, b))
                .collect();
            self.merged[0].add_all(&parts);
            return;
        }
        self.merged
            .par_iter_mut()
            .zip(self.queries.par_iter())
            .for_each(|(m, q)| {
                for (k, a, b) in seen(q) {
                    m.add(&split_partial(sh, blocks, q, k - first, a, b));
                }
            });
    }

    /// Every query's output `[T, heads, head_dim]`.
    pub fn finish(self, out: &mut [f32]) {
        let per = self.sh.heads * self.sh.head_dim;
        assert_eq!(
            out.len(),
            self.queries.len() * per,
            "out is [T, heads, head_dim]"
        );
        let sink = self.sinks.map(|s| sink_partial(s, self.sh.head_dim));
        for (q, (mut m, o)) in self
            .queries
            .iter()
            .zip(self.merged.into_iter().zip(out.chunks_exact_mut(per)))
        {
            assert!(q.n <= self.rows, "a query sees 1..=cached rows");
            if let Some(p) = &sink {
                m.add(p);
            }
            m.finish(o);
        }
    }
}

/// The twin that defines the order: one query at a time, splits in turn,
/// the sink last, on the calling thread, compiled for the baseline
/// instruction set.
pub fn gqa_attend_scalar(
    sh: &GqaShape,
    blocks: &[&[f32]],
    queries: &[GqaQuery<'_>],
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    check(sh, blocks, queries, out);
    let per = sh.heads * sh.head_dim;
    for (q, o) in queries.iter().zip(out.chunks_exact_mut(per)) {
        let mut merged = Merged::new(sh.heads, sh.head_dim);
        for (k, a, b) in sh.seen(q.n) {
            merged.add(&split_partial_impl(sh, blocks, q, k, a, b));
        }
        if let Some(s) = sinks {
            merged.add(&sink_partial(s, sh.head_dim));
        }
        merged.finish(o);
    }
}
