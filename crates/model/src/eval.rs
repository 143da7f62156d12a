//! How far a lossy variant of a model (int8 spine, bf16 latent cache) is from the exact
//! one, on teacher-forced positions: both see the same tokens, and every
//! position's next-token distribution is compared.

use crate::error::Result;
use crate::lm::{CausalLm, Logits};

/// Agreement of a test model's logits with a reference's.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Agreement {
    pub positions: usize,
    /// Positions whose argmax is the same.
    pub top1_agree: usize,
    /// Sum over positions of `KL(p_ref ‖ p_test)` in nats.
    pub kl_sum: f64,
    pub max_abs_dlogit: f32,
}

impl Agreement {
    pub fn top1_rate(&self) -> f64 {
        self.top1_agree as f64 / self.positions.max(1) as f64
    }

    pub fn mean_kl(&self) -> f64 {
        self.kl_sum / self.positions.max(1) as f64
    }

    /// Adds the positions of `[positions, vocab]` logits.
    pub fn add(&mut self, reference: &[f32], test: &[f32], vocab: usize) {
        assert_eq!(reference.len(), test.len(), "logit shapes differ");
        for (r, t) in reference.chunks_exact(vocab).zip(test.chunks_exact(vocab)) {
            self.positions += 1;
            self.top1_agree += usize::from(argmax(r) == argmax(t));
            self.kl_sum += kl(r, t);
            for (a, b) in r.iter().zip(t) {
                self.max_abs_dlogit = self.max_abs_dlogit.max((a - b).abs());
            }
        }
    }
}

/// First index of the largest value.
pub fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |best, i| if x[i] > x[best] { i } else { best })
}

/// `log softmax` in f64.
fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let lse = m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
    x.iter().map(|&v| v as f64 - lse).collect()
}

/// `KL(softmax(p) ‖ softmax(q))` in nats.
pub fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter()
        .zip(&lq)
        .map(|(a, b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

/// Teacher-forces `tokens` through both models and compares every position.
pub fn compare(reference: &dyn CausalLm, test: &dyn CausalLm, tokens: &[u32]) -> Result<Agreement> {
    let a = reference.forward(reference.new_state().as_mut(), tokens, Logits::All)?;
    let b = test.forward(test.new_state().as_mut(), tokens, Logits::All)?;
    let mut agg = Agreement::default();
    agg.add(&a, &b, reference.info().vocab_size);
    Ok(agg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_and_agreement_on_known_values() {
        assert_eq!(kl(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]), 0.0);
        // p = (1/2, 1/2), q = (e/(1+e), 1/(1+e)): KL = ln((1+e)/(2e)) + ln((1+e)/2).
        let e = std::f64::consts::E;
        let want = 0.5 * ((0.5 * (1.0 + e) / e).ln() + (0.5 * (1.0 + e)).ln());
        assert!((kl(&[0.0, 0.0], &[1.0, 0.0]) - want).abs() < 1e-12);
        let mut a = Agreement::default();
        a.add(&[0.0, 1.0, 5.0, 0.0], &[0.0, 1.5, 0.0, 6.0], 2);
        assert_eq!((a.positions, a.top1_agree, a.max_abs_dlogit), (2, 1, 6.0));
    }
}
