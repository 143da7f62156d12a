//! The checkpoint's multi-token-prediction (MTP) layer as a drafter.
//!
//! DeepSeek-V3 (and R1) ship one extra layer (index `num_layers`) trained
//! to predict the token after next. For position `j` it combines the
//! decoder's final hidden row `h_j` with the embedding of the token that
//! follows it:
//!
//! ```text
//! x   = eh_proj([RMSNorm(embed(t_{j+1}); enorm) | RMSNorm(h_j; hnorm)])
//! x  += MLA(RMSNorm(x; input_layernorm))           (its own latent cache)
//! x  += MoE(RMSNorm(x; post_attention_layernorm))  (its own routed experts)
//! p   = shared_head.head(RMSNorm(x; shared_head.norm))   → guess at t_{j+2}
//! ```
//!
//! `h_j` is the row the decoder's head reads (after the final norm). A draft
//! of `k` tokens chains the layer on its own output. It only proposes: the
//! full model verifies every token, so nothing here can change the output;
//! rows the drafter misses (a restored prefix, a prompt longer than the
//! tap) only make its guesses worse.

use fathom_kernels::ops::rms_norm_rows;
use fathom_weights::Checkpoint;

use super::DeepseekV3Model;
use super::attention::attention;
use super::config::DeepseekV3Spec;
use super::tensors::{check_mtp_tensors, layer_name};
use super::weights::{FfnWeights, LayerWeights, layer};
use crate::batch::{Path, add};
use crate::bind::{Binder, require_none};
use crate::error::{ModelError, Result};
use crate::hybrid::mla::MlaRope;
use crate::kv::PagedRows;
use crate::kv_state::KvState;
use crate::linear::Linear;
use crate::lm::SeqState;
use crate::rotary::Angles;

/// Hidden rows a sequence keeps for its drafter (the oldest go first).
pub const TAP_ROWS: usize = 512;

/// The MTP layer's weights (bf16 or as stored; never int8).
#[derive(Debug)]
pub struct MtpWeights {
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub eh_proj: Linear,
    pub layer: LayerWeights,
    pub shared_head_norm: Vec<f32>,
    pub shared_head: Linear,
}

impl MtpWeights {
    /// Reads the first MTP layer; an error says when the checkpoint has none.
    pub fn load(spec: &DeepseekV3Spec, ck: &Checkpoint) -> Result<Self> {
        if spec.num_nextn_predict_layers == 0 {
            return Err(ModelError::Config {
                field: "num_nextn_predict_layers".into(),
                msg: "= 0: this checkpoint has no multi-token-prediction layer to draft with; \
                      use --draft ngram or --draft model:DIR"
                    .into(),
            });
        }
        require_none(&check_mtp_tensors(spec, ck))?;
        let b = Binder {
            ck,
            fp8_block: spec.fp8_block(),
        };
        let l = spec.num_layers;
        let n = |rest: &str| layer_name(l, rest);
        Ok(MtpWeights {
            enorm: b.vector(&n("enorm.weight"))?,
            hnorm: b.vector(&n("hnorm.weight"))?,
            eh_proj: b.linear(&n("eh_proj.weight"))?,
            layer: layer(spec, &b, l)?,
            shared_head_norm: b.vector(&n("shared_head.norm.weight"))?,
            shared_head: b.linear(&n("shared_head.head.weight"))?,
        })
    }
}

/// One sequence's drafter: the MTP layer's latent cache, holding the rows
/// of pairs `offset..offset + cache.len()`, and the tokens they were made
/// from (`t_0 ..= t_{offset + len}`).
pub struct MtpDraft {
    cache: PagedRows,
    offset: usize,
    tokens: Vec<u32>,
}

impl MtpDraft {
    pub fn new(model: &DeepseekV3Model) -> Self {
        MtpDraft {
            cache: PagedRows::new(model.spec.mla_dims().cache_width(), &model.kv),
            offset: 0,
            tokens: Vec::new(),
        }
    }

    /// Up to `k` guesses at the tokens after `ctx` (every committed token;
    /// the target state has read all but the last).
    pub fn propose(
        &mut self,
        model: &DeepseekV3Model,
        target: &dyn SeqState,
        ctx: &[u32],
        k: usize,
    ) -> Result<Vec<u32>> {
        let (Some(w), Some(state)) = (
            model.parts.mtp.as_ref(),
            target.as_any().downcast_ref::<KvState>(),
        ) else {
            return Ok(Vec::new());
        };
        let Some(tap) = state.tap.as_ref() else {
            return Ok(Vec::new());
        };
        let n = ctx.len();
        if k == 0 || n < 2 || state.pos + 1 != n {
            return Ok(Vec::new());
        }
        // Keep the pairs whose tokens are still the context's.
        let same = ctx
            .iter()
            .zip(&self.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        let valid = same.saturating_sub(1).saturating_sub(self.offset);
        self.cache.truncate(valid.min(self.cache.len()));
        // Pairs (h_j, t_{j+1}) not yet read, j < n - 1; restart at the tap
        // when it no longer holds the next one.
        let mut j = self.offset + self.cache.len();
        if tap.row(j).is_none() {
            self.cache.truncate(0);
            self.offset = tap.first;
            j = tap.first;
        }
        let pairs: Vec<(Vec<f32>, u32)> = (j..n - 1)
            .filter_map(|p| Some((tap.row(p)?.to_vec(), ctx[p + 1])))
            .collect();
        if pairs.is_empty() || j + pairs.len() != n - 1 {
            return Ok(Vec::new());
        }
        let hidden: Vec<f32> = pairs.iter().flat_map(|(h, _)| h.iter().copied()).collect();
        let toks: Vec<u32> = pairs.iter().map(|p| p.1).collect();
        let committed = self.cache.len() + toks.len();
        // One decision for the whole proposal, as a step makes one.
        let drafted = self.chain(model, w, Path::now(), (&hidden, &toks), k);
        match &drafted {
            Ok(_) => {
                self.cache.truncate(committed);
                self.tokens = ctx.to_vec();
            }
            Err(_) => {
                // Start over next time: the cache may hold part of a pass.
                self.cache.truncate(0);
                self.tokens.clear();
            }
        }
        drafted
    }

    /// The new pairs, then `k` guesses, each the layer on its own output.
    fn chain(
        &mut self,
        model: &DeepseekV3Model,
        w: &MtpWeights,
        path: Path,
        (hidden, toks): (&[f32], &[u32]),
        k: usize,
    ) -> Result<Vec<u32>> {
        let d = model.spec.hidden_size;
        let mut out = Vec::with_capacity(k);
        let (mut logits, mut h) = self.layer(model, w, path, hidden, toks)?;
        for i in 0..k {
            let t = argmax(&logits);
            out.push(t);
            if i + 1 < k {
                (logits, h) = self.layer(model, w, path, &h[h.len() - d..], &[t])?;
            }
        }
        Ok(out)
    }

    /// The layer over pairs (`hidden` rows, the tokens after them) at the
    /// cache's next positions: the last row's logits and every output row.
    fn layer(
        &mut self,
        model: &DeepseekV3Model,
        w: &MtpWeights,
        path: Path,
        hidden: &[f32],
        toks: &[u32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (spec, m) = (&*model.spec, toks.len());
        let (d, eps) = (spec.hidden_size, spec.rms_norm_eps);
        let mut e = model.weights.embed_tokens.rows(toks)?;
        rms_norm_rows(&mut e, d, &w.enorm, eps);
        let mut hn = hidden.to_vec();
        rms_norm_rows(&mut hn, d, &w.hnorm, eps);
        let cat: Vec<f32> = (0..m)
            .flat_map(|r| {
                let (a, b) = (&e[r * d..(r + 1) * d], &hn[r * d..(r + 1) * d]);
                a.iter().chain(b).copied()
            })
            .collect();
        let mut x = w.eh_proj.forward(&cat, m);
        let segs = [0..m];
        let angles = Angles::new(&model.parts.rope, &segs, &[self.offset + self.cache.len()]);
        let rope = MlaRope {
            rope: &model.parts.rope,
            angles: &angles,
            interleaved: spec.rope_interleave,
        };
        let lw = &w.layer;
        let mut a = x.clone();
        rms_norm_rows(&mut a, d, &lw.input_layernorm, eps);
        let att = attention(
            spec,
            path,
            &lw.self_attn,
            &rope,
            &mut [&mut self.cache],
            &segs,
            &a,
            None,
        )?
        .0;
        add(&mut x, &att);
        let mut f = x.clone();
        rms_norm_rows(&mut f, d, &lw.post_attention_layernorm, eps);
        let ffn = match &lw.mlp {
            FfnWeights::Dense(mw) => mw.forward(&f, m, fathom_kernels::ops::GluAct::Swiglu),
            FfnWeights::Moe(mw) => spec.sparse_block().forward(
                path,
                spec.num_layers,
                mw,
                &f,
                model.experts.as_ref(),
                None,
                None,
                None,
            )?,
        };
        add(&mut x, &ffn);
        let mut last = x[(m - 1) * d..].to_vec();
        rms_norm_rows(&mut last, d, &w.shared_head_norm, eps);
        Ok((w.shared_head.forward(&last, 1), x))
    }
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
