//! Per-row symmetric int8 quantisation of resident spine matrices.
//!
//! Row `r` gets `scale = absmax / 127` (an f32) and `q = round_half_even(w / scale)`,
//! clamped to ±127 (so −128 is never used and the code is symmetric). A zero
//! row gets scale 0 and q = 0. Division by the stored scale (rather than a
//! multiply by `127 / absmax`) makes the rounding decision against the very
//! scale that dequantises the value: `|w − q·scale| ≤ scale/2` up to one f32
//! rounding. Lossy by design: the caller must label results as such.

/// Quantises rows of `cols` values given by `row(r, out)` into `(q, scale)`.
pub fn quantize_rows_int8(
    rows: usize,
    cols: usize,
    row: impl Fn(usize, &mut [f32]),
) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; rows * cols];
    let mut scale = vec![0f32; rows];
    let mut buf = vec![0f32; cols];
    for r in 0..rows {
        row(r, &mut buf);
        scale[r] = quantize_row(&buf, &mut q[r * cols..(r + 1) * cols]);
    }
    (q, scale)
}

/// Quantises one row into `q`, returning its scale.
pub fn quantize_row(w: &[f32], q: &mut [i8]) -> f32 {
    let absmax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = absmax / 127.0;
    if scale == 0.0 || !scale.is_finite() {
        q.fill(0);
        return if scale.is_finite() { 0.0 } else { scale };
    }
    for (d, &v) in q.iter_mut().zip(w) {
        *d = (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_half_to_even_against_the_stored_scale() {
        // absmax 127 → scale 1: 2.5 → 2, 3.5 → 4, −0.5 → 0, −127 stays.
        let w = [2.5f32, 3.5, -0.5, -127.0, 127.0, 0.49];
        let mut q = [0i8; 6];
        let s = quantize_row(&w, &mut q);
        assert_eq!(s, 1.0);
        assert_eq!(q, [2, 4, 0, -127, 127, 0]);
    }

    #[test]
    fn error_is_at_most_half_a_step() {
        let w: Vec<f32> = (0..999)
            .map(|i| ((i * 7919) % 1000) as f32 / 333.0 - 1.4)
            .collect();
        let mut q = vec![0i8; w.len()];
        let s = quantize_row(&w, &mut q);
        for (v, d) in w.iter().zip(&q) {
            assert!(
                (v - *d as f32 * s).abs() <= s * 0.5 * (1.0 + 1e-5),
                "{v} {d} {s}"
            );
        }
        let (q2, s2) = quantize_rows_int8(2, 3, |r, o| o.copy_from_slice(&[0.0, 0.0, r as f32]));
        assert_eq!((q2, s2), (vec![0, 0, 0, 0, 0, 127], vec![0.0, 1.0 / 127.0]));
    }
}
