//! A MoE layer's routed experts through their combine as one backend call
//! ([`super::Backend::moe_tail`]): the experts, each row's rank-order sum,
//! and optionally the latent RMS norm and the output projection, so only
//! the layer's inputs go to the device and only its output comes back.
//! [`moe_tail_cpu`] is the twin that defines every operation's order.

use super::MatRef;
use crate::ops::{GluAct, rms_norm};

/// One routed expert of a [`MoeTail`]: `down(act(x gateᵀ, x upᵀ))` on its
/// own rows `x [t, gate.cols]`, the matrices' bytes stable as for
/// [`super::matmul_stable`].
#[derive(Clone, Copy)]
pub struct TailExpert<'w, 'b> {
    pub gate: MatRef<'w>,
    pub up: MatRef<'w>,
    pub down: MatRef<'w>,
    pub x: &'b [f32],
    pub t: usize,
}

/// What a MoE layer computes from its routed experts' inputs:
///
/// ```text
/// o_e = down_e(act(gate_e x_e, up_e x_e))            (each expert, its rows)
/// s_r = Σ_{j<k} w_{r,j} · o[pick_{r,j}]              (from 0, in rank order j;
///                                                     each product rounded, then added)
/// s_r = RMSNorm(s_r, norm)                           (if `norm`)
/// y   = s Upᵀ                                        (if `up`; else y = s)
/// ```
/// `picks[r·k + j]` is (expert index, row of its output) and
/// `weights[r·k + j]` its combine weight; `y` is `[R, up.rows]` (or `[R,
/// width]` without `up`), `R = picks.len() / k`.
pub struct MoeTail<'w, 'b> {
    pub experts: &'b [TailExpert<'w, 'b>],
    pub act: GluAct,
    pub k: usize,
    pub picks: &'b [(u32, u32)],
    pub weights: &'b [f32],
    /// The norm's weight and ε.
    pub norm: Option<(&'b [f32], f32)>,
    pub up: Option<MatRef<'w>>,
    pub y: &'b mut [f32],
}

impl MoeTail<'_, '_> {
    /// The experts' output width (their downs' rows); 0 with none.
    pub fn width(&self) -> usize {
        self.experts.first().map_or(0, |e| e.down.rows())
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.picks.len().checked_div(self.k).unwrap_or(0)
    }

    /// Whether the lengths agree: every expert's matrices chain (gate and
    /// up of one shape, down reading their rows, one output width), its
    /// input holds its rows, every pick names a row that exists, the norm
    /// and `up` take the width, `y` holds the output.
    pub fn is_consistent(&self) -> bool {
        let width = self.width();
        let expert_ok = |e: &TailExpert<'_, '_>| {
            let (f, cols) = (e.gate.rows(), e.gate.cols());
            (e.up.rows(), e.up.cols()) == (f, cols)
                && e.down.cols() == f
                && e.down.rows() == width
                && f > 0
                && e.t > 0
                && e.x.len() == e.t * cols
        };
        let picks_ok = self.picks.iter().all(|&(e, n)| {
            self.experts
                .get(e as usize)
                .is_some_and(|x| (n as usize) < x.t)
        });
        let out_w = self.up.map_or(width, |u| u.rows());
        self.k > 0
            && width > 0
            && self.experts.iter().all(expert_ok)
            && self.picks.len().is_multiple_of(self.k)
            && self.weights.len() == self.picks.len()
            && picks_ok
            && self.norm.is_none_or(|(w, _)| w.len() == width)
            && self.up.is_none_or(|u| u.cols() == width)
            && self.y.len() == self.rows() * out_w
    }
}

/// The CPU twin of [`super::Backend::moe_tail`] (see [`MoeTail`]): each
/// expert's products on the CPU kernels with `act` between them, the sums
/// in rank order, the norm as [`rms_norm`], then `up`'s product.
pub fn moe_tail_cpu(tail: &mut MoeTail<'_, '_>) {
    let width = tail.width();
    let outs: Vec<Vec<f32>> = tail
        .experts
        .iter()
        .map(|e| {
            let f = e.gate.rows();
            let mut g = vec![0f32; e.t * f];
            let mut u = vec![0f32; e.t * f];
            e.gate.cpu(e.x, e.t, &mut g);
            e.up.cpu(e.x, e.t, &mut u);
            tail.act.apply(&mut g, &u);
            let mut o = vec![0f32; e.t * width];
            e.down.cpu(&g, e.t, &mut o);
            o
        })
        .collect();
    let rows = tail.rows();
    let mut s = vec![0f32; rows * width];
    for (r, sr) in s.chunks_exact_mut(width).enumerate() {
        for j in 0..tail.k {
            let (e, n) = tail.picks[r * tail.k + j];
            let wj = tail.weights[r * tail.k + j];
            let o = &outs[e as usize][n as usize * width..][..width];
            for (a, &b) in sr.iter_mut().zip(o) {
                *a += wj * b;
            }
        }
        if let Some((w, eps)) = tail.norm {
            rms_norm(sr, w, eps);
        }
    }
    match tail.up {
        Some(up) => up.cpu(&s, rows, tail.y),
        None => tail.y.copy_from_slice(&s),
    }
}
