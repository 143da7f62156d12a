//! Kimi K3 text decoder: hybrid Kimi Delta Attention + gated NoPE MLA,
//! block attention residuals, SiTU-GLU, LatentMoE with MXFP4 experts.
//!
//! The math is `shared/docs/k3-model.md` (checked against torchtitan's K3,
//! PR 4025, and Moonshot's `modeling_kimi_linear.py`); this module follows its
//! section numbers. Activations are fp32 throughout. A forward pass takes any
//! number T ≥ 1 of new tokens for one sequence: prefill, decode and
//! speculative verification are the same code, and each position's result is
//! bit-identical whatever T is.

pub mod attn_res;
pub mod config;
pub mod kda;
pub mod mla;
pub mod moe;
pub mod state;
pub mod tensors;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use fathom_kernels::ops::rms_norm_rows;
use fathom_weights::Checkpoint;

use self::attn_res::attn_res;
use self::config::K3Spec;
use self::moe::{NextLayerHint, Route};
use self::state::{LayerState, SequenceState};
use self::weights::{AttnWeights, FfnWeights, K3Weights};
use crate::error::{ModelError, Result};
use crate::experts::{ExpertSource, ExpertTable, ResidentExperts};
use crate::linear::Spine;

/// Which positions' logits a pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last new position (prefill, decode).
    Last,
    /// Every new position (verification of proposed tokens).
    All,
}

/// Observer of named intermediates (`attn_in`, `attn_out`, `mlp_in`,
/// `mlp_out` per layer, `final_hidden`) and of routing decisions, for
/// comparing with reference dumps. Costs nothing when absent.
pub trait Tracer {
    fn tensor(&mut self, _layer: usize, _name: &str, _rows: &[f32]) {}
    fn routes(&mut self, _layer: usize, _routes: &[Route]) {}
}

/// A loaded K3 model: spec, resident spine, and a source of routed experts.
pub struct K3Model {
    pub spec: K3Spec,
    pub weights: K3Weights,
    pub experts: Arc<dyn ExpertSource>,
    /// Locators of every routed expert (what a streamed source reads).
    pub expert_table: ExpertTable,
}

impl K3Model {
    /// Loads a model with every expert resident in RAM.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, |spec, ck, table| {
            Ok(Arc::new(ResidentExperts::load(spec, ck, table)?))
        })
    }

    /// Loads a model with every expert resident and the spine in `spine` precision.
    pub fn load_spine(dir: &Path, spine: Spine) -> Result<Self> {
        let mut model = Self::load(dir)?;
        if spine == Spine::Int8 {
            model.weights.quantize_spine_int8();
        }
        Ok(model)
    }

    /// Loads the spine and builds the expert source with `make_source`.
    pub fn load_with(
        dir: &Path,
        make_source: impl FnOnce(
            &K3Spec,
            &Arc<Checkpoint>,
            &ExpertTable,
        ) -> Result<Arc<dyn ExpertSource>>,
    ) -> Result<Self> {
        let spec = K3Spec::from_dir(dir)?;
        let ck = Arc::new(Checkpoint::open(dir)?);
        let weights = K3Weights::load(&spec, &ck)?;
        let expert_table = ExpertTable::from_checkpoint(&spec, &ck)?;
        let experts = make_source(&spec, &ck, &expert_table)?;
        Ok(K3Model {
            spec,
            weights,
            experts,
            expert_table,
        })
    }

    pub fn new_state(&self) -> SequenceState {
        SequenceState::new(&self.spec)
    }

    /// Runs `tokens` through the model from `state`, advancing it. Returns the
    /// logits `[positions, vocab]` of the positions `which` asks for.
    pub fn forward(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        which: Logits,
    ) -> Result<Vec<f32>> {
        self.forward_traced(state, tokens, which, None)
    }

    pub fn forward_traced(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        which: Logits,
        mut tracer: Option<&mut dyn Tracer>,
    ) -> Result<Vec<f32>> {
        let spec = &self.spec;
        let w = &self.weights;
        let (d, t, eps) = (spec.hidden_size, tokens.len(), spec.rms_norm_eps);
        if t == 0 {
            return Err(ModelError::EmptyInput);
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= spec.vocab_size) {
            return Err(ModelError::TokenOutOfRange {
                id,
                vocab: spec.vocab_size,
            });
        }
        let mut partial: Vec<f32> = tokens
            .iter()
            .flat_map(|&id| w.embed_tokens.row(id as usize))
            .collect();
        let mut blocks: Vec<Vec<f32>> = Vec::new();
        for (i, lw) in w.layers.iter().enumerate() {
            // Attention side (§3): mix, maybe open a block, attend.
            let h = if blocks.is_empty() {
                partial.clone()
            } else {
                attn_res(&partial, &blocks, &lw.self_attention_res, d, eps)
            };
            if i % spec.attn_res_block_size == 0 {
                blocks.push(std::mem::replace(&mut partial, vec![0.0; t * d]));
            }
            trace(&mut tracer, i, "attn_in", &h);
            let mut x = h;
            rms_norm_rows(&mut x, d, &lw.input_layernorm, eps);
            let a = match (&lw.attn, &mut state.layers[i]) {
                (AttnWeights::Kda(aw), LayerState::Kda(st)) => kda::kda(spec, aw, st, &x),
                (AttnWeights::Mla(aw), LayerState::Mla(st)) => mla::mla(spec, aw, st, &x),
                _ => unreachable!("state layer kinds follow the spec"),
            };
            trace(&mut tracer, i, "attn_out", &a);
            add(&mut partial, &a);

            // MLP side.
            let mut x = attn_res(&partial, &blocks, &lw.mlp_res, d, eps);
            trace(&mut tracer, i, "mlp_in", &x);
            rms_norm_rows(&mut x, d, &lw.post_attention_layernorm, eps);
            let m = match &lw.ffn {
                FfnWeights::Dense(mw) => moe::mlp(spec, mw, &x, t),
                FfnWeights::Moe(mw) => {
                    let hint = w.layers.get(i + 1).and_then(|n| match &n.ffn {
                        FfnWeights::Moe(nw) => Some(NextLayerHint {
                            layer: i + 1,
                            weights: nw,
                        }),
                        FfnWeights::Dense(_) => None,
                    });
                    let mut routes = tracer.as_ref().map(|_| Vec::new());
                    let out = moe::moe(
                        spec,
                        i,
                        mw,
                        &x,
                        t,
                        self.experts.as_ref(),
                        hint,
                        routes.as_mut(),
                    )?;
                    if let (Some(tr), Some(r)) = (tracer.as_deref_mut(), routes) {
                        tr.routes(i, &r);
                    }
                    out
                }
            };
            trace(&mut tracer, i, "mlp_out", &m);
            add(&mut partial, &m);
        }
        state.pos += t;

        // Output mix, final norm and head, only for the rows asked for.
        let first = match which {
            Logits::Last => t - 1,
            Logits::All => 0,
        };
        let rows = t - first;
        let part = &partial[first * d..];
        let blk: Vec<Vec<f32>> = blocks.iter().map(|b| b[first * d..].to_vec()).collect();
        let mut hfin = attn_res(part, &blk, &w.output_attn_res, d, eps);
        rms_norm_rows(&mut hfin, d, &w.norm, eps);
        trace(&mut tracer, usize::MAX, "final_hidden", &hfin);
        Ok(w.lm_head.forward(&hfin, rows))
    }
}

fn add(a: &mut [f32], b: &[f32]) {
    a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
}

fn trace(tracer: &mut Option<&mut dyn Tracer>, layer: usize, name: &str, rows: &[f32]) {
    if let Some(t) = tracer.as_deref_mut() {
        t.tensor(layer, name, rows);
    }
}
