//! Greedy generation: prefill the prompt in one pass, then one token per pass.

use std::ops::ControlFlow;
use std::time::Instant;

use fathom_model::kimi_k3::state::SequenceState;
use fathom_model::{K3Model, Logits, Result};

/// What a generation cost.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_s: f64,
    pub prefill_tok_s: f64,
    /// Prompt submitted → first generated token known.
    pub first_token_s: f64,
    /// Decode passes after the first token (the steady state).
    pub decode_s: f64,
    pub decode_tok_s: f64,
    pub expert_bytes_read: u64,
    pub expert_cache_hits: u64,
    pub expert_cache_misses: u64,
    pub peak_rss_bytes: u64,
    pub state_bytes: usize,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub output_ids: Vec<u32>,
    pub stats: GenStats,
    /// Why generation ended.
    pub stop: StopReason,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    MaxTokens,
    Eos,
    Cancelled,
}

/// Index of the largest logit; ties go to the lower id.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding of up to `max_new` tokens from a fresh state. `stop_ids`
/// end generation (the stop token is kept in the output). `on_token` sees
/// each token as soon as it is chosen and may cancel.
pub fn greedy(
    model: &K3Model,
    prompt: &[u32],
    max_new: usize,
    stop_ids: &[u32],
    on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation> {
    greedy_from(
        model,
        &mut model.new_state(),
        prompt,
        max_new,
        stop_ids,
        on_token,
    )
}

/// Greedy decoding continuing `state`: feeds `prompt` (≥ 1 token), then
/// generates. On return `state` has consumed the prompt and every generated
/// token but the last (which has not been fed back yet).
pub fn greedy_from(
    model: &K3Model,
    state: &mut SequenceState,
    prompt: &[u32],
    max_new: usize,
    stop_ids: &[u32],
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<Generation> {
    let before = model.experts.stats();
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut logits = model.forward(state, prompt, Logits::Last)?;
    stats.prefill_s = t0.elapsed().as_secs_f64();
    stats.prefill_tok_s = prompt.len() as f64 / stats.prefill_s.max(1e-9);
    let mut out = Vec::with_capacity(max_new);
    let mut stop = StopReason::MaxTokens;
    let mut decode_start = None;
    while out.len() < max_new {
        let next = argmax(&logits);
        out.push(next);
        if out.len() == 1 {
            stats.first_token_s = t0.elapsed().as_secs_f64();
            decode_start = Some(Instant::now());
        }
        if on_token(next).is_break() {
            stop = StopReason::Cancelled;
            break;
        }
        if stop_ids.contains(&next) {
            stop = StopReason::Eos;
            break;
        }
        if out.len() == max_new {
            break;
        }
        logits = model.forward(state, &[next], Logits::Last)?;
    }
    if let Some(s) = decode_start {
        stats.decode_s = s.elapsed().as_secs_f64();
        let steady = out.len().saturating_sub(1);
        stats.decode_tok_s = if steady > 0 {
            steady as f64 / stats.decode_s.max(1e-9)
        } else {
            0.0
        };
    }
    let after = model.experts.stats();
    stats.generated_tokens = out.len();
    stats.expert_bytes_read = after.bytes_read - before.bytes_read;
    stats.expert_cache_hits = after.hits - before.hits;
    stats.expert_cache_misses = after.misses - before.misses;
    stats.peak_rss_bytes = crate::sys::peak_rss_bytes().unwrap_or(0);
    stats.state_bytes = state.bytes();
    Ok(Generation {
        output_ids: out,
        stats,
        stop,
    })
}
