//! The GPT-OSS sparse block: a biased linear router, softmax over the
//! chosen top-k logits, and clamped-SwiGLU experts whose matrices (stored
//! input-major) and biases come from the expert source.
//!
//! ```text
//! z = x W_rᵀ + b_r;  T = top-k of z;  w_e = softmax_{e∈T}(z_e)
//! [g | u] = x·W_gu,e + b_gu,e           (gate and up interleaved: g = even, u = odd columns)
//! g ← min(g, limit);  u ← clamp(u, −limit, limit)
//! y = Σ_{e∈T} w_e · (((u + 1) ⊙ g ⊙ σ(alpha·g))·W_down,e + b_down,e)
//! ```
//! The union of a step's experts is fetched once and each row's sum runs
//! in the router's rank order ([`crate::moe::ExpertFetch`]).

use fathom_kernels::ops::{sigmoid, softmax};

use super::config::GptOssSpec;
use super::weights::RouterWeights;
use crate::error::Result;
use crate::experts::{ExpertSource, ExpertWeights};
use crate::moe::{ExpertFetch, Route, hint_order};

/// Routes every row of `x [T, D]`: experts by descending router logit
/// (ties to the lower index); the margin is on the logits.
pub fn route(spec: &GptOssSpec, w: &RouterWeights, x: &[f32], t: usize) -> Vec<Route> {
    routes_of(spec, w, w.weight.forward(x, t))
}

/// [`route`] from the router's product `x Wᵀ` (`[T, E]`, its bias not yet
/// added).
pub fn routes_of(spec: &GptOssSpec, w: &RouterWeights, mut logits: Vec<f32>) -> Vec<Route> {
    let (e, k) = (spec.num_experts, spec.top_k);
    logits
        .chunks_exact_mut(e)
        .map(|row| {
            row.iter_mut().zip(&w.bias).for_each(|(z, b)| *z += b);
            let mut order: Vec<u32> = (0..e as u32).collect();
            order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            let ids: Vec<u32> = order[..k].to_vec();
            let margin = if k < e {
                row[order[k - 1] as usize] - row[order[k] as usize]
            } else {
                f32::INFINITY
            };
            let mut weights: Vec<f32> = ids.iter().map(|&i| row[i as usize]).collect();
            softmax(&mut weights);
            Route {
                ids,
                weights,
                margin,
            }
        })
        .collect()
}

/// One expert on `x [n, D]` → `[n, D]`.
fn expert_forward(spec: &GptOssSpec, e: &ExpertWeights, x: &[f32], n: usize) -> Vec<f32> {
    let f = spec.intermediate_size;
    let (limit, alpha) = (spec.swiglu_limit, spec.swiglu_alpha);
    let mut gu = vec![0f32; n * 2 * f];
    e.matmul(0, x, n, &mut gu);
    let act: Vec<f32> = gu
        .chunks_exact(2)
        .map(|p| {
            let g = p[0].min(limit);
            let u = p[1].clamp(-limit, limit);
            (u + 1.0) * (g * sigmoid(g * alpha))
        })
        .collect();
    let mut y = vec![0f32; n * spec.hidden_size];
    e.matmul(1, &act, n, &mut y);
    y
}

/// The sparse block of layer `layer` over `x [T, D]` (already
/// `post_attention_layernorm`ed). `next` is the next layer (index and
/// router), whose routes from this input are handed to the source as a
/// guess; `routes_out` receives the routes (tracing); `product` is the
/// router's product when a device made it in the attention's call.
#[allow(clippy::too_many_arguments)]
pub fn moe(
    spec: &GptOssSpec,
    layer: usize,
    w: &RouterWeights,
    x: &[f32],
    source: &dyn ExpertSource,
    next: Option<(usize, &RouterWeights)>,
    routes_out: Option<&mut Vec<Route>>,
    product: Option<Vec<f32>>,
) -> Result<Vec<f32>> {
    let d = spec.hidden_size;
    let t = x.len() / d;
    let routes = match product {
        Some(p) => routes_of(spec, w, p),
        None => route(spec, w, x, t),
    };
    if let Some((nl, nw)) = next.filter(|_| source.wants_hints()) {
        let guesses = route(spec, nw, x, t);
        source.hint(nl, &hint_order(&guesses, spec.top_k));
    }
    let fetch = ExpertFetch::start(source, layer, &routes)?;
    let work = 3 * spec.intermediate_size * d;
    let y = fetch.finish(source, &routes, x, d, work, |e, rows, n| {
        expert_forward(spec, e, rows, n)
    })?;
    if let Some(ro) = routes_out {
        ro.extend(routes);
    }
    Ok(y)
}
