//! The MLP side of a layer up to its experts' choice, handed to a device
//! in the attention's call ([`Then`]). Every family whose layers end in a
//! post-attention RMSNorm and a gated MLP or a MoE uses it: the residual
//! is plain (`h + a`; DeepSeek-V3 / Kimi K2, Kimi-Linear, Qwen3-MoE,
//! GPT-OSS) or mixed over depth with earlier blocks ([`Residual`]; block
//! attention residuals), and a MoE's products before its experts are its
//! own ([`MoeFirst`]: a sigmoid MoE's router and shared experts, a latent
//! MoE's down-projection too) or one router product ([`Ffn::Router`]). The
//! host path of those families does the same operations (the mix,
//! [`fathom_kernels::backend::rms_norm32_rows`], the products), so the
//! bits do not depend on which side did them.

use fathom_kernels::backend::{Then, ThenGlu, ThenProduct, rms_norm32_rows};
use fathom_kernels::ops::GluAct;

use crate::batch::Path;
use crate::linear::Linear;
use crate::mlp::MlpWeights;

/// A MoE's products of its input before its routed experts, which a
/// device may compute in the attention's call.
pub trait MoeFirst: Sized {
    /// The MoE layer's weights.
    type Weights;
    /// Room for `n` rows of `w`'s products.
    fn room(w: &Self::Weights, n: usize) -> Self;
    /// Its products as a [`Then`]'s: plain ones, gated ones.
    fn then_parts<'a>(
        &'a mut self,
        w: &'a Self::Weights,
    ) -> (Vec<ThenProduct<'a>>, Vec<ThenGlu<'a>>);
}

/// A layer's MLP side: a dense gated MLP, a MoE whose first products are
/// `M`'s, or a MoE whose first product is its router's (`Router`: the
/// matrix, without a bias; the family adds its bias and routes).
pub enum Ffn<'a, M: MoeFirst> {
    Dense(&'a MlpWeights),
    Moe(&'a M::Weights),
    Router(&'a Linear),
}

impl<M: MoeFirst> Clone for Ffn<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M: MoeFirst> Copy for Ffn<'_, M> {}

/// The rows the MLP side's input is made of once the attention's output
/// is added to `partial`: those rows themselves (`query` unset), or their
/// mix over depth with the earlier `blocks` by the site's `query`
/// ([`fathom_kernels::backend::depth_mix`]).
#[derive(Clone, Copy)]
pub struct Residual<'a> {
    pub partial: &'a [f32],
    pub blocks: &'a [Vec<f32>],
    pub query: Option<&'a [f32]>,
}

impl<'a> Residual<'a> {
    /// The plain residual `h`.
    pub fn plain(h: &'a [f32]) -> Self {
        Residual {
            partial: h,
            blocks: &[],
            query: None,
        }
    }
}

/// What a device computed of a layer's MLP side in its attention's call:
/// the normed rows `x`, and the MLP's output or the MoE's products before
/// its experts.
pub struct Early<M> {
    pub x: Vec<f32>,
    pub ffn: Ahead<M>,
}

pub enum Ahead<M> {
    Mlp(Vec<f32>),
    Moe(M),
    /// The router's product `[N, E]`.
    Router(Vec<f32>),
}

impl<M> Ahead<M> {
    /// The MoE's first products, when this is a MoE's.
    pub fn moe(self) -> Option<M> {
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

impl<M: MoeFirst> Early<M> {
    /// Room for the MLP side `ffn` when a device may do it in the
    /// attention's call: the step's `path` is the device's and no tracer
    /// reads the rows in between.
    pub fn on_device(
        path: Path,
        tracer: &Option<&mut dyn crate::trace::Tracer>,
        ffn: Ffn<'_, M>,
        n: usize,
        d: usize,
    ) -> Option<Self> {
        (tracer.is_none() && path.device()).then(|| Early::room(ffn, n, d))
    }

    /// Room for `n` rows of width `d` of the MLP side `ffn`.
    pub fn room(ffn: Ffn<'_, M>, n: usize, d: usize) -> Self {
        let ffn = match ffn {
            Ffn::Dense(mw) => Ahead::Mlp(vec![0f32; n * mw.down_proj.rows]),
            Ffn::Moe(mw) => Ahead::Moe(M::room(mw, n)),
            Ffn::Router(w) => Ahead::Router(vec![0f32; n * w.rows]),
        };
        Early {
            x: vec![0f32; n * d],
            ffn,
        }
    }

    /// The MLP side `ffn` (the one room was made for) of a plain residual
    /// as a [`Then`] writing here: `h + a`, the RMSNorm with weight
    /// `norm`, then the products (SwiGLU).
    pub fn then<'a>(
        &'a mut self,
        ffn: Ffn<'a, M>,
        h: &'a [f32],
        norm: &'a [f32],
        eps: f32,
    ) -> Then<'a> {
        self.then_mixed(ffn, Residual::plain(h), norm, eps, GluAct::Swiglu)
    }

    /// The MLP side `ffn` (the one room was made for) as a [`Then`]
    /// writing here: the residual `res` with the attention's output, the
    /// RMSNorm with weight `norm`, then the products (gated by `act`).
    pub fn then_mixed<'a>(
        &'a mut self,
        ffn: Ffn<'a, M>,
        res: Residual<'a>,
        norm: &'a [f32],
        eps: f32,
        act: GluAct,
    ) -> Then<'a> {
        let (plain, glu) = match (&mut self.ffn, ffn) {
            (Ahead::Mlp(y), Ffn::Dense(mw)) => (Vec::new(), vec![mw.then_glu(y)]),
            (Ahead::Moe(f), Ffn::Moe(mw)) => f.then_parts(mw),
            (Ahead::Router(y), Ffn::Router(w)) => {
                (vec![ThenProduct { w: w.as_mat(), y }], Vec::new())
            }
            _ => unreachable!("room is made for the layer's own MLP side"),
        };
        Then {
            d: norm.len(),
            partial: res.partial,
            blocks: res.blocks,
            query: res.query,
            eps,
            norm,
            x: &mut self.x,
            plain,
            glu,
            act,
            done: false,
        }
    }
}

/// The MLP side's input after the attention's output `a` was added to
/// `h`: the rows a device normed in the attention's call (`early`, when
/// `done`), else `h` normed here the same way. The [`Early`] comes back
/// when its products are done.
pub fn normed<M>(
    early: Option<Early<M>>,
    done: bool,
    h: &[f32],
    norm: &[f32],
    eps: f32,
) -> (Vec<f32>, Option<Early<M>>) {
    normed_mixed(early, done, || h.to_vec(), norm, eps)
}

/// As [`normed`], for any residual: when the device did not, the rows
/// `mix` makes (the residual's mix, as [`Residual`] describes it) are
/// normed here.
pub fn normed_mixed<M>(
    early: Option<Early<M>>,
    done: bool,
    mix: impl FnOnce() -> Vec<f32>,
    norm: &[f32],
    eps: f32,
) -> (Vec<f32>, Option<Early<M>>) {
    match early.filter(|_| done) {
        Some(mut e) => (std::mem::take(&mut e.x), Some(e)),
        None => {
            let mut x = mix();
            rms_norm32_rows(&mut x, norm.len(), norm, eps);
            (x, None)
        }
    }
}
