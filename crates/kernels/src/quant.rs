//! Per-row symmetric int8 quantisation of resident spine matrices.
//!
//! Row `r` gets `scale = absmax / 127` (an f32) and `q = round_half_even(w / scale)`,
//! clamped to ±127 (so −128 is never used and the code is symmetric). A zero
//! row gets scale 0 and q = 0. Division by the stored scale (rather than a
//! multiply by `127 / absmax`) makes the rounding decision against the very
//! scale that dequantises the value: `|w − q·scale| ≤ scale/2` up to one f32
//! rounding. Lossy by design: the caller must label results as such.

/// Quantises rows of `cols` values given by `row(r, out)` into `(q, scale)`,
/// rows spread over the thread pool (each row's result depends on that row
/// alone, so not on the split).
pub fn quantize_rows_int8(
    rows: usize,
    cols: usize,
    row: impl Fn(usize, &mut [f32]) + Sync,
) -> (Vec<i8>, Vec<f32>) {
    use rayon::prelude::*;
    let mut q = vec![0i8; rows * cols];
    let mut scale = vec![0f32; rows];
    if cols == 0 {
        return (q, scale);
    }
    q.par_chunks_mut(cols)
        .zip(scale.par_iter_mut())
        .enumerate()
        .with_min_len((1 << 16) / cols + 1)
        .for_each_init(
            || vec![0f32; cols],
            |buf, (r, (qr, s))| {
                row(r, buf);
                *s = quantize_row(buf, qr);
            },
        );
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
        *d = round_ties_even(v / scale).clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// 1.5·2²³: adding it leaves a unit in the last place of 1.
const ROUNDER: f32 = 12_582_912.0;

/// `x.round_ties_even()` for `|x| < 2²²` (and NaN stays NaN): the sum with
/// [`ROUNDER`] is rounded to an integer by the FPU's own
/// round-half-to-even, and the difference is exact. Unlike the library
/// call, it vectorises. The quotient `v / scale` is at most a little over
/// 127 in magnitude.
#[inline(always)]
fn round_ties_even(x: f32) -> f32 {
    (x + ROUNDER) - ROUNDER
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

    /// The vectorisable rounding gives the library's codes (a zero's sign
    /// aside, which no code keeps) over every quotient a row can give:
    /// halves, near-halves and values around ±127.
    #[test]
    fn rounding_matches_round_ties_even() {
        let mut xs: Vec<f32> = (-600..=600).map(|k| k as f32 / 4.0).collect();
        for k in -130i32..=130 {
            let h = k as f32 + 0.5;
            xs.extend([h, h.next_up(), h.next_down(), -0.0, f32::NAN]);
        }
        for x in xs {
            let code = |r: f32| r.clamp(-127.0, 127.0) as i8;
            let (a, b) = (round_ties_even(x), x.round_ties_even());
            assert_eq!(code(a), code(b), "{x}: {a} vs {b}");
            assert!(a == b || (a.is_nan() && b.is_nan()), "{x}: {a} vs {b}");
        }
    }

    /// Rows spread over threads give what one row at a time gives.
    #[test]
    fn rows_quantise_the_same_on_any_thread_count() {
        let (rows, cols) = (300, 517);
        let value = |r: usize, c: usize| (((r * 131 + c * 7919) % 2003) as f32 - 1001.0) / 97.0;
        let fill = |r: usize, o: &mut [f32]| {
            for (c, v) in o.iter_mut().enumerate() {
                *v = value(r, c);
            }
        };
        let mut want_q = vec![0i8; rows * cols];
        let mut want_s = Vec::new();
        for r in 0..rows {
            let w: Vec<f32> = (0..cols).map(|c| value(r, c)).collect();
            want_s.push(quantize_row(&w, &mut want_q[r * cols..(r + 1) * cols]));
        }
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let (q, s) = pool.install(|| quantize_rows_int8(rows, cols, fill));
            assert!(q == want_q, "{threads} threads");
            assert_eq!(
                s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want_s.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}
