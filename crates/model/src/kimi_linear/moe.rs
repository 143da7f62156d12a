//! The Kimi-Linear sparse block: the shared sigmoid-routed block
//! ([`crate::moe::SigmoidMoe`]: a group-limited router with a selection
//! bias, bf16 SwiGLU experts `w1, w2, w3` on the full hidden width, plus
//! the shared experts) with this family's dimensions.
//!
//! ```text
//! y = Σ_{e∈T} w_e · w2_e(SiLU(w1_e x) ⊙ w3_e x) + SharedMLP(x)
//! ```

use super::config::KimiLinearSpec;
use super::weights::MoeWeights;
use crate::batch::Path;
use crate::error::Result;
use crate::experts::ExpertSource;
use crate::moe::{Route, SigmoidFirst};

/// Routes every row of `x [T, D]`.
pub fn route(spec: &KimiLinearSpec, w: &MoeWeights, x: &[f32], t: usize) -> Vec<Route> {
    spec.sparse_block().route(w, x, t)
}

/// Optional guess for the next MoE layer (see [`crate::moe::hint_order`]).
pub struct NextLayerHint<'a> {
    pub layer: usize,
    pub weights: &'a MoeWeights,
}

/// The sparse block over `x [T, D]` (already `post_attention_layernorm`ed)
/// in a step on `path`;
/// `first`: its router's logits and shared experts' output when a device
/// computed them in the attention's call.
#[allow(clippy::too_many_arguments)]
pub fn moe(
    spec: &KimiLinearSpec,
    path: Path,
    layer: usize,
    w: &MoeWeights,
    x: &[f32],
    source: &dyn ExpertSource,
    hint: Option<NextLayerHint<'_>>,
    routes_out: Option<&mut Vec<Route>>,
    first: Option<SigmoidFirst>,
) -> Result<Vec<f32>> {
    let next = hint.map(|h| (h.layer, h.weights));
    spec.sparse_block()
        .forward(path, layer, w, x, source, next, routes_out, first)
}
