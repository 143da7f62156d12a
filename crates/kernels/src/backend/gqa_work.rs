//! A grouped-query attention layer (Qwen3-MoE, GPT-OSS) from its normed
//! rows to its output as one backend call ([`super::Backend::gqa_attend`]),
//! so a device needs one round trip a layer before its experts' choice:
//! the q, k, v products with their biases, the per-head q/k RMSNorms, the
//! rotary step, the new `[K | V]` rows into each sequence's cache, the
//! attention ([`crate::gqa`], its window and sinks) and `o_proj` with its
//! bias. [`gqa_work_cpu`] is the order a device repeats; it is the model's
//! own host path, step for step.

use super::mla_proj::{DEVICE_MAX_NORM, blocks_with, rotate_heads};
use super::{MatRef, MlaSeqWork};
use crate::attention::SPLIT;
use crate::gqa::{GqaAccum, GqaQuery, GqaShape};
use crate::ops::rms_norm_rows;

/// A product with its optional bias: `x Wᵀ (+ b)`, the bias added to each
/// rounded product.
#[derive(Clone, Copy)]
pub struct Biased<'a> {
    pub w: MatRef<'a>,
    pub bias: Option<&'a [f32]>,
}

impl Biased<'_> {
    /// `x Wᵀ (+ b)` over `t` rows on the CPU.
    pub fn cpu(&self, x: &[f32], t: usize) -> Vec<f32> {
        let mut y = vec![0f32; t * self.w.rows()];
        self.w.cpu(x, t, &mut y);
        if let Some(b) = self.bias {
            for row in y.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(a, c)| *a += c);
            }
        }
        y
    }

    fn fits(&self, rows: usize, cols: usize) -> bool {
        self.w.rows() == rows && self.w.cols() == cols && self.bias.is_none_or(|b| b.len() == rows)
    }
}

/// One GQA layer's step for several sequences, from the normed rows `x [T,
/// D]`: `q, k, v` = `qkv` (biased products), each head of q and k
/// RMSNormed with `qk_norm`'s weights (`[head_dim]` each) when given, both
/// rotated by their row's angles (`cos`, `sin` `[T, head_dim/2]`,
/// rotate-half pairs, the whole head); each sequence's new rows `[K | V]`
/// join its cache (its `blocks` hold the rows before the step; its
/// queries are the step's rows `queries`, `ns[i]` = rows query i sees,
/// exactly its own and all before) and are written to `rows_out [T, 2·kv
/// heads·head_dim]`; the attention's context `[T, heads·head_dim]`
/// ([`crate::gqa::gqa_attend_scalar`]: `shape`'s window, `sinks`) through
/// `o_proj` gives `out [T, D]`.
pub struct GqaWork<'a> {
    pub shape: GqaShape,
    pub seqs: &'a [MlaSeqWork<'a>],
    pub ns: &'a [usize],
    pub x: &'a [f32],
    pub qkv: [Biased<'a>; 3],
    /// The q and k norms' weights and their epsilon.
    pub qk_norm: Option<(&'a [f32], &'a [f32], f32)>,
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub sinks: Option<&'a [f32]>,
    pub o_proj: Biased<'a>,
    pub out: &'a mut [f32],
    pub rows_out: &'a mut [f32],
    /// The rest of the layer up to its experts' choice, from `out`
    /// ([`super::Then`]); a backend that takes it sets its `done`.
    pub then: Option<super::Then<'a>>,
}

impl GqaWork<'_> {
    /// A sequence's rows before the step and after it (its blocks start
    /// at block `first` of its cache).
    pub fn seq_rows(&self, s: &MlaSeqWork<'_>) -> (usize, usize) {
        let w = self.shape.width().max(1);
        let past = s.first * SPLIT + s.blocks.iter().map(|b| b.len() / w).sum::<usize>();
        (past, past + s.queries.len())
    }

    /// Whether the work is what a device's kernels (`gqa.cu` and the
    /// products) take: every shape and length as above, the sequences
    /// covering the queries in order with their blocks whole (all but the
    /// last [`SPLIT`] rows, the kept ones full), a head within the kernels'
    /// staging (`gqa.cu`'s `GQA_HEAD_MAX`), a window of at least one row
    /// reaching no block before the sequence's `first`, sizes within `i32`.
    pub fn fits_device_kernel(&self) -> bool {
        let sh = &self.shape;
        let (h, kvh, hd, t) = (sh.heads, sh.kv_heads, sh.head_dim, self.ns.len());
        let (qw, kvw, w) = (h * hd, kvh * hd, sh.width());
        let dm = self.qkv[0].w.cols();
        let small = |v: usize| i32::try_from(v).is_ok();
        let dout = self.o_proj.w.rows();
        let [q, k, v] = &self.qkv;
        let shapes = kvh > 0
            && h > 0
            && h.is_multiple_of(kvh)
            && h <= 65535
            && (2..=DEVICE_MAX_NORM.min(1024)).contains(&hd)
            && hd.is_multiple_of(2)
            && sh.window != Some(0)
            && dm > 0
            && q.fits(qw, dm)
            && k.fits(kvw, dm)
            && v.fits(kvw, dm)
            && self.o_proj.fits(dout, qw)
            && dout > 0
            && self
                .qk_norm
                .is_none_or(|(a, b, _)| a.len() == hd && b.len() == hd)
            && self.sinks.is_none_or(|s| s.len() == h);
        let lens = t > 0
            && self.x.len() == t * dm
            && self.cos.len() == t * hd / 2
            && self.sin.len() == t * hd / 2
            && self.out.len() == t * dout
            && self.rows_out.len() == t * w
            && t.checked_mul(dm.max(qw).max(w).max(dout))
                .is_some_and(small)
            && self
                .max_splits()
                .checked_mul(h)
                .and_then(|v| v.checked_mul(SPLIT + hd + 2))
                .and_then(|v| v.checked_mul(t))
                .is_some_and(small);
        shapes && lens && self.seqs_fit(w)
    }

    /// The splits the longest query reads.
    pub fn max_splits(&self) -> usize {
        self.ns.iter().copied().max().unwrap_or(0).div_ceil(SPLIT)
    }

    fn seqs_fit(&self, w: usize) -> bool {
        let mut next = 0;
        let all = self.seqs.iter().all(|s| {
            let ok = s.queries.start == next
                && s.queries.start <= s.queries.end
                && s.queries.end <= self.ns.len()
                && s.stable <= s.blocks.len()
                && s.blocks[..s.stable].iter().all(|b| b.len() == SPLIT * w);
            next = s.queries.end;
            let Some((last, full)) = s.blocks.split_last() else {
                return ok && self.seen(s, w);
            };
            ok && full.iter().all(|b| b.len() == SPLIT * w)
                && !last.is_empty()
                && last.len() % w == 0
                && last.len() <= SPLIT * w
                && self.seen(s, w)
        });
        all && next == self.ns.len()
    }

    /// Query k of `s` sees its cache's rows before the step and the new
    /// ones up to its own.
    fn seen(&self, s: &MlaSeqWork<'_>, _w: usize) -> bool {
        let (past, rows) = self.seq_rows(s);
        let from = |n: usize| self.shape.first_row(n) / SPLIT;
        i32::try_from(rows).is_ok()
            && self.ns[s.queries.clone()]
                .iter()
                .enumerate()
                .all(|(k, &n)| n == past + k + 1 && from(n) >= s.first)
    }
}

/// The step's q (`[T, heads·hd]`) and new rows (`[T, 2·kv_heads·hd]`) on the
/// CPU: the biased products, the heads' norms, the rotary step.
pub fn gqa_rows_cpu(work: &GqaWork<'_>) -> (Vec<f32>, Vec<f32>) {
    let sh = &work.shape;
    let (hd, t) = (sh.head_dim, work.ns.len());
    let [mut q, mut k, v] = work.qkv.map(|p| p.cpu(work.x, t));
    if let Some((qn, kn, eps)) = work.qk_norm {
        rms_norm_rows(&mut q, hd, qn, eps);
        rms_norm_rows(&mut k, hd, kn, eps);
    }
    let kvw = sh.kv_heads * hd;
    let half = hd / 2;
    let mut rows = Vec::with_capacity(t * 2 * kvw);
    for r in 0..t {
        let (c, s) = (&work.cos[r * half..][..half], &work.sin[r * half..][..half]);
        rotate_heads(
            &mut q[r * sh.heads * hd..][..sh.heads * hd],
            hd,
            c,
            s,
            false,
        );
        rotate_heads(&mut k[r * kvw..][..kvw], hd, c, s, false);
        rows.extend_from_slice(&k[r * kvw..][..kvw]);
        rows.extend_from_slice(&v[r * kvw..][..kvw]);
    }
    (q, rows)
}

/// [`GqaWork`] on the CPU, step by step — the twin a device must match
/// (its `then` is the caller's: [`super::then_cpu`] from `out`); the work
/// must fit ([`GqaWork::fits_device_kernel`]).
pub fn gqa_work_cpu(work: &mut GqaWork<'_>) {
    let sh = work.shape;
    let (qw, w, t) = (sh.heads * sh.head_dim, sh.width(), work.ns.len());
    let (q, rows) = gqa_rows_cpu(work);
    work.rows_out.copy_from_slice(&rows);
    let mut ctx = vec![0f32; t * qw];
    for s in work.seqs {
        let (kept, owned) =
            blocks_with(&s.blocks, &rows[s.queries.start * w..s.queries.end * w], w);
        let blocks: Vec<&[f32]> = kept
            .into_iter()
            .chain(owned.iter().map(Vec::as_slice))
            .collect();
        let queries: Vec<GqaQuery<'_>> = s
            .queries
            .clone()
            .map(|i| GqaQuery {
                q: &q[i * qw..(i + 1) * qw],
                n: work.ns[i],
            })
            .collect();
        let out = &mut ctx[s.queries.start * qw..s.queries.end * qw];
        // The host path's own accumulation (the scalar twin's bits), from
        // the first block any query sees.
        let mut acc = GqaAccum::new(sh, &queries);
        if let Some(sinks) = work.sinks {
            acc = acc.with_sinks(sinks);
        }
        let from = acc.first_block();
        acc.add(from, &blocks[from - s.first..]);
        acc.finish(out);
    }
    work.out.copy_from_slice(&work.o_proj.cpu(&ctx, t));
}
