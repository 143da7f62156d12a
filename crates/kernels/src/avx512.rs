//! AVX-512 (F + BW) kernels: 32 lanes = two zmm accumulators per position.
//!
//! Each row's weights are dequantised in registers once per 32 columns and
//! applied to up to four positions at a time (eight accumulators), so a row
//! crosses the memory bus once for all T; further position groups re-read it
//! from L1/L2. The operations are exactly those of `formats::block_scalar`.

use std::arch::x86_64::*;
use std::ops::Range;

use fathom_weights::mxfp4::{E2M1, GROUP, e8m0};

use crate::formats::{Bf16Rows, F32Rows, Int8Rows, LANES, Mxfp4Rows, Rows};

/// Rows in flight together.
const NR: usize = 4;
/// Positions sharing one pass over those rows.
const NT: usize = 2;

/// Formats that can load 32 dequantised weights into two zmm registers.
pub trait Load512: Rows {
    /// Columns `c .. c + 32` of row `r` (all in range).
    ///
    /// # Safety
    /// The CPU supports AVX-512 F and BW, and `c + 32 <= cols`.
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2];
}

impl Load512 for F32Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2] {
        let p = self.w[r * self.cols + c..][..LANES].as_ptr();
        // SAFETY: the slice above holds 32 f32; unaligned loads.
        unsafe { [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))] }
    }
}

impl Load512 for Bf16Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2] {
        let p = self.w[r * self.cols + c..][..LANES].as_ptr();
        // SAFETY: the slice above holds 32 u16 (64 bytes); bf16 → f32 is a 16-bit shift.
        unsafe {
            let a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
            let b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(16).cast()));
            [
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(a)),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b)),
            ]
        }
    }
}

impl Load512 for Int8Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2] {
        let p = self.q[r * self.cols + c..][..LANES].as_ptr();
        // SAFETY: the slice above holds 32 bytes; i8 → i32 → f32 is exact.
        unsafe {
            let a = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()));
            let b = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(16).cast()));
            [_mm512_cvtepi32_ps(a), _mm512_cvtepi32_ps(b)]
        }
    }
}

impl Load512 for Mxfp4Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2] {
        let m = &self.0;
        let bytes = m.packed[(r * m.cols + c) / 2..][..LANES / 2].as_ptr();
        let scale = e8m0(m.scales[(r * m.cols + c) / GROUP]);
        // SAFETY: 16 packed bytes are in range (slice above); the rest is register work.
        unsafe {
            // The 16 signed E2M1 values, indexed by the whole nibble.
            let lut = _mm512_setr_ps(
                E2M1[0], E2M1[1], E2M1[2], E2M1[3], E2M1[4], E2M1[5], E2M1[6], E2M1[7], -E2M1[0],
                -E2M1[1], -E2M1[2], -E2M1[3], -E2M1[4], -E2M1[5], -E2M1[6], -E2M1[7],
            );
            let b = _mm_loadu_si128(bytes.cast());
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(b, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
            // Column order: low nibble (even column) then high nibble (odd).
            let c0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
            let c1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));
            // Scaling the table gives the same products `e2m1 · 2^e`, one multiply per group.
            let lut = _mm512_mul_ps(lut, _mm512_set1_ps(scale));
            [
                _mm512_permutexvar_ps(c0, lut),
                _mm512_permutexvar_ps(c1, lut),
            ]
        }
    }
}

/// Folds two zmm of partial sums exactly as `formats::fold32`.
#[inline(always)]
unsafe fn fold(a: [__m512; 2]) -> f32 {
    // SAFETY: register-only intrinsics; the caller runs with AVX-512 F enabled.
    unsafe {
        let s16 = _mm512_add_ps(a[0], a[1]);
        let s8 = _mm256_add_ps(
            _mm512_castps512_ps256(s16),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(s16))),
        );
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }
}

/// `acc[j] += x_j * w` for the K positions whose 32 activations start at `xp[j]`.
#[inline(always)]
unsafe fn step<const K: usize>(acc: &mut [[__m512; 2]; K], wv: [__m512; 2], xp: &[*const f32; K]) {
    for (a, &p) in acc.iter_mut().zip(xp) {
        // SAFETY: the caller guarantees 32 readable f32 at `p`.
        unsafe {
            a[0] = _mm512_add_ps(a[0], _mm512_mul_ps(_mm512_loadu_ps(p), wv[0]));
            a[1] = _mm512_add_ps(a[1], _mm512_mul_ps(_mm512_loadu_ps(p.add(16)), wv[1]));
        }
    }
}

/// Dot products of rows `r0 .. r0 + R` with positions `j0 .. j0 + K`:
/// `out[i·t + j0 + j]`. R rows in flight give independent add chains and
/// memory streams at T = 1; each (row, position) keeps its own lanes, so
/// the grouping never changes a result.
#[inline(always)]
unsafe fn dots<W: Load512, const R: usize, const K: usize>(
    w: &W,
    r0: usize,
    x: &[f32],
    t: usize,
    j0: usize,
    out: &mut [f32],
) {
    let n = w.cols();
    let full = n / LANES * LANES;
    let xs = &x[j0 * n..(j0 + K) * n];
    // SAFETY: register-only.
    let mut acc = unsafe { [[[_mm512_setzero_ps(); 2]; K]; R] };
    let mut c = 0;
    while c < full {
        let xp: [*const f32; K] = std::array::from_fn(|j| xs[j * n + c..][..LANES].as_ptr());
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: `c + 32 <= full <= n` (checked slices above hold 32 columns).
            unsafe { step(a, w.load(r0 + i, c), &xp) };
        }
        c += LANES;
    }
    if full < n {
        // Tail: zero-padded copies, as the scalar reference pads.
        let mut wb = [[0f32; LANES]; R];
        let mut xb = [[0f32; LANES]; K];
        for col in full..n {
            for (i, row) in wb.iter_mut().enumerate() {
                row[col - full] = w.at(r0 + i, col);
            }
            for (j, row) in xb.iter_mut().enumerate() {
                row[col - full] = xs[j * n + col];
            }
        }
        let xp: [*const f32; K] = std::array::from_fn(|j| xb[j].as_ptr());
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: the stack buffers hold 32 f32 each.
            unsafe {
                step(
                    a,
                    [
                        _mm512_loadu_ps(wb[i].as_ptr()),
                        _mm512_loadu_ps(wb[i].as_ptr().add(16)),
                    ],
                    &xp,
                )
            };
        }
    }
    for (i, ai) in acc.into_iter().enumerate() {
        for (j, a) in ai.into_iter().enumerate() {
            // SAFETY: register-only folding.
            out[i * t + j0 + j] = w.finish(r0 + i, unsafe { fold(a) });
        }
    }
}

/// All positions of rows `r0 .. r0 + R`, K at a time.
#[inline(always)]
unsafe fn rows_of<W: Load512, const R: usize>(
    w: &W,
    r0: usize,
    x: &[f32],
    t: usize,
    out: &mut [f32],
) {
    let mut j = 0;
    while j + NT <= t {
        // SAFETY: forwarded from the caller.
        unsafe { dots::<W, R, NT>(w, r0, x, t, j, out) };
        j += NT;
    }
    while j < t {
        // SAFETY: forwarded from the caller.
        unsafe { dots::<W, R, 1>(w, r0, x, t, j, out) };
        j += 1;
    }
}

#[target_feature(enable = "avx512f,avx512bw")]
fn block<W: Load512>(w: &W, x: &[f32], t: usize, rows: Range<usize>, out: &mut [f32]) {
    let mut r = rows.start;
    while r + NR <= rows.end {
        let o = &mut out[(r - rows.start) * t..];
        // SAFETY: this function is compiled with, and only reached on, AVX-512 F/BW.
        unsafe { rows_of::<W, NR>(w, r, x, t, o) };
        r += NR;
    }
    while r < rows.end {
        let o = &mut out[(r - rows.start) * t..];
        // SAFETY: as above.
        unsafe { rows_of::<W, 1>(w, r, x, t, o) };
        r += 1;
    }
}

/// Table entry. Only `dispatch` references it, after detecting AVX-512 F/BW.
pub(crate) fn entry<W: Load512>(w: &W, x: &[f32], t: usize, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the dispatch table holding this entry is built only when the CPU has AVX-512 F/BW.
    unsafe { block(w, x, t, rows, out) }
}
