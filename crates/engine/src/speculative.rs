//! Speculative decoding: one pass of the full model verifies several
//! proposed tokens, and the output is exactly plain greedy decoding's.
//!
//! Each round feeds `[last, d1..dk]` in one multi-position pass (the MoE
//! reads the union of the positions' experts once per layer), takes the
//! k+1 argmaxes, accepts the drafts up to the first disagreement, appends
//! the model's own token there, and keeps exactly the accepted positions of
//! the state (MLA rows truncated, KDA rewound and replayed). Because every
//! position of a multi-position pass is bit-identical to a one-token pass,
//! the committed state — and so every later token — is what greedy decoding
//! would have produced.
//!
//! The proposal length adapts to live acceptance, and drafting switches
//! itself off when verification passes cost more than they return
//! (measured: tokens per second of drafted rounds vs plain steps), probing
//! again now and then.

use std::ops::ControlFlow;
use std::time::Instant;

use fathom_model::kimi_k3::state::SequenceState;
use fathom_model::{K3Model, Logits, Result};

use crate::draft::Drafter;
use crate::generate::{Generation, Meter, StopReason, argmax};

/// Drafting counters.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct DraftStats {
    pub drafter: String,
    pub proposed: u64,
    pub accepted: u64,
    pub verify_passes: u64,
    pub plain_steps: u64,
    pub acceptance_rate: f64,
    /// Generated tokens per verification pass (accepted drafts + the model's own).
    pub tokens_per_pass: f64,
    /// Unique expert bytes the passes touched per generated token.
    pub expert_bytes_per_token: f64,
    /// Seconds spent drafting, in verification passes, and in plain steps.
    pub draft_s: f64,
    pub verify_s: f64,
    pub plain_s: f64,
}

/// How drafts are used.
#[derive(Debug, Clone, Copy)]
pub struct DraftOptions {
    /// Most tokens proposed per round.
    pub max_k: usize,
    /// Adapt the proposal length and switch drafting off when it does not
    /// pay. Off: always propose `max_k` (tests use this to pin the length).
    pub adaptive: bool,
}

impl Default for DraftOptions {
    fn default() -> Self {
        DraftOptions {
            max_k: 8,
            adaptive: true,
        }
    }
}

/// Adaptive proposal length and the on/off decision.
struct Policy {
    adaptive: bool,
    k: usize,
    max_k: usize,
    /// Exponential averages of seconds per generated token.
    spec_cost: Option<f64>,
    plain_cost: Option<f64>,
    /// Plain steps left before drafting is tried again.
    off_for: usize,
    accept_ema: f64,
}

impl Policy {
    fn new(o: DraftOptions) -> Self {
        let max_k = o.max_k.max(1);
        let k = if o.adaptive { max_k.min(4) } else { max_k };
        Policy {
            adaptive: o.adaptive,
            k,
            max_k,
            spec_cost: None,
            plain_cost: None,
            off_for: 0,
            accept_ema: 0.5,
        }
    }

    fn ema(v: &mut Option<f64>, x: f64) {
        *v = Some(v.map_or(x, |a| 0.7 * a + 0.3 * x));
    }

    fn after_round(&mut self, proposed: usize, accepted: usize, secs: f64) {
        if !self.adaptive {
            return;
        }
        let rate = accepted as f64 / proposed.max(1) as f64;
        self.accept_ema = 0.7 * self.accept_ema + 0.3 * rate;
        Self::ema(&mut self.spec_cost, secs / (accepted + 1) as f64);
        self.k = if accepted == proposed {
            (self.k + 1).min(self.max_k)
        } else if self.accept_ema < 0.3 {
            self.k.saturating_sub(1).max(1)
        } else {
            self.k
        };
        if let (Some(s), Some(p)) = (self.spec_cost, self.plain_cost) {
            if s > 1.05 * p {
                self.off_for = 16; // does not pay: plain steps, then probe again
            }
        }
    }

    fn after_plain(&mut self, secs: f64) {
        if !self.adaptive {
            return;
        }
        Self::ema(&mut self.plain_cost, secs);
        self.off_for = self.off_for.saturating_sub(1);
    }

    fn drafting(&self) -> bool {
        self.off_for == 0
    }
}

/// Greedy decoding with drafts; output identical to [`crate::greedy`].
pub fn speculative(
    model: &K3Model,
    prompt: &[u32],
    max_new: usize,
    stop_ids: &[u32],
    drafter: &mut dyn Drafter,
    opts: DraftOptions,
    on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<(Generation, DraftStats)> {
    speculative_from(
        model,
        &mut model.new_state(),
        prompt,
        max_new,
        stop_ids,
        drafter,
        opts,
        on_token,
    )
}

/// As [`speculative`], continuing `state`.
#[allow(clippy::too_many_arguments)]
pub fn speculative_from(
    model: &K3Model,
    state: &mut SequenceState,
    prompt: &[u32],
    max_new: usize,
    stop_ids: &[u32],
    drafter: &mut dyn Drafter,
    opts: DraftOptions,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<(Generation, DraftStats)> {
    let mut m = Meter::start(model, prompt.len(), max_new);
    let mut ds = DraftStats {
        drafter: drafter.name(),
        ..Default::default()
    };
    let mut policy = Policy::new(opts);
    let logits = model.forward(state, prompt, Logits::Last)?;
    m.prefilled();
    if max_new == 0 {
        return Ok((m.finish(model, state, StopReason::MaxTokens), ds));
    }
    let mut context: Vec<u32> = prompt.to_vec();
    // `next` is known (argmax of the last logits) but not yet fed.
    let mut next = argmax(&logits);
    let requested_before = model.experts.stats().requested;
    let stop = 'outer: loop {
        context.push(next);
        if let Some(stop) = m.emit(next, max_new, stop_ids, &mut on_token) {
            break stop;
        }
        let room = max_new - m.out.len();
        let td = Instant::now();
        let drafts = if policy.drafting() {
            drafter.propose(&context, policy.k.min(room))?
        } else {
            Vec::new()
        };
        let draft_s = td.elapsed().as_secs_f64();
        ds.draft_s += draft_s;
        let t = Instant::now();
        if drafts.is_empty() {
            let logits = model.forward(state, &[next], Logits::Last)?;
            next = argmax(&logits);
            ds.plain_steps += 1;
            let secs = t.elapsed().as_secs_f64();
            ds.plain_s += secs;
            policy.after_plain(secs);
            continue;
        }
        // Verify [next, d1..dk] in one pass.
        let mut input = Vec::with_capacity(drafts.len() + 1);
        input.push(next);
        input.extend_from_slice(&drafts);
        let pass = state.begin_pass(&model.spec);
        let all = model.forward(state, &input, Logits::All)?;
        let v = model.spec.vocab_size;
        let mut accepted = 0;
        while accepted < drafts.len()
            && argmax(&all[accepted * v..(accepted + 1) * v]) == drafts[accepted]
        {
            accepted += 1;
        }
        let bonus = argmax(&all[accepted * v..(accepted + 1) * v]);
        state.keep(&model.spec, pass, accepted + 1);
        ds.verify_passes += 1;
        ds.proposed += drafts.len() as u64;
        ds.accepted += accepted as u64;
        let verify_s = t.elapsed().as_secs_f64();
        ds.verify_s += verify_s;
        // The round's cost includes drafting: that is what plain steps save.
        policy.after_round(drafts.len(), accepted, verify_s + draft_s);
        // Emit the accepted drafts; `bonus` becomes the next pending token.
        for &d in &drafts[..accepted] {
            context.push(d);
            if let Some(stop) = m.emit(d, max_new, stop_ids, &mut on_token) {
                break 'outer stop;
            }
        }
        next = bonus;
    };
    ds.acceptance_rate = ds.accepted as f64 / ds.proposed.max(1) as f64;
    ds.tokens_per_pass = if ds.verify_passes > 0 {
        (ds.accepted + ds.verify_passes) as f64 / ds.verify_passes as f64
    } else {
        0.0
    };
    let after_first = m.out.len().saturating_sub(1).max(1) as f64;
    let eb = fathom_model::kimi_k3::tensors::expert_bytes(&model.spec) as f64;
    ds.expert_bytes_per_token =
        (model.experts.stats().requested - requested_before) as f64 * eb / after_first;
    Ok((m.finish(model, state, stop), ds))
}
