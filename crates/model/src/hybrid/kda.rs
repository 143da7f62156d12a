//! Kimi Delta Attention over T new positions with carried state
//! (k3-model.md §4), from the layer's projections on.
//!
//! ```text
//! q̃,k̃,v = SiLU(CausalConv4(x W_{q,k,v}ᵀ))      depthwise, window carried across calls
//! f = (x W_f_aᵀ) W_f_bᵀ,  b = x W_bᵀ,  g = the family's output gate (K3: x W_gᵀ;
//!                                             Kimi-Linear: (x W_g_aᵀ) W_g_bᵀ)
//! per head h, per token:
//!   q = l2(q̃_h)·K^-½,  k = l2(k̃_h),  β = σ(b_h)
//!   log α[k] = lb·σ(A_h·(f_h[k] + dt_bias[h,k]))      (or −A_h·softplus(·) without a bound)
//!   S ← diag(α) S;   S ← S + k ⊗ β(v − Sᵀk);   o = Sᵀq
//! ô_h = RMSNorm(o_h; o_norm) ⊙ σ(g_h);   out = concat(ô) W_oᵀ
//! ```
//! Heads are independent, so they run in parallel; within a head the token
//! loop is sequential, which makes a T-token pass bit-identical to T
//! single-token passes.

use fathom_kernels::kda::{DeltaInputs, delta_rule, log_decay, short_conv};
use fathom_kernels::ops::{l2_normalize, rms_norm, sigmoid};
use rayon::prelude::*;

use super::KdaDims;
use super::state::{KdaJournal, KdaState};

pub use crate::batch::Segment;

/// Epsilon inside the KDA kernels' q/k L2 normalisation.
pub const KDA_L2_EPS: f32 = 1e-6;

/// A KDA layer's own parameters (besides its projections).
pub struct KdaParams<'a> {
    /// Depthwise conv taps `[P, kernel]` for q, k, v.
    pub conv: [&'a [f32]; 3],
    /// `exp(A_log[h])` per (head, channel): `[H·K]`.
    pub a: &'a [f32],
    pub dt_bias: &'a [f32],
    /// The output norm weight `[K]`, shared by heads.
    pub o_norm: &'a [f32],
}

/// A step's projections of its rows `x [N, D]`.
pub struct KdaProjections {
    /// Pre-convolution q, k, v, `[N, P]` each.
    pub pre: [Vec<f32>; 3],
    /// Forget-gate input `[N, P]`.
    pub f: Vec<f32>,
    /// β logits `[N, H]`.
    pub b: Vec<f32>,
    /// Output-gate logits `[N, P]`.
    pub g: Vec<f32>,
}

/// One head's inputs for `t` positions starting at row `r0` of the
/// projections (`q`, `k`, `v` convolved, `f`, `b` raw).
struct HeadRows<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    f: &'a [f32],
    b: &'a [f32],
}

fn head_inputs(d: &KdaDims, w: &KdaParams<'_>, r: &HeadRows<'_>, hh: usize) -> HeadInputs {
    let (h, kd) = (d.heads, d.head_dim);
    let p = h * kd;
    let t = r.q.len() / p;
    let scale = (kd as f32).powf(-0.5);
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
        hi.beta[ti] = sigmoid(r.b[ti * h + hh]);
    }
    hi
}

/// KDA for the rows of several sequences, from their projections:
/// `segs[i]` are sequence i's rows, `states[i]` its state. The convolution
/// and the delta rule run per sequence. Returns the gated head outputs
/// `[N, P]` (what `o_proj` takes).
/// Its time is the decode profile's `linear_core`.
pub fn kda_heads(
    d: &KdaDims,
    w: &KdaParams<'_>,
    states: &mut [&mut KdaState],
    segs: &[Segment],
    proj: &KdaProjections,
) -> Vec<f32> {
    crate::phase::timed(crate::phase::Phase::LinearCore, || {
        heads(d, w, states, segs, proj)
    })
}

fn heads(
    d: &KdaDims,
    w: &KdaParams<'_>,
    states: &mut [&mut KdaState],
    segs: &[Segment],
    proj: &KdaProjections,
) -> Vec<f32> {
    let (h, kd) = (d.heads, d.head_dim);
    let p = h * kd;
    let n = segs.last().map_or(0, |s| s.end);
    let pre = &proj.pre;
    let mut conv = [vec![0f32; n * p], vec![0f32; n * p], vec![0f32; n * p]];
    // q, k and v of every sequence, in parallel (each writes its own window).
    let outs: Vec<Vec<f32>> = states
        .par_iter_mut()
        .zip(segs)
        .flat_map(|(st, seg)| {
            let rows = seg.start * p..seg.end * p;
            st.conv.par_iter_mut().enumerate().map(move |(c, win)| {
                short_conv(&pre[c][rows.clone()], win, w.conv[c], p, d.conv_kernel)
            })
        })
        .collect();
    for (i, seg) in segs.iter().enumerate() {
        for c in 0..3 {
            conv[c][seg.start * p..seg.end * p].copy_from_slice(&outs[3 * i + c]);
        }
    }
    let (f, b, g) = (&proj.f, &proj.b, &proj.g);

    // Per head, every sequence's state slice, so heads run in parallel and
    // each head walks the sequences in batch order.
    let journaling: Vec<bool> = states.iter().map(|s| s.journal.is_some()).collect();
    let mut per_head: Vec<Vec<&mut [f32]>> = (0..h).map(|_| Vec::new()).collect();
    for st in states.iter_mut() {
        for (hh, s) in st.s.chunks_mut(kd * kd).enumerate() {
            per_head[hh].push(s);
        }
    }
    let min_len = crate::par_min_len(h, n * kd * kd * 4);
    let outs: Vec<(Vec<f32>, Vec<Option<HeadInputs>>)> = per_head
        .into_par_iter()
        .enumerate()
        .with_min_len(min_len)
        .map(|(hh, slices)| {
            let mut o = vec![0f32; n * kd];
            let mut inputs = Vec::with_capacity(segs.len());
            for ((s, seg), &journal) in slices.into_iter().zip(segs).zip(&journaling) {
                let rows = HeadRows {
                    q: &conv[0][seg.start * p..seg.end * p],
                    k: &conv[1][seg.start * p..seg.end * p],
                    v: &conv[2][seg.start * p..seg.end * p],
                    f: &f[seg.start * p..seg.end * p],
                    b: &b[seg.start * h..seg.end * h],
                };
                let hi = head_inputs(d, w, &rows, hh);
                let os = &mut o[seg.start * kd..seg.end * kd];
                delta_rule(s, &hi.positions(hi.beta.len(), kd), os);
                inputs.push(journal.then_some(hi));
            }
            // Gated RMSNorm of the head output.
            for (ti, orow) in o.chunks_exact_mut(kd).enumerate() {
                rms_norm(orow, w.o_norm, d.norm_eps);
                for (c, ov) in orow.iter_mut().enumerate() {
                    *ov *= sigmoid(g[ti * p + hh * kd + c]);
                }
            }
            (o, inputs)
        })
        .collect();
    for (si, (st, seg)) in states.iter_mut().zip(segs).enumerate() {
        if let Some(j) = st.journal.as_mut() {
            let pre_rows: [Vec<f32>; 3] =
                std::array::from_fn(|c| pre[c][seg.start * p..seg.end * p].to_vec());
            j.record(
                &pre_rows,
                outs.iter()
                    .map(|(_, i)| i[si].as_ref().expect("journaling")),
            );
        }
    }
    let mut cat = vec![0f32; n * p];
    for (hh, (o, _)) in outs.iter().enumerate() {
        for ti in 0..n {
            cat[ti * p + hh * kd..ti * p + (hh + 1) * kd]
                .copy_from_slice(&o[ti * kd..(ti + 1) * kd]);
        }
    }
    cat
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
    /// The first `t` positions as the kernel's inputs (head width `kd`).
    fn positions(&self, t: usize, kd: usize) -> DeltaInputs<'_> {
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

/// Rewinds `st` to the start of its journaled pass and replays the first
/// `keep` positions: the recurrent state and conv windows become bit for bit
/// what a pass of only those positions would have left.
pub fn replay_prefix(d: &KdaDims, st: &mut KdaState, j: &KdaJournal, keep: usize) {
    let kd = d.head_dim;
    let p = d.width();
    st.s.copy_from_slice(&j.s0);
    let min_len = crate::par_min_len(j.heads.len(), keep * kd * kd * 4);
    st.s.par_chunks_mut(kd * kd)
        .zip(j.heads.par_iter())
        .with_min_len(min_len)
        .for_each(|(s, hi)| {
            let mut o = vec![0f32; keep * kd];
            delta_rule(s, &hi.positions(keep, kd), &mut o);
        });
    let hist = d.conv_kernel - 1;
    for (c, (w0, pre)) in st.conv.iter_mut().zip(j.conv0.iter().zip(&j.pre)) {
        // Window after `keep` positions: the last `hist` rows of w0 ++ pre[..keep].
        let rows: Vec<&[f32]> = w0
            .chunks_exact(p)
            .chain(pre.chunks_exact(p).take(keep))
            .collect();
        let tail = &rows[rows.len() - hist..];
        for (dst, src) in c.chunks_exact_mut(p).zip(tail) {
            dst.copy_from_slice(src);
        }
    }
}
