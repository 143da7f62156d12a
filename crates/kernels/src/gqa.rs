//! Grouped-query attention over a key/value cache, every head of a query
//! in one pass over the rows.
//!
//! The cache holds per token one row `[K (kv_heads·head_dim) | V
//! (kv_heads·head_dim)]`. A query brings `q [heads, head_dim]`; query head
//! `h` reads key/value head `h / (heads / kv_heads)`. For each head
//!
//! ```text
//! s_r = (k_r[g] · q[h]) · scale
//! out[h] = Σ_r softmax(s)_r · v_r[g]
//! ```
//!
//! # Reduction order (fixed by the shapes and the row index only)
//!
//! The same as the latent-cache kernel ([`crate::attention`]): dot products
//! in [`dot_lanes`] order; rows cut into splits of [`SPLIT`] rows at
//! absolute offsets, read in place from blocks of `SPLIT` rows; within a
//! split the scores, the split's max, then in row order `p = exp(s − m)`,
//! `l += p`, `c += p · v`; splits merged in order with the online-softmax
//! rule. A query's result depends only on its own inputs and `n`.
//! [`gqa_attend_scalar`] is the twin that defines this order; [`gqa_attend`]
//! must equal it bit for bit.

use rayon::prelude::*;

use crate::attention::{Merged, Partial, SPLIT, dot_lanes, splits};

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
}

impl GqaShape {
    /// Floats per cached row: keys then values.
    pub fn width(&self) -> usize {
        2 * self.kv_heads * self.head_dim
    }
}

/// One query: `q [heads, head_dim]`, attending rows `0..n`.
#[derive(Debug, Clone, Copy)]
pub struct GqaQuery<'a> {
    pub q: &'a [f32],
    pub n: usize,
}

/// The partial of split `k` (rows `k·SPLIT..` of which `len` are seen) for
/// query `q`; compiled for AVX2 + FMA when the process's kernel set allows
/// it (the dot products are fused multiply-adds in every build, the
/// context update plain multiplies and adds: same bits everywhere).
fn split_partial(
    sh: &GqaShape,
    blocks: &[&[f32]],
    q: &GqaQuery<'_>,
    k: usize,
    len: usize,
) -> Partial {
    #[cfg(target_arch = "x86_64")]
    if matches!(crate::kernels().isa, crate::Isa::Avx2 | crate::Isa::Avx512) {
        // SAFETY: the kernel table is AVX2 or AVX-512 only on CPUs that report AVX2 and FMA.
        return unsafe { split_partial_avx2(sh, blocks, q, k, len) };
    }
    split_partial_impl(sh, blocks, q, k, len)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn split_partial_avx2(
    sh: &GqaShape,
    blocks: &[&[f32]],
    q: &GqaQuery<'_>,
    k: usize,
    len: usize,
) -> Partial {
    split_partial_impl(sh, blocks, q, k, len)
}

#[inline(always)]
fn split_partial_impl(
    sh: &GqaShape,
    blocks: &[&[f32]],
    q: &GqaQuery<'_>,
    k: usize,
    len: usize,
) -> Partial {
    let (h, d, w) = (sh.heads, sh.head_dim, sh.width());
    let kvw = sh.kv_heads * d;
    let group = h / sh.kv_heads;
    let rows = &blocks[k][..len * w];
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
            let p = (s[hh * len + j] - m[hh]).exp();
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
/// cache rows in blocks of [`SPLIT`]. Queries run in parallel; a single
/// query's splits too.
pub fn gqa_attend(sh: &GqaShape, blocks: &[&[f32]], queries: &[GqaQuery<'_>], out: &mut [f32]) {
    check(sh, blocks, queries, out);
    let mut acc = GqaAccum::new(*sh, queries);
    for (i, win) in blocks.chunks(WINDOW).enumerate() {
        acc.add(i * WINDOW, win);
    }
    acc.finish(out);
}

/// [`gqa_attend`] over a cache handed in windows of consecutive blocks (a
/// cache read back from disk a window at a time): `add` them in order,
/// then `finish`. The same bits however the blocks are windowed.
pub struct GqaAccum<'q> {
    sh: GqaShape,
    queries: &'q [GqaQuery<'q>],
    merged: Vec<Merged>,
    next: usize,
    rows: usize,
}

impl<'q> GqaAccum<'q> {
    pub fn new(sh: GqaShape, queries: &'q [GqaQuery<'q>]) -> Self {
        assert!(
            sh.kv_heads >= 1 && sh.heads.is_multiple_of(sh.kv_heads),
            "kv_heads divides heads"
        );
        for q in queries {
            assert!(q.n >= 1, "a query sees at least one row");
            assert_eq!(q.q.len(), sh.heads * sh.head_dim);
        }
        GqaAccum {
            merged: queries
                .iter()
                .map(|_| Merged::new(sh.heads, sh.head_dim))
                .collect(),
            sh,
            queries,
            next: 0,
            rows: 0,
        }
    }

    /// Blocks `first..first + blocks.len()` (each [`SPLIT`] rows but the
    /// cache's last), following the previous call's.
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
            splits(q.n).filter(move |&(k, _)| k >= first && k < first + blocks.len())
        };
        if self.queries.len() == 1 {
            let q = &self.queries[0];
            let all: Vec<(usize, usize)> = seen(q).collect();
            let parts: Vec<Partial> = all
                .par_iter()
                .map(|&(k, len)| split_partial(sh, blocks, q, k - first, len))
                .collect();
            self.merged[0].add_all(&parts);
            return;
        }
        self.merged
            .par_iter_mut()
            .zip(self.queries.par_iter())
            .for_each(|(m, q)| {
                for (k, len) in seen(q) {
                    m.add(&split_partial(sh, blocks, q, k - first, len));
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
        for (q, (m, o)) in self
            .queries
            .iter()
            .zip(self.merged.into_iter().zip(out.chunks_exact_mut(per)))
        {
            assert!(q.n <= self.rows, "a query sees 1..=cached rows");
            m.finish(o);
        }
    }
}

/// The twin that defines the order: one query at a time, splits in turn,
/// on the calling thread, compiled for the baseline instruction set.
pub fn gqa_attend_scalar(
    sh: &GqaShape,
    blocks: &[&[f32]],
    queries: &[GqaQuery<'_>],
    out: &mut [f32],
) {
    check(sh, blocks, queries, out);
    let per = sh.heads * sh.head_dim;
    for (q, o) in queries.iter().zip(out.chunks_exact_mut(per)) {
        let mut merged = Merged::new(sh.heads, sh.head_dim);
        for (k, len) in splits(q.n) {
            merged.add(&split_partial_impl(sh, blocks, q, k, len));
        }
        merged.finish(o);
    }
}
