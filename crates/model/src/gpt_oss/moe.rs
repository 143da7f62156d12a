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

use std::sync::Arc;

use fathom_kernels::backend::{Hints, MatRef, Product, Role, matmul_batch_stable};
use fathom_kernels::ops::{sigmoid, softmax};

use super::config::GptOssSpec;
use super::weights::RouterWeights;
use crate::batch::Path;
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
    let mut gu = vec![0f32; n * 2 * spec.intermediate_size];
    e.matmul(0, x, n, &mut gu);
    let act = clamped_swiglu(spec, &gu);
    let mut y = vec![0f32; n * spec.hidden_size];
    e.matmul(1, &act, n, &mut y);
    y
}

/// The clamped SwiGLU of interleaved `[g | u]` pairs.
fn clamped_swiglu(spec: &GptOssSpec, gu: &[f32]) -> Vec<f32> {
    let (limit, alpha) = (spec.swiglu_limit, spec.swiglu_alpha);
    gu.chunks_exact(2)
        .map(|p| {
            let g = p[0].min(limit);
            let u = p[1].clamp(-limit, limit);
            (u + 1.0) * (g * sigmoid(g * alpha))
        })
        .collect()
}

/// [`expert_forward`] for every expert of a layer's union at once, when
/// all are MXFP4: each of the two products of every expert in one batch
/// (one device call where the backend takes it; the same kernels and bits
/// as one product at a time), the biases and the activation between on
/// the host as before. `None` for other formats.
fn experts_batched(
    spec: &GptOssSpec,
    experts: &[Arc<ExpertWeights>],
    inputs: &[Vec<f32>],
    ns: &[usize],
) -> Option<Vec<Vec<f32>>> {
    let mats =
        |i: usize| -> Option<Vec<MatRef<'_>>> { experts.iter().map(|e| e.mxfp4_mat(i)).collect() };
    let (first, second) = (mats(0)?, mats(1)?);
    let product = |ws: &[MatRef<'_>], xs: &[Vec<f32>], width: usize, i: usize| {
        let mut ys: Vec<Vec<f32>> = ns.iter().map(|&n| vec![0f32; n * width]).collect();
        let mut batch: Vec<Product<'_, '_>> = ws
            .iter()
            .zip(xs)
            .zip(ns)
            .zip(ys.iter_mut())
            .map(|(((&w, x), &t), y)| Product {
                w,
                role: Role::Expert,
                x,
                t,
                y,
            })
            .collect();
        matmul_batch_stable(&mut batch, &Hints::default());
        drop(batch);
        for (e, y) in experts.iter().zip(&mut ys) {
            e.after_product(i, y);
        }
        ys
    };
    let gu = product(&first, inputs, 2 * spec.intermediate_size, 0);
    let act: Vec<Vec<f32>> = gu.iter().map(|g| clamped_swiglu(spec, g)).collect();
    Some(product(&second, &act, spec.hidden_size, 1))
}

/// The sparse block of layer `layer` over `x [T, D]` (already
/// `post_attention_layernorm`ed) in a step on `path`. `next` is the next layer (index and
/// router), whose routes from this input are handed to the source as a
/// guess; `routes_out` receives the routes (tracing); `product` is the
/// router's product when a device made it in the attention's call.
#[allow(clippy::too_many_arguments)]
pub fn moe(
    spec: &GptOssSpec,
    path: Path,
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
    let fetch = ExpertFetch::start(path, source, layer, &routes)?;
    let work = 3 * spec.intermediate_size * d;
    let batch = |es: &[Arc<ExpertWeights>], xs: &[Vec<f32>], ns: &[usize]| {
        experts_batched(spec, es, xs, ns)
    };
    let y = fetch.finish_batched(source, &routes, x, (d, work), &batch, |e, rows, n| {
        expert_forward(spec, e, rows, n)
    })?;
    if let Some(ro) = routes_out {
        ro.extend(routes);
    }
    Ok(y)
}
