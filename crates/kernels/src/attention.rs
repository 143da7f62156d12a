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
//! * Dot products use [`dot_lanes`]: 8 interleaved partial sums of fused
//!   multiply-adds, folded pairwise, then the tail in order (fused too).
//! * The rows `0..n` are cut into splits of [`SPLIT`] rows at absolute
//!   offsets (`[0, 256)`, `[256, 512)`, …). The cache is given as blocks of
//!   exactly `SPLIT` rows (the last may be shorter), so a split is a block:
//!   a paged cache is read in place. Within a split: scores, the
//!   split's max `m`, then in row order `p = exp(s − m)` (the
//!   [`crate::expf`] definition, which has vector twins), `l += p`,
//!   `c = fma(p, lat, c)` (element-wise).
//! * Splits are merged in order with the online-softmax rule
//!   `M' = max(M, m)`, `L = L·e^(M−M') + l·e^(m−M')`,
//!   `C = C·e^(M−M') + c·e^(m−M')` (e^ by [`crate::expf::exp_fixed`], which a
//!   device repeats; the first split's factor for the empty state is 0);
//!   finally `ctx = C · (1/L)`.
//!
//! So a query's result depends only on its own inputs and `n`: not on how
//! many queries share the call (prefill chunk, decode, draft verification),
//! which other sequences are batched, or the thread count (splits may be
//! computed on any thread; the merge is always in order).
//! [`mla_attend_scalar`] is the twin that defines this order, one query,
//! one head-set and one split at a time; [`mla_attend`] must equal it bit
//! for bit.

use rayon::prelude::*;

use crate::expf::{exp_fixed, exp_softmax};

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
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for i in body..n {
        s = a[i].mul_add(b[i], s);
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

/// Buffers of finished splits, kept for the next ones: a long context
/// makes hundreds of 100 KB-scale partials per step, and handing them back
/// to the allocator each time costs page faults on every core.
static POOL: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());
/// Most buffers kept (a window's partials and scores, with room to spare).
const POOL_MAX: usize = 4 * WINDOW;

/// A zeroed buffer of `n` values, reused when one is free.
pub(crate) fn scratch(n: usize) -> Vec<f32> {
    let mut v = POOL
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop()
        .unwrap_or_default();
    v.clear();
    v.resize(n, 0.0);
    v
}

/// Returns a buffer from [`scratch`] for reuse.
pub(crate) fn recycle(v: Vec<f32>) {
    let mut p = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if p.len() < POOL_MAX {
        p.push(v);
    }
}

/// One split's softmax pieces for every head (shared with the GQA kernel).
pub(crate) struct Partial {
    pub(crate) m: Vec<f32>,
    pub(crate) l: Vec<f32>,
    /// `[H, dim]` (the value width: `lora` here, `head_dim` for GQA)
    pub(crate) c: Vec<f32>,
}

/// The partial of split `k` (rows `k·SPLIT..` of which `len` are seen) for
/// query `q`. The same arithmetic, compiled for AVX2 + FMA when the
/// process's kernel set allows it: every multiply-add is a fused
/// `mul_add` (one rounding) in every build, the baseline twin included
/// (where it is a library call), so every table gives the same bits.
fn split_partial(
    sh: &MlaShape,
    blocks: &[&[f32]],
    q: &MlaQuery<'_>,
    k: usize,
    len: usize,
) -> Partial {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::attention_x86::{Width, split_partial as x86};
        let wd = match crate::kernels().isa {
            crate::Isa::Avx512 => Some(Width::Avx512),
            crate::Isa::Avx2 => Some(Width::Avx2),
            _ => None,
        };
        if let Some(wd) = wd {
            // SAFETY: the kernel table is AVX2 (AVX-512) only on CPUs that
            // report AVX2 and FMA (AVX-512 F and BW).
            return unsafe { x86(wd, sh, blocks, q, k, len) };
        }
    }
    split_partial_tiled(sh, blocks, q, k, len)
}

/// Heads per tile of [`split_partial_tiled`]: their queries and context
/// rows stay in L1 while the split's rows stream past, and their dot
/// products run as independent chains.
pub(crate) const HEAD_TILE: usize = 8;

/// `[row · qs[k]]` for each `k`, each exactly as [`dot_lanes`] computes it
/// (8 lanes of fused multiply-adds, the same fold, the same tail), run
/// side by side so the chains overlap.
#[inline(always)]
fn dot_many<const N: usize>(row: &[f32], qs: [&[f32]; N]) -> [f32; N] {
    let n = row.len();
    let body = n / 8 * 8;
    let mut acc = [[0f32; 8]; N];
    for c in (0..body).step_by(8) {
        let r = &row[c..c + 8];
        for (a, q) in acc.iter_mut().zip(&qs) {
            let q = &q[c..c + 8];
            for l in 0..8 {
                a[l] = r[l].mul_add(q[l], a[l]);
            }
        }
    }
    let mut out = [0f32; N];
    for ((o, a), q) in out.iter_mut().zip(&acc).zip(&qs) {
        let mut s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        for i in body..n {
            s = row[i].mul_add(q[i], s);
        }
        *o = s;
    }
    out
}

/// [`split_partial_simple`]'s arithmetic, reordered only across
/// independent values: heads in tiles of [`HEAD_TILE`], each tile's dot
/// products computed together, each context row and score still summed
/// over the rows in row order. Bit-identical to the simple loop.
#[inline(always)]
fn split_partial_tiled(
    sh: &MlaShape,
    blocks: &[&[f32]],
    q: &MlaQuery<'_>,
    k: usize,
    len: usize,
) -> Partial {
    let (h, lora, rope, w) = (sh.heads, sh.lora, sh.rope, sh.width());
    let rows = &blocks[k][..len * w];
    let mut s = scratch(h * len);
    let mut m = vec![f32::NEG_INFINITY; h];
    let mut l = vec![0f32; h];
    let mut c = scratch(h * lora);
    let ql = |hh: usize| &q.q_lat[hh * lora..(hh + 1) * lora];
    let qr = |hh: usize| &q.q_rope[hh * rope..(hh + 1) * rope];
    let mut h0 = 0;
    while h0 < h {
        let full = h0 + HEAD_TILE <= h;
        let h1 = if full { h0 + HEAD_TILE } else { h0 + 1 };
        for (j, r) in rows.chunks_exact(w).enumerate() {
            let (lat, kr) = r.split_at(lora);
            let mut put = |hh: usize, a: f32, b: f32| {
                let v = (a + b) * sh.scale;
                s[hh * len + j] = v;
                m[hh] = m[hh].max(v);
            };
            if full {
                let a = dot_many(lat, std::array::from_fn::<_, HEAD_TILE, _>(|i| ql(h0 + i)));
                let b = dot_many(kr, std::array::from_fn::<_, HEAD_TILE, _>(|i| qr(h0 + i)));
                for i in 0..HEAD_TILE {
                    put(h0 + i, a[i], b[i]);
                }
            } else {
                put(h0, dot_lanes(lat, ql(h0)), dot_lanes(kr, qr(h0)));
            }
        }
        if full {
            tile_context(&s, &m, &mut l, &mut c, rows, (h0, len, lora, w));
        } else {
            for (j, r) in rows.chunks_exact(w).enumerate() {
                let lat = &r[..lora];
                let p = exp_softmax(s[h0 * len + j] - m[h0]);
                l[h0] += p;
                for (cv, &x) in c[h0 * lora..(h0 + 1) * lora].iter_mut().zip(lat) {
                    *cv = p.mul_add(x, *cv);
                }
            }
        }
        h0 = h1;
    }
    recycle(s);
    Partial { m, l, c }
}

/// One full head tile's softmax weights (row order, summed into `l`) and
/// context rows: eight columns at a time, the tile's eight accumulators
/// kept in registers while the split's rows stream past — each context
/// value still `fma(p_j, lat_j, ·)` over the rows in order from zero.
#[inline(always)]
fn tile_context(
    s: &[f32],
    m: &[f32],
    l: &mut [f32],
    c: &mut [f32],
    rows: &[f32],
    (h0, len, lora, w): (usize, usize, usize, usize),
) {
    let mut p = scratch(HEAD_TILE * len);
    for k in 0..HEAD_TILE {
        let hh = h0 + k;
        for j in 0..len {
            let v = exp_softmax(s[hh * len + j] - m[hh]);
            p[k * len + j] = v;
            l[hh] += v;
        }
    }
    let body = lora / 8 * 8;
    for cc in (0..body).step_by(8) {
        let mut acc = [[0f32; 8]; HEAD_TILE];
        for j in 0..len {
            let x = &rows[j * w + cc..j * w + cc + 8];
            for (k, a) in acc.iter_mut().enumerate() {
                let pk = p[k * len + j];
                for i in 0..8 {
                    a[i] = pk.mul_add(x[i], a[i]);
                }
            }
        }
        for (k, a) in acc.iter().enumerate() {
            c[(h0 + k) * lora + cc..][..8].copy_from_slice(a);
        }
    }
    for cc in body..lora {
        for k in 0..HEAD_TILE {
            let mut a = 0f32;
            for j in 0..len {
                a = p[k * len + j].mul_add(rows[j * w + cc], a);
            }
            c[(h0 + k) * lora + cc] = a;
        }
    }
    recycle(p);
}

/// The order-defining loop: per row, per head, the score; then per row,
/// per head, the softmax weight and the context update.
fn split_partial_simple(
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
            let p = exp_softmax(s[hh * len + j] - m[hh]);
            l[hh] += p;
            for (cv, &x) in c[hh * lora..(hh + 1) * lora].iter_mut().zip(lat) {
                *cv = p.mul_add(x, *cv);
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
                exp_fixed(self.m[hh] - m)
            };
            let b = exp_fixed(p.m[hh] - m);
            self.l[hh] = self.l[hh] * a + p.l[hh] * b;
            let dst = &mut self.c[hh * dim..(hh + 1) * dim];
            for (cv, &x) in dst.iter_mut().zip(&p.c[hh * dim..(hh + 1) * dim]) {
                *cv = *cv * a + x * b;
            }
            self.m[hh] = m;
        }
    }

    /// Merges `parts` in order, every head independently (heads run in
    /// parallel; each head's fold is the same sequence as [`Merged::add`]).
    pub(crate) fn add_all(&mut self, parts: &[Partial]) {
        let dim = self.dim;
        let min = (1usize << 14).div_ceil((parts.len() * dim).max(1)).max(1);
        self.c
            .par_chunks_mut(dim.max(1))
            .zip(self.m.par_iter_mut())
            .zip(self.l.par_iter_mut())
            .enumerate()
            .with_min_len(min)
            .for_each(|(hh, ((c, m), l))| {
                for p in parts {
                    let mn = m.max(p.m[hh]);
                    let a = if *m == f32::NEG_INFINITY {
                        0.0
                    } else {
                        exp_fixed(*m - mn)
                    };
                    let b = exp_fixed(p.m[hh] - mn);
                    *l = *l * a + p.l[hh] * b;
                    for (cv, &x) in c.iter_mut().zip(&p.c[hh * dim..(hh + 1) * dim]) {
                        *cv = *cv * a + x * b;
                    }
                    *m = mn;
                }
            });
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
        check_query(sh, q);
    }
}

fn check_query(sh: &MlaShape, q: &MlaQuery<'_>) {
    assert_eq!(q.q_lat.len(), sh.heads * sh.lora);
    assert_eq!(q.q_rope.len(), sh.heads * sh.rope);
}

/// Every query's context `[T, H, lora]` into `out`; `blocks` are the
/// cache rows in blocks of [`SPLIT`]. Queries run in
/// parallel; a single query's splits too.
pub fn mla_attend(sh: &MlaShape, blocks: &[&[f32]], queries: &[MlaQuery<'_>], out: &mut [f32]) {
    check(sh, blocks, queries, out);
    let mut acc = MlaAccum::new(*sh, queries);
    for (i, win) in blocks.chunks(WINDOW).enumerate() {
        acc.add(i * WINDOW, win);
    }
    acc.finish(out);
}

/// [`mla_attend`] over a cache handed in windows of consecutive blocks (a
/// cache read from disk a window at a time): `add` the blocks in order,
/// then `finish`. Same arithmetic and order, so the same bits, however the
/// blocks are windowed.
pub struct MlaAccum<'q> {
    sh: MlaShape,
    queries: &'q [MlaQuery<'q>],
    merged: Vec<Merged>,
    /// Blocks added so far.
    next: usize,
    /// Rows added so far.
    rows: usize,
}

impl<'q> MlaAccum<'q> {
    pub fn new(sh: MlaShape, queries: &'q [MlaQuery<'q>]) -> Self {
        for q in queries {
            assert!(q.n >= 1, "a query sees at least one row");
            check_query(&sh, q);
        }
        MlaAccum {
            merged: queries
                .iter()
                .map(|_| Merged::new(sh.heads, sh.lora))
                .collect(),
            sh,
            queries,
            next: 0,
            rows: 0,
        }
    }

    /// Blocks `first..first + blocks.len()` of the cache (each [`SPLIT`]
    /// rows but the cache's last); `first` must follow the previous call.
    pub fn add(&mut self, first: usize, blocks: &[&[f32]]) {
        assert_eq!(first, self.next, "blocks are added in order");
        let w = self.sh.width();
        assert_eq!(
            self.rows,
            first * SPLIT,
            "only the cache's last block is short"
        );
        for (i, b) in blocks.iter().enumerate() {
            assert!(b.len().is_multiple_of(w.max(1)), "a block holds whole rows");
            let last = i + 1 == blocks.len();
            assert!(
                last || b.len() == SPLIT * w,
                "every block but the last holds SPLIT rows"
            );
        }
        self.rows += blocks.iter().map(|b| b.len()).sum::<usize>() / w.max(1);
        self.next += blocks.len();
        let sh = &self.sh;
        // Splits of this window a query sees: (split, rows of it seen).
        let seen = |q: &MlaQuery<'_>| {
            splits(q.n).filter(move |&(k, _)| k >= first && k < first + blocks.len())
        };
        let local = |k: usize| k - first;
        if self.queries.len() == 1 {
            let q = &self.queries[0];
            let all: Vec<(usize, usize)> = seen(q).collect();
            let parts: Vec<Partial> = all
                .par_iter()
                .map(|&(k, len)| split_partial(sh, blocks, q, local(k), len))
                .collect();
            self.merged[0].add_all(&parts);
            parts.into_iter().for_each(|p| recycle(p.c));
            return;
        }
        self.merged
            .par_iter_mut()
            .zip(self.queries.par_iter())
            .for_each(|(m, q)| {
                for (k, len) in seen(q) {
                    let p = split_partial(sh, blocks, q, local(k), len);
                    m.add(&p);
                    recycle(p.c);
                }
            });
    }

    /// Every query's context `[T, H, lora]`.
    pub fn finish(self, out: &mut [f32]) {
        let per = self.sh.heads * self.sh.lora;
        assert_eq!(out.len(), self.queries.len() * per, "out is [T, H, lora]");
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
            merged.add(&split_partial_simple(sh, blocks, q, k, len));
        }
        merged.finish(o);
    }
}
