//! Where a step's wall time goes, by part of the layer: cumulative
//! process-wide clocks a family's step feeds (`timed`) and a run report
//! reads as differences of [`snapshot`]s. A profile for machines without a
//! sampling profiler (the GPU host has none) and for comparing backends.
//! Timing only: nothing here changes what is computed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// The parts a step is split into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Linear-attention layers (KDA, gated delta rule): projections,
    /// convolution, recurrence, output.
    LinearAttention,
    /// Full-attention layers (MLA, GQA): projections, cache, attention, output.
    FullAttention,
    /// Dense MLP layers.
    Mlp,
    /// Mixture-of-experts layers: routing, experts (and waiting for them),
    /// shared experts, the weighted sum.
    Moe,
    /// Residual mixing, norms, embedding, and the final norm and output head.
    MixAndHead,
    /// Inside linear attention: the convolution, delta rule and output
    /// norm, with the forget gate's up-projection before them and `o_proj`
    /// after (a device runs the three in one call).
    LinearCore,
    /// Inside full attention: attention over the cache (after the projections).
    FullCore,
    /// Inside the MoE: the routed experts (and waiting for them).
    RoutedExperts,
}

const N: usize = 8;
static NS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];

/// Runs `f`, adding its wall time to `phase`'s clock.
pub fn timed<T>(phase: Phase, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    add(phase, t);
    out
}

/// Adds the time since `start` to `phase`'s clock.
pub fn add(phase: Phase, start: Instant) {
    NS[phase as usize].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// Milliseconds spent in each phase (cumulative, or a difference of two).
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PhaseMs {
    pub linear_attention: f64,
    pub full_attention: f64,
    pub mlp: f64,
    pub moe: f64,
    pub mix_and_head: f64,
    /// Parts of the phases above (not added to [`PhaseMs::total`]).
    pub linear_core: f64,
    pub full_core: f64,
    pub routed_experts: f64,
}

impl PhaseMs {
    /// The time from `start` to this snapshot.
    pub fn since(&self, start: &PhaseMs) -> PhaseMs {
        PhaseMs {
            linear_attention: self.linear_attention - start.linear_attention,
            full_attention: self.full_attention - start.full_attention,
            mlp: self.mlp - start.mlp,
            moe: self.moe - start.moe,
            mix_and_head: self.mix_and_head - start.mix_and_head,
            linear_core: self.linear_core - start.linear_core,
            full_core: self.full_core - start.full_core,
            routed_experts: self.routed_experts - start.routed_experts,
        }
    }

    /// The sum of the five phases (the parts are inside them).
    pub fn total(&self) -> f64 {
        self.linear_attention + self.full_attention + self.mlp + self.moe + self.mix_and_head
    }
}

/// The clocks now.
pub fn snapshot() -> PhaseMs {
    let ms = |p: Phase| NS[p as usize].load(Ordering::Relaxed) as f64 / 1e6;
    PhaseMs {
        linear_attention: ms(Phase::LinearAttention),
        full_attention: ms(Phase::FullAttention),
        mlp: ms(Phase::Mlp),
        moe: ms(Phase::Moe),
        mix_and_head: ms(Phase::MixAndHead),
        linear_core: ms(Phase::LinearCore),
        full_core: ms(Phase::FullCore),
        routed_experts: ms(Phase::RoutedExperts),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_phase_adds_to_its_clock() {
        let a = snapshot();
        let v = timed(Phase::Mlp, || {
            std::thread::sleep(std::time::Duration::from_millis(3));
            7
        });
        assert_eq!(v, 7);
        let d = snapshot().since(&a);
        assert!(d.mlp >= 3.0, "{d:?}");
        assert!(d.total() >= d.mlp);
    }
}
