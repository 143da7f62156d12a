//! The MLP side of a layer up to its experts' choice, handed to a device
//! in the attention's call ([`Then`]) by the families whose layers end in
//! a plain residual, a post-attention RMSNorm and a gated MLP, a
//! sigmoid-routed MoE (DeepSeek-V3 / Kimi K2, Kimi-Linear) or a MoE whose
//! router is one product (Qwen3-MoE, GPT-OSS). The host path
//! of those families does the same operations (`h + a`,
//! [`fathom_kernels::backend::rms_norm32_rows`], the products), so the
//! bits do not depend on which side did them.

use fathom_kernels::backend::{Then, rms_norm32_rows};
use fathom_kernels::ops::GluAct;

use crate::linear::Linear;
use crate::mlp::MlpWeights;
use crate::moe::{SigmoidFirst, SigmoidMoeWeights};

/// A layer's MLP side: a dense gated MLP, a sigmoid-routed MoE, or a MoE
/// whose first product is its router's (`Router`: the matrix, without a
/// bias; the family adds its bias and routes).
#[derive(Clone, Copy)]
pub enum Ffn<'a> {
    Dense(&'a MlpWeights),
    Moe(&'a SigmoidMoeWeights),
    Router(&'a Linear),
}

/// What a device computed of a layer's MLP side in its attention's call:
/// the normed rows `x`, and the MLP's output or the MoE's products before
/// its experts.
pub struct Early {
    pub x: Vec<f32>,
    pub ffn: Ahead,
}

pub enum Ahead {
    Mlp(Vec<f32>),
    Moe(SigmoidFirst),
    /// The router's product `[N, E]`.
    Router(Vec<f32>),
}

impl Ahead {
    /// The MoE's first products, when this is a sigmoid MoE's.
    pub fn moe(self) -> Option<SigmoidFirst> {
        match self {
            Ahead::Moe(f) => Some(f),
            Ahead::Mlp(_) | Ahead::Router(_) => None,
        }
    }

    /// The router's product, when this is a router's.
    pub fn router(self) -> Option<Vec<f32>> {
        match self {
            Ahead::Router(y) => Some(y),
            Ahead::Mlp(_) | Ahead::Moe(_) => None,
        }
    }
}

impl Early {
    /// Room for the MLP side `ffn` when a device may do it in the
    /// attention's call: one is installed and no tracer reads the rows in
    /// between.
    pub fn on_device(
        tracer: &Option<&mut dyn crate::trace::Tracer>,
        ffn: Ffn<'_>,
        n: usize,
        d: usize,
    ) -> Option<Self> {
        (tracer.is_none() && fathom_kernels::backend::installed().is_some())
            .then(|| Early::room(ffn, n, d))
    }

    /// Room for `n` rows of width `d` of the MLP side `ffn`.
    pub fn room(ffn: Ffn<'_>, n: usize, d: usize) -> Self {
        let ffn = match ffn {
            Ffn::Dense(mw) => Ahead::Mlp(vec![0f32; n * mw.down_proj.rows]),
            Ffn::Moe(mw) => Ahead::Moe(SigmoidFirst::room(mw, n)),
            Ffn::Router(w) => Ahead::Router(vec![0f32; n * w.rows]),
        };
        Early {
            x: vec![0f32; n * d],
            ffn,
        }
    }

    /// The MLP side `ffn` (the one room was made for) as a [`Then`]
    /// writing here: `h + a`, the RMSNorm with weight `norm`, then the
    /// products (SwiGLU).
    pub fn then<'a>(
        &'a mut self,
        ffn: Ffn<'a>,
        h: &'a [f32],
        norm: &'a [f32],
        eps: f32,
    ) -> Then<'a> {
        let (plain, glu) = match (&mut self.ffn, ffn) {
            (Ahead::Mlp(y), Ffn::Dense(mw)) => (Vec::new(), vec![mw.then_glu(y)]),
            (Ahead::Moe(f), Ffn::Moe(mw)) => f.then_parts(mw),
            (Ahead::Router(y), Ffn::Router(w)) => {
                let p = fathom_kernels::backend::ThenProduct { w: w.as_mat(), y };
                (vec![p], Vec::new())
            }
            _ => unreachable!("room is made for the layer's own MLP side"),
        };
        Then {
            d: norm.len(),
            partial: h,
            blocks: &[],
            query: None,
            eps,
            norm,
            x: &mut self.x,
            plain,
            glu,
            act: GluAct::Swiglu,
            done: false,
        }
    }
}

/// The MLP side's input after the attention's output `a` was added to
/// `h`: the rows a device normed in the attention's call (`early`, when
/// `done`), else `h` normed here the same way. The [`Early`] comes back
/// when its products are done.
pub fn normed(
    early: Option<Early>,
    done: bool,
    h: &[f32],
    norm: &[f32],
    eps: f32,
) -> (Vec<f32>, Option<Early>) {
    match early.filter(|_| done) {
        Some(mut e) => (std::mem::take(&mut e.x), Some(e)),
        None => {
            let mut x = h.to_vec();
            rms_norm32_rows(&mut x, norm.len(), norm, eps);
            (x, None)
        }
    }
}
