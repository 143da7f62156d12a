//! The sigmoid-routed sparse block with shared experts (Kimi-Linear,
//! DeepSeek-V3 / Kimi K2), and its part before the experts' choice that a
//! device may take in the attention's call.

use fathom_kernels::ops::GluAct;

use super::*;
use crate::linear::Linear;
use crate::mlp::MlpWeights;

/// What a sigmoid-routed sparse block holds besides its routed experts:
/// the router `[E, D]` (kept in its stored precision: it picks experts),
/// its selection bias and the shared experts, if any.
#[derive(Debug)]
pub struct SigmoidMoeWeights {
    pub gate: Linear,
    pub e_score_correction_bias: Vec<f32>,
    pub shared_experts: Option<MlpWeights>,
}

/// The sigmoid-routed sparse block of Kimi-Linear and DeepSeek-V3 / Kimi
/// K2: a [`SigmoidRouter`], SwiGLU experts on the full hidden width (the
/// expert table lists gate, down, up), plus the shared experts.
///
/// ```text
/// y = Σ_{e∈T} w_e · down_e(SiLU(gate_e x) ⊙ up_e x) + SharedMLP(x)
/// ```
/// The union of a step's experts is fetched once; each row's sum runs in
/// the router's rank order ([`ExpertFetch`]); the shared experts run while
/// the routed ones arrive and are added last.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SigmoidMoe {
    pub router: SigmoidRouter,
    pub hidden: usize,
    /// Expert hidden width F.
    pub intermediate: usize,
}

impl SigmoidMoe {
    /// Routes every row of `x [t, D]`.
    pub fn route(&self, w: &SigmoidMoeWeights, x: &[f32], t: usize) -> Vec<Route> {
        self.routes_of(w, &w.gate.forward(x, t))
    }

    /// The routes of the router's logits `[t, E]`.
    fn routes_of(&self, w: &SigmoidMoeWeights, logits: &[f32]) -> Vec<Route> {
        let bias = &w.e_score_correction_bias;
        logits
            .chunks_exact(bias.len())
            .map(|row| self.router.route(row, bias))
            .collect()
    }

    /// The expert: `down(SiLU(gate x) ⊙ up x)` (the table lists gate, down, up).
    fn expert(&self) -> GluExpert {
        GluExpert {
            gate: 0,
            up: 2,
            down: 1,
            inter: self.intermediate,
            act: GluAct::Swiglu,
        }
    }

    /// The block over `x [T, D]` (already normed) in layer `layer` of a
    /// step on `path`. `next`
    /// is the next MoE layer (its index and weights), whose routes from
    /// this input are handed to the source as a guess; `routes_out`
    /// receives the routes (tracing); `first`, when a device already
    /// computed them, the router's logits and the shared experts' output.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        path: Path,
        layer: usize,
        w: &SigmoidMoeWeights,
        x: &[f32],
        source: &dyn ExpertSource,
        next: Option<(usize, &SigmoidMoeWeights)>,
        routes_out: Option<&mut Vec<Route>>,
        first: Option<SigmoidFirst>,
    ) -> Result<Vec<f32>> {
        let d = self.hidden;
        let t = x.len() / d;
        let (routes, early_shared) = match first {
            Some(f) => (self.routes_of(w, &f.logits), Some(f.shared)),
            None => (self.route(w, x, t), None),
        };
        let guess = next.and_then(|(nl, nw)| {
            guess_next(source, nl, self.router.top_k, || self.route(nw, x, t))
        });
        // Start the reads, run the shared experts while they arrive.
        let fetch = ExpertFetch::start(path, source, layer, &routes)?.with_guess(guess);
        let shared = early_shared.unwrap_or_else(|| {
            w.shared_experts
                .as_ref()
                .map(|sh| sh.forward(x, t, GluAct::Swiglu))
        });
        // With a device, the sums are made there too (one row a token).
        let mut y = fetch
            .finish_tail(source, &routes, x, d, &self.expert(), Tail::default())?
            .into_sums();
        if let Some(s) = shared {
            y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
        }
        if let Some(ro) = routes_out {
            ro.extend(routes);
        }
        Ok(y)
    }
}

/// A [`SigmoidMoe`] layer's products of its input before the routed
/// experts — the router's logits `[T, E]` and the shared experts' output
/// `[T, D]` —, computed by a device in the attention's call
/// ([`fathom_kernels::backend::Then`]).
pub struct SigmoidFirst {
    pub logits: Vec<f32>,
    pub shared: Option<Vec<f32>>,
}

impl crate::early::MoeFirst for SigmoidFirst {
    type Weights = SigmoidMoeWeights;

    fn room(w: &SigmoidMoeWeights, t: usize) -> Self {
        SigmoidFirst {
            logits: vec![0f32; t * w.gate.rows],
            shared: w
                .shared_experts
                .as_ref()
                .map(|sh| vec![0f32; t * sh.down_proj.rows]),
        }
    }

    /// The router plain, the shared experts gated (SwiGLU).
    fn then_parts<'a>(
        &'a mut self,
        w: &'a SigmoidMoeWeights,
    ) -> (
        Vec<fathom_kernels::backend::ThenProduct<'a>>,
        Vec<fathom_kernels::backend::ThenGlu<'a>>,
    ) {
        let plain = vec![fathom_kernels::backend::ThenProduct {
            w: w.gate.as_mat(),
            y: &mut self.logits,
        }];
        let glu = match (&w.shared_experts, self.shared.as_deref_mut()) {
            (Some(sh), Some(y)) => vec![sh.then_glu(y)],
            _ => Vec::new(),
        };
        (plain, glu)
    }
}
