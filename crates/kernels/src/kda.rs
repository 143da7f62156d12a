//! Kimi Delta Attention's per-sequence arithmetic: the short causal
//! convolution and the gated delta rule (docs/k3-model.md §4).
//!
//! The step recurrence defines the arithmetic: a T-position call runs the
//! positions in order and is bit-identical to T one-position calls. Within
//! a position every operation is element-wise over the value dimension (no
//! reduction whose order could vary), so the AVX2 build of the same code
//! ([`delta_rule`] picks it when the kernel set allows) gives the same bits
//! as the baseline twin [`delta_rule_scalar`].

use crate::expf::exp_fixed;
use crate::ops::{sigmoid_fixed, silu_fixed, softplus_fixed};

/// Depthwise causal convolution + SiLU over `pre [T, P]`, using and updating
/// `window` (`[kernel−1, P]`, the previous pre-convolution rows).
pub fn short_conv(
    pre: &[f32],
    window: &mut [f32],
    taps: &[f32],
    p: usize,
    kernel: usize,
) -> Vec<f32> {
    fma_build!(short_conv_impl(pre: &[f32], window: &mut [f32], taps: &[f32], p: usize, kernel: usize) -> Vec<f32>)
}

#[inline(always)]
fn short_conv_impl(
    pre: &[f32],
    window: &mut [f32],
    taps: &[f32],
    p: usize,
    kernel: usize,
) -> Vec<f32> {
    let t = pre.len() / p;
    let hist = kernel - 1;
    // seq = window ++ pre, rows of width p
    let row = |r: usize| -> &[f32] {
        if r < hist {
            &window[r * p..(r + 1) * p]
        } else {
            &pre[(r - hist) * p..(r - hist + 1) * p]
        }
    };
    // Each channel sums its taps in order from zero, then SiLU.
    let mut out = vec![0f32; t * p];
    for (ti, o) in out.chunks_exact_mut(p).enumerate() {
        for (c, (v, w)) in o.iter_mut().zip(taps.chunks_exact(kernel)).enumerate() {
            let mut acc = 0f32;
            for (j, &tap) in w.iter().enumerate() {
                acc += tap * row(ti + j)[c];
            }
            *v = silu_fixed(acc);
        }
    }
    // New window: the last `hist` rows of seq.
    let total = hist + t;
    let mut new = Vec::with_capacity(hist * p);
    for r in total - hist..total {
        new.extend_from_slice(row(r));
    }
    window.copy_from_slice(&new);
    out
}

/// Per-channel log decay `log α` for one head.
#[inline]
pub fn log_decay(f: f32, a: f32, dt: f32, lower_bound: Option<f32>) -> f32 {
    let z = f + dt;
    match lower_bound {
        Some(lb) => lb * sigmoid_fixed(a * z),
        None => -a * softplus_fixed(z),
    }
}

/// One head's inputs for `beta.len()` positions: `q`, `k`, `log_alpha`
/// are `[T, K]` (`kd` wide), `v` is `[T, V]` (`vd` wide).
#[derive(Debug, Clone, Copy)]
pub struct DeltaInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub log_alpha: &'a [f32],
    pub beta: &'a [f32],
    pub kd: usize,
    pub vd: usize,
}

#[inline(always)]
fn delta_rule_impl(s: &mut [f32], x: &DeltaInputs<'_>, out: &mut [f32]) {
    let DeltaInputs {
        q,
        k,
        v,
        log_alpha,
        beta,
        kd,
        vd,
    } = *x;
    let mut pred = vec![0f32; vd];
    for ti in 0..beta.len() {
        let (qt, kt, vt) = (
            &q[ti * kd..][..kd],
            &k[ti * kd..][..kd],
            &v[ti * vd..][..vd],
        );
        let la = &log_alpha[ti * kd..][..kd];
        // S ← diag(α) S, and pred = Sᵀ k in the same sweep.
        pred.fill(0.0);
        for kk in 0..kd {
            let alpha = exp_fixed(la[kk]);
            let row = &mut s[kk * vd..(kk + 1) * vd];
            for (sv, p) in row.iter_mut().zip(pred.iter_mut()) {
                *sv *= alpha;
                *p += kt[kk] * *sv;
            }
        }
        // u = β (v − pred);  S ← S + k ⊗ u;  o = Sᵀ q.
        for (p, &x) in pred.iter_mut().zip(vt) {
            *p = beta[ti] * (x - *p);
        }
        let o = &mut out[ti * vd..(ti + 1) * vd];
        o.fill(0.0);
        for kk in 0..kd {
            let row = &mut s[kk * vd..(kk + 1) * vd];
            for ((sv, &u), ov) in row.iter_mut().zip(pred.iter()).zip(o.iter_mut()) {
                *sv += kt[kk] * u;
                *ov += qt[kk] * *sv;
            }
        }
    }
}

/// One head's gated delta rule: `s` is the state `[K, V]`, `out` `[T, V]`.
pub fn delta_rule(s: &mut [f32], x: &DeltaInputs<'_>, out: &mut [f32]) {
    fma_build!(delta_rule_impl(s: &mut [f32], x: &DeltaInputs<'_>, out: &mut [f32]) -> ())
}

/// The twin: the same arithmetic for the baseline instruction set.
pub fn delta_rule_scalar(s: &mut [f32], x: &DeltaInputs<'_>, out: &mut [f32]) {
    delta_rule_impl(s, x, out)
}

/// Epsilon inside the q/k L2 normalisation.
pub const KDA_L2_EPS: f32 = 1e-6;

/// Dimensions of a KDA layer.
#[derive(Debug, Clone, PartialEq)]
pub struct KdaDims {
    pub heads: usize,
    /// K = V.
    pub head_dim: usize,
    pub conv_kernel: usize,
    /// `log α = lb·σ(…)` when set, else `−A·softplus(…)`.
    pub gate_lower_bound: Option<f32>,
    /// Epsilon of the gated output norm (`o_norm`).
    pub norm_eps: f32,
}

impl KdaDims {
    /// Projection width P = heads × head_dim.
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// The query scale `K^-½`.
    pub fn q_scale(&self) -> f32 {
        (self.head_dim as f32).powf(-0.5)
    }
}

/// A KDA layer's own parameters (besides its projections).
#[derive(Clone, Copy)]
pub struct KdaParams<'a> {
    /// Depthwise conv taps `[P, kernel]` for q, k, v.
    pub conv: [&'a [f32]; 3],
    /// `exp(A_log[h])` per (head, channel): `[H·K]`.
    pub a: &'a [f32],
    pub dt_bias: &'a [f32],
    /// The output norm weight `[K]`, shared by heads.
    pub o_norm: &'a [f32],
}

impl KdaParams<'_> {
    /// The owner is dropping these vectors: a backend that kept device
    /// copies of them (the KDA step's) discards them.
    pub fn forget(&self) {
        for v in self
            .conv
            .iter()
            .chain([&self.a, &self.dt_bias, &self.o_norm])
        {
            crate::backend::forget(v);
        }
    }
}

/// One head's delta-rule inputs for the positions of a pass, kept so the
/// state can be rolled forward again to any prefix (speculative rollback).
#[derive(Debug, Clone, Default)]
pub struct HeadInputs {
    /// `[T, K]` normalised and scaled queries.
    pub q: Vec<f32>,
    /// `[T, K]` normalised keys.
    pub k: Vec<f32>,
    /// `[T, V]` values.
    pub v: Vec<f32>,
    /// `[T, K]` log decays.
    pub log_alpha: Vec<f32>,
    /// `[T]` β.
    pub beta: Vec<f32>,
}

impl HeadInputs {
    /// The first `t` positions as the delta rule's inputs (head width `kd`).
    pub fn positions(&self, t: usize, kd: usize) -> DeltaInputs<'_> {
        DeltaInputs {
            q: &self.q[..t * kd],
            k: &self.k[..t * kd],
            v: &self.v[..t * kd],
            log_alpha: &self.log_alpha[..t * kd],
            beta: &self.beta[..t],
            kd,
            vd: kd,
        }
    }
}

/// A sequence's rows of a step's inputs, each `[T, P]` but `b` (`[T, H]`):
/// q, k, v convolved, `f` and `b` raw.
pub struct HeadRows<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub f: &'a [f32],
    pub b: &'a [f32],
}

/// Head `hh`'s delta-rule inputs: `q = l2(q̃)·K^-½`, `k = l2(k̃)`, the log
/// decays and `β = σ(b)` (the functions of [`crate::expf::exp_fixed`]).
pub fn head_inputs(d: &KdaDims, w: &KdaParams<'_>, r: &HeadRows<'_>, hh: usize) -> HeadInputs {
    fma_build!(head_inputs_impl(d: &KdaDims, w: &KdaParams<'_>, r: &HeadRows<'_>, hh: usize) -> HeadInputs)
}

#[inline(always)]
fn head_inputs_impl(d: &KdaDims, w: &KdaParams<'_>, r: &HeadRows<'_>, hh: usize) -> HeadInputs {
    use crate::ops::l2_normalize;
    let (h, kd) = (d.heads, d.head_dim);
    let p = h * kd;
    let t = r.q.len() / p;
    let scale = d.q_scale();
    let mut hi = HeadInputs {
        q: vec![0f32; t * kd],
        k: vec![0f32; t * kd],
        v: vec![0f32; t * kd],
        log_alpha: vec![0f32; t * kd],
        beta: vec![0f32; t],
    };
    for ti in 0..t {
        let src = ti * p + hh * kd;
        let qr = &mut hi.q[ti * kd..(ti + 1) * kd];
        qr.copy_from_slice(&r.q[src..src + kd]);
        l2_normalize(qr, KDA_L2_EPS);
        qr.iter_mut().for_each(|z| *z *= scale);
        let kr = &mut hi.k[ti * kd..(ti + 1) * kd];
        kr.copy_from_slice(&r.k[src..src + kd]);
        l2_normalize(kr, KDA_L2_EPS);
        hi.v[ti * kd..(ti + 1) * kd].copy_from_slice(&r.v[src..src + kd]);
        for c in 0..kd {
            let j = hh * kd + c;
            hi.log_alpha[ti * kd + c] =
                log_decay(r.f[ti * p + j], w.a[j], w.dt_bias[j], d.gate_lower_bound);
        }
        hi.beta[ti] = sigmoid_fixed(r.b[ti * h + hh]);
    }
    hi
}

/// Head `hh`'s outputs `o [T, K]`, in place: RMSNorm (`o_norm`) gated by
/// `σ(g)` (`g [T, P]`).
pub fn gated_norm(d: &KdaDims, w: &KdaParams<'_>, g: &[f32], hh: usize, o: &mut [f32]) {
    fma_build!(gated_norm_impl(d: &KdaDims, w: &KdaParams<'_>, g: &[f32], hh: usize, o: &mut [f32]) -> ())
}

#[inline(always)]
fn gated_norm_impl(d: &KdaDims, w: &KdaParams<'_>, g: &[f32], hh: usize, o: &mut [f32]) {
    let (kd, p) = (d.head_dim, d.width());
    for (ti, orow) in o.chunks_exact_mut(kd).enumerate() {
        crate::ops::rms_norm(orow, w.o_norm, d.norm_eps);
        for (c, ov) in orow.iter_mut().enumerate() {
            *ov *= sigmoid_fixed(g[ti * p + hh * kd + c]);
        }
    }
}

/// A step's inputs for every sequence: `pre` (q, k, v before the
/// convolution), `f` and `g` are `[N, P]`, `b` is `[N, H]` (`f` is the
/// forget gate's low-rank input `[N, R]` when the job has an `f_up`).
#[derive(Clone, Copy)]
pub struct KdaInputs<'a> {
    pub pre: [&'a [f32]; 3],
    pub f: &'a [f32],
    pub b: &'a [f32],
    pub g: &'a [f32],
}

/// A KDA layer's six input projections of the step's rows, for a backend
/// to run inside the core's call (one round trip for the whole layer):
/// `x [N, D]` (already normed) times q, k, v (`[P, D]` each), the forget
/// gate's low-rank `f_a` (`[R, D]`, or `[P, D]` without an `f_up`), β
/// (`[H, D]`) and the output gate (`[P, D]`) — what [`KdaInputs`] holds
/// otherwise. The matrices' bytes are stable as for
/// [`crate::backend::matmul_stable`].
#[derive(Clone, Copy)]
pub struct KdaProj<'a> {
    pub x: &'a [f32],
    pub mats: [crate::backend::MatRef<'a>; 6],
}

impl<'a> KdaProj<'a> {
    /// The step's rows.
    pub fn rows(&self) -> usize {
        self.x.len() / self.mats[0].cols().max(1)
    }

    /// The six projections on the CPU kernels: pre q, k, v, f, b, g.
    pub fn cpu(&self) -> [Vec<f32>; 6] {
        let n = self.rows();
        self.mats.map(|m| {
            let mut y = vec![0f32; n * m.rows()];
            m.cpu(self.x, n, &mut y);
            y
        })
    }
}

/// One sequence of a step: its rows of the inputs and what it carries.
pub struct KdaSeq<'a> {
    pub rows: std::ops::Range<usize>,
    /// `S [H, K, V]`.
    pub s: &'a mut crate::state_buf::StateBuf,
    /// The q, k, v convolution windows, `[kernel − 1, P]` each.
    pub conv: [&'a mut crate::state_buf::StateBuf; 3],
}

/// A KDA layer's core for one step of several sequences, from the
/// projections to the gated head outputs `out [N, P]` — or, with `o_proj`,
/// to those outputs projected, `out [N, D]` —, optionally starting with
/// the forget gate's up-projection `f_up`. [`kda_step_cpu`] defines it; a
/// backend's [`crate::backend::Backend::kda_step`] gives the same bits
/// (the products with the CPU kernels' order, as for every product).
pub struct KdaJob<'a> {
    pub dims: &'a KdaDims,
    pub w: KdaParams<'a>,
    /// The projections; ignored (empty) when `proj` is set.
    pub x: KdaInputs<'a>,
    /// When set, the projections are computed from it first (in the
    /// backend's call) and `x` is not read.
    pub proj: Option<KdaProj<'a>>,
    pub seqs: Vec<KdaSeq<'a>>,
    /// `[N, P]`, or `[N, D]` with `o_proj`.
    pub out: &'a mut [f32],
    /// The forget gate's up-projection `[P, R]` (bytes stable as for
    /// [`crate::backend::matmul_stable`]), applied to `x.f` first.
    pub f_up: Option<crate::backend::MatRef<'a>>,
    /// The output gate's up-projection `[P, Rg]` (bytes stable likewise),
    /// applied to `x.g` first when the gate is low-rank (Kimi-Linear).
    pub g_up: Option<crate::backend::MatRef<'a>>,
    /// The output projection `[D, P]` (bytes stable likewise), applied to
    /// the gated head outputs last.
    pub o_proj: Option<crate::backend::MatRef<'a>>,
    /// When set, every position's delta-rule inputs (what a journal keeps,
    /// [`HeadInputs`]' values): q, k, v, log α as `[4, N, P]`, then β as
    /// `[N, H]` ([`KdaJob::inputs_len`] values).
    pub inputs_out: Option<&'a mut [f32]>,
    /// With `o_proj`: the rest of the layer up to its experts' choice,
    /// from `out` ([`crate::backend::Then`]); a backend that takes it sets
    /// its `done`.
    pub then: Option<crate::backend::Then<'a>>,
}

/// The longest convolution a device's KDA kernel carries (`kda.cu`'s
/// `KDA_MAX_KERNEL`).
pub const DEVICE_MAX_KERNEL: usize = 8;

impl KdaJob<'_> {
    /// The length of [`KdaJob::inputs_out`] for `n` rows.
    pub fn inputs_len(d: &KdaDims, n: usize) -> usize {
        n * (4 * d.width() + d.heads)
    }

    /// Whether the job is what a device's KDA kernel (`kda.cu`) takes:
    /// the sequences' rows tile `0..n` in order, every buffer has the
    /// length the dimensions ask for (the projections' shapes too when the
    /// job carries them), a head fits one block (`kd` ≤ 1024 threads), the
    /// convolution is at most [`DEVICE_MAX_KERNEL`] wide, sizes fit an
    /// `i32`, and no state's values were lost (such a step runs on the
    /// CPU, whose read names the cause).
    pub fn fits_device_kernel(&self) -> bool {
        let d = self.dims;
        let (h, kd, kernel) = (d.heads, d.head_dim, d.conv_kernel);
        let p = h * kd;
        let n = self.seqs.last().map_or(0, |s| s.rows.end);
        let small = |v: usize| i32::try_from(v).is_ok();
        // The forget gate's input width, and the output's.
        let r = self.f_up.map_or(p, |m| m.cols());
        let rg = self.g_up.map_or(p, |m| m.cols());
        let dout = self.o_proj.map_or(p, |m| m.rows());
        let products = self.f_up.is_none_or(|m| m.rows() == p && r > 0)
            && self.g_up.is_none_or(|m| m.rows() == p && rg > 0)
            && self.o_proj.is_none_or(|m| m.cols() == p && dout > 0);
        let mut next = 0;
        let tiled = self.seqs.iter().all(|s| {
            let ok = s.rows.start == next && s.rows.end >= s.rows.start;
            next = s.rows.end;
            ok
        });
        let sizes = (1..=1024).contains(&kd)
            && (2..=DEVICE_MAX_KERNEL).contains(&kernel)
            && h > 0
            && n > 0
            && n.checked_mul(4 * p + h + r + rg + dout).is_some_and(small);
        let inputs = match &self.proj {
            // Six products of x [N, D] giving the inputs' shapes.
            Some(pj) => {
                let dm = pj.mats[0].cols();
                dm > 0
                    && pj.x.len() == n * dm
                    && n.checked_mul(dm).is_some_and(small)
                    && pj
                        .mats
                        .iter()
                        .zip([p, p, p, r, h, rg])
                        .all(|(m, rw)| m.rows() == rw && m.cols() == dm)
            }
            None => {
                self.x.f.len() == n * r
                    && self.x.pre.iter().all(|v| v.len() == n * p)
                    && self.x.g.len() == n * rg
                    && self.x.b.len() == n * h
            }
        };
        let outputs = self.out.len() == n * dout
            && self
                .inputs_out
                .as_ref()
                .is_none_or(|b| b.len() == KdaJob::inputs_len(d, n));
        let w = &self.w;
        let params = w.conv.iter().all(|t| t.len() == p * kernel)
            && w.a.len() == p
            && w.dt_bias.len() == p
            && w.o_norm.len() == kd;
        let states = self.seqs.iter().all(|s| {
            s.s.len() == h * kd * kd
                && s.conv.iter().all(|c| c.len() == (kernel - 1) * p)
                && s.s.check().is_ok()
                && s.conv.iter().all(|c| c.check().is_ok())
        });
        tiled && products && sizes && inputs && outputs && params && states
    }
}

/// Head `hh`'s [`HeadInputs`] for the rows `rows` of an `inputs_out` of
/// `n` rows.
pub fn head_inputs_of(
    d: &KdaDims,
    buf: &[f32],
    n: usize,
    rows: std::ops::Range<usize>,
    hh: usize,
) -> HeadInputs {
    let (h, kd, p) = (d.heads, d.head_dim, d.width());
    let plane = |i: usize| -> Vec<f32> {
        rows.clone()
            .flat_map(|r| buf[i * n * p + r * p + hh * kd..][..kd].iter().copied())
            .collect()
    };
    HeadInputs {
        q: plane(0),
        k: plane(1),
        v: plane(2),
        log_alpha: plane(3),
        beta: rows.clone().map(|r| buf[4 * n * p + r * h + hh]).collect(),
    }
}

/// The twin of a device's [`KdaJob`]: each sequence's convolution, then
/// per head the inputs, the delta rule and the gated norm, in order on one
/// thread (the model's step runs the same functions with heads in parallel).
pub fn kda_step_cpu(job: &mut KdaJob<'_>) -> Result<(), crate::state_buf::StateError> {
    let d = job.dims;
    let (h, kd, p) = (d.heads, d.head_dim, d.width());
    let projected: [Vec<f32>; 6];
    let x = match job.proj {
        Some(pj) => {
            projected = pj.cpu();
            let [q, k, v, f, b, g] = &projected;
            KdaInputs {
                pre: [q, k, v],
                f,
                b,
                g,
            }
        }
        None => job.x,
    };
    // The step's rows (the sequences' rows lie among them).
    let n = x.pre[0].len() / p;
    // The gates' up-projections, when the job has them.
    let up = |m: Option<crate::backend::MatRef<'_>>, low: &[f32]| {
        m.map(|m| {
            let mut y = vec![0f32; n * m.rows()];
            m.cpu(low, n, &mut y);
            y
        })
    };
    let (f_full, g_full) = (up(job.f_up, x.f), up(job.g_up, x.g));
    let f = f_full.as_deref().unwrap_or(x.f);
    let g = g_full.as_deref().unwrap_or(x.g);
    let mut cat = vec![0f32; n * p];
    for seq in job.seqs.iter_mut() {
        let rows = seq.rows.start * p..seq.rows.end * p;
        let mut conv: Vec<Vec<f32>> = Vec::with_capacity(3);
        for c in 0..3 {
            let win = seq.conv[c].host_mut()?;
            conv.push(short_conv(
                &x.pre[c][rows.clone()],
                win,
                job.w.conv[c],
                p,
                d.conv_kernel,
            ));
        }
        let s = seq.s.host_mut()?;
        let r = HeadRows {
            q: &conv[0],
            k: &conv[1],
            v: &conv[2],
            f: &f[rows.clone()],
            b: &x.b[seq.rows.start * h..seq.rows.end * h],
        };
        let g = &g[rows.clone()];
        let t = seq.rows.len();
        for hh in 0..h {
            let hi = head_inputs(d, &job.w, &r, hh);
            if let Some(buf) = job.inputs_out.as_deref_mut() {
                for ti in 0..t {
                    let (row, np) = (seq.rows.start + ti, n * p);
                    let at = row * p + hh * kd;
                    let src = ti * kd..(ti + 1) * kd;
                    buf[at..at + kd].copy_from_slice(&hi.q[src.clone()]);
                    buf[np + at..np + at + kd].copy_from_slice(&hi.k[src.clone()]);
                    buf[2 * np + at..2 * np + at + kd].copy_from_slice(&hi.v[src.clone()]);
                    buf[3 * np + at..3 * np + at + kd].copy_from_slice(&hi.log_alpha[src]);
                    buf[4 * np + row * h + hh] = hi.beta[ti];
                }
            }
            let mut o = vec![0f32; t * kd];
            delta_rule(
                &mut s[hh * kd * kd..(hh + 1) * kd * kd],
                &hi.positions(t, kd),
                &mut o,
            );
            gated_norm(d, &job.w, g, hh, &mut o);
            for ti in 0..t {
                let at = (seq.rows.start + ti) * p + hh * kd;
                cat[at..at + kd].copy_from_slice(&o[ti * kd..(ti + 1) * kd]);
            }
        }
    }
    match job.o_proj {
        Some(m) => m.cpu(&cat, n, job.out),
        None => job.out.copy_from_slice(&cat),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state_buf::StateBuf;

    fn vals(seed: u64, n: usize, amp: f32) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|i| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let v = ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * amp;
                if i % 29 == 0 { v * 60.0 } else { v }
            })
            .collect()
    }

    fn dims() -> KdaDims {
        KdaDims {
            heads: 3,
            head_dim: 40,
            conv_kernel: 4,
            gate_lower_bound: Some(-5.0),
            norm_eps: 1e-5,
        }
    }

    struct Params {
        conv: [Vec<f32>; 3],
        a: Vec<f32>,
        dt: Vec<f32>,
        o_norm: Vec<f32>,
    }

    impl Params {
        fn new(d: &KdaDims) -> Self {
            let p = d.width();
            Params {
                conv: std::array::from_fn(|i| vals(10 + i as u64, p * d.conv_kernel, 0.7)),
                a: vals(20, p, 1.0).iter().map(|v| v.abs() + 0.01).collect(),
                dt: vals(21, p, 1.0),
                o_norm: vals(22, d.head_dim, 1.5),
            }
        }
        fn get(&self) -> KdaParams<'_> {
            KdaParams {
                conv: [&self.conv[0], &self.conv[1], &self.conv[2]],
                a: &self.a,
                dt_bias: &self.dt,
                o_norm: &self.o_norm,
            }
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fma_builds_give_the_baseline_bits() {
        if !matches!(crate::kernels().isa, crate::Isa::Avx2 | crate::Isa::Avx512) {
            eprintln!("skipped: this CPU runs the baseline builds only");
            return;
        }
        let d = dims();
        let w = Params::new(&d);
        let (p, t, kd) = (d.width(), 3, d.head_dim);
        let pre = vals(1, t * p, 2.0);
        let (mut w1, mut w2) = (vals(2, 3 * p, 1.0), vals(2, 3 * p, 1.0));
        let got = short_conv(&pre, &mut w1, &w.conv[0], p, d.conv_kernel);
        let want = short_conv_impl(&pre, &mut w2, &w.conv[0], p, d.conv_kernel);
        assert_eq!((bits(&got), bits(&w1)), (bits(&want), bits(&w2)));
        let (f, b, g) = (
            vals(3, t * p, 4.0),
            vals(4, t * d.heads, 4.0),
            vals(5, t * p, 4.0),
        );
        let r = HeadRows {
            q: &got,
            k: &pre,
            v: &f,
            f: &f,
            b: &b,
        };
        for hh in 0..d.heads {
            let (x, y) = (
                head_inputs(&d, &w.get(), &r, hh),
                head_inputs_impl(&d, &w.get(), &r, hh),
            );
            for (a, b) in [
                (&x.q, &y.q),
                (&x.k, &y.k),
                (&x.log_alpha, &y.log_alpha),
                (&x.beta, &y.beta),
            ] {
                assert_eq!(bits(a), bits(b), "head {hh}");
            }
            let (mut s1, mut s2) = (vals(6, kd * kd, 0.1), vals(6, kd * kd, 0.1));
            let (mut o1, mut o2) = (vec![0f32; t * kd], vec![0f32; t * kd]);
            delta_rule(&mut s1, &x.positions(t, kd), &mut o1);
            delta_rule_scalar(&mut s2, &x.positions(t, kd), &mut o2);
            assert_eq!((bits(&s1), bits(&o1)), (bits(&s2), bits(&o2)), "head {hh}");
            gated_norm(&d, &w.get(), &g, hh, &mut o1);
            gated_norm_impl(&d, &w.get(), &g, hh, &mut o2);
            assert_eq!(bits(&o1), bits(&o2), "head {hh}");
        }
    }

    /// One sequence's state, convolution windows and `t` positions' outputs
    /// after the positions `rows` of `x` in calls of `per_call` positions.
    fn run(
        d: &KdaDims,
        w: &KdaParams<'_>,
        x: &KdaInputs<'_>,
        t: usize,
        per_call: usize,
    ) -> Vec<u32> {
        let p = d.width();
        let mut s = StateBuf::new(vals(7, d.heads * d.head_dim * d.head_dim, 0.1));
        let mut conv: [StateBuf; 3] =
            std::array::from_fn(|i| StateBuf::new(vals(8 + i as u64, 3 * p, 1.0)));
        let mut outs = Vec::new();
        for r0 in (0..t).step_by(per_call) {
            let rows = r0..(r0 + per_call).min(t);
            let mut out = vec![0f32; t * p];
            let [q, k, v] = &mut conv;
            let mut job = KdaJob {
                dims: d,
                w: *w,
                x: *x,
                proj: None,
                seqs: vec![KdaSeq {
                    rows: rows.clone(),
                    s: &mut s,
                    conv: [q, k, v],
                }],
                out: &mut out,
                f_up: None,
                g_up: None,
                o_proj: None,
                inputs_out: None,
                then: None,
            };
            kda_step_cpu(&mut job).unwrap();
            outs.extend(bits(&out[rows.start * p..rows.end * p]));
        }
        outs.extend(bits(&s.read().unwrap()));
        for c in &conv {
            outs.extend(bits(&c.read().unwrap()));
        }
        outs
    }

    #[test]
    fn t_positions_in_one_call_give_the_bits_of_t_calls() {
        let d = dims();
        let w = Params::new(&d);
        let (p, t) = (d.width(), 5);
        let pre: [Vec<f32>; 3] = std::array::from_fn(|i| vals(30 + i as u64, t * p, 2.0));
        let (f, b, g) = (
            vals(40, t * p, 4.0),
            vals(41, t * d.heads, 4.0),
            vals(42, t * p, 4.0),
        );
        let x = KdaInputs {
            pre: [&pre[0], &pre[1], &pre[2]],
            f: &f,
            b: &b,
            g: &g,
        };
        let whole = run(&d, &w.get(), &x, t, t);
        assert_eq!(whole, run(&d, &w.get(), &x, t, 1), "one position a call");
        assert_eq!(whole, run(&d, &w.get(), &x, t, 2), "two positions a call");
    }
}
