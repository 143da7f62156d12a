//! The Kimi-Linear sparse block: a group-limited sigmoid router with a
//! selection bias ([`crate::moe::SigmoidRouter`]), SwiGLU experts (bf16) on
//! the full hidden width, plus the shared experts.
//!
//! ```text
//! y = Σ_{e∈T} w_e · w2_e(SiLU(w1_e x) ⊙ w3_e x) + SharedMLP(x)
//! ```
//! The union of a step's experts is fetched once; each row's sum runs in
//! the router's rank order ([`crate::moe::ExpertFetch`]).

use fathom_kernels::ops::swiglu;

use super::config::KimiLinearSpec;
use super::weights::MoeWeights;
use crate::error::Result;
use crate::experts::{ExpertSource, ExpertWeights};
use crate::moe::{ExpertFetch, Route, hint_order};

/// Routes every row of `x [T, D]`.
pub fn route(spec: &KimiLinearSpec, w: &MoeWeights, x: &[f32], t: usize) -> Vec<Route> {
    let router = spec.router();
    w.gate
        .forward(x, t)
        .chunks_exact(spec.num_experts)
        .map(|row| router.route(row, &w.e_score_correction_bias))
        .collect()
}

/// One expert on `x [n, D]`: `w2(SiLU(w1 x) ⊙ w3 x)` → `[n, D]`.
fn expert_forward(spec: &KimiLinearSpec, e: &ExpertWeights, x: &[f32], n: usize) -> Vec<f32> {
    let f = spec.moe_intermediate_size;
    let mut g = vec![0f32; n * f];
    let mut u = vec![0f32; n * f];
    e.matmul(0, x, n, &mut g);
    e.matmul(2, x, n, &mut u);
    swiglu(&mut g, &u);
    let mut y = vec![0f32; n * spec.hidden_size];
    e.matmul(1, &g, n, &mut y);
    y
}

/// Optional guess for the next MoE layer (see [`crate::moe::hint_order`]).
pub struct NextLayerHint<'a> {
    pub layer: usize,
    pub weights: &'a MoeWeights,
}

/// The sparse block over `x [T, D]` (already `post_attention_layernorm`ed).
pub fn moe(
    spec: &KimiLinearSpec,
    layer: usize,
    w: &MoeWeights,
    x: &[f32],
    source: &dyn ExpertSource,
    hint: Option<NextLayerHint<'_>>,
    routes_out: Option<&mut Vec<Route>>,
) -> Result<Vec<f32>> {
    let d = spec.hidden_size;
    let t = x.len() / d;
    let routes = route(spec, w, x, t);
    if let Some(h) = hint.filter(|_| source.wants_hints()) {
        let guesses = route(spec, h.weights, x, t);
        source.hint(h.layer, &hint_order(&guesses, spec.top_k));
    }
    // Start the reads, run the shared experts while they arrive.
    let fetch = ExpertFetch::start(source, layer, &routes)?;
    let shared = w.shared_experts.as_ref().map(|sh| sh.forward(x, t, swiglu));
    let work = 3 * spec.moe_intermediate_size * d;
    let mut y = fetch.finish(source, &routes, x, d, work, |e, rows, n| {
        expert_forward(spec, e, rows, n)
    })?;
    if let Some(s) = shared {
        y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
    }
    if let Some(ro) = routes_out {
        ro.extend(routes);
    }
    Ok(y)
}
