//! Rotary position embedding in the "rotate half" layout: within a head of
//! width `d`, channel `i < d/2` is paired with channel `i + d/2` and the pair
//! is rotated by `pos · inv_freq[i]`:
//!
//! ```text
//! inv_freq[i] = 1 / θ^(2i/d)
//! x'[i]       = x[i]·cos − x[i + d/2]·sin
//! x'[i + d/2] = x[i + d/2]·cos + x[i]·sin
//! ```
//!
//! The angle is `pos · inv_freq[i]` rounded to f32 and its cosine and sine
//! are taken in f64 and rounded once, so a position's rotation depends on
//! the position only (not on the batch, the chunking or the instruction
//! set). Scalar code: it is its own reference.

/// The frequencies of one head width and base.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    head_dim: usize,
    inv_freq: Vec<f32>,
}

impl Rope {
    /// `head_dim` must be even; `theta` is the base (`rope_theta`).
    pub fn new(head_dim: usize, theta: f64) -> Self {
        assert!(head_dim.is_multiple_of(2), "rotary head width must be even");
        let inv_freq = (0..head_dim / 2)
            .map(|i| {
                let e = (2 * i) as f32 / head_dim as f32;
                1.0 / (theta.powf(e as f64) as f32)
            })
            .collect();
        Rope { head_dim, inv_freq }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// `cos` and `sin` (each `head_dim / 2`) of position `pos`.
    pub fn angles(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for ((f, c), s) in self.inv_freq.iter().zip(cos).zip(sin) {
            let a = (pos as f32 * f) as f64;
            *c = a.cos() as f32;
            *s = a.sin() as f32;
        }
    }

    /// Rotates every head of `x` (`[heads, head_dim]`) by the angles of one
    /// position (from [`Rope::angles`]).
    pub fn rotate(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.head_dim / 2;
        for head in x.chunks_exact_mut(self.head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}
