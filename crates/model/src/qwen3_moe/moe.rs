//! The Qwen3-MoE sparse block: softmax router, top-k, SwiGLU experts, no
//! shared expert.
//!
//! ```text
//! p = softmax(x W_gateᵀ)  (fp32, over all experts);  T = top-k of p
//! w_e = p_e  (or p_e / Σ_T p  with norm_topk_prob)
//! y = Σ_{e∈T} w_e · down_e(SiLU(gate_e x) ⊙ up_e x)
//! ```
//! Every chosen expert is computed — the source must deliver all of them;
//! the union of a step's experts is fetched once and each row's sum runs
//! in the router's rank order ([`crate::moe::ExpertFetch`]).

use fathom_kernels::ops::{GluAct, softmax};

use super::config::Qwen3MoeSpec;
use super::weights::MoeWeights;
use crate::batch::Path;
use crate::error::Result;
use crate::experts::ExpertSource;
use crate::moe::{ExpertFetch, GluExpert, Route, Tail, guess_next};

/// Routes every row of `x [T, D]`: experts by descending probability (ties
/// to the lower index); the margin is on the router logits.
pub fn route(spec: &Qwen3MoeSpec, w: &MoeWeights, x: &[f32], t: usize) -> Vec<Route> {
    routes_of(spec, &w.gate.forward(x, t))
}

/// [`route`] from the router's logits `[T, E]`.
pub fn routes_of(spec: &Qwen3MoeSpec, logits: &[f32]) -> Vec<Route> {
    let (e, k) = (spec.num_experts, spec.top_k);
    logits
        .chunks_exact(e)
        .map(|row| {
            let mut p = row.to_vec();
            softmax(&mut p);
            let mut order: Vec<u32> = (0..e as u32).collect();
            order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
            let ids: Vec<u32> = order[..k].to_vec();
            let margin = if k < e {
                row[order[k - 1] as usize] - row[order[k] as usize]
            } else {
                f32::INFINITY
            };
            let mut weights: Vec<f32> = ids.iter().map(|&i| p[i as usize]).collect();
            if spec.norm_topk_prob {
                let sum: f32 = weights.iter().sum();
                weights.iter_mut().for_each(|v| *v /= sum);
            }
            Route {
                ids,
                weights,
                margin,
            }
        })
        .collect()
}

/// Optional guess for the next MoE layer, handed to the source before this
/// layer's experts are fetched so its I/O overlaps this layer's compute.
pub struct NextLayerHint<'a> {
    pub layer: usize,
    pub weights: &'a MoeWeights,
}

/// The sparse block over `x [T, D]` (already `post_attention_layernorm`ed)
/// in a step on `path`.
#[allow(clippy::too_many_arguments)]
pub fn moe(
    spec: &Qwen3MoeSpec,
    path: Path,
    layer: usize,
    w: &MoeWeights,
    x: &[f32],
    source: &dyn ExpertSource,
    hint: Option<NextLayerHint<'_>>,
    routes_out: Option<&mut Vec<Route>>,
    logits: Option<Vec<f32>>,
) -> Result<Vec<f32>> {
    let d = spec.hidden_size;
    let t = x.len() / d;
    let routes = match logits {
        Some(l) => routes_of(spec, &l),
        None => route(spec, w, x, t),
    };
    let guess =
        hint.and_then(|h| guess_next(source, h.layer, spec.top_k, || route(spec, h.weights, x, t)));
    let fetch = ExpertFetch::start(path, source, layer, &routes)?.with_guess(guess);
    // One expert on `x [n, D]`: `down(SiLU(gate x) ⊙ up x)` → `[n, D]`.
    let expert = GluExpert {
        gate: 0,
        up: 1,
        down: 2,
        inter: spec.moe_intermediate_size,
        act: GluAct::Swiglu,
    };
    // With a device, the sums are made there too: one row a token comes
    // back instead of one an expert.
    let y = fetch
        .finish_tail(source, &routes, x, d, &expert, Tail::default())?
        .into_sums();
    if let Some(ro) = routes_out {
        ro.extend(routes);
    }
    Ok(y)
}
