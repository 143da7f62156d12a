//! `y[T, out] = x[T, in] · W[out, in]ᵀ` for bf16, f32, int8, MXFP4, FP8
//! (block-scaled E4M3) and INT4 (group-scaled, pack-quantized) weights.
//!
//! Rows of W are visited once for all T positions (the weight row stays in
//! cache while the T activations stream past it), which is what makes a
//! multi-position pass cheaper than T single-position passes when weights
//! dominate the bytes. The kernels behind these entry points are chosen once
//! per process (`dispatch`); every choice gives bit-identical results.

use std::borrow::Cow;
use std::ops::Range;

use fathom_weights::mxfp4::Mxfp4Ref;
use rayon::prelude::*;

use crate::dispatch::{Kernels, kernels};
use crate::formats::{Bf16Rows, F32Rows, Fp8Rows, Int4Rows, Int8Rows, Mxfp4Rows, Rows};

/// Below this many weight elements a product runs on the calling thread.
const PAR_MIN_ELEMS: usize = 1 << 16;
/// Output rows handed to one kernel call (and one rayon task).
const ROWS_PER_TASK: usize = 16;

/// Runs `block(rows, out)` over row blocks, in parallel when large, and
/// writes `y[T, rows]`. A row's result never depends on the block split or
/// on the thread count: each dot product is computed whole by one call.
fn for_rows(
    t: usize,
    rows: usize,
    cols: usize,
    y: &mut [f32],
    block: impl Fn(Range<usize>, &mut [f32]) + Sync,
) {
    assert_eq!(y.len(), t * rows, "output buffer has the wrong size");
    let parallel = rows * cols >= PAR_MIN_ELEMS && rayon::current_num_threads() > 1;
    // Blocks write `[rows, T]`; for T = 1 that is already `y`'s layout.
    let mut tmp = if t == 1 {
        Vec::new()
    } else {
        vec![0f32; rows * t]
    };
    let buf: &mut [f32] = if t == 1 { y } else { &mut tmp };
    let run = |(b, chunk): (usize, &mut [f32])| {
        let r0 = b * ROWS_PER_TASK;
        block(r0..r0 + chunk.len() / t, chunk)
    };
    if parallel {
        buf.par_chunks_mut(ROWS_PER_TASK * t)
            .enumerate()
            .for_each(run);
    } else {
        buf.chunks_mut(ROWS_PER_TASK * t).enumerate().for_each(run);
    }
    if t > 1 {
        for r in 0..rows {
            for ti in 0..t {
                y[ti * rows + r] = tmp[r * t + ti];
            }
        }
    }
}

impl Kernels {
    /// f32 weights `[rows, cols]`.
    pub fn matmul_f32(
        &self,
        x: &[f32],
        t: usize,
        w: &[f32],
        rows: usize,
        cols: usize,
        y: &mut [f32],
    ) {
        assert_eq!(x.len(), t * cols, "activation has the wrong size");
        assert_eq!(w.len(), rows * cols, "weight has the wrong size");
        let w = F32Rows { w, cols };
        for_rows(t, rows, cols, y, |r, o| (self.f32)(&w, x, t, r, o));
    }

    /// bf16 weights `[rows, cols]` given as raw bit patterns.
    pub fn matmul_bf16(
        &self,
        x: &[f32],
        t: usize,
        w: &[u16],
        rows: usize,
        cols: usize,
        y: &mut [f32],
    ) {
        assert_eq!(x.len(), t * cols, "activation has the wrong size");
        assert_eq!(w.len(), rows * cols, "weight has the wrong size");
        let w = Bf16Rows { w, cols };
        for_rows(t, rows, cols, y, |r, o| (self.bf16)(&w, x, t, r, o));
    }

    /// Row-scaled int8 weights: `W[r][c] = q[r·cols + c] · scale[r]`.
    pub fn matmul_int8(
        &self,
        x: &[f32],
        t: usize,
        q: &[i8],
        scale: &[f32],
        cols: usize,
        y: &mut [f32],
    ) {
        let rows = scale.len();
        assert_eq!(x.len(), t * cols, "activation has the wrong size");
        assert_eq!(q.len(), rows * cols, "weight has the wrong size");
        let w = Int8Rows { q, scale, cols };
        for_rows(t, rows, cols, y, |r, o| (self.int8)(&w, x, t, r, o));
    }

    /// MXFP4 weights, dequantised in registers 32 columns (one scale group) at a time.
    pub fn matmul_mxfp4(&self, x: &[f32], t: usize, w: Mxfp4Ref<'_>, y: &mut [f32]) {
        assert_eq!(x.len(), t * w.cols, "activation has the wrong size");
        let (rows, cols) = (w.rows, w.cols);
        let w = Mxfp4Rows(w);
        for_rows(t, rows, cols, y, |r, o| (self.mxfp4)(&w, x, t, r, o));
    }

    /// FP8 E4M3 weights with block scales, dequantised in registers 32
    /// columns (within one scale tile) at a time.
    pub fn matmul_fp8(&self, x: &[f32], t: usize, w: Fp8Rows<'_>, y: &mut [f32]) {
        assert_eq!(x.len(), t * w.cols, "activation has the wrong size");
        let (rows, cols) = (w.rows(), w.cols);
        for_rows(t, rows, cols, y, |r, o| (self.fp8)(&w, x, t, r, o));
    }

    /// Group-scaled symmetric INT4 weights (compressed-tensors pack-quantized).
    pub fn matmul_int4(&self, x: &[f32], t: usize, w: Int4Rows<'_>, y: &mut [f32]) {
        assert_eq!(x.len(), t * w.cols, "activation has the wrong size");
        let (rows, cols) = (w.rows(), w.cols);
        for_rows(t, rows, cols, y, |r, o| (self.int4)(&w, x, t, r, o));
    }
}

/// `y = x Wᵀ` for bf16 weights, with the process-wide kernels.
pub fn matmul_bf16(x: &[f32], t: usize, w: &[u16], rows: usize, cols: usize, y: &mut [f32]) {
    kernels().matmul_bf16(x, t, w, rows, cols, y)
}

/// `y = x Wᵀ` for bf16 weights given as little-endian bytes (a routed
/// expert read into a byte buffer): the bytes are used in place when they
/// are 2-byte aligned, else copied once. Same results as [`matmul_bf16`].
pub fn matmul_bf16_bytes(x: &[f32], t: usize, w: &[u8], rows: usize, cols: usize, y: &mut [f32]) {
    assert_eq!(w.len(), 2 * rows * cols, "weight has the wrong size");
    // SAFETY: every bit pattern is a valid u16; align_to only hands out the
    // aligned middle, and the result is used only when nothing is left over.
    let (head, words, tail) = unsafe { w.align_to::<u16>() };
    if cfg!(target_endian = "little") && head.is_empty() && tail.is_empty() {
        return matmul_bf16(x, t, words, rows, cols, y);
    }
    let copied: Vec<u16> = w
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    matmul_bf16(x, t, &copied, rows, cols, y)
}

/// `y = x Wᵀ` for f32 weights, with the process-wide kernels.
pub fn matmul_f32(x: &[f32], t: usize, w: &[f32], rows: usize, cols: usize, y: &mut [f32]) {
    kernels().matmul_f32(x, t, w, rows, cols, y)
}

/// Little-endian f32 bytes as f32s: in place when 4-byte aligned, else
/// copied once (a tensor read into a byte buffer at any offset).
pub fn f32s_of_bytes(b: &[u8]) -> Cow<'_, [f32]> {
    assert!(b.len().is_multiple_of(4), "f32 bytes come in fours");
    // SAFETY: every bit pattern is a valid f32; align_to only hands out the
    // aligned middle, and the result is used only when nothing is left over.
    let (head, words, tail) = unsafe { b.align_to::<f32>() };
    if cfg!(target_endian = "little") && head.is_empty() && tail.is_empty() {
        return Cow::Borrowed(words);
    }
    Cow::Owned(
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

/// Little-endian u16 bytes (bf16 bit patterns) as u16s, in place when
/// 2-byte aligned, else copied once.
pub fn u16s_of_bytes(b: &[u8]) -> Cow<'_, [u16]> {
    assert!(b.len().is_multiple_of(2), "u16 bytes come in pairs");
    // SAFETY: as in `f32s_of_bytes`.
    let (head, words, tail) = unsafe { b.align_to::<u16>() };
    if cfg!(target_endian = "little") && head.is_empty() && tail.is_empty() {
        return Cow::Borrowed(words);
    }
    Cow::Owned(
        b.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect(),
    )
}

/// `y = x Wᵀ` for f32 weights given as little-endian bytes (used in place
/// when aligned). Same results as [`matmul_f32`].
pub fn matmul_f32_bytes(x: &[f32], t: usize, w: &[u8], rows: usize, cols: usize, y: &mut [f32]) {
    assert_eq!(w.len(), 4 * rows * cols, "weight has the wrong size");
    matmul_f32(x, t, &f32s_of_bytes(w), rows, cols, y)
}

/// `y = x Wᵀ` for FP8 E4M3 weights with block scales, with the
/// process-wide kernels: equal to dotting with the matrix dequantised as
/// `e4m3 · scale` (one f32 rounding per weight), in the fixed 32-lane order.
pub fn matmul_fp8(x: &[f32], t: usize, w: Fp8Rows<'_>, y: &mut [f32]) {
    kernels().matmul_fp8(x, t, w, y)
}

/// `y = x Wᵀ` for group-scaled INT4 weights, with the process-wide
/// kernels: every weight `(code − 8) · scale` is exact in f32.
pub fn matmul_int4(x: &[f32], t: usize, w: Int4Rows<'_>, y: &mut [f32]) {
    kernels().matmul_int4(x, t, w, y)
}

/// `y = x Wᵀ` for row-scaled int8 weights, with the process-wide kernels.
pub fn matmul_int8(x: &[f32], t: usize, q: &[i8], scale: &[f32], cols: usize, y: &mut [f32]) {
    kernels().matmul_int8(x, t, q, scale, cols, y)
}

/// `y = x Wᵀ` for MXFP4 weights, with the process-wide kernels.
///
/// Each weight is `e2m1 · 2^e` rounded once to f32 (exact for every finite
/// product), so this equals dotting with the dequantised matrix, in the
/// fixed 32-lane order of `formats`.
pub fn matmul_mxfp4(x: &[f32], t: usize, w: Mxfp4Ref<'_>, y: &mut [f32]) {
    kernels().matmul_mxfp4(x, t, w, y)
}

/// Output columns one task of [`Kernels::matmul_bf16_in_major`] owns.
const COLS_PER_TASK: usize = 256;
/// Activation rows whose accumulators share each read of a weight row.
const IN_MAJOR_ROW_TILE: usize = 4;

impl Kernels {
    /// `y[T, out] = x[T, in] · W` for bf16 weights stored input-major,
    /// `W[in, out]` (GPT-OSS's stacked experts), given as raw bit patterns.
    ///
    /// Each output is `Σ_k x[k]·W[k, o]` accumulated in `k` order with a
    /// fused multiply-add per term, from zero: the order is fixed by the
    /// shapes, so every instruction set (the AVX2 build compiles the same
    /// loop with FMA enabled; the baseline's `mul_add` is the library's
    /// exact fused operation), thread count and row count gives the same
    /// bits. Threads split the output columns.
    pub fn matmul_bf16_in_major(
        &self,
        x: &[f32],
        t: usize,
        w: &[u16],
        ins: usize,
        outs: usize,
        y: &mut [f32],
    ) {
        assert_eq!(x.len(), t * ins, "activation has the wrong size");
        assert_eq!(w.len(), ins * outs, "weight has the wrong size");
        assert_eq!(y.len(), t * outs, "output buffer has the wrong size");
        let parallel = ins * outs >= PAR_MIN_ELEMS && rayon::current_num_threads() > 1;
        let avx2 = matches!(self.isa, crate::Isa::Avx2 | crate::Isa::Avx512);
        let chunks = outs.div_ceil(COLS_PER_TASK);
        let run = |c: usize| -> Vec<f32> {
            let cols = c * COLS_PER_TASK..((c + 1) * COLS_PER_TASK).min(outs);
            let mut part = vec![0f32; t * cols.len()];
            in_major_cols(avx2, x, t, w, ins, outs, cols, &mut part);
            part
        };
        let parts: Vec<Vec<f32>> = if parallel {
            (0..chunks).into_par_iter().map(run).collect()
        } else {
            (0..chunks).map(run).collect()
        };
        for (c, part) in parts.iter().enumerate() {
            let c0 = c * COLS_PER_TASK;
            let n = part.len() / t.max(1);
            for ti in 0..t {
                y[ti * outs + c0..][..n].copy_from_slice(&part[ti * n..(ti + 1) * n]);
            }
        }
    }
}

/// Columns `cols` of the input-major product into `part [T, cols.len()]`,
/// compiled for AVX2 + FMA when `avx2` (the caller's table is AVX2 or
/// AVX-512) and for the baseline otherwise: the same fused arithmetic.
#[allow(clippy::too_many_arguments)]
fn in_major_cols(
    avx2: bool,
    x: &[f32],
    t: usize,
    w: &[u16],
    ins: usize,
    outs: usize,
    cols: Range<usize>,
    part: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: a table is AVX2 or AVX-512 only on CPUs that report AVX2 and FMA.
        return unsafe { in_major_cols_avx2(x, t, w, ins, outs, cols, part) };
    }
    let _ = avx2;
    in_major_cols_impl(x, t, w, ins, outs, cols, part)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn in_major_cols_avx2(
    x: &[f32],
    t: usize,
    w: &[u16],
    ins: usize,
    outs: usize,
    cols: Range<usize>,
    part: &mut [f32],
) {
    in_major_cols_impl(x, t, w, ins, outs, cols, part)
}

/// The order-defining loop: per tile of rows, per input `k` in order, per
/// column, `acc = fma(x[k], W[k, o], acc)`.
#[inline(always)]
fn in_major_cols_impl(
    x: &[f32],
    t: usize,
    w: &[u16],
    ins: usize,
    outs: usize,
    cols: Range<usize>,
    part: &mut [f32],
) {
    let n = cols.len();
    let mut wrow = vec![0f32; n];
    for t0 in (0..t).step_by(IN_MAJOR_ROW_TILE) {
        let t1 = (t0 + IN_MAJOR_ROW_TILE).min(t);
        let acc = &mut part[t0 * n..t1 * n];
        for k in 0..ins {
            let src = &w[k * outs + cols.start..k * outs + cols.end];
            for (d, &b) in wrow.iter_mut().zip(src) {
                *d = f32::from_bits((b as u32) << 16);
            }
            for (ti, a) in (t0..t1).zip(acc.chunks_exact_mut(n)) {
                let xv = x[ti * ins + k];
                for (o, &wv) in a.iter_mut().zip(&wrow) {
                    *o = xv.mul_add(wv, *o);
                }
            }
        }
    }
}

/// [`Kernels::matmul_bf16_in_major`] with the process-wide kernels, for
/// weights given as little-endian bytes (used in place when 2-byte
/// aligned, else copied once).
pub fn matmul_bf16_in_major_bytes(
    x: &[f32],
    t: usize,
    w: &[u8],
    ins: usize,
    outs: usize,
    y: &mut [f32],
) {
    assert_eq!(w.len(), 2 * ins * outs, "weight has the wrong size");
    // SAFETY: every bit pattern is a valid u16; align_to only hands out the
    // aligned middle, and the result is used only when nothing is left over.
    let (head, words, tail) = unsafe { w.align_to::<u16>() };
    if cfg!(target_endian = "little") && head.is_empty() && tail.is_empty() {
        return kernels().matmul_bf16_in_major(x, t, words, ins, outs, y);
    }
    let copied: Vec<u16> = w
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    kernels().matmul_bf16_in_major(x, t, &copied, ins, outs, y)
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

    /// bf16 weights given as bytes, aligned or not, equal the u16 path.
    #[test]
    fn bf16_bytes_equal_bf16_words() {
        let mut s = 5;
        let (t, rows, cols) = (3, 17, 40);
        let x: Vec<f32> = (0..t * cols).map(|_| lcg(&mut s)).collect();
        let w: Vec<u16> = (0..rows * cols)
            .map(|_| (lcg(&mut s).to_bits() >> 16) as u16)
            .collect();
        let mut want = vec![0f32; t * rows];
        matmul_bf16(&x, t, &w, rows, cols, &mut want);
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        for shift in [0, 1] {
            let mut buf = vec![0u8; shift];
            buf.extend_from_slice(&bytes);
            let mut y = vec![0f32; t * rows];
            matmul_bf16_bytes(&x, t, &buf[shift..], rows, cols, &mut y);
            assert_eq!(y, want, "offset {shift}");
        }
    }
}
