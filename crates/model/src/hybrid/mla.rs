//! NoPE MLA over T new positions, attending through the compressed latent
//! cache (docs/k3-model.md §5), from the layer's query and `kv_a` projections to
//! the layer's output: the per-head values by position, times σ(gate) when
//! the family has an output gate, through `o_proj`.
//!
//! Computation order ("absorbed"): the cache holds, per token, the
//! normalised latent `lat = RMSNorm(c[:kv_lora])` and the shared key part
//! `kr = c[kv_lora:]`. Per-head keys and values are never materialised:
//!
//! ```text
//! k_h·q_h  = (W_uk,h lat)·q_nope,h + kr·q_rope,h = lat·(W_uk,hᵀ q_nope,h) + kr·q_rope,h
//! Σ p v_h  = Σ_s p_s W_uv,h lat_s = W_uv,h (Σ_s p_s lat_s)
//! ```
//! where `W_uk,h` / `W_uv,h` are head h's `qk_nope` / `v_head_dim` row blocks
//! of `kv_b_proj`. So a step costs `H·N·(kv_lora + rope)` for scores plus
//! `H·N·kv_lora` for the context, and the cache is 576 floats/token for K3.
//! This equals the expanded form up to fp32 summation order; the golden
//! logits (computed in the expanded order) hold to ~1e-4.
//!
//! The Kimi line uses no rotary transform (`mla_use_nope`): the "rope"
//! slices are ordinary dimensions. DeepSeek-V3 / Kimi K2 pass an
//! [`MlaRope`]: each row's `kr` is rotated by its position's angles before
//! it is cached, and so is every head's `q_rope` (the decoupled RoPE of
//! the MLA paper); nothing else changes. Scores are scaled by
//! [`MlaDims::softmax_scale`] (`1/sqrt(qk_nope + qk_rope)`, times YaRN's
//! mscale² for DeepSeek).
//!
//! The attention itself is `fathom_kernels::attention::mla_attend`: every
//! head in one pass over the cache rows, in fixed 256-row splits merged in
//! order, so a position's result is the same in a prefill chunk, a decode
//! step or a verification pass, batched or not, at any thread count. A
//! backend that takes it (`Backend::mla_attend`, the same bits) gets the
//! whole absorbed step — `uk_t`, the attention over every sequence's
//! cache, `uv`, the gate and `o_proj` — in one call when every cache is
//! fp32 in RAM.

use fathom_kernels::attention::{MlaAccum, MlaQuery, MlaShape};
use fathom_kernels::backend::{
    self, MlaAngles, MlaOut, MlaProj, MlaQueryProj, MlaSeqWork, MlaWork, Then,
};
use fathom_kernels::ops::{rms_norm_rows, sigmoid_fixed};
use fathom_kernels::rope::Rope;

use crate::batch::{Path, Segment};
use crate::error::Result;
use crate::rotary::{Angles, deinterleave};

use super::MlaDims;
use super::state::MlaCache;
use crate::kv::{push_step_rows, step_blocks};
use crate::linear::Linear;

/// `kv_b_proj` (`[H·(dn + dv), lora]`, head-major) rearranged once at load
/// for the absorbed form: `uk_t` holds every head's `W_uk,hᵀ` (`[H·lora,
/// dn]`, so `q_lat = W_uk,hᵀ q_nope` is a matrix product) and `uv` every
/// head's `W_uv,h` (`[H·dv, lora]`). Same bytes and precision as stored
/// (an FP8 `kv_b_proj` stays FP8 where its heads are tile-aligned, as in
/// DeepSeek-V3's release; otherwise the same values are held in f32).
#[derive(Debug)]
pub struct AbsorbedKvB {
    pub uk_t: Linear,
    pub uv: Linear,
}

impl AbsorbedKvB {
    pub fn new(d: &MlaDims, kv_b: &Linear) -> Self {
        let (h, dn, dv) = (d.heads, d.qk_nope_head_dim, d.v_head_dim);
        let per = dn + dv;
        let uk_t = Linear::stack(
            (0..h)
                .map(|hh| kv_b.transposed_rows(hh * per..hh * per + dn))
                .collect(),
        );
        let uv = Linear::stack(
            (0..h)
                .map(|hh| kv_b.select_rows(hh * per + dn..(hh + 1) * per))
                .collect(),
        );
        AbsorbedKvB { uk_t, uv }
    }
}

/// The rotary step of decoupled-RoPE MLA (DeepSeek-V3): the shared key
/// part and every head's query rope part are rotated by their row's angles.
pub struct MlaRope<'a> {
    /// Heads `qk_rope_head_dim` wide.
    pub rope: &'a Rope,
    /// The angles of the step's stacked rows.
    pub angles: &'a Angles,
    /// The checkpoint pairs adjacent channels (`rope_interleave`): rows are
    /// de-interleaved before the rotate-half rotation.
    pub interleaved: bool,
}

impl MlaRope<'_> {
    /// Rotates row `r`'s heads `x` (`[heads, dr]`).
    fn apply(&self, r: usize, x: &mut [f32]) {
        if self.interleaved {
            deinterleave(x, self.rope.head_dim());
        }
        let (c, s) = self.angles.row(r);
        self.rope.rotate(x, c, s);
    }
}

/// MLA for the rows of several sequences (`segs[i]` are sequence i's rows,
/// `caches[i]` its cache, to which its rows are appended), from the queries
/// `q [N, H·dq]` and the raw `kv_a_proj_with_mqa` output `c [N, lora + dr]`,
/// with the rotary step if `rope` is given; the per-head values `[N, H·dv]`,
/// each times `σ(gate)` when a gate `[N, H·dv]` is given, through `o_proj`:
/// the layer's output `[N, D]`. A device that takes the attention takes
/// the gate and the projection in the same call ([`MlaOut`]; the same
/// operations, [`mla_out_cpu`]). With `then`, that device may also
/// compute the rest of the layer up to its experts' choice in the same
/// call: the flag says whether it did. The attention's time is the decode
/// profile's `full_core`.
///
/// [`mla_out_cpu`]: fathom_kernels::backend::mla_out_cpu
#[allow(clippy::too_many_arguments)]
pub fn mla_heads(
    path: Path,
    d: &MlaDims,
    kv_a_layernorm: &[f32],
    kv_b: &AbsorbedKvB,
    rope: Option<&MlaRope<'_>>,
    caches: &mut [&mut MlaCache],
    segs: &[Segment],
    (q, c): (&[f32], Vec<f32>),
    (gate, o_proj): (Option<&[f32]>, &Linear),
    then: Option<Then<'_>>,
) -> Result<(Vec<f32>, bool)> {
    let out = MlaOut {
        gate,
        o_proj: o_proj.as_mat(),
    };
    let v = crate::phase::timed(crate::phase::Phase::FullCore, || {
        heads(
            path,
            d,
            kv_a_layernorm,
            kv_b,
            rope,
            caches,
            segs,
            (q, c),
            (out, then),
        )
    })?;
    Ok(match v {
        MlaValues::Out(y, done) => (y, done),
        MlaValues::ByPosition(mut cat) => {
            if let Some(g) = gate {
                for (v, &g) in cat.iter_mut().zip(g) {
                    *v *= sigmoid_fixed(g);
                }
            }
            let n = segs.last().map_or(0, |s| s.end);
            (o_proj.forward(&cat, n), false)
        }
    })
}

/// An MLA layer's projections as [`mla_heads_projected`] takes them: the
/// queries' (made from the matrices by [`Linear::as_mat`]),
/// `kv_a_proj_with_mqa` with `kv_a_layernorm`, and the output gate's.
pub struct MlaLinears<'a> {
    pub q: MlaQueryProj<'a>,
    pub kv_a: &'a Linear,
    pub kv_a_layernorm: &'a [f32],
    pub gate: Option<&'a Linear>,
    pub o_proj: &'a Linear,
}

/// [`mla_heads`] from the layer's normed rows `x [N, D]` in one device
/// call: the projections ([`MlaProj`]), the attention, the gate, `o_proj`
/// and, with `then`, the rest of the layer up to its experts' choice; the
/// step's new rows come back with the output and join the caches after
/// it. `None`, nothing changed, when no device takes it or a cache is not
/// all fp32 in RAM: the caller then runs [`mla_heads`] (without `then`).
pub fn mla_heads_projected(
    path: Path,
    d: &MlaDims,
    lin: &MlaLinears<'_>,
    kv_b: &AbsorbedKvB,
    rope: Option<&MlaRope<'_>>,
    (caches, segs): (&mut [&mut MlaCache], &[Segment]),
    x: &[f32],
    then: Option<Then<'_>>,
) -> Result<Option<(Vec<f32>, bool)>> {
    if !path.device() {
        return Ok(None);
    }
    let n = segs.last().map_or(0, |s| s.end);
    let w = d.kv_lora_rank + d.qk_rope_head_dim;
    let done = crate::phase::timed(crate::phase::Phase::FullCore, || {
        let (seqs, ns) = step_blocks(caches, segs, |_| 0)?;
        let (mut out, mut rows) = (vec![0f32; n * lin.o_proj.rows], vec![0f32; n * w]);
        let angles = rope.map(|r| MlaAngles {
            cos: &r.angles.cos,
            sin: &r.angles.sin,
            interleaved: r.interleaved,
        });
        let mut work = MlaWork {
            shape: shape(d),
            seqs: &seqs,
            ns: &ns,
            q_nope: &[],
            q_rope: &[],
            uk_t: kv_b.uk_t.as_mat(),
            uv: kv_b.uv.as_mat(),
            o: Some(MlaOut {
                gate: None,
                o_proj: lin.o_proj.as_mat(),
            }),
            out: &mut out,
            then,
            proj: Some(MlaProj {
                x,
                q: lin.q,
                kv_a: lin.kv_a.as_mat(),
                kv_norm: lin.kv_a_layernorm,
                kv_eps: d.norm_eps,
                gate: lin.gate.map(Linear::as_mat),
                angles,
                rows_out: &mut rows,
            }),
        };
        let taken = backend::mla_attend_taken(&mut work);
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

/// What [`heads`] computed.
enum MlaValues {
    /// The per-head values `[N, H·dv]`.
    ByPosition(Vec<f32>),
    /// The layer's output `[N, D]`, from the device, and whether it did
    /// the call's `then` too.
    Out(Vec<f32>, bool),
}

#[allow(clippy::too_many_arguments)]
fn heads(
    path: Path,
    d: &MlaDims,
    kv_a_layernorm: &[f32],
    kv_b: &AbsorbedKvB,
    rope: Option<&MlaRope<'_>>,
    caches: &mut [&mut MlaCache],
    segs: &[Segment],
    (q, mut c): (&[f32], Vec<f32>),
    (out, then): (MlaOut<'_>, Option<Then<'_>>),
) -> Result<MlaValues> {
    let n = segs.last().map_or(0, |s| s.end);
    if n == 0 {
        return Ok(MlaValues::ByPosition(Vec::new()));
    }
    let (lora, dr) = (d.kv_lora_rank, d.qk_rope_head_dim);
    let width = lora + dr;
    for (r, row) in c.chunks_exact_mut(width).enumerate() {
        rms_norm_rows(&mut row[..lora], lora, kv_a_layernorm, d.norm_eps);
        if let Some(rope) = rope {
            rope.apply(r, &mut row[lora..]);
        }
    }
    // (cache, rows already cached before this step) per sequence.
    let mut past = Vec::with_capacity(caches.len());
    for (cache, seg) in caches.iter_mut().zip(segs) {
        past.push(cache.len());
        cache.push_rows(&c[seg.start * width..seg.end * width])?;
    }
    let (qn, mut q_rope) = split_queries(d, q, n);
    if let Some(rope) = rope {
        for (r, row) in q_rope.chunks_exact_mut(d.heads * dr).enumerate() {
            rope.apply(r, row);
        }
    }
    let queries = (&qn[..], &q_rope[..]);
    if path.device()
        && let Some(v) = on_device(d, kv_b, (caches, segs, &past), queries, (out, then))
    {
        return Ok(v);
    }
    let q_lat = latent_queries(d, kv_b, &qn, n);
    let ctx = attend(d, caches, segs, &past, &q_lat, &q_rope)?;
    Ok(MlaValues::ByPosition(values(d, kv_b, &ctx, n)))
}

/// `q [N, H·dq]` split into each head's no-position queries `[H, N, dn]`
/// (one block per head) and the position parts `q_rope [N, H, dr]`.
fn split_queries(d: &MlaDims, q: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
    let (h, dn, dr) = (d.heads, d.qk_nope_head_dim, d.qk_rope_head_dim);
    let dq = dn + dr;
    let mut qn = Vec::with_capacity(h * n * dn);
    for hh in 0..h {
        for ti in 0..n {
            qn.extend_from_slice(&q[ti * h * dq + hh * dq..][..dn]);
        }
    }
    let mut q_rope = vec![0f32; n * h * dr];
    for ti in 0..n {
        for hh in 0..h {
            let src = &q[ti * h * dq + hh * dq + dn..][..dr];
            q_rope[(ti * h + hh) * dr..][..dr].copy_from_slice(src);
        }
    }
    (qn, q_rope)
}

/// The absorbed queries `q_lat [N, H, lora]`, `q_lat[t, h] = W_uk,hᵀ
/// q_nope[t, h]`, of the no-position queries `qn [H, N, dn]`.
fn latent_queries(d: &MlaDims, kv_b: &AbsorbedKvB, qn: &[f32], n: usize) -> Vec<f32> {
    let (h, lora) = (d.heads, d.kv_lora_rank);
    let lat = kv_b.uk_t.forward_groups(h, qn, n);
    let mut q_lat = vec![0f32; n * h * lora];
    for (hh, ql) in lat.chunks(n * lora).enumerate() {
        for ti in 0..n {
            q_lat[(ti * h + hh) * lora..][..lora].copy_from_slice(&ql[ti * lora..(ti + 1) * lora]);
        }
    }
    q_lat
}

/// The layer's output (the values through `o`) from a backend that
/// takes the whole absorbed attention in one call (`Backend::mla_attend`,
/// the same bits as the steps below); `None` when none does or a cache is
/// not all fp32 in RAM (each sequence's rows are already in its cache).
fn on_device(
    d: &MlaDims,
    kv_b: &AbsorbedKvB,
    (caches, segs, past): (&[&mut MlaCache], &[Segment], &[usize]),
    (qn, q_rope): (&[f32], &[f32]),
    (o, then): (MlaOut<'_>, Option<Then<'_>>),
) -> Option<MlaValues> {
    let mut seqs = Vec::with_capacity(caches.len());
    let mut ns = Vec::new();
    for ((cache, seg), &p0) in caches.iter().zip(segs).zip(past) {
        let (blocks, stable) = cache.ram_blocks(p0 + seg.len())?;
        seqs.push(MlaSeqWork {
            blocks,
            stable,
            queries: seg.clone(),
            first: 0,
        });
        // causal: each position sees itself and all before
        ns.extend((0..seg.len()).map(|i| p0 + i + 1));
    }
    let n = ns.len();
    let mut out = vec![0f32; n * o.o_proj.rows()];
    let mut work = MlaWork {
        shape: shape(d),
        seqs: &seqs,
        ns: &ns,
        q_nope: qn,
        q_rope,
        uk_t: kv_b.uk_t.as_mat(),
        uv: kv_b.uv.as_mat(),
        o: Some(o),
        out: &mut out,
        then,
        proj: None,
    };
    let taken = backend::mla_attend_taken(&mut work);
    let done = work.then.as_ref().is_some_and(|t| t.done);
    drop(work);
    taken.then_some(MlaValues::Out(out, done))
}

/// The attention kernels' shape for `d`.
fn shape(d: &MlaDims) -> MlaShape {
    MlaShape {
        heads: d.heads,
        lora: d.kv_lora_rank,
        rope: d.qk_rope_head_dim,
        scale: d.softmax_scale,
    }
}

/// Context on the latent, `[N, H, lora]`: each sequence's rows attend to
/// its cache (`past[i]` rows before this step, then its own, causally).
fn attend(
    d: &MlaDims,
    caches: &[&mut MlaCache],
    segs: &[Segment],
    past: &[usize],
    q_lat: &[f32],
    q_rope: &[f32],
) -> Result<Vec<f32>> {
    let (h, dr, lora) = (d.heads, d.qk_rope_head_dim, d.kv_lora_rank);
    let n = segs.last().map_or(0, |s| s.end);
    let shape = shape(d);
    let mut ctx = vec![0f32; n * h * lora];
    for ((cache, seg), &p0) in caches.iter().zip(segs).zip(past) {
        let queries: Vec<MlaQuery<'_>> = seg
            .clone()
            .enumerate()
            .map(|(i, ti)| MlaQuery {
                q_lat: &q_lat[ti * h * lora..(ti + 1) * h * lora],
                q_rope: &q_rope[ti * h * dr..(ti + 1) * h * dr],
                // causal: this position sees itself and all before
                n: p0 + i + 1,
            })
            .collect();
        let out = &mut ctx[seg.start * h * lora..seg.end * h * lora];
        let mut acc = MlaAccum::new(shape, &queries);
        cache.windows(p0 + seg.len(), |first, blocks| acc.add(first, blocks))?;
        acc.finish(out);
    }
    Ok(ctx)
}

/// The per-head values `[N, H·dv]` of the latent context through `W_uv`.
fn values(d: &MlaDims, kv_b: &AbsorbedKvB, ctx: &[f32], n: usize) -> Vec<f32> {
    let (h, lora) = (d.heads, d.kv_lora_rank);
    // [H, N, lora]: each head's latent context, one block per head.
    let mut c = Vec::with_capacity(h * n * lora);
    for hh in 0..h {
        for ti in 0..n {
            c.extend_from_slice(&ctx[(ti * h + hh) * lora..][..lora]);
        }
    }
    by_position(d, &kv_b.uv.forward_groups(h, &c, n), n)
}

/// Per-head values `[H, N, dv]` as `[N, H·dv]`.
fn by_position(d: &MlaDims, all: &[f32], n: usize) -> Vec<f32> {
    let (h, dv) = (d.heads, d.v_head_dim);
    let outs: Vec<&[f32]> = all.chunks(n * dv).collect();
    let mut cat = vec![0f32; n * h * dv];
    for ti in 0..n {
        for (hh, o) in outs.iter().enumerate() {
            cat[ti * h * dv + hh * dv..][..dv].copy_from_slice(&o[ti * dv..(ti + 1) * dv]);
        }
    }
    cat
}
