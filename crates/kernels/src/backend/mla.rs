//! One MLA layer's absorbed attention for a step's sequences as one
//! backend call ([`super::Backend::mla_attend`]), its shape check, and its
//! CPU twin.

use std::ops::Range;

use super::MatRef;
use super::mla_proj::{MlaProj, blocks_with, mla_proj_cpu};
use crate::attention::{MlaQuery, MlaShape, SPLIT, mla_attend};
use crate::ops::sigmoid_fixed;

/// One sequence's cache in an [`MlaWork`]: its row blocks as
/// [`crate::attention::mla_attend`] takes them (every block but the last
/// [`SPLIT`] rows), of which the first `stable` keep their bytes at their
/// address until their owner calls [`super::forget`] on them (a device may
/// keep copies of those; the others change between calls), and its
/// queries (a range of the work's). With [`MlaWork::proj`] the blocks
/// hold only the rows cached before the step (there may be none), and the
/// step's new rows follow them, one a query. `first` is the cache's index
/// of `blocks[0]`: 0, or for a sliding window ([`super::GqaWork`]) the
/// first block any query of the step sees (earlier ones are left out).
pub struct MlaSeqWork<'a> {
    pub blocks: Vec<&'a [f32]>,
    pub stable: usize,
    pub queries: Range<usize>,
    pub first: usize,
}

/// One MLA layer's attention for a step's sequences in absorbed form
/// ([`super::Backend::mla_attend`]): the queries' no-position parts
/// `q_nope [H, T, dn]` through `uk_t`'s H row blocks (as
/// [`super::Backend::matmul_groups`]) give the latent queries `[H, T,
/// lora]`; each query attends, with its position part `q_rope [T, H,
/// rope]`, to the first `ns[i]` rows of its sequence's cache
/// ([`crate::attention::mla_attend`]); the context `[H, T, lora]` through
/// `uv`'s H row blocks gives `out [H, T, dv]` — or, with `o`, the values
/// by position through [`MlaOut`] give `out [T, o_proj.rows]`. Each step
/// has the bits of its own CPU kernel ([`mla_work_cpu`]). With `proj`, the
/// queries, the gate and the step's new cache rows come from the layer's
/// rows in the same call ([`MlaProj`]; `q_nope`, `q_rope` are then empty
/// and `o`'s gate is `None`).
pub struct MlaWork<'a> {
    pub shape: MlaShape,
    pub seqs: &'a [MlaSeqWork<'a>],
    pub ns: &'a [usize],
    pub q_nope: &'a [f32],
    pub q_rope: &'a [f32],
    pub uk_t: MatRef<'a>,
    pub uv: MatRef<'a>,
    pub o: Option<MlaOut<'a>>,
    pub out: &'a mut [f32],
    /// With `o`: the rest of the layer up to its experts' choice, from
    /// `out` ([`super::Then`]); a backend that takes it sets its `done`.
    pub then: Option<super::Then<'a>>,
    /// The layer's projections, computed first in the same call.
    pub proj: Option<MlaProj<'a>>,
}

/// What follows an MLA layer's values in the same call: each position's
/// values `[T, H·dv]` times `σ(gate)` ([`crate::ops::sigmoid_fixed`]; with
/// `gate`, `[T, H·dv]`), then `o_proj` (`[D, H·dv]`).
#[derive(Clone, Copy)]
pub struct MlaOut<'a> {
    pub gate: Option<&'a [f32]>,
    pub o_proj: MatRef<'a>,
}

impl MlaWork<'_> {
    /// The splits the longest query reads.
    pub fn max_splits(&self) -> usize {
        let n = self.ns.iter().copied().max().unwrap_or(0);
        n.div_ceil(SPLIT)
    }

    /// The partial-result values one query needs on a device (its
    /// splits' scores, maxima, sums and contexts); `None` past `usize`.
    pub fn scratch_per_query(&self) -> Option<usize> {
        let per_split = self.shape.heads.checked_mul(SPLIT + self.shape.lora + 2)?;
        self.max_splits().checked_mul(per_split)
    }

    /// Whether the work is what the device kernels (`mla.cu` and the
    /// grouped products) take: queries covered by the sequences in order,
    /// each seeing 1 to all of its cache's rows (with `proj`, exactly the
    /// rows up to its own), every block but each cache's last full, the
    /// products' shapes and every length as the shape says, at most 65535
    /// heads, and every size (scratch included) within the kernels' `int`s.
    pub fn fits_device_kernel(&self) -> bool {
        let sh = &self.shape;
        let (h, w, t) = (sh.heads, sh.width(), self.ns.len());
        let small = |v: usize| i32::try_from(v).is_ok();
        let dn = self.uk_t.cols();
        let dv = if h == 0 { 0 } else { self.uv.rows() / h };
        let scratch = self.scratch_per_query().and_then(|q| q.checked_mul(t));
        let widest = h
            .checked_mul(t)
            .and_then(|v| v.checked_mul(sh.lora.max(dn).max(dv)));
        let queries = match &self.proj {
            None => self.q_nope.len() == h * t * dn && self.q_rope.len() == t * h * sh.rope,
            Some(p) => {
                self.q_nope.is_empty()
                    && self.q_rope.is_empty()
                    && self.o.is_some_and(|o| o.gate.is_none())
                    && p.fits(sh, dn, h * dv, t)
            }
        };
        // Heads are a launch's grid y or z (at most 65535).
        t > 0
            && h > 0
            && h <= 65535
            && sh.lora > 0
            && self.seqs_fit(w)
            && self.uk_t.rows() == h * sh.lora
            && self.uv.cols() == sh.lora
            && dv > 0
            && self.uv.rows() == h * dv
            && queries
            && self.o_fits(h * dv)
            && widest.is_some_and(small)
            && scratch.is_some_and(small)
    }

    /// `out`'s length, and with [`MlaOut`] its gate's and projection's
    /// shapes, for values `hdv = H·dv` wide.
    fn o_fits(&self, hdv: usize) -> bool {
        let t = self.ns.len();
        let small = |v: usize| i32::try_from(v).is_ok();
        match &self.o {
            None => self.out.len() == t * hdv,
            Some(o) => {
                let rows = o.o_proj.rows();
                o.o_proj.cols() == hdv
                    && o.gate.is_none_or(|g| g.len() == t * hdv)
                    && self.out.len() == t * rows
                    && rows.checked_mul(t).is_some_and(small)
            }
        }
    }

    /// A sequence's rows before the step (those in its blocks) and after
    /// it (with [`MlaWork::proj`], one more a query; otherwise the same).
    pub fn seq_rows(&self, s: &MlaSeqWork<'_>) -> (usize, usize) {
        let w = self.shape.width().max(1);
        let past = s.blocks.iter().map(|b| b.len() / w).sum::<usize>();
        let new = if self.proj.is_some() {
            s.queries.len()
        } else {
            0
        };
        (past, past + new)
    }

    /// The sequences cover the queries in order, each cache's blocks are
    /// whole rows of width `w` (all but its last full), and each query sees
    /// 1 to all of its cache's rows — with `proj`, the rows before the
    /// step and the new ones up to its own.
    fn seqs_fit(&self, w: usize) -> bool {
        let mut next = 0;
        let all = self.seqs.iter().all(|s| {
            let (full, last) = match s.blocks.split_last() {
                Some((last, full)) => (full, Some(last)),
                None => (&[][..], None),
            };
            let in_order = s.queries.start == next
                && s.queries.start <= s.queries.end
                && s.queries.end <= self.ns.len();
            next = s.queries.end;
            let shaped = full.iter().all(|b| b.len() == SPLIT * w)
                && last.is_none_or(|l| !l.is_empty() && l.len() % w == 0 && l.len() <= SPLIT * w)
                && (last.is_some() || self.proj.is_some())
                && s.stable <= s.blocks.len()
                && s.blocks[..s.stable].iter().all(|b| b.len() == SPLIT * w)
                && s.first == 0;
            if !(in_order && shaped) {
                return false;
            }
            let (past, rows) = self.seq_rows(s);
            let ns = &self.ns[s.queries.clone()];
            let seen = match self.proj {
                None => ns.iter().all(|&n| (1..=rows).contains(&n)),
                Some(_) => ns.iter().enumerate().all(|(k, &n)| n == past + k + 1),
            };
            i32::try_from(rows).is_ok() && seen
        });
        all && next == self.ns.len()
    }
}

/// `y [T, rows_g]` = row block `g` of `w` (of `groups`) applied to `x`:
/// the whole matrix's product, keeping the block's rows (every row's
/// result is its own on the CPU).
fn block_product(w: &MatRef<'_>, groups: usize, g: usize, x: &[f32], t: usize, y: &mut [f32]) {
    let (rows, rg) = (w.rows(), w.rows() / groups);
    let mut all = vec![0f32; t * rows];
    w.cpu(x, t, &mut all);
    for ti in 0..t {
        y[ti * rg..(ti + 1) * rg].copy_from_slice(&all[ti * rows + g * rg..][..rg]);
    }
}

/// [`MlaWork`] on the CPU, step by step — the twin a device must match:
/// `uk_t`'s row blocks each on its head's queries, each sequence's
/// attention ([`crate::attention::mla_attend`]), `uv`'s row blocks each on
/// its head's context. Writes `work.out`; the work must fit
/// ([`MlaWork::fits_device_kernel`]).
pub fn mla_work_cpu(work: &mut MlaWork<'_>) {
    if work.proj.is_some() {
        return projected_cpu(work);
    }
    let sh = work.shape;
    let (h, lora, rope, t) = (sh.heads, sh.lora, sh.rope, work.ns.len());
    let (dn, dv) = (work.uk_t.cols(), work.uv.rows() / h);
    let mut lat = vec![0f32; h * t * lora];
    for (g, y) in lat.chunks_mut(t * lora).enumerate() {
        block_product(&work.uk_t, h, g, &work.q_nope[g * t * dn..][..t * dn], t, y);
    }
    let mut ctx = vec![0f32; h * t * lora];
    for s in work.seqs {
        let by_query: Vec<Vec<f32>> = s
            .queries
            .clone()
            .map(|i| {
                (0..h)
                    .flat_map(|hh| &lat[(hh * t + i) * lora..][..lora])
                    .copied()
                    .collect()
            })
            .collect();
        let queries: Vec<MlaQuery<'_>> = s
            .queries
            .clone()
            .zip(&by_query)
            .map(|(i, q_lat)| MlaQuery {
                q_lat,
                q_rope: &work.q_rope[i * h * rope..][..h * rope],
                n: work.ns[i],
            })
            .collect();
        let mut out = vec![0f32; queries.len() * h * lora];
        mla_attend(&sh, &s.blocks, &queries, &mut out);
        for (k, i) in s.queries.clone().enumerate() {
            for hh in 0..h {
                ctx[(hh * t + i) * lora..][..lora]
                    .copy_from_slice(&out[(k * h + hh) * lora..][..lora]);
            }
        }
    }
    let mut vals = vec![0f32; h * t * dv];
    for (g, y) in vals.chunks_mut(t * dv).enumerate() {
        block_product(&work.uv, h, g, &ctx[g * t * lora..][..t * lora], t, y);
    }
    match &work.o {
        Some(o) => mla_out_cpu(o, &vals, (h, t, dv), work.out),
        None => work.out.copy_from_slice(&vals),
    }
}

/// [`mla_work_cpu`] of a work with `proj`: the projections
/// ([`mla_proj_cpu`], the new rows into `rows_out`), the new rows after
/// each sequence's cached ones ([`blocks_with`]), then the same work
/// without `proj`.
fn projected_cpu(work: &mut MlaWork<'_>) {
    let (t, w) = (work.ns.len(), work.shape.width());
    let Some(p) = work.proj.as_mut() else {
        return;
    };
    let pr = mla_proj_cpu(p, &work.shape, work.uk_t.cols(), t);
    p.rows_out.copy_from_slice(&pr.rows);
    let joined: Vec<_> = work
        .seqs
        .iter()
        .map(|s| {
            blocks_with(
                &s.blocks,
                &pr.rows[s.queries.start * w..s.queries.end * w],
                w,
            )
        })
        .collect();
    let seqs: Vec<MlaSeqWork<'_>> = joined
        .iter()
        .zip(work.seqs)
        .map(|((kept, owned), s)| MlaSeqWork {
            blocks: kept
                .iter()
                .copied()
                .chain(owned.iter().map(Vec::as_slice))
                .collect(),
            stable: 0,
            queries: s.queries.clone(),
            first: 0,
        })
        .collect();
    mla_work_cpu(&mut MlaWork {
        shape: work.shape,
        seqs: &seqs,
        ns: work.ns,
        q_nope: &pr.q_nope,
        q_rope: &pr.q_rope,
        uk_t: work.uk_t,
        uv: work.uv,
        o: work.o.map(|o| MlaOut {
            gate: pr.gate.as_deref(),
            ..o
        }),
        out: &mut *work.out,
        then: None,
        proj: None,
    });
}

/// [`MlaOut`] on the CPU: the values `vals [H, T, dv]` by position, each
/// times `σ(gate)` (rounded once), through `o_proj` into `out`.
pub fn mla_out_cpu(
    o: &MlaOut<'_>,
    vals: &[f32],
    (h, t, dv): (usize, usize, usize),
    out: &mut [f32],
) {
    let mut cat = vec![0f32; t * h * dv];
    for ti in 0..t {
        for hh in 0..h {
            cat[(ti * h + hh) * dv..][..dv].copy_from_slice(&vals[(hh * t + ti) * dv..][..dv]);
        }
    }
    if let Some(g) = o.gate {
        for (v, &g) in cat.iter_mut().zip(g) {
            *v *= sigmoid_fixed(g);
        }
    }
    o.o_proj.cpu(&cat, t, out);
}
