//! Scoring the guessed matrices a caller hands over (the next MoE layer's
//! likely experts): a guess is right when a product uses its matrix before
//! the batch after next hands over its own guesses (by then the layer it
//! was meant for has run), or the caller reports computing it on the CPU. Copies of guesses are worth their bandwidth only
//! while most are right: a wrong one takes the copy engine from the misses
//! that follow it and may push a useful expert out of the cache. Guesses
//! keep being scored while their copies are paused, so copying resumes
//! when they improve.

use std::collections::VecDeque;

use crate::cache::Key;

/// Copy guesses only while at least this share of the recent ones was
/// right. On a random-weight synth (0.51 right) copying them all made decoding
/// 3–8 % slower (more bytes copied than misses saved: f377c4b on an H200,
/// `fathom run --model M4 --prompt-ids 1,2,3,4,5,6,7,8 --max-new 24
/// --experts stream --ram-budget 40GB --heat H --heat-pin 0.9 --device cuda
/// --vram-budget 9GB --json`, builds with this floor at 0.7 and at 0 run
/// interleaved; M4 as in docs/bench.md); a trained model's next-layer
/// guesses are right far more often (k3-code-small: about 0.75, the
/// streaming store's `prefetch_precision`).
pub(crate) const MIN_PRECISION: f64 = 0.7;

/// How many scored guesses the precision is taken over.
const WINDOW: usize = 256;

/// Guesses not yet scored, two generations of them, and the recent scores.
#[derive(Default)]
pub(crate) struct GuessLog {
    /// The last batch's guesses: (matrix, used since).
    current: Vec<(Key, bool)>,
    /// The guesses of the batch before it.
    previous: Vec<(Key, bool)>,
    recent: VecDeque<bool>,
    /// Every guess scored so far, and the right ones.
    pub(crate) scored: u64,
    pub(crate) right: u64,
}

impl GuessLog {
    /// A new batch's guessed matrices (each named by its first segment):
    /// the guesses two batches old are scored and dropped.
    pub(crate) fn guessed(&mut self, mats: impl IntoIterator<Item = Key>) {
        let fresh: Vec<(Key, bool)> = mats.into_iter().map(|k| (k, false)).collect();
        if fresh.is_empty() {
            return;
        }
        let old = std::mem::replace(&mut self.previous, std::mem::take(&mut self.current));
        self.current = fresh;
        for (_, used) in old {
            self.scored += 1;
            self.right += u64::from(used);
            if self.recent.len() == WINDOW {
                self.recent.pop_front();
            }
            self.recent.push_back(used);
        }
    }

    /// A product used matrix `k` (its first segment).
    pub(crate) fn used(&mut self, k: &Key) {
        for (g, used) in self.previous.iter_mut().chain(self.current.iter_mut()) {
            if g == k {
                *used = true;
            }
        }
    }

    /// The share of the recent scored guesses that were right (1 before any).
    pub(crate) fn precision(&self) -> f64 {
        if self.recent.is_empty() {
            return 1.0;
        }
        self.recent.iter().filter(|&&u| u).count() as f64 / self.recent.len() as f64
    }

    /// Whether guesses should be copied now.
    pub(crate) fn worth_copying(&self) -> bool {
        self.precision() >= MIN_PRECISION
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guess_is_right_when_used_before_the_batch_after_next() {
        let mut log = GuessLog::default();
        assert!(log.worth_copying(), "optimistic before any score");
        log.guessed([(1, 8), (2, 8)]);
        log.used(&(1, 8));
        log.guessed([(3, 8)]);
        assert_eq!(log.scored, 0, "one generation old: not yet scored");
        log.used(&(2, 8)); // still in time (the layer it was meant for ran late)
        log.guessed([(4, 8)]);
        assert_eq!((log.scored, log.right), (2, 2));
        log.guessed([(5, 8)]);
        assert_eq!((log.scored, log.right), (3, 2), "(3, 8) never used");
        assert!((log.precision() - 2.0 / 3.0).abs() < 1e-12);
        assert!(!log.worth_copying());
        log.guessed(std::iter::empty());
        assert_eq!(log.scored, 3, "a batch without guesses scores nothing");
    }

    #[test]
    fn copying_resumes_when_guesses_improve() {
        let mut log = GuessLog::default();
        for i in 0..WINDOW {
            log.guessed([(i, 1)]);
        }
        assert!(!log.worth_copying(), "none used");
        for i in WINDOW..3 * WINDOW {
            log.used(&(i - 1, 1));
            log.used(&(i - 2, 1));
            log.guessed([(i, 1)]);
        }
        assert!(log.worth_copying(), "{}", log.precision());
    }
}
