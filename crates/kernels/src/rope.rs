//! Rotary position embedding in the "rotate half" layout: within a head of
//! width `d`, channel `i < d/2` is paired with channel `i + d/2` and the pair
//! is rotated by `pos · inv_freq[i]`:
//!
//! ```text
//! inv_freq[i] = 1 / θ^(2i/d)                         (plain)
//! x'[i]       = (x[i]·cos − x[i + d/2]·sin)
//! x'[i + d/2] = (x[i + d/2]·cos + x[i]·sin)
//! ```
//!
//! With YaRN ([`Rope::yarn`]) the frequencies blend the plain ones with
//! ones interpolated by the scaling factor, dimension by dimension, and
//! `cos`/`sin` are multiplied by an attention factor:
//!
//! ```text
//! extra[i] = 1 / θ^(2i/d),  inter[i] = extra[i] / factor
//! corr(r)  = d·ln(L / (2π r)) / (2 ln θ)        L = original context
//! lo, hi   = corr(beta_fast), corr(beta_slow)   (floor / ceil when truncating; clamped to [0, d−1])
//! ramp[i]  = clamp((i − lo) / (hi − lo), 0, 1)  (hi += 0.001 when lo = hi)
//! inv_freq[i] = inter[i]·ramp[i] + extra[i]·(1 − ramp[i])
//! ```
//! (the frequencies in f32 as the reference computes them).
//!
//! The angle is `pos · inv_freq[i]` rounded to f32 and its cosine and sine
//! are taken in f64 and rounded once (then scaled by the attention factor,
//! when it is not 1), so a position's rotation depends on the position only
//! (not on the batch, the chunking or the instruction set). Scalar code: it
//! is its own reference.

/// YaRN's parameters (`rope_scaling` with `rope_type` `"yarn"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// Context extension factor.
    pub factor: f64,
    /// The context the model was pretrained with.
    pub original_max_position: f64,
    /// Rotations per context above which dimensions keep their frequency…
    pub beta_fast: f64,
    /// …and below which they are fully interpolated.
    pub beta_slow: f64,
    /// Round the correction range outward to whole dimensions.
    pub truncate: bool,
    /// Multiplies every `cos` and `sin`.
    pub attention_factor: f32,
}

/// YaRN's magnitude correction `0.1·m·ln(scale) + 1` (1 for `scale ≤ 1`).
pub fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

/// The frequencies of one head width and base.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    head_dim: usize,
    inv_freq: Vec<f32>,
    /// Multiplies `cos` and `sin` (1 without YaRN).
    attention_factor: f32,
}

/// `θ^(2i/d)` for each pair `i`, rounded to f32.
fn wavelengths(head_dim: usize, theta: f64) -> impl Iterator<Item = f32> {
    (0..head_dim / 2).map(move |i| {
        let e = (2 * i) as f32 / head_dim as f32;
        theta.powf(e as f64) as f32
    })
}

impl Rope {
    /// `head_dim` must be even; `theta` is the base (`rope_theta`).
    pub fn new(head_dim: usize, theta: f64) -> Self {
        assert!(head_dim.is_multiple_of(2), "rotary head width must be even");
        Rope {
            head_dim,
            inv_freq: wavelengths(head_dim, theta).map(|p| 1.0 / p).collect(),
            attention_factor: 1.0,
        }
    }

    /// YaRN frequencies (see the module notes) for `head_dim` and base `theta`.
    pub fn yarn(head_dim: usize, theta: f64, y: &Yarn) -> Self {
        assert!(head_dim.is_multiple_of(2), "rotary head width must be even");
        let d = head_dim as f64;
        let corr = |rot: f64| {
            d * (y.original_max_position / (rot * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * theta.ln())
        };
        let (mut lo, mut hi) = (corr(y.beta_fast), corr(y.beta_slow));
        if y.truncate {
            (lo, hi) = (lo.floor(), hi.ceil());
        }
        let (lo, mut hi) = (lo.max(0.0) as f32, hi.min(d - 1.0) as f32);
        if lo == hi {
            hi += 0.001;
        }
        let factor = y.factor as f32;
        let inv_freq = wavelengths(head_dim, theta)
            .enumerate()
            .map(|(i, pos)| {
                let extra = 1.0 / pos;
                let inter = 1.0 / (factor * pos);
                let ramp = ((i as f32 - lo) / (hi - lo)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                inter * (1.0 - keep) + extra * keep
            })
            .collect();
        Rope {
            head_dim,
            inv_freq,
            attention_factor: y.attention_factor,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The frequencies, `head_dim / 2` of them.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `cos` and `sin` (each `head_dim / 2`) of position `pos`.
    pub fn angles(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let af = self.attention_factor;
        for ((f, c), s) in self.inv_freq.iter().zip(cos).zip(sin) {
            let a = (pos as f32 * f) as f64;
            *c = a.cos() as f32;
            *s = a.sin() as f32;
            if af != 1.0 {
                *c *= af;
                *s *= af;
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yarn_keeps_fast_dimensions_and_interpolates_slow_ones() {
        let y = Yarn {
            factor: 40.0,
            original_max_position: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 1.0,
        };
        let (d, theta) = (64, 10_000.0);
        let plain = Rope::new(d, theta);
        let r = Rope::yarn(d, theta, &y);
        // corr(32) = 64·ln(4096/(64π))/(2 ln 1e4) ≈ 10.5 → 10; corr(1) ≈ 22.5 → 23.
        for i in 0..=10 {
            assert_eq!(r.inv_freq()[i], plain.inv_freq()[i], "dimension {i}");
        }
        for i in 23..32 {
            let want = plain.inv_freq()[i] / 40.0;
            assert!(
                (r.inv_freq()[i] - want).abs() <= 1e-6 * want,
                "dimension {i}"
            );
        }
        let mid = r.inv_freq()[16];
        assert!(mid < plain.inv_freq()[16] && mid > plain.inv_freq()[16] / 40.0);
        assert!((yarn_mscale(40.0, 1.0) - (0.1 * 40f64.ln() + 1.0)).abs() < 1e-12);
        assert_eq!(yarn_mscale(1.0, 1.0), 1.0);
    }

    #[test]
    fn attention_factor_scales_cos_and_sin() {
        let y = Yarn {
            factor: 32.0,
            original_max_position: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: false,
            attention_factor: 1.5,
        };
        let r = Rope::yarn(16, 150_000.0, &y);
        let (mut c, mut s) = (vec![0f32; 8], vec![0f32; 8]);
        r.angles(0, &mut c, &mut s);
        assert!(c.iter().all(|&v| v == 1.5) && s.iter().all(|&v| v == 0.0));
    }
}
