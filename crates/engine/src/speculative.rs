//! Speculative decoding: one pass of the full model verifies several
//! proposed tokens, and the output is exactly what decoding without drafts
//! produces — greedy or sampled, for the same seed.
//!
//! Each round feeds `[last, d1..dk]` in one multi-position pass (inside the
//! engine's batched step; the MoE reads the union of the positions' experts
//! once per layer), samples each of the k+1 positions with that position's
//! own draw, accepts the drafts while each equals the token sampled before
//! it, appends the model's own token there, and keeps exactly the accepted
//! positions of the state (MLA rows truncated, KDA rewound and replayed).
//! Because every position of a multi-position pass is bit-identical to a
//! one-token pass, the committed state — and so every later token — is what
//! plain decoding would have produced (`crate::plan::absorb` does this).
//!
//! The proposal length adapts to live acceptance, and drafting switches
//! itself off when verification passes cost more than they return
//! (measured: tokens per second of drafted rounds vs plain steps), probing
//! again now and then.

/// Drafting counters.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct DraftStats {
    pub drafter: String,
    pub proposed: u64,
    pub accepted: u64,
    pub verify_passes: u64,
    pub plain_steps: u64,
    pub acceptance_rate: f64,
    /// Generated tokens per verification pass (accepted drafts + the model's own).
    pub tokens_per_pass: f64,
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
pub(crate) struct Policy {
    adaptive: bool,
    pub k: usize,
    max_k: usize,
    /// Exponential averages of seconds per generated token.
    spec_cost: Option<f64>,
    plain_cost: Option<f64>,
    /// Plain steps left before drafting is tried again.
    off_for: usize,
    accept_ema: f64,
}

impl Policy {
    pub fn new(o: DraftOptions) -> Self {
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

    pub fn after_round(&mut self, proposed: usize, accepted: usize, secs: f64) {
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

    pub fn after_plain(&mut self, secs: f64) {
        if !self.adaptive {
            return;
        }
        Self::ema(&mut self.plain_cost, secs);
        self.off_for = self.off_for.saturating_sub(1);
    }

    pub fn drafting(&self) -> bool {
        self.off_for == 0
    }
}

impl DraftStats {
    /// Fills the derived rates.
    pub fn finish(&mut self) {
        self.acceptance_rate = self.accepted as f64 / self.proposed.max(1) as f64;
        self.tokens_per_pass = if self.verify_passes > 0 {
            (self.accepted + self.verify_passes) as f64 / self.verify_passes as f64
        } else {
            0.0
        };
    }
}
