//! Attention over a compressed latent cache (absorbed MLA), every head in
//! one pass over the rows.
//!
//! The cache holds per token one row `[lat (lora) | kr (rope)]`. A query
//! brings, per head, its absorbed part `q_lat[h]` (`lora`) and its shared-key
//! part `q_rope[h]` (`rope`). For each head
//!
//! ```text
//! s_r = (lat_r · q_lat[h] + kr_r · q_rope[h]) · scale
//! ctx[h] = Σ_r softmax(s)_r · lat_r
//! ```
//!
//! # Reduction order (fixed by the shapes and the row index only)
//!
//! * Dot products use [`dot_lanes`]: 8 interleaved partial sums, folded
//!   pairwise, then the tail in order.
//! * The rows `0..n` are cut into splits of [`SPLIT`] rows at absolute
//!   offsets (`[0, 256)`, `[256, 512)`, …). The cache is given as blocks of
//!   exactly `SPLIT` rows (the last may be shorter), so a split is a block:
//!   a paged cache is read in place. Within a split: scores, the
//!   split's max `m`, then in row order `p = exp(s − m)`, `l += p`,
//!   `c += p · lat` (element-wise).
//! * Splits are merged in order with the online-softmax rule
//!   `M' = max(M, m)`, `L = L·e^(M−M') + l·e^(m−M')`,
//!   `C = C·e^(M−M') + c·e^(m−M')`; finally `ctx = C / L`.
//!
//! So a query's result depends only on its own inputs and `n`: not on how
//! many queries share the call (prefill chunk, decode, draft verification),
//! which other sequences are batched, or the thread count (splits may be
//! computed on any thread; the merge is always in order).
//! [`mla_attend_scalar`] is the twin that defines this order, one query,
//! one head-set and one split at a time; [`mla_attend`] must equal it bit
//! for bit.

use rayon::prelude::*;

/// Rows per split of the context (fixed: part of the reduction order).
pub const SPLIT: usize = 256;
/// Splits computed at a time for one query (bounds scratch memory).
const WINDOW: usize = 64;

/// `Σ a_i b_i` in the fixed lane order.
#[inline(always)]
pub fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let body = n / 8 * 8;
    for (ca, cb) in a[..body].chunks_exact(8).zip(b[..body].chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for i in body..n {
        s += a[i] * b[i];
    }
    s
}

/// The dimensions of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct MlaShape {
    pub heads: usize,
    pub lora: usize,
    pub rope: usize,
    /// Applied to every score.
    pub scale: f32,
}

impl MlaShape {
    pub fn width(&self) -> usize {
        self.lora + self.rope
    }
}

/// One query: `q_lat [H, lora]`, `q_rope [H, rope]`, attending rows `0..n`.
#[derive(Debug, Clone, Copy)]
pub struct MlaQuery<'a> {
    pub q_lat: &'a [f32],
    pub q_rope: &'a [f32],
    pub n: usize,
}

/// One split's softmax pieces for every head (shared with the GQA kernel).
pub(crate) struct Partial {
    pub(crate) m: Vec<f32>,
    pub(crate) l: Vec<f32>,
    /// `[H, dim]` (the value width: `lora` here, `head_dim` for GQA)
    pub(crate) c: Vec<f32>,
}

/// The partial of split `k` (rows `k·SPLIT..` of which `len` are seen) for
/// query `q`. The same arithmetic, compiled for AVX2 when the process's
/// kernel set allows it (lane-wise adds and multiplies, no fused
/// multiply-add, so every table gives the same bits).
fn split_partial(
    sh: &MlaShape,
    blocks: &[&[f32]],
    q: &MlaQuery<'_>,
    k: usize,
    len: usize,
) -> Partial {
    #[cfg(target_arch = "x86_64")]
    if matches!(crate::kernels().isa, crate::Isa::Avx2 | crate::Isa::Avx512) {
        // SAFETY: the kernel table is AVX2 or AVX-512 only on CPUs that report AVX2.
        return unsafe { split_partial_avx2(sh, blocks, q, k, len) };
    }
    split_partial_impl(sh, blocks, q, k, len)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn split_partial_avx2(
    sh: &MlaShape,
    blocks: &[&[f32]],
    q: &MlaQuery<'_>,
    k: usize,
    len: usize,
) -> Partial {
    split_partial_impl(sh, blocks, q, k, len)
}

#[inline(always)]
fn split_partial_impl(
    sh: &MlaShape,
    blocks: &[&[f32]],
    q: &MlaQuery<'_>,
    k: usize,
    len: usize,
) -> Partial {
    let (h, lora, rope, w) = (sh.heads, sh.lora, sh.rope, sh.width());
    let rows = &blocks[k][..len * w];
    let mut s = vec![0f32; h * len];
    let mut m = vec![f32::NEG_INFINITY; h];
    for (j, r) in rows.chunks_exact(w).enumerate() {
        let (lat, kr) = r.split_at(lora);
        for hh in 0..h {
            let ql = &q.q_lat[hh * lora..(hh + 1) * lora];
            let qr = &q.q_rope[hh * rope..(hh + 1) * rope];
            let v = (dot_lanes(lat, ql) + dot_lanes(kr, qr)) * sh.scale;
            s[hh * len + j] = v;
            m[hh] = m[hh].max(v);
        }
    }
    let mut l = vec![0f32; h];
    let mut c = vec![0f32; h * lora];
    for (j, r) in rows.chunks_exact(w).enumerate() {
        let lat = &r[..lora];
        for hh in 0..h {
            let p = (s[hh * len + j] - m[hh]).exp();
            l[hh] += p;
            for (cv, &x) in c[hh * lora..(hh + 1) * lora].iter_mut().zip(lat) {
                *cv += p * x;
            }
        }
    }
    Partial { m, l, c }
}

/// Running merge of splits, in order, for `heads` heads of `dim` values.
pub(crate) struct Merged {
    m: Vec<f32>,
    l: Vec<f32>,
    c: Vec<f32>,
    dim: usize,
}

impl Merged {
    pub(crate) fn new(heads: usize, dim: usize) -> Self {
        Merged {
            m: vec![f32::NEG_INFINITY; heads],
            l: vec![0.0; heads],
            c: vec![0.0; heads * dim],
            dim,
        }
    }

    pub(crate) fn add(&mut self, p: &Partial) {
        let dim = self.dim;
        for hh in 0..self.m.len() {
            let m = self.m[hh].max(p.m[hh]);
            // The first split: the running state is empty (factor 0, never NaN).
            let a = if self.m[hh] == f32::NEG_INFINITY {
                0.0
            } else {
                (self.m[hh] - m).exp()
            };
            let b = (p.m[hh] - m).exp();
            self.l[hh] = self.l[hh] * a + p.l[hh] * b;
            let dst = &mut self.c[hh * dim..(hh + 1) * dim];
            for (cv, &x) in dst.iter_mut().zip(&p.c[hh * dim..(hh + 1) * dim]) {
                *cv = *cv * a + x * b;
            }
            self.m[hh] = m;
        }
    }

    pub(crate) fn finish(self, out: &mut [f32]) {
        let dim = self.dim;
        for hh in 0..self.m.len() {
            let inv = 1.0 / self.l[hh];
            for (o, &cv) in out[hh * dim..(hh + 1) * dim]
                .iter_mut()
                .zip(&self.c[hh * dim..(hh + 1) * dim])
            {
                *o = cv * inv;
            }
        }
    }
}

/// (split, rows of it seen) for a query seeing `n` rows.
pub(crate) fn splits(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n.div_ceil(SPLIT)).map(move |k| (k, ((k + 1) * SPLIT).min(n) - k * SPLIT))
}

fn check(sh: &MlaShape, blocks: &[&[f32]], queries: &[MlaQuery<'_>], out: &[f32]) {
    let w = sh.width();
    assert_eq!(
        out.len(),
        queries.len() * sh.heads * sh.lora,
        "out is [T, H, lora]"
    );
    let full = blocks.iter().rev().skip(1).all(|b| b.len() == SPLIT * w);
    assert!(full, "every block but the last holds SPLIT rows");
    let rows = blocks.iter().map(|b| b.len()).sum::<usize>() / w.max(1);
    for q in queries {
        assert!(q.n >= 1 && q.n <= rows, "a query sees 1..=cached rows");
        assert_eq!(q.q_lat.len(), sh.heads * sh.lora);
        assert_eq!(q.q_rope.len(), sh.heads * sh.rope);
    }
}

/// Every query's context `[T, H, lora]` into `out`; `blocks` are the
/// cache rows in blocks of [`SPLIT`]. Queries run in
/// parallel; a single query's splits too.
pub fn mla_attend(sh: &MlaShape, blocks: &[&[f32]], queries: &[MlaQuery<'_>], out: &mut [f32]) {
    check(sh, blocks, queries, out);
    let per = sh.heads * sh.lora;
    if queries.len() == 1 {
        let q = &queries[0];
        let all: Vec<(usize, usize)> = splits(q.n).collect();
        let mut merged = Merged::new(sh.heads, sh.lora);
        for win in all.chunks(WINDOW) {
            let parts: Vec<Partial> = win
                .par_iter()
                .map(|&(k, len)| split_partial(sh, blocks, q, k, len))
                .collect();
            for p in &parts {
                merged.add(p);
            }
        }
        merged.finish(out);
        return;
    }
    out.par_chunks_mut(per)
        .zip(queries.par_iter())
        .for_each(|(o, q)| {
            let mut merged = Merged::new(sh.heads, sh.lora);
            for (k, len) in splits(q.n) {
                merged.add(&split_partial(sh, blocks, q, k, len));
            }
            merged.finish(o);
        });
}

/// The twin that defines the order: one query at a time, splits in turn,
/// on the calling thread, compiled for the baseline instruction set.
pub fn mla_attend_scalar(
    sh: &MlaShape,
    blocks: &[&[f32]],
    queries: &[MlaQuery<'_>],
    out: &mut [f32],
) {
    check(sh, blocks, queries, out);
    let per = sh.heads * sh.lora;
    for (q, o) in queries.iter().zip(out.chunks_exact_mut(per)) {
        let mut merged = Merged::new(sh.heads, sh.lora);
        for (k, len) in splits(q.n) {
            merged.add(&split_partial_impl(sh, blocks, q, k, len));
        }
        merged.finish(o);
    }
}
