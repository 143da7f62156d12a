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
///
/// The length is chosen from measured costs: a verification pass of `n`
/// positions takes `a + b·n` seconds (a fit over recent passes: `a` is
/// what a pass costs whatever its width — the spine's weights read once,
/// from RAM or, when the spine is streamed, from disk — and `b` each
/// position's own work), each proposed token `d` seconds of drafting, and
/// a draft is accepted with probability `p` given the one before it was
/// (counted over recent rounds). The length is the `k ≤ max_k` that
/// maximises expected tokens per second, `(1 + p + … + p^k) ÷ (a + b·(k+1)
/// + d·k)`: long when a pass is expensive and fixed, short when each
/// position costs as much as the pass. Until passes of different widths
/// have been seen (and again when recent passes all had one width), the
/// length steps down while few drafts are accepted and otherwise moves,
/// so the fit sees a slope.
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
    /// Pass time against pass width.
    fit: PassFit,
    /// Drafting seconds per proposed token.
    draft_cost: Option<f64>,
    /// Drafts accepted and drafts tried up to the first refusal (decayed).
    hits: f64,
    tries: f64,
}

/// A pass's seconds as `a + b·n` for `n` positions: least squares over
/// exponentially decayed sums (recent passes weigh most).
#[derive(Default, Clone, Copy)]
struct PassFit {
    w: f64,
    n: f64,
    t: f64,
    nn: f64,
    nt: f64,
}

impl PassFit {
    const DECAY: f64 = 0.9;

    fn add(&mut self, n: usize, t: f64) {
        let n = n as f64;
        let d = Self::DECAY;
        self.w = d * self.w + 1.0;
        self.n = d * self.n + n;
        self.t = d * self.t + t;
        self.nn = d * self.nn + n * n;
        self.nt = d * self.nt + n * t;
    }

    /// `(a, b)`, once passes of different widths have been seen.
    fn line(&self) -> Option<(f64, f64)> {
        if self.w < 2.0 {
            return None;
        }
        let (mn, mt) = (self.n / self.w, self.t / self.w);
        let var = self.nn / self.w - mn * mn;
        if var < 0.1 {
            return None;
        }
        let b = ((self.nt / self.w - mn * mt) / var).max(0.0);
        Some(((mt - b * mn).max(0.0), b))
    }
}

/// Expected tokens per second of proposing `k`: `p` the chance a draft is
/// accepted after an accepted one, a pass of `n` positions `a + b·n`
/// seconds, a proposed token `d` seconds.
pub(crate) fn expected_rate(k: usize, p: f64, (a, b): (f64, f64), d: f64) -> f64 {
    let p = p.clamp(0.0, 0.999);
    // 1 + p + … + p^k: the model's own token and the accepted drafts.
    let expected = (0..=k).map(|i| p.powi(i as i32)).sum::<f64>();
    expected / (a + b * (k + 1) as f64 + d * k as f64).max(1e-12)
}

/// The proposal length in `1..=max_k` with the most expected tokens per
/// second ([`expected_rate`]).
pub(crate) fn best_length(max_k: usize, p: f64, line: (f64, f64), d: f64) -> usize {
    let mut best = (1, f64::MIN);
    for k in 1..=max_k.max(1) {
        let rate = expected_rate(k, p, line, d);
        if rate > best.1 * (1.0 + 1e-9) {
            best = (k, rate);
        }
    }
    best.0
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
            fit: PassFit::default(),
            draft_cost: None,
            hits: 0.0,
            tries: 0.0,
        }
    }

    fn ema(v: &mut Option<f64>, x: f64) {
        *v = Some(v.map_or(x, |a| 0.7 * a + 0.3 * x));
    }

    /// After a verification pass of `proposed` drafts (`step_s` seconds)
    /// of which `accepted` were kept, drafted in `draft_s` seconds.
    pub fn after_round(&mut self, proposed: usize, accepted: usize, step_s: f64, draft_s: f64) {
        if !self.adaptive {
            return;
        }
        let rate = accepted as f64 / proposed.max(1) as f64;
        self.accept_ema = 0.7 * self.accept_ema + 0.3 * rate;
        Self::ema(
            &mut self.spec_cost,
            (step_s + draft_s) / (accepted + 1) as f64,
        );
        Self::ema(&mut self.draft_cost, draft_s / proposed.max(1) as f64);
        self.fit.add(proposed + 1, step_s);
        let refused = usize::from(accepted < proposed);
        self.hits = 0.8 * self.hits + accepted as f64;
        self.tries = 0.8 * self.tries + (accepted + refused) as f64;
        let p = self.hits / self.tries.max(1e-9);
        let d = self.draft_cost.unwrap_or(0.0);
        let line = self.fit.line();
        if let Some((a, b)) = line {
            // The fit prices a plain step too (one position): drafting
            // stops for a while when its best length returns less.
            let k = best_length(self.max_k, p, (a, b), d);
            if expected_rate(k, p, (a, b), d) < 1.0 / (a + b).max(1e-12) {
                self.off_for = 16;
            }
        }
        self.k = match line {
            Some(line) => best_length(self.max_k, p, line, d),
            None if accepted == proposed => (self.k + 1).min(self.max_k),
            None if self.accept_ema < 0.3 => self.k.saturating_sub(1).max(1),
            // Another width, so the fit can see the slope.
            None if self.k < self.max_k => self.k + 1,
            None => self.k.saturating_sub(1).max(1),
        };
        if let (Some(s), Some(p)) = (self.spec_cost, self.plain_cost) {
            if s > 1.05 * p {
                self.off_for = 16; // does not pay: plain steps, then probe again
            }
        }
    }

    /// After a plain step of one position (`step_s` seconds).
    pub fn after_plain(&mut self, step_s: f64) {
        if !self.adaptive {
            return;
        }
        Self::ema(&mut self.plain_cost, step_s);
        self.fit.add(1, step_s);
        self.off_for = self.off_for.saturating_sub(1);
    }

    pub fn drafting(&self) -> bool {
        self.off_for == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expensive_fixed_pass_drafts_long_and_a_per_position_cost_short() {
        // A streamed spine: 1 s a pass, 2 ms a position, 1 ms a draft.
        assert_eq!(best_length(16, 0.8, (1.0, 0.002), 0.001), 16);
        assert_eq!(best_length(8, 0.8, (1.0, 0.002), 0.001), 8);
        // Resident on a small CPU: a position costs as much as the pass.
        assert_eq!(best_length(8, 0.8, (0.0, 0.01), 0.001), 1);
        // In between: the optimum of (1 + … + 0.7^k) ÷ (10 + 2(k+1)) ms is 3.
        assert_eq!(best_length(8, 0.7, (0.010, 0.002), 0.0), 3);
        // Drafts that are never accepted: the shortest.
        assert_eq!(best_length(8, 0.0, (1.0, 0.0), 0.0), 1);
    }

    #[test]
    fn the_fit_recovers_a_line_from_passes_of_two_widths() {
        let mut f = PassFit::default();
        assert!(f.line().is_none());
        for n in [5, 5, 5] {
            f.add(n, 1.0 + 0.01 * n as f64);
        }
        assert!(f.line().is_none(), "one width says nothing of the slope");
        for n in [1, 9, 3, 7] {
            f.add(n, 1.0 + 0.01 * n as f64);
        }
        let (a, b) = f.line().unwrap();
        assert!((a - 1.0).abs() < 1e-9 && (b - 0.01).abs() < 1e-9, "{a} {b}");
    }

    #[test]
    fn drafting_stops_when_a_wider_pass_costs_more_than_it_returns() {
        let mut p = Policy::new(DraftOptions {
            max_k: 8,
            adaptive: true,
        });
        // A position costs as much as a pass (5 ms each), drafts 1 ms, and
        // half are accepted: plain steps return more.
        for _ in 0..6 {
            let k = p.k;
            p.after_round(k, k / 2, 0.005 * (k + 1) as f64, 0.001 * k as f64);
        }
        assert!(!p.drafting());
        assert_eq!(p.k, 1);
    }

    #[test]
    fn a_streamed_spine_grows_the_length_to_its_maximum() {
        let mut p = Policy::new(DraftOptions {
            max_k: 8,
            adaptive: true,
        });
        assert_eq!(p.k, 4);
        // Passes cost 1 s plus 2 ms a position; 3 of 4 drafts accepted.
        for round in 0..12 {
            let k = p.k;
            let accepted = (k * 3 / 4).min(k);
            p.after_round(k, accepted, 1.0 + 0.002 * (k + 1) as f64, 0.001 * k as f64);
            if round == 0 {
                assert_eq!(p.k, 5, "no fit yet: another width, so the fit sees a slope");
            }
        }
        assert_eq!(p.k, 8);
        assert!(p.drafting());
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
