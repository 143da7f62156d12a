//! Kimi Delta Attention's per-sequence arithmetic: the short causal
//! convolution and the gated delta rule (k3-model.md §4).
//!
//! The step recurrence defines the arithmetic: a T-position call runs the
//! positions in order and is bit-identical to T one-position calls. Within
//! a position every operation is element-wise over the value dimension (no
//! reduction whose order could vary), so the AVX2 build of the same code
//! ([`delta_rule`] picks it when the kernel set allows) gives the same bits
//! as the baseline twin [`delta_rule_scalar`].

use crate::ops::{sigmoid, silu};

/// Depthwise causal convolution + SiLU over `pre [T, P]`, using and updating
/// `window` (`[kernel−1, P]`, the previous pre-convolution rows).
pub fn short_conv(
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
            *v = silu(acc);
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
        Some(lb) => lb * sigmoid(a * z),
        None => -a * softplus(z),
    }
}

#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
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
            let alpha = la[kk].exp();
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
    #[cfg(target_arch = "x86_64")]
    if matches!(crate::kernels().isa, crate::Isa::Avx2 | crate::Isa::Avx512) {
        // SAFETY: the kernel table is AVX2 or AVX-512 only on CPUs that report AVX2.
        unsafe { delta_rule_avx2(s, x, out) };
        return;
    }
    delta_rule_impl(s, x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn delta_rule_avx2(s: &mut [f32], x: &DeltaInputs<'_>, out: &mut [f32]) {
    delta_rule_impl(s, x, out)
}

/// The twin: the same arithmetic for the baseline instruction set.
pub fn delta_rule_scalar(s: &mut [f32], x: &DeltaInputs<'_>, out: &mut [f32]) {
    delta_rule_impl(s, x, out)
}
