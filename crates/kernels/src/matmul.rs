//! `y[T, out] = x[T, in] · W[out, in]ᵀ` for bf16, f32 and MXFP4 weights.
//!
//! Rows of W are visited once for all T positions (the weight row stays in
//! cache while the T activations stream past it), which is what makes a
//! multi-position pass cheaper than T single-position passes when weights
//! dominate the bytes.

use fathom_weights::mxfp4::{E2M1, GROUP, Mxfp4Ref, e8m0};
use rayon::prelude::*;

/// Below this many weight elements a product runs on the calling thread.
const PAR_MIN_ELEMS: usize = 1 << 16;
/// Output rows handed to one rayon task.
const ROWS_PER_TASK: usize = 16;

/// Dot product with eight interleaved partial sums combined pairwise.
/// `w(i)` yields the weight at column `i` as f32.
#[inline(always)]
fn dot8(x: &[f32], w: impl Fn(usize) -> f32) -> f32 {
    let n = x.len();
    let mut acc = [0f32; 8];
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        for l in 0..8 {
            acc[l] += x[i + l] * w(i + l);
        }
        i += 8;
    }
    for (l, j) in (full..n).enumerate() {
        acc[l] += x[j] * w(j);
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Runs `row_fn(r, out_col)` for every output row, in parallel when large.
/// `row_fn` returns the T results of row `r` through `emit(t, value)`.
fn for_rows(
    t: usize,
    rows: usize,
    cols: usize,
    y: &mut [f32],
    row_fn: impl Fn(usize, &mut dyn FnMut(usize, f32)) + Sync,
) {
    assert_eq!(y.len(), t * rows, "output buffer has the wrong size");
    if rows * cols < PAR_MIN_ELEMS || rayon::current_num_threads() == 1 {
        for r in 0..rows {
            row_fn(r, &mut |ti, v| y[ti * rows + r] = v);
        }
        return;
    }
    // Compute row blocks in parallel into a [rows, T] scratch, then transpose.
    let mut tmp = vec![0f32; rows * t];
    tmp.par_chunks_mut(ROWS_PER_TASK * t)
        .enumerate()
        .for_each(|(blk, chunk)| {
            let r0 = blk * ROWS_PER_TASK;
            for (k, out) in chunk.chunks_exact_mut(t).enumerate() {
                row_fn(r0 + k, &mut |ti, v| out[ti] = v);
            }
        });
    for r in 0..rows {
        for ti in 0..t {
            y[ti * rows + r] = tmp[r * t + ti];
        }
    }
}

/// bf16 weights given as raw bit patterns.
pub fn matmul_bf16(x: &[f32], t: usize, w: &[u16], rows: usize, cols: usize, y: &mut [f32]) {
    assert_eq!(x.len(), t * cols, "activation has the wrong size");
    assert_eq!(w.len(), rows * cols, "weight has the wrong size");
    for_rows(t, rows, cols, y, |r, emit| {
        let wr = &w[r * cols..(r + 1) * cols];
        for ti in 0..t {
            let xr = &x[ti * cols..(ti + 1) * cols];
            emit(ti, dot8(xr, |i| f32::from_bits((wr[i] as u32) << 16)));
        }
    });
}

/// f32 weights.
pub fn matmul_f32(x: &[f32], t: usize, w: &[f32], rows: usize, cols: usize, y: &mut [f32]) {
    assert_eq!(x.len(), t * cols, "activation has the wrong size");
    assert_eq!(w.len(), rows * cols, "weight has the wrong size");
    for_rows(t, rows, cols, y, |r, emit| {
        let wr = &w[r * cols..(r + 1) * cols];
        for ti in 0..t {
            let xr = &x[ti * cols..(ti + 1) * cols];
            emit(ti, dot8(xr, |i| wr[i]));
        }
    });
}

/// MXFP4 weights, dequantised in registers one 32-column group at a time.
///
/// Per group the E2M1 values (exact small numbers) are dotted with x, then
/// multiplied by the group's power-of-two scale. Scaling by a power of two is
/// exact, so this equals dotting with the dequantised weights group by group.
pub fn matmul_mxfp4(x: &[f32], t: usize, w: Mxfp4Ref<'_>, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(x.len(), t * cols, "activation has the wrong size");
    let groups = cols / GROUP;
    for_rows(t, rows, cols, y, |r, emit| {
        let packed = &w.packed[r * cols / 2..(r + 1) * cols / 2];
        let scales = &w.scales[r * groups..(r + 1) * groups];
        for ti in 0..t {
            let xr = &x[ti * cols..(ti + 1) * cols];
            let mut total = 0f32;
            for g in 0..groups {
                let pb = &packed[g * GROUP / 2..(g + 1) * GROUP / 2];
                let xg = &xr[g * GROUP..(g + 1) * GROUP];
                let part = dot8(xg, |i| {
                    let b = pb[i / 2];
                    let code = if i % 2 == 0 { b & 0x0F } else { b >> 4 };
                    let m = E2M1[(code & 7) as usize];
                    if code & 8 != 0 { -m } else { m }
                });
                total += part * e8m0(scales[g]);
            }
            emit(ti, total);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    fn naive(x: &[f32], t: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut y = vec![0f32; t * rows];
        for ti in 0..t {
            for r in 0..rows {
                let mut s = 0f64;
                for c in 0..cols {
                    s += x[ti * cols + c] as f64 * w[r * cols + c] as f64;
                }
                y[ti * rows + r] = s as f32;
            }
        }
        y
    }

    #[test]
    fn bf16_and_f32_agree_with_f64_reference() {
        let mut s = 7;
        for &(t, rows, cols) in &[(1, 3, 5), (3, 300, 257), (2, 700, 128)] {
            let x: Vec<f32> = (0..t * cols).map(|_| lcg(&mut s)).collect();
            let wbits: Vec<u16> = (0..rows * cols)
                .map(|_| (lcg(&mut s).to_bits() >> 16) as u16)
                .collect();
            let wf: Vec<f32> = wbits
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect();
            let want = naive(&x, t, &wf, rows, cols);
            let mut a = vec![0f32; t * rows];
            let mut b = vec![0f32; t * rows];
            matmul_bf16(&x, t, &wbits, rows, cols, &mut a);
            matmul_f32(&x, t, &wf, rows, cols, &mut b);
            assert_eq!(
                a, b,
                "bf16 and f32 paths must be bit-identical on equal weights"
            );
            for (g, w) in a.iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "{g} vs {w}");
            }
        }
    }

    #[test]
    fn mxfp4_matches_dequantised_f32() {
        let mut s = 11;
        let (t, rows, cols) = (3, 40, 96);
        let packed: Vec<u8> = (0..rows * cols / 2)
            .map(|_| ((lcg(&mut s) + 0.5) * 255.0) as u8)
            .collect();
        let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 120 + (i % 9) as u8).collect();
        let m = Mxfp4Ref::new(rows, cols, &packed, &scales).unwrap();
        let wf = m.dequantize();
        let x: Vec<f32> = (0..t * cols).map(|_| lcg(&mut s)).collect();
        let mut got = vec![0f32; t * rows];
        matmul_mxfp4(&x, t, m, &mut got);
        let want = naive(&x, t, &wf, rows, cols);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-4 * w.abs().max(1.0), "{g} vs {w}");
        }
    }

    #[test]
    fn thread_count_does_not_change_results() {
        let mut s = 3;
        let (t, rows, cols) = (2, 1024, 512);
        let x: Vec<f32> = (0..t * cols).map(|_| lcg(&mut s)).collect();
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut s)).collect();
        let run = |threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut y = vec![0f32; t * rows];
            pool.install(|| matmul_f32(&x, t, &w, rows, cols, &mut y));
            y
        };
        assert_eq!(run(1), run(3));
    }
}
