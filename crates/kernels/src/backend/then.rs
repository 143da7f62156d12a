//! What a layer computes between its attention and the point where its
//! experts are chosen, handed to the attention's device call
//! ([`Then`]) so that the layer needs no round trip in between: the
//! residual add, a softmax over depth mixing earlier blocks with the
//! residual (block attention residuals), the RMSNorm, and the products of
//! the normed rows (a MoE layer's router, latent projection and shared
//! experts; a dense layer's gated MLP). [`then_cpu`] is the order every
//! device repeats.

use super::{GluProduct, Hints, MatRef, Role, glu_steps_on};
use crate::expf::exp_fixed;
use crate::ops::GluAct;

/// The most sources (earlier blocks and the residual) a device's mix
/// kernel takes (`glu.cu`'s `MIX_MAX_SOURCES`).
pub const DEVICE_MAX_SOURCES: usize = 64;

/// One product of the normed rows: `y [N, w.rows]`.
pub struct ThenProduct<'a> {
    pub w: MatRef<'a>,
    pub y: &'a mut [f32],
}

/// One gated MLP of the normed rows: `y [N, down.rows] = down(act(gate x, up x))`.
pub struct ThenGlu<'a> {
    pub gate: MatRef<'a>,
    pub up: MatRef<'a>,
    pub down: MatRef<'a>,
    pub y: &'a mut [f32],
}

/// The rest of a layer before its experts are chosen, for the rows
/// `[N, D]` of a step, from the attention's output `a`:
///
/// ```text
/// p = partial + a;   h = depth_mix(blocks…, p) if query, else p
/// x = rms_norm32(h) · norm;   y_i = x W_iᵀ;   y_j = glu_j(x)
/// ```
///
/// A backend that computes all of it in the attention's call sets
/// `done`; otherwise the caller does it. Matrix bytes are stable as for
/// [`super::matmul_stable`].
pub struct Then<'a> {
    pub d: usize,
    /// The residual before the attention's output is added, `[N, D]`.
    pub partial: &'a [f32],
    /// Earlier blocks, each `[N, D]`, mixed with `p` when `query` is set.
    pub blocks: &'a [Vec<f32>],
    /// The site's pseudo-query (its norm weight folded in), `[D]`.
    pub query: Option<&'a [f32]>,
    pub eps: f32,
    /// The RMSNorm's weight, `[D]`.
    pub norm: &'a [f32],
    /// The normed rows `x`, written.
    pub x: &'a mut [f32],
    pub plain: Vec<ThenProduct<'a>>,
    pub glu: Vec<ThenGlu<'a>>,
    pub act: GluAct,
    /// Set by a backend that wrote `x` and every `y`.
    pub done: bool,
}

impl Then<'_> {
    /// Rows in the step.
    pub fn rows(&self) -> usize {
        self.partial.len() / self.d.max(1)
    }

    /// Whether every buffer has the length the shapes ask for.
    pub fn is_consistent(&self) -> bool {
        let (d, nd) = (self.d, self.partial.len());
        let n = self.rows();
        d > 0
            && nd == n * d
            && self.x.len() == nd
            && self.blocks.iter().all(|b| b.len() == nd)
            && self.query.is_none_or(|q| q.len() == d)
            && self.norm.len() == d
            && self
                .plain
                .iter()
                .all(|p| p.w.cols() == d && p.y.len() == n * p.w.rows())
            && self.glu.iter().all(|g| {
                let f = g.gate.rows();
                g.gate.cols() == d
                    && (g.up.rows(), g.up.cols()) == (f, d)
                    && g.down.cols() == f
                    && g.y.len() == n * g.down.rows()
            })
    }
}

/// `softmax` with [`exp_fixed`] (a device repeats it): the maximum by
/// `f32::max` from −∞, each `exp_fixed(v − max)`, their sum in order, each
/// divided by it.
pub fn softmax_fixed(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0f32;
    for v in x.iter_mut() {
        *v = exp_fixed(*v - m);
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// `Σ aᵢbᵢ` in the matrix products' order (`formats::block_scalar`: 32
/// lanes of fused sums over the columns `l, l + 32, …`, folded in halves),
/// which a device's warp repeats with short chains: a row of 7168 is 224
/// steps a lane (the 8-lane `dot_lanes` would be 896).
pub fn dot32(a: &[f32], b: &[f32]) -> f32 {
    let mut y = [0f32];
    MatRef::F32 {
        w: b,
        rows: 1,
        cols: b.len(),
    }
    .cpu(&a[..b.len()], 1, &mut y);
    y[0]
}

/// `1 / sqrt(dot32(x, x) / len + ε)`.
pub fn rms_inv32(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot32(x, x) / x.len() as f32 + eps).sqrt()
}

/// RMSNorm of every `d`-wide row of `x` with [`rms_inv32`]: `v · r · w`.
pub fn rms_norm32_rows(x: &mut [f32], d: usize, w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(d) {
        let r = rms_inv32(row, eps);
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * r * g;
        }
    }
}

/// Block attention residuals' softmax over depth: per row,
/// `Σ_n p_n V_n` with `V = [blocks…, partial]`, `p = softmax_fixed_n(
/// rms_inv32(V_n) · dot32(V_n, query))`, the weighted sum from zero in
/// source order, each product rounded and then added.
pub fn depth_mix(
    partial: &[f32],
    blocks: &[Vec<f32>],
    query: &[f32],
    d: usize,
    eps: f32,
) -> Vec<f32> {
    let t = partial.len() / d;
    let n = blocks.len() + 1;
    let mut out = vec![0f32; t * d];
    let mut p = vec![0f32; n];
    for ti in 0..t {
        let row = |j: usize| -> &[f32] {
            let src = if j < blocks.len() {
                &blocks[j]
            } else {
                partial
            };
            &src[ti * d..(ti + 1) * d]
        };
        for (j, pj) in p.iter_mut().enumerate() {
            let v = row(j);
            *pj = rms_inv32(v, eps) * dot32(v, query);
        }
        softmax_fixed(&mut p);
        let o = &mut out[ti * d..(ti + 1) * d];
        for (j, &pj) in p.iter().enumerate() {
            for (a, &x) in o.iter_mut().zip(row(j)) {
                *a += pj * x;
            }
        }
    }
    out
}

/// The normed rows `x` of [`Then`] from the attention's output `a`, on
/// the CPU.
pub fn then_mix(then: &Then<'_>, a: &[f32]) -> Vec<f32> {
    let mut p = then.partial.to_vec();
    p.iter_mut().zip(a).for_each(|(v, b)| *v += b);
    let mut x = match then.query {
        Some(q) => depth_mix(&p, then.blocks, q, then.d, then.eps),
        None => p,
    };
    rms_norm32_rows(&mut x, then.d, then.norm, then.eps);
    x
}

/// All of [`Then`] on the CPU kernels (what a device's call must equal),
/// `x` and every `y` written; `done` is left as it is.
pub fn then_cpu(then: &mut Then<'_>, a: &[f32]) {
    let x = then_mix(then, a);
    let n = then.rows();
    for p in then.plain.iter_mut() {
        p.w.cpu(&x, n, p.y);
    }
    let mut jobs: Vec<GluProduct<'_, '_>> = then
        .glu
        .iter_mut()
        .map(|g| GluProduct {
            gate: g.gate,
            up: g.up,
            down: g.down,
            role: Role::Spine,
            x: &x,
            t: n,
            y: &mut *g.y,
        })
        .collect();
    glu_steps_on(None, &mut jobs, then.act, &Hints::default());
    drop(jobs);
    then.x.copy_from_slice(&x);
}
