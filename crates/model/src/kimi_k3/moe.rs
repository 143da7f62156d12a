//! Dense SiTU MLP and the stable LatentMoE (docs/k3-model.md §6).
//!
//! ```text
//! s = σ(x W_routerᵀ)  (fp32);  T = top-k of s + e_score_correction_bias
//! w_e = s_e / (Σ_{T} s + 1e-20) · routed_scaling_factor
//! z = x W_downᵀ;  y = Σ_{e∈T} w_e W2_e(SiTU-GLU(W1_e z, W3_e z));  y = RMSNorm(y)
//! out = y W_upᵀ + SharedMLP(x)
//! ```
//! Every chosen expert is computed — the source must deliver all of them.
//! For T > 1 the union of the positions' experts is fetched once and each
//! expert runs on all its tokens at once; per-token sums are accumulated in
//! the router's rank order, so the result does not depend on T.

use fathom_kernels::backend::{self, GluProduct, Hints, Product, Role, ThenGlu, ThenProduct};
use fathom_kernels::ops::{GluAct, rms_norm};

use super::config::K3Spec;
use super::tensors::ExpertMatrix;
use super::weights::{MlpWeights, MoeWeights};
use crate::batch::Path;
use crate::early::MoeFirst;
use crate::error::Result;
use crate::experts::ExpertSource;
use crate::moe::{ExpertFetch, Finished, GluExpert, SigmoidRouter, Tail, guess_next};

/// The router's decision for one token: experts by best corrected score,
/// combine weights from the uncorrected scores (renormalised and scaled),
/// margin on the corrected scores.
pub use crate::moe::Route;

/// `down(SiTU-GLU(gate(x), up(x)))` over `[T, D]`.
pub fn mlp(spec: &K3Spec, w: &MlpWeights, x: &[f32], t: usize) -> Vec<f32> {
    w.forward(x, t, situ(spec))
}

/// The SiTU-GLU of `spec`.
pub(super) fn situ(spec: &K3Spec) -> GluAct {
    GluAct::Situ {
        beta: spec.situ_beta,
        beta_lin: spec.situ_linear_beta,
    }
}

/// Routes every row of `x [T, D]`.
pub fn route(spec: &K3Spec, w: &MoeWeights, x: &[f32], t: usize) -> Vec<Route> {
    routes_of(spec, w, &w.gate.forward(x, t))
}

/// The routes of the router's logits `[T, E]`.
fn routes_of(spec: &K3Spec, w: &MoeWeights, logits: &[f32]) -> Vec<Route> {
    let router = SigmoidRouter {
        top_k: spec.top_k,
        groups: 1,
        topk_group: 1,
        renormalize: spec.moe_renormalize,
        scaling: spec.routed_scaling_factor,
    };
    logits
        .chunks_exact(spec.num_experts)
        .map(|row| router.route(row, &w.e_score_correction_bias))
        .collect()
}

/// What a MoE layer computes from its input before the routed experts:
/// the router's logits, the latent down-projection `z`, the shared
/// experts' output — in one device call ([`backend::glu_mixed_taken`];
/// each the bits of its own call); `None` when no device takes it.
fn spine_first(spec: &K3Spec, w: &MoeWeights, x: &[f32], t: usize) -> Option<SpineFirst> {
    let SpineFirst {
        mut logits,
        mut z,
        mut shared,
    } = SpineFirst::room(w, t);
    let mut plain = [
        Product {
            w: w.gate.as_mat(),
            role: Role::Spine,
            x,
            t,
            y: &mut logits,
        },
        Product {
            w: w.routed_expert_down_proj.as_mat(),
            role: Role::Spine,
            x,
            t,
            y: &mut z,
        },
    ];
    let mut job: Vec<GluProduct<'_, '_>> = match (&w.shared_experts, shared.as_deref_mut()) {
        (Some(sh), Some(y)) => vec![sh.job(x, t, y)],
        _ => Vec::new(),
    };
    let taken = backend::glu_mixed_taken(&mut plain, &mut job, situ(spec), &Hints::default());
    drop((plain, job));
    taken.then_some(SpineFirst { logits, z, shared })
}

/// The router's logits `[T, E]`, the latent projection `z [T, L]` and the
/// shared experts' output `[T, D]`, computed before the routed experts.
pub(super) struct SpineFirst {
    pub(super) logits: Vec<f32>,
    pub(super) z: Vec<f32>,
    pub(super) shared: Option<Vec<f32>>,
}

impl MoeFirst for SpineFirst {
    type Weights = MoeWeights;

    fn room(w: &MoeWeights, t: usize) -> Self {
        SpineFirst {
            logits: vec![0f32; t * w.gate.rows],
            z: vec![0f32; t * w.routed_expert_down_proj.rows],
            shared: w
                .shared_experts
                .as_ref()
                .map(|sh| vec![0f32; t * sh.down_proj.rows]),
        }
    }

    /// The router, the latent projection; the shared experts gated.
    fn then_parts<'a>(&'a mut self, w: &'a MoeWeights) -> (Vec<ThenProduct<'a>>, Vec<ThenGlu<'a>>) {
        let plain = vec![
            ThenProduct {
                w: w.gate.as_mat(),
                y: &mut self.logits,
            },
            ThenProduct {
                w: w.routed_expert_down_proj.as_mat(),
                y: &mut self.z,
            },
        ];
        let glu = match (&w.shared_experts, self.shared.as_deref_mut()) {
            (Some(sh), Some(y)) => vec![sh.then_glu(y)],
            _ => Vec::new(),
        };
        (plain, glu)
    }
}

/// Optional guess for the next MoE layer, handed to the source before this
/// layer's experts are fetched so its I/O overlaps this layer's compute.
pub struct NextLayerHint<'a> {
    pub layer: usize,
    pub weights: &'a MoeWeights,
}

/// LatentMoE over `x [T, D]` (already `post_attention_layernorm`ed) in a
/// step on `path`;
/// `early`, when a device already computed them, the layer's first
/// products of `x`.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe(
    spec: &K3Spec,
    path: Path,
    layer: usize,
    w: &MoeWeights,
    x: &[f32],
    t: usize,
    source: &dyn ExpertSource,
    hint: Option<NextLayerHint<'_>>,
    routes_out: Option<&mut Vec<Route>>,
    early: Option<SpineFirst>,
) -> Result<Vec<f32>> {
    // With a device that takes them, the router, the latent projection and
    // the shared experts go in one call (two round trips saved); on the
    // CPU the routes come first, so the expert reads start before the CPU
    // computes the rest while they arrive.
    let early = early.or_else(|| path.device().then(|| spine_first(spec, w, x, t)).flatten());
    let routes = match &early {
        Some(e) => routes_of(spec, w, &e.logits),
        None => route(spec, w, x, t),
    };
    let guess =
        hint.and_then(|h| guess_next(source, h.layer, spec.top_k, || route(spec, h.weights, x, t)));
    let fetch = ExpertFetch::start(path, source, layer, &routes)?.with_guess(guess);
    let l = spec.latent_size;
    let (z, shared) = match early {
        Some(e) => (e.z, e.shared),
        None => (
            w.routed_expert_down_proj.forward(x, t),
            w.shared_experts.as_ref().map(|sh| mlp(spec, sh, x, t)),
        ),
    };
    // One expert on `z [n, L]`: `W2(SiTU-GLU(W1 z, W3 z))` → `[n, L]`.
    let expert = GluExpert {
        gate: ExpertMatrix::W1 as usize,
        up: ExpertMatrix::W3 as usize,
        down: ExpertMatrix::W2 as usize,
        inter: spec.moe_intermediate_size,
        act: situ(spec),
    };
    // With a device, the experts, their sums, the norm and the
    // up-projection may go in one call (the same operations either way).
    let norm = spec.latent_moe_use_norm;
    let tail = Tail {
        norm: norm.then_some((&w.routed_expert_norm[..], spec.rms_norm_eps)),
        up: Some(w.routed_expert_up_proj.as_mat()),
    };
    let mut out = match fetch.finish_tail(source, &routes, &z, l, &expert, tail)? {
        Finished::Tail(out) => out,
        Finished::Summed(mut y) => {
            if norm {
                for yr in y.chunks_exact_mut(l) {
                    rms_norm(yr, &w.routed_expert_norm, spec.rms_norm_eps);
                }
            }
            w.routed_expert_up_proj.forward(&y, t)
        }
    };
    if let Some(s) = shared {
        out.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
    }
    if let Some(ro) = routes_out {
        ro.extend(routes);
    }
    Ok(out)
}
