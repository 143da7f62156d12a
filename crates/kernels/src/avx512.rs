//! AVX-512 (F + BW) kernels: 32 lanes = two zmm accumulators per position.
//!
//! Each row's weights are dequantised in registers once per 32 columns and
//! applied to up to two positions at a time with four rows in flight (eight
//! rows at T = 1: sixteen independent FMA chains and eight memory streams),
//! so a row crosses the memory bus once for all T; further position groups
//! re-read it from L1/L2. MXFP4 looks its scaled 16-entry table up per
//! (row, group) in [`MXFP4_LUTS`] and, where the CPU has VBMI, runs its own
//! loop ([`mxfp4_dots`]): nibbles expanded with `vpmultishiftqb`, per-row
//! pointers, software prefetch. The activations of a column block are loaded
//! once and shared by the rows in flight. The operations are exactly those of
//! `formats::block_scalar`: one fused multiply-add per weight into its lane.

use std::arch::x86_64::*;
use std::ops::Range;

use fathom_weights::mxfp4::{E2M1, GROUP};

use crate::formats::{Bf16Rows, F32Rows, Fp8Rows, Int4Rows, Int8Rows, LANES, Mxfp4Rows, Rows};
use crate::fp8::E4M3_SUB_STEP;

/// Rows in flight together.
const NR: usize = 4;
/// Rows in flight together at T = 1.
const NR1: usize = 8;
/// Positions sharing one pass over those rows.
const NT: usize = 2;

/// Formats that can load 32 dequantised weights into two zmm registers.
pub trait Load512: Rows {
    /// Columns `c .. c + 32` of row `r`. Unchecked: this runs once per 32
    /// weights, where bounds checks cost as much as the arithmetic.
    ///
    /// # Safety
    /// The CPU supports AVX-512 F and BW,
    /// `r < rows` and `c + 32 <= cols`.
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2];

    /// Whether [`NR1`] rows fit the registers at T = 1 (MXFP4's per-row
    /// tables do not: eight rows spill, and measure slower than four).
    const WIDE_T1: bool = true;

    /// Asks for the line holding column `c` of row `r` (which may lie past
    /// the last row: a prefetch never faults). Default: nothing.
    #[inline(always)]
    fn prefetch(&self, _r: usize, _c: usize) {}
}

/// Rows at most this wide get the next row block prefetched while the
/// current one is read: their rows are too short for the hardware
/// prefetchers to ramp up. Measured at 4495d5f on a 2-core AVX-512 VM
/// (docs/bench.md, "short rows read cold", gives the command), bf16 at
/// T = 1 over 48 MB of distinct matrices (cold): 384- and 768-wide rows
/// 6.3–9.7 → 8.9–12.7 GB/s on one core, 12–17 → 17–23 GB/s on two;
/// 1024- and 2048-wide rows no better or worse (they stream on their own).
/// Prefetching two blocks ahead measured no better than one.
pub(crate) const PF_NEXT_MAX_COLS: usize = 768;

/// Issues a T0 prefetch of `p` (any address: a prefetch never faults).
#[inline(always)]
pub(crate) fn prefetch_line<T>(p: *const T) {
    // SAFETY: a prefetch reads nothing architecturally and cannot fault;
    // SSE is part of x86-64.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
}

impl Load512 for F32Rows<'_> {
    #[inline(always)]
    fn prefetch(&self, r: usize, c: usize) {
        prefetch_line(self.w.as_ptr().wrapping_add(r * self.cols + c));
    }

    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2] {
        debug_assert!(r < self.rows() && c + LANES <= self.cols);
        // SAFETY: the caller keeps the 32 f32 in range; unaligned loads.
        unsafe {
            let p = self.w.as_ptr().add(r * self.cols + c);
            [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))]
        }
    }
}

impl Load512 for Bf16Rows<'_> {
    #[inline(always)]
    fn prefetch(&self, r: usize, c: usize) {
        prefetch_line(self.w.as_ptr().wrapping_add(r * self.cols + c));
    }

    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2] {
        debug_assert!(r < self.rows() && c + LANES <= self.cols);
        // SAFETY: the caller keeps the 32 u16 (64 bytes) in range; bf16 → f32
        // is a 16-bit shift.
        unsafe {
            let p = self.w.as_ptr().add(r * self.cols + c);
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
    fn prefetch(&self, r: usize, c: usize) {
        prefetch_line(self.q.as_ptr().wrapping_add(r * self.cols + c));
    }

    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2] {
        debug_assert!(r < self.rows() && c + LANES <= self.cols);
        // SAFETY: the caller keeps the 32 bytes in range; i8 → i32 → f32 is exact.
        unsafe {
            let p = self.q.as_ptr().add(r * self.cols + c);
            let a = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()));
            let b = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(16).cast()));
            [_mm512_cvtepi32_ps(a), _mm512_cvtepi32_ps(b)]
        }
    }
}

/// The 16 signed E2M1 values, indexed by the whole nibble, times the group
/// scale: one aligned load from [`MXFP4_LUTS`].
///
/// # Safety
/// The CPU supports AVX-512 F.
#[inline(always)]
unsafe fn mxfp4_lut(scale_byte: u8) -> __m512 {
    // SAFETY: one 64-byte aligned row of a static table.
    unsafe { _mm512_load_ps(MXFP4_LUTS.0[scale_byte as usize].as_ptr()) }
}

/// `e8m0(b).to_bits()` without branches: `b << 23`, plus the quiet bit for
/// 0 (2^-127, subnormal) and 0xFF (NaN).
#[inline(always)]
const fn e8m0_bits(b: u8) -> u32 {
    ((b as u32) << 23) | (((b == 0) | (b == 0xFF)) as u32) << 22
}

/// The 16 signed E2M1 values (indexed by the whole nibble) times `e8m0(b)`,
/// for every scale byte `b`: the same correctly rounded products
/// `e2m1 · 2^e` as the scalar reference (each one exact, or NaN for 0xFF),
/// computed at compile time and looked up with one load per (row, group)
/// instead of a broadcast and a multiply. Scale bytes of real checkpoints
/// cluster, so the few lines in use stay in L1.
#[repr(C, align(64))]
struct Mxfp4Luts([[f32; 16]; 256]);

static MXFP4_LUTS: Mxfp4Luts = Mxfp4Luts({
    let mut t = [[0f32; 16]; 256];
    let mut b = 0;
    while b < 256 {
        let s = f32::from_bits(e8m0_bits(b as u8));
        let mut i = 0;
        while i < 16 {
            let m = if i & 8 != 0 {
                -E2M1[i & 7]
            } else {
                E2M1[i & 7]
            };
            t[b][i] = m * s;
            i += 1;
        }
        b += 1;
    }
    t
});

impl Load512 for Mxfp4Rows<'_> {
    const WIDE_T1: bool = false;

    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2] {
        let m = &self.0;
        debug_assert!(r < m.rows && c + LANES <= m.cols);
        // SAFETY: the caller keeps the 16 packed bytes and the scale in range.
        unsafe {
            let bytes = m.packed.as_ptr().add((r * m.cols + c) / 2);
            let lut = mxfp4_lut(*m.scales.get_unchecked((r * m.cols + c) / GROUP));
            let b = _mm_loadu_si128(bytes.cast());
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(b, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
            // Column order: low nibble (even column) then high nibble (odd).
            let c0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
            let c1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));
            [
                _mm512_permutexvar_ps(c0, lut),
                _mm512_permutexvar_ps(c1, lut),
            ]
        }
    }
}

/// Sixteen E4M3 codes (one per dword) as f32, with the bits of `fp8::E4M3`
/// (the three cases of `avx2::e4m3_8`, selected by masks).
#[inline(always)]
unsafe fn e4m3_16(v: __m512i) -> __m512 {
    // SAFETY: register-only intrinsics; the caller runs with AVX-512 F enabled.
    unsafe {
        let mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7F));
        let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(v, _mm512_set1_epi32(0x80)));
        let normal = _mm512_castsi512_ps(_mm512_add_epi32(
            _mm512_slli_epi32::<20>(mag),
            _mm512_set1_epi32(120 << 23),
        ));
        let sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(E4M3_SUB_STEP));
        let is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
        let is_nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
        let x = _mm512_mask_blend_ps(is_sub, normal, sub);
        let x = _mm512_mask_blend_ps(is_nan, x, _mm512_set1_ps(f32::NAN));
        _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign))
    }
}

impl Load512 for Fp8Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2] {
        debug_assert!(r < self.rows() && c + LANES <= self.cols);
        // One checked lookup per 32 weights (the grid is the caller's).
        let s = self.scale[self.scale_index(r, c)];
        // SAFETY: the caller keeps the 32 bytes in range (`r < rows`, `c + 32 <= cols`).
        unsafe {
            let p = self.q.as_ptr().add(r * self.cols + c);
            let s = _mm512_set1_ps(s);
            let a = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(16).cast()));
            [_mm512_mul_ps(e4m3_16(a), s), _mm512_mul_ps(e4m3_16(b), s)]
        }
    }
}

impl Load512 for Int4Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> [__m512; 2] {
        debug_assert!(r < self.rows() && c + LANES <= self.cols);
        let s = self.scale_at(r, c);
        // SAFETY: the caller keeps the 16 packed bytes in range.
        unsafe {
            let bytes = self.packed.as_ptr().add((r * self.cols + c) / 2);
            let b = _mm_loadu_si128(bytes.cast());
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(b, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
            // Column order: low nibble (even column) then high nibble (odd).
            let c0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
            let c1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));
            let (s, eight) = (_mm512_set1_ps(s), _mm512_set1_epi32(8));
            [
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(c0, eight)), s),
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(c1, eight)), s),
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

/// `acc[j] = fma(x_j, w, acc[j])` for the K positions' activations `xv`.
#[inline(always)]
unsafe fn step<const K: usize>(acc: &mut [[__m512; 2]; K], wv: [__m512; 2], xv: &[[__m512; 2]; K]) {
    for (a, x) in acc.iter_mut().zip(xv) {
        // SAFETY: register-only.
        unsafe {
            a[0] = _mm512_fmadd_ps(x[0], wv[0], a[0]);
            a[1] = _mm512_fmadd_ps(x[1], wv[1], a[1]);
        }
    }
}

/// The 32 activations at each of `xp`.
///
/// # Safety
/// Each pointer has 32 readable f32.
#[inline(always)]
unsafe fn load_x<const K: usize>(xp: [*const f32; K]) -> [[__m512; 2]; K] {
    // SAFETY: forwarded from the caller.
    xp.map(|p| unsafe { [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))] })
}

/// Dot products of rows `r0 .. r0 + R` with positions `j0 .. j0 + K`:
/// `out[i·t + j0 + j]`. R rows in flight give independent FMA chains and
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
    assert!(r0 + R <= w.rows());
    // SAFETY: register-only.
    let mut acc = unsafe { [[[_mm512_setzero_ps(); 2]; K]; R] };
    let ahead = n <= PF_NEXT_MAX_COLS;
    let mut c = 0;
    while c < full {
        // SAFETY: `c + 32 <= full <= n`, so each position's 32 activations
        // lie in `xs` and each row's 32 weights in `w` (rows checked above).
        unsafe {
            let xv = load_x(std::array::from_fn(|j| xs.as_ptr().add(j * n + c)));
            for (i, a) in acc.iter_mut().enumerate() {
                if ahead {
                    w.prefetch(r0 + R + i, c);
                }
                step(a, w.load(r0 + i, c), &xv);
            }
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
        // SAFETY: the stack buffers hold 32 f32 each.
        let xv = unsafe { load_x(std::array::from_fn(|j| xb[j].as_ptr())) };
        for (i, a) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            unsafe { step(a, load_x([wb[i].as_ptr()])[0], &xv) };
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

/// Rows `rows`, NR at a time.
///
/// # Safety
/// The CPU supports what `W::load` needs; the caller is compiled with it.
#[inline(always)]
unsafe fn block_body<W: Load512>(w: &W, x: &[f32], t: usize, rows: Range<usize>, out: &mut [f32]) {
    let mut r = rows.start;
    // At T = 1 nothing is reused across positions: eight rows in flight give
    // sixteen FMA chains and eight memory streams (16 + 2 zmm of the 32).
    while W::WIDE_T1 && t == 1 && r + NR1 <= rows.end {
        let o = &mut out[(r - rows.start) * t..];
        // SAFETY: forwarded from the caller.
        unsafe { rows_of::<W, NR1>(w, r, x, t, o) };
        r += NR1;
    }
    while r + NR <= rows.end {
        let o = &mut out[(r - rows.start) * t..];
        // SAFETY: forwarded from the caller.
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

#[target_feature(enable = "avx512f,avx512bw")]
fn block<W: Load512>(w: &W, x: &[f32], t: usize, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: this function is compiled with, and only reached on, AVX-512 F/BW.
    unsafe { block_body(w, x, t, rows, out) }
}

/// MXFP4 rows in flight at T = 1 on the VBMI path (the tables live in
/// memory, so only the accumulators and activations take registers).
const NR1_MXFP4: usize = 8;
/// How far ahead of each row's read position the VBMI path prefetches.
const PF_BYTES: usize = 1024;

/// MXFP4 dot products of rows `r0 .. r0 + R` with positions `j0 .. j0 + K`
/// on the VBMI path: the same operations as [`dots`] over [`Mxfp4Rows`] (a
/// group's weights are the scaled table entries of its nibbles, one FMA per
/// weight into its lane), with per-row pointers that advance by one group
/// (16 packed bytes, one scale byte) per step, so a row's group costs one
/// table load, two multishifts, two permutes and the FMAs. `vpmultishiftqb`
/// moves each nibble straight into the low bits of its column's dword
/// (`vpermps` reads only those four bits). Every fourth group, each row
/// prefetches the line [`PF_BYTES`] ahead.
///
/// # Safety
/// The CPU supports AVX-512 F/BW/VBMI, `r0 + R <= rows`, and `x` holds
/// positions `j0 .. j0 + K`.
#[inline(always)]
unsafe fn mxfp4_dots<const R: usize, const K: usize>(
    w: &Mxfp4Rows<'_>,
    r0: usize,
    x: &[f32],
    t: usize,
    j0: usize,
    out: &mut [f32],
) {
    let m = &w.0;
    let n = m.cols;
    let groups = n / GROUP;
    let xs = &x[j0 * n..(j0 + K) * n];
    assert!(r0 + R <= m.rows && n.is_multiple_of(GROUP));
    // SAFETY: rows checked above; each row has `groups` scale bytes and
    // `groups · 16` packed bytes, and each position `n` activations.
    unsafe {
        let pk: [*const u8; R] = std::array::from_fn(|i| m.packed.as_ptr().add((r0 + i) * (n / 2)));
        let sc: [*const u8; R] = std::array::from_fn(|i| m.scales.as_ptr().add((r0 + i) * groups));
        let luts = MXFP4_LUTS.0.as_ptr().cast::<f32>();
        // Qword k of the result holds columns 2k (low nibble of byte k, bit
        // offset 8k) and 2k + 1 (high nibble, offset 8k + 4) in its two dwords.
        let ctrl = _mm512_set_epi64(
            (60 << 32) | 56,
            (52 << 32) | 48,
            (44 << 32) | 40,
            (36 << 32) | 32,
            (28 << 32) | 24,
            (20 << 32) | 16,
            (12 << 32) | 8,
            4 << 32,
        );
        let mut acc = [[[_mm512_setzero_ps(); 2]; K]; R];
        for g in 0..groups {
            let xv = load_x(std::array::from_fn(|j| xs.as_ptr().add(j * n + g * GROUP)));
            if g % 4 == 0 {
                for p in pk {
                    // A hint: past the end of the rows it may point anywhere.
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(16 * g + PF_BYTES).cast());
                }
            }
            for i in 0..R {
                let lut = _mm512_load_ps(luts.add(16 * *sc[i].add(g) as usize));
                let p = pk[i].add(16 * g);
                let q0 = _mm512_set1_epi64(p.cast::<i64>().read_unaligned());
                let q1 = _mm512_set1_epi64(p.add(8).cast::<i64>().read_unaligned());
                let wv = [
                    _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctrl, q0), lut),
                    _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctrl, q1), lut),
                ];
                step(&mut acc[i], wv, &xv);
            }
        }
        for (i, ai) in acc.into_iter().enumerate() {
            for (j, a) in ai.into_iter().enumerate() {
                out[i * t + j0 + j] = fold(a);
            }
        }
    }
}

/// All positions of MXFP4 rows `r0 .. r0 + R`, K at a time.
#[inline(always)]
unsafe fn mxfp4_rows_of<const R: usize>(
    w: &Mxfp4Rows<'_>,
    r0: usize,
    x: &[f32],
    t: usize,
    out: &mut [f32],
) {
    let mut j = 0;
    while j + NT <= t {
        // SAFETY: forwarded from the caller.
        unsafe { mxfp4_dots::<R, NT>(w, r0, x, t, j, out) };
        j += NT;
    }
    while j < t {
        // SAFETY: forwarded from the caller.
        unsafe { mxfp4_dots::<R, 1>(w, r0, x, t, j, out) };
        j += 1;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
fn block_vbmi(w: &Mxfp4Rows<'_>, x: &[f32], t: usize, rows: Range<usize>, out: &mut [f32]) {
    let mut r = rows.start;
    // SAFETY (all calls): this function is compiled with, and only reached
    // on, AVX-512 F/BW/VBMI; each call's rows lie in `rows`.
    while t == 1 && r + NR1_MXFP4 <= rows.end {
        let o = &mut out[(r - rows.start) * t..];
        unsafe { mxfp4_rows_of::<NR1_MXFP4>(w, r, x, t, o) };
        r += NR1_MXFP4;
    }
    while r + NR <= rows.end {
        let o = &mut out[(r - rows.start) * t..];
        unsafe { mxfp4_rows_of::<NR>(w, r, x, t, o) };
        r += NR;
    }
    while r < rows.end {
        let o = &mut out[(r - rows.start) * t..];
        unsafe { mxfp4_rows_of::<1>(w, r, x, t, o) };
        r += 1;
    }
}

/// Table entry. Only `dispatch` references it, after detecting AVX-512 F/BW.
pub(crate) fn entry<W: Load512>(w: &W, x: &[f32], t: usize, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the dispatch table holding this entry is built only when the CPU has AVX-512 F/BW.
    unsafe { block(w, x, t, rows, out) }
}

/// MXFP4 table entry: the VBMI nibble expansion where the CPU has it (the
/// detection is a cached flag, read once per row block), else the F/BW one.
/// Both produce the same weights, so the choice never changes a result.
pub(crate) fn entry_mxfp4(
    w: &Mxfp4Rows<'_>,
    x: &[f32],
    t: usize,
    rows: Range<usize>,
    out: &mut [f32],
) {
    if is_x86_feature_detected!("avx512vbmi") {
        // SAFETY: AVX-512 F/BW (dispatch) and VBMI (just detected) are present.
        unsafe { block_vbmi(w, x, t, rows, out) }
    } else {
        entry(w, x, t, rows, out)
    }
}

#[cfg(test)]
mod tests {
    use fathom_weights::mxfp4::{Mxfp4Ref, e2m1, e8m0};

    use crate::formats::{Mxfp4Rows, block_scalar};

    #[test]
    fn branch_free_scale_is_e8m0() {
        for b in 0..=255u8 {
            assert_eq!(super::e8m0_bits(b), e8m0(b).to_bits(), "scale byte {b}");
        }
    }

    #[test]
    fn scaled_tables_are_the_reference_products() {
        for b in 0..=255u8 {
            for code in 0..16u8 {
                let (got, want) = (
                    super::MXFP4_LUTS.0[b as usize][code as usize],
                    e2m1(code) * e8m0(b),
                );
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "scale byte {b}, code {code}: {got} vs {want}"
                );
            }
        }
    }

    /// The VBMI loop against the scalar reference at every row grouping
    /// (8, 4 and single rows) and position grouping (2 and single).
    #[test]
    fn vbmi_path_is_bit_identical_to_scalar() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vbmi"))
        {
            return;
        }
        let mut s = 5u64;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let (rows, cols) = (23, 160);
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| (next() % 161) as u8)
            .collect();
        let w = Mxfp4Rows(Mxfp4Ref::new(rows, cols, &packed, &scales).unwrap());
        for t in [1, 2, 3] {
            let x: Vec<f32> = (0..t * cols)
                .map(|_| next() as f32 / 2f32.powi(31) - 1.0)
                .collect();
            for range in [0..rows, 3..20, 5..6] {
                let mut want = vec![0f32; range.len() * t];
                let mut got = vec![1f32; range.len() * t];
                block_scalar(&w, &x, t, range.clone(), &mut want);
                super::entry_mxfp4(&w, &x, t, range.clone(), &mut got);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "t={t} rows={range:?}");
            }
        }
    }
}
