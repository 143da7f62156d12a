//! Greedy generation: prefill the prompt in one pass, then one token per pass.

use std::ops::ControlFlow;
use std::time::Instant;

use fathom_model::experts::ExpertStats;
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

/// Timing, counters and the output of one generation; shared by the plain
/// and the speculative loops so both report the same figures the same way.
pub(crate) struct Meter {
    before: ExpertStats,
    t0: Instant,
    decode_start: Option<Instant>,
    pub stats: GenStats,
    pub out: Vec<u32>,
}

impl Meter {
    pub fn start(model: &K3Model, prompt_len: usize, max_new: usize) -> Self {
        Meter {
            before: model.experts.stats(),
            t0: Instant::now(),
            decode_start: None,
            stats: GenStats {
                prompt_tokens: prompt_len,
                ..Default::default()
            },
            out: Vec::with_capacity(max_new),
        }
    }

    /// The prompt has been read.
    pub fn prefilled(&mut self) {
        self.stats.prefill_s = self.t0.elapsed().as_secs_f64();
        self.stats.prefill_tok_s = self.stats.prompt_tokens as f64 / self.stats.prefill_s.max(1e-9);
    }

    /// Appends a chosen token and reports it; `Some` ends generation.
    pub fn emit(
        &mut self,
        token: u32,
        max_new: usize,
        stop_ids: &[u32],
        on_token: &mut impl FnMut(u32) -> ControlFlow<()>,
    ) -> Option<StopReason> {
        self.out.push(token);
        if self.out.len() == 1 {
            self.stats.first_token_s = self.t0.elapsed().as_secs_f64();
            self.decode_start = Some(Instant::now());
        }
        if on_token(token).is_break() {
            Some(StopReason::Cancelled)
        } else if stop_ids.contains(&token) {
            Some(StopReason::Eos)
        } else if self.out.len() >= max_new {
            Some(StopReason::MaxTokens)
        } else {
            None
        }
    }

    pub fn finish(
        mut self,
        model: &K3Model,
        state: &SequenceState,
        stop: StopReason,
    ) -> Generation {
        let s = &mut self.stats;
        if let Some(d) = self.decode_start {
            s.decode_s = d.elapsed().as_secs_f64();
            let steady = self.out.len().saturating_sub(1);
            s.decode_tok_s = if steady > 0 {
                steady as f64 / s.decode_s.max(1e-9)
            } else {
                0.0
            };
        }
        let d = model.experts.stats().since(&self.before);
        s.generated_tokens = self.out.len();
        s.expert_bytes_read = d.bytes_read;
        s.expert_cache_hits = d.hits;
        s.expert_cache_misses = d.misses;
        s.peak_rss_bytes = crate::sys::peak_rss_bytes().unwrap_or(0);
        s.state_bytes = state.bytes();
        Generation {
            output_ids: self.out,
            stats: self.stats,
            stop,
        }
    }
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
    let mut m = Meter::start(model, prompt.len(), max_new);
    let mut logits = model.forward(state, prompt, Logits::Last)?;
    m.prefilled();
    if max_new == 0 {
        return Ok(m.finish(model, state, StopReason::MaxTokens));
    }
    loop {
        if let Some(stop) = m.emit(argmax(&logits), max_new, stop_ids, &mut on_token) {
            return Ok(m.finish(model, state, stop));
        }
        let last = *m.out.last().expect("just emitted");
        logits = model.forward(state, &[last], Logits::Last)?;
    }
}
