//! Draft sources: cheap guesses at the next tokens. A draft only proposes;
//! the full model verifies every proposed token and decides the output.

use std::sync::Arc;

use fathom_model::lm::SelfDrafter;
use fathom_model::{CausalLm, Logits, ModelError, Result, SeqState};

use crate::sampling::argmax;

/// Something that proposes continuations of the committed tokens.
pub trait Drafter: Send {
    /// Up to `k` tokens likely to follow `context` (every committed token);
    /// `target` is the sequence's state in the full model, which has read
    /// all of `context` but its last token (read-only: a drafter never
    /// changes what the model decides).
    fn propose(&mut self, context: &[u32], k: usize, target: &dyn SeqState) -> Result<Vec<u32>>;
    fn name(&self) -> String;
}

/// Prompt lookup: finds the latest earlier occurrence of the context's last
/// n tokens (longest n first) and proposes what followed it. No model, no
/// memory beyond the context; pays off on code and repetitive text.
pub struct NgramDrafter {
    pub max_n: usize,
    pub min_n: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter { max_n: 4, min_n: 1 }
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, ctx: &[u32], k: usize, _: &dyn SeqState) -> Result<Vec<u32>> {
        Ok(self.lookup(ctx, k))
    }

    fn name(&self) -> String {
        "ngram".into()
    }
}

impl NgramDrafter {
    /// What followed the latest earlier occurrence of the longest suffix.
    fn lookup(&self, ctx: &[u32], k: usize) -> Vec<u32> {
        for n in (self.min_n..=self.max_n.min(ctx.len().saturating_sub(1))).rev() {
            let suffix = &ctx[ctx.len() - n..];
            // Latest start i < len - n with ctx[i..i+n] == suffix.
            if let Some(i) = (0..ctx.len() - n).rev().find(|&i| &ctx[i..i + n] == suffix) {
                let from = i + n;
                let out: Vec<u32> = ctx[from..(from + k).min(ctx.len())].to_vec();
                if !out.is_empty() {
                    return out;
                }
            }
        }
        Vec::new()
    }
}

/// A small model with the same tokenizer, run greedily. It keeps its own
/// state in step with the committed tokens: each round it reads the newly
/// committed tokens in one pass, drafts k tokens, then rolls back the drafts.
pub struct ModelDrafter {
    model: Arc<dyn CausalLm>,
    state: Box<dyn SeqState>,
    consumed: Vec<u32>,
}

impl ModelDrafter {
    /// `target_vocab` must match the draft's vocabulary (same tokenizer).
    pub fn new(model: Arc<dyn CausalLm>, target_vocab: usize) -> Result<Self> {
        let vocab = model.info().vocab_size;
        if vocab != target_vocab {
            return Err(ModelError::Config {
                field: "vocab_size".into(),
                msg: format!(
                    "draft model vocabulary {vocab} differs from the target's {target_vocab}: they must share a tokenizer"
                ),
            });
        }
        Ok(ModelDrafter {
            state: model.new_state(),
            model,
            consumed: Vec::new(),
        })
    }
}

impl Drafter for ModelDrafter {
    fn propose(&mut self, ctx: &[u32], k: usize, _: &dyn SeqState) -> Result<Vec<u32>> {
        if k == 0 || ctx.is_empty() {
            return Ok(Vec::new());
        }
        if !ctx.starts_with(&self.consumed) || self.consumed.len() == ctx.len() {
            // Diverged (or nothing new to read): start over from the context.
            self.state = self.model.new_state();
            self.consumed.clear();
        }
        let new = &ctx[self.consumed.len()..];
        let mut logits = self.model.forward(self.state.as_mut(), new, Logits::Last)?;
        self.consumed = ctx.to_vec();
        let snap = self.state.snapshot();
        let mut out = Vec::with_capacity(k);
        for i in 0..k {
            let t = argmax(&logits);
            out.push(t);
            if i + 1 < k {
                logits = self
                    .model
                    .forward(self.state.as_mut(), &[t], Logits::Last)?;
            }
        }
        self.state.restore(snap.as_ref())?;
        Ok(out)
    }

    fn name(&self) -> String {
        "model".into()
    }
}

/// The target model's own prediction layer (`--draft mtp`: checkpoints of
/// the DeepSeek-V3 architecture may ship one; V3 and R1 do), reading the
/// target's hidden rows.
pub struct MtpDrafter {
    inner: Box<dyn SelfDrafter>,
}

impl MtpDrafter {
    /// The drafter of `model`, which must have been loaded with its
    /// prediction layer (`LoadOptions::mtp`).
    pub fn new(model: Arc<dyn CausalLm>) -> Result<Self> {
        let family = model.info().family;
        let inner = model.self_drafter().ok_or_else(|| {
            ModelError::Unsupported(format!(
                "--draft mtp: this {family} model was loaded without a multi-token-prediction layer"
            ))
        })?;
        Ok(MtpDrafter { inner })
    }
}

impl Drafter for MtpDrafter {
    fn propose(&mut self, ctx: &[u32], k: usize, target: &dyn SeqState) -> Result<Vec<u32>> {
        self.inner.propose(target, ctx, k)
    }

    fn name(&self) -> String {
        "mtp".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_proposes_what_followed_the_latest_match() {
        let d = NgramDrafter::default();
        // "1 2 3 9 ... 1 2 3" → proposes "9 8"
        let ctx = [1, 2, 3, 9, 8, 7, 5, 1, 2, 3];
        assert_eq!(d.lookup(&ctx, 2), vec![9, 8]);
        // Longest match wins over a later shorter one.
        let ctx = [4, 5, 6, 1, 5, 2, 4, 5];
        assert_eq!(d.lookup(&ctx, 1), vec![6]);
        assert!(d.lookup(&[1, 2, 3], 4).is_empty());
    }
}
