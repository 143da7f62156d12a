//! Kimi Delta Attention over T new positions with carried state
//! (docs/k3-model.md §4), from the layer's projections on.
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

use fathom_kernels::backend::{self, Then};
use fathom_kernels::kda::{
    HeadRows, KdaInputs, KdaJob, KdaProj, KdaSeq, delta_rule, gated_norm, head_inputs,
    head_inputs_of, short_conv,
};
use fathom_kernels::state_buf::StateError;
use rayon::prelude::*;

use super::KdaDims;
use super::state::{KdaJournal, KdaState};
use crate::batch::Path;
use crate::error::{ModelError, Result};
use crate::linear::Linear;

pub use crate::batch::Segment;
pub use fathom_kernels::kda::{HeadInputs, KDA_L2_EPS, KdaParams};

/// A step's projections of its rows `x [N, D]`.
pub struct KdaProjections {
    /// Pre-convolution q, k, v, `[N, P]` each.
    pub pre: [Vec<f32>; 3],
    /// Forget-gate input: its low-rank part `[N, R]` (`f_a`'s output;
    /// [`KdaLinears::f_up`] is applied to it in the core's call).
    pub f: Vec<f32>,
    /// β logits `[N, H]`.
    pub b: Vec<f32>,
    /// Output-gate logits `[N, P]`, or with [`KdaLinears::g_up`] its
    /// low-rank part `[N, Rg]` (the up-projection applied in the core's
    /// call).
    pub g: Vec<f32>,
}

/// The products around a KDA layer's core that a device runs in the
/// core's own call: the forget gate's up-projection (and a low-rank output
/// gate's, Kimi-Linear's) before it, `o_proj` after it.
pub struct KdaLinears<'a> {
    pub f_up: &'a Linear,
    pub g_up: Option<&'a Linear>,
    pub o_proj: &'a Linear,
}

/// KDA for the rows of several sequences, from their projections:
/// `segs[i]` are sequence i's rows, `states[i]` its state. The convolution
/// and the delta rule run per sequence. Returns the gated head outputs
/// through `o_proj`, `[N, D]`.
/// Its time is the decode profile's `linear_core`. The step runs on the
/// backend's device when it takes it (the states then stay there; a
/// journaling sequence gets its delta-rule inputs back for its journal);
/// else here.
pub fn kda_heads(
    path: Path,
    d: &KdaDims,
    w: &KdaParams<'_>,
    states: &mut [&mut KdaState],
    segs: &[Segment],
    mut proj: KdaProjections,
    lin: &KdaLinears<'_>,
) -> Result<Vec<f32>> {
    crate::phase::timed(crate::phase::Phase::LinearCore, || {
        if let Some((out, inputs)) = on_device(path, d, w, states, segs, &proj, lin)? {
            if let Some(buf) = inputs {
                record_journals(d, states, segs, &proj, &buf);
            }
            return Ok(out);
        }
        let n = segs.last().map_or(0, |s| s.end);
        proj.f = lin.f_up.forward(&proj.f, n);
        if let Some(g_up) = lin.g_up {
            proj.g = g_up.forward(&proj.g, n);
        }
        let cat = heads(d, w, states, segs, &proj).map_err(|e| ModelError::State(e.to_string()))?;
        Ok(lin.o_proj.forward(&cat, n))
    })
}

/// [`kda_heads`] with the layer's six projections of `x [N, D]` (q, k, v,
/// the forget gate's `f_a`, β, the output gate) inside the device's call:
/// one round trip for the layer. `None`, nothing changed, when no device
/// takes it — the step is on the host path, the device declines, or a
/// sequence journals (its journal keeps the pre-convolution rows, which
/// then stay on the device) —: the caller computes the projections and
/// calls [`kda_heads`]. With
/// `then`, the device may also compute the rest of the layer up to its
/// experts' choice in the same call: the flag says whether it did.
#[allow(clippy::too_many_arguments)]
pub fn kda_heads_projected(
    path: Path,
    d: &KdaDims,
    w: &KdaParams<'_>,
    states: &mut [&mut KdaState],
    segs: &[Segment],
    x: &[f32],
    mats: [&Linear; 6],
    lin: &KdaLinears<'_>,
    then: Option<Then<'_>>,
) -> Result<Option<(Vec<f32>, bool)>> {
    if !path.device() || states.iter().any(|s| s.journal.is_some()) {
        return Ok(None);
    }
    crate::phase::timed(crate::phase::Phase::LinearCore, || {
        let n = segs.last().map_or(0, |s| s.end);
        let mut out = vec![0f32; n * lin.o_proj.rows];
        let seqs = job_seqs(states, segs);
        let none: &[f32] = &[];
        let mut job = KdaJob {
            dims: d,
            w: *w,
            x: KdaInputs {
                pre: [none; 3],
                f: none,
                b: none,
                g: none,
            },
            proj: Some(KdaProj {
                x,
                mats: mats.map(Linear::as_mat),
            }),
            seqs,
            out: &mut out,
            f_up: Some(lin.f_up.as_mat()),
            g_up: lin.g_up.map(Linear::as_mat),
            o_proj: Some(lin.o_proj.as_mat()),
            inputs_out: None,
            then,
        };
        let taken = backend::kda_step(&mut job).map_err(ModelError::State)?;
        let done = job.then.as_ref().is_some_and(|t| t.done);
        drop(job);
        Ok(taken.then_some((out, done)))
    })
}

/// What a device step gives: the outputs, and every row's delta-rule
/// inputs when a sequence journals.
type DeviceStep = (Vec<f32>, Option<Vec<f32>>);

/// The step as one [`KdaJob`] for the backend; `None` when it declines
/// (nothing changed), an error when the device failed part way.
fn on_device(
    path: Path,
    d: &KdaDims,
    w: &KdaParams<'_>,
    states: &mut [&mut KdaState],
    segs: &[Segment],
    proj: &KdaProjections,
    lin: &KdaLinears<'_>,
) -> Result<Option<DeviceStep>> {
    if !path.device() {
        return Ok(None);
    }
    let n = segs.last().map_or(0, |s| s.end);
    let mut out = vec![0f32; n * lin.o_proj.rows];
    let journaling = states.iter().any(|s| s.journal.is_some());
    let mut inputs = journaling.then(|| vec![0f32; KdaJob::inputs_len(d, n)]);
    let seqs = job_seqs(states, segs);
    let mut job = KdaJob {
        dims: d,
        w: *w,
        x: KdaInputs {
            pre: [&proj.pre[0], &proj.pre[1], &proj.pre[2]],
            f: &proj.f,
            b: &proj.b,
            g: &proj.g,
        },
        proj: None,
        seqs,
        out: &mut out,
        f_up: Some(lin.f_up.as_mat()),
        g_up: lin.g_up.map(Linear::as_mat),
        o_proj: Some(lin.o_proj.as_mat()),
        inputs_out: inputs.as_deref_mut(),
        then: None,
    };
    if !backend::kda_step(&mut job).map_err(ModelError::State)? {
        return Ok(None);
    }
    Ok(Some((out, inputs)))
}

/// The sequences of a step as a [`KdaJob`] names them: their rows and
/// carried buffers.
fn job_seqs<'a>(states: &'a mut [&mut KdaState], segs: &[Segment]) -> Vec<KdaSeq<'a>> {
    states
        .iter_mut()
        .zip(segs)
        .map(|(st, seg)| {
            let [q, k, v] = &mut st.conv;
            KdaSeq {
                rows: seg.start..seg.end,
                s: &mut st.s,
                conv: [q, k, v],
            }
        })
        .collect()
}

/// Appends a device step's rows to the journals of the sequences that keep
/// one, from the step's inputs and the delta-rule inputs it returned.
fn record_journals(
    d: &KdaDims,
    states: &mut [&mut KdaState],
    segs: &[Segment],
    proj: &KdaProjections,
    buf: &[f32],
) {
    let (n, p) = (segs.last().map_or(0, |s| s.end), d.width());
    for (st, seg) in states.iter_mut().zip(segs) {
        if let Some(j) = st.journal.as_mut() {
            let pre: [Vec<f32>; 3] =
                std::array::from_fn(|c| proj.pre[c][seg.start * p..seg.end * p].to_vec());
            let heads: Vec<HeadInputs> = (0..d.heads)
                .map(|hh| head_inputs_of(d, buf, n, seg.start..seg.end, hh))
                .collect();
            j.record(&pre, heads.iter());
        }
    }
}

fn heads(
    d: &KdaDims,
    w: &KdaParams<'_>,
    states: &mut [&mut KdaState],
    segs: &[Segment],
    proj: &KdaProjections,
) -> std::result::Result<Vec<f32>, StateError> {
    let (h, kd) = (d.heads, d.head_dim);
    let p = h * kd;
    let n = segs.last().map_or(0, |s| s.end);
    let pre = &proj.pre;
    let mut conv = [vec![0f32; n * p], vec![0f32; n * p], vec![0f32; n * p]];
    let journaling: Vec<bool> = states.iter().map(|s| s.journal.is_some()).collect();
    // States left on the device by earlier steps come back first.
    let mut host: Vec<(&mut Vec<f32>, [&mut Vec<f32>; 3])> = Vec::with_capacity(states.len());
    for st in states.iter_mut() {
        let [q, k, v] = &mut st.conv;
        host.push((
            st.s.host_mut()?,
            [q.host_mut()?, k.host_mut()?, v.host_mut()?],
        ));
    }
    // q, k and v of every sequence, in parallel (each writes its own window).
    let outs: Vec<Vec<f32>> = host
        .par_iter_mut()
        .zip(segs)
        .flat_map(|((_, wins), seg)| {
            let rows = seg.start * p..seg.end * p;
            wins.par_iter_mut().enumerate().map(move |(c, win)| {
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
    let mut per_head: Vec<Vec<&mut [f32]>> = (0..h).map(|_| Vec::new()).collect();
    for (s, _) in host.iter_mut() {
        for (hh, s) in s.chunks_mut(kd * kd).enumerate() {
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
            gated_norm(d, w, g, hh, &mut o);
            (o, inputs)
        })
        .collect();
    drop(host);
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
    Ok(cat)
}

/// Rewinds `st` to the start of its journaled pass and replays the first
/// `keep` positions: the recurrent state and conv windows become bit for bit
/// what a pass of only those positions would have left.
pub fn replay_prefix(
    d: &KdaDims,
    st: &mut KdaState,
    j: &KdaJournal,
    keep: usize,
) -> std::result::Result<(), StateError> {
    let kd = d.head_dim;
    let p = d.width();
    // Both overwritten whole: read the start once, never the current copy.
    st.s.overwrite(&j.s0.read()?);
    let min_len = crate::par_min_len(j.heads.len(), keep * kd * kd * 4);
    st.s.host_mut()?
        .par_chunks_mut(kd * kd)
        .zip(j.heads.par_iter())
        .with_min_len(min_len)
        .for_each(|(s, hi)| {
            let mut o = vec![0f32; keep * kd];
            delta_rule(s, &hi.positions(keep, kd), &mut o);
        });
    let hist = d.conv_kernel - 1;
    for (c, (w0, pre)) in st.conv.iter_mut().zip(j.conv0.iter().zip(&j.pre)) {
        let w0 = w0.read()?;
        // Window after `keep` positions: the last `hist` rows of w0 ++ pre[..keep].
        let rows: Vec<&[f32]> = w0
            .chunks_exact(p)
            .chain(pre.chunks_exact(p).take(keep))
            .collect();
        c.overwrite(&rows[rows.len() - hist..].concat());
    }
    Ok(())
}
