//! AVX2 + FMA-class kernels: 32 lanes = four ymm accumulators per position.
//!
//! Same structure as `avx512.rs`: two rows per pass (eight accumulators of
//! the sixteen ymm registers), one position at a time. With four positions
//! or more, each pair of rows is dequantised once into an f32 copy and the
//! four accumulators of a (row, position) are run one after another, one
//! register each, so four positions share every weight load. Each weight is
//! one `vfmadd` into its lane, as the scalar reference's `mul_add`; dispatch
//! requires FMA beside AVX2 (every AVX2 CPU but a few VIA parts has it).

use std::arch::x86_64::*;
use std::ops::Range;

use fathom_weights::mxfp4::{E2M1, GROUP, e8m0};

use crate::avx512::{PF_NEXT_MAX_COLS, prefetch_line};
use crate::formats::{Bf16Rows, F32Rows, Fp8Rows, Int4Rows, Int8Rows, LANES, Mxfp4Rows, Rows};
use crate::fp8::E4M3_SUB_STEP;

/// Rows in flight together.
const NR: usize = 2;
/// Positions sharing one pass over those rows.
const NT: usize = 1;

type V = [__m256; 4];

/// `[body(0), body(1), body(2), body(3)]` expanded in place: a closure (as
/// `std::array::from_fn` takes) is a function of its own without the
/// caller's AVX2, where intrinsics become library calls.
macro_rules! each4 {
    (|$k:ident| $body:expr) => {
        [
            {
                let $k = 0usize;
                $body
            },
            {
                let $k = 1usize;
                $body
            },
            {
                let $k = 2usize;
                $body
            },
            {
                let $k = 3usize;
                $body
            },
        ]
    };
}

/// Formats that can load 32 dequantised weights into four ymm registers.
pub trait Load256: Rows {
    /// Columns `c .. c + 32` of row `r`.
    ///
    /// # Safety
    /// The CPU supports AVX2, and `c + 32 <= cols`.
    unsafe fn load(&self, r: usize, c: usize) -> V;

    /// Asks for the line holding column `c` of row `r` (which may lie past
    /// the last row: a prefetch never faults). Default: nothing. See
    /// [`PF_NEXT_MAX_COLS`].
    #[inline(always)]
    fn prefetch(&self, _r: usize, _c: usize) {}

    /// Four rows in flight at fewer than four positions rather than
    /// [`NR`]: int8, whose loads are cheapest, needs more independent sums
    /// to keep up with memory (measured with `bench_kernels`).
    const FOUR_ROWS: bool = false;
}

impl Load256 for F32Rows<'_> {
    #[inline(always)]
    fn prefetch(&self, r: usize, c: usize) {
        prefetch_line(self.w.as_ptr().wrapping_add(r * self.cols + c));
    }

    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let p = self.w[r * self.cols + c..][..LANES].as_ptr();
        // SAFETY: the slice above holds 32 f32.
        unsafe { each4!(|k| _mm256_loadu_ps(p.add(8 * k))) }
    }
}

impl Load256 for Bf16Rows<'_> {
    #[inline(always)]
    fn prefetch(&self, r: usize, c: usize) {
        prefetch_line(self.w.as_ptr().wrapping_add(r * self.cols + c));
    }

    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let p = self.w[r * self.cols + c..][..LANES].as_ptr();
        // SAFETY: the slice above holds 32 u16; bf16 → f32 is a 16-bit shift.
        unsafe {
            each4!(|k| {
                let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(8 * k).cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v))
            })
        }
    }
}

impl Load256 for Int8Rows<'_> {
    const FOUR_ROWS: bool = true;

    #[inline(always)]
    fn prefetch(&self, r: usize, c: usize) {
        prefetch_line(self.q.as_ptr().wrapping_add(r * self.cols + c));
    }

    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let p = self.q[r * self.cols + c..][..LANES].as_ptr();
        // SAFETY: the slice above holds 32 bytes; i8 → i32 → f32 is exact.
        unsafe {
            each4!(|k| {
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8 * k).cast())))
            })
        }
    }
}

impl Load256 for Mxfp4Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let m = &self.0;
        let bytes = m.packed[(r * m.cols + c) / 2..][..LANES / 2].as_ptr();
        let scale = e8m0(m.scales[(r * m.cols + c) / GROUP]);
        // SAFETY: 16 packed bytes are in range (slice above); the rest is register work.
        unsafe {
            let mag = _mm256_setr_ps(
                E2M1[0], E2M1[1], E2M1[2], E2M1[3], E2M1[4], E2M1[5], E2M1[6], E2M1[7],
            );
            // Scaling the table gives the same products; the sign flip commutes with it.
            let mag = _mm256_mul_ps(mag, _mm256_set1_ps(scale));
            let sign = _mm256_set1_epi32(i32::MIN);
            // Four packed bytes are eight columns, column j in bits 4j .. 4j + 3:
            // each lane shifts its own nibble down, so the table lookup
            // (vpermps) is the one shuffle per eight values.
            let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            each4!(|k| {
                let word = _mm256_set1_epi32(bytes.add(4 * k).cast::<i32>().read_unaligned());
                let code = _mm256_srlv_epi32(word, shifts);
                // vpermps reads the low three bits (the magnitude); bit 3 becomes the sign.
                let m = _mm256_permutevar8x32_ps(mag, code);
                let sg = _mm256_and_si256(_mm256_slli_epi32::<28>(code), sign);
                _mm256_xor_ps(m, _mm256_castsi256_ps(sg))
            })
        }
    }
}

/// Eight E4M3 codes (one per dword) as f32, with the bits of `fp8::E4M3`:
/// normal codes re-bias the exponent field (`(code << 20) + (120 << 23)`),
/// subnormal ones (`code < 8`) are the exact product `code · 2⁻⁹`, 0x7F is NaN;
/// the sign bit is moved into place last.
#[inline(always)]
unsafe fn e4m3_8(v: __m256i) -> __m256 {
    // SAFETY: register-only intrinsics; the caller runs with AVX2 enabled.
    unsafe {
        let mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
        let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(v, _mm256_set1_epi32(0x80)));
        let normal = _mm256_castsi256_ps(_mm256_add_epi32(
            _mm256_slli_epi32::<20>(mag),
            _mm256_set1_epi32(120 << 23),
        ));
        let sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(E4M3_SUB_STEP));
        let is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
        let is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
        let x = _mm256_blendv_ps(normal, sub, is_sub);
        let x = _mm256_blendv_ps(x, _mm256_set1_ps(f32::NAN), is_nan);
        _mm256_or_ps(x, _mm256_castsi256_ps(sign))
    }
}

impl Load256 for Fp8Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let p = self.q[r * self.cols + c..][..LANES].as_ptr();
        let s = self.scale[self.scale_index(r, c)];
        // SAFETY: the slice above holds 32 bytes; the rest is register work.
        unsafe {
            let s = _mm256_set1_ps(s);
            each4!(|k| {
                let code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8 * k).cast()));
                _mm256_mul_ps(e4m3_8(code), s)
            })
        }
    }
}

impl Load256 for Int4Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let bytes = self.packed[(r * self.cols + c) / 2..][..LANES / 2].as_ptr();
        let s = self.scale_at(r, c);
        // SAFETY: 16 packed bytes are in range (slice above); the rest is register work.
        unsafe {
            let b = _mm_loadu_si128(bytes.cast());
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(b, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), mask);
            let cols = [_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)];
            let (s, eight) = (_mm256_set1_ps(s), _mm256_set1_epi32(8));
            each4!(|k| {
                let half = cols[k / 2];
                let e = if k % 2 == 0 {
                    half
                } else {
                    _mm_srli_si128::<8>(half)
                };
                let code = _mm256_sub_epi32(_mm256_cvtepu8_epi32(e), eight);
                _mm256_mul_ps(_mm256_cvtepi32_ps(code), s)
            })
        }
    }
}

/// Folds four ymm of partial sums exactly as `formats::fold32`.
#[inline(always)]
unsafe fn fold(a: V) -> f32 {
    // SAFETY: register-only intrinsics; the caller runs with AVX2 enabled.
    unsafe {
        let s8 = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }
}

/// `acc[j] += x_j * w` for the K positions whose 32 activations start at `xp[j]`.
#[inline(always)]
unsafe fn step<const K: usize>(acc: &mut [V; K], wv: V, xp: &[*const f32; K]) {
    for (a, &p) in acc.iter_mut().zip(xp) {
        for (k, (ak, wk)) in a.iter_mut().zip(wv).enumerate() {
            // SAFETY: the caller guarantees 32 readable f32 at `p`.
            unsafe { *ak = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(8 * k)), wk, *ak) };
        }
    }
}

/// Dot products of rows `r0 .. r0 + R` with positions `j0 .. j0 + K`:
/// `out[i·t + j0 + j]`. R rows in flight give independent add chains and
/// memory streams at T = 1; each (row, position) keeps its own lanes, so
/// the grouping never changes a result.
#[inline(always)]
unsafe fn dots<W: Load256, const R: usize, const K: usize>(
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
    let mut acc = unsafe { [[[_mm256_setzero_ps(); 4]; K]; R] };
    let ahead = n <= PF_NEXT_MAX_COLS;
    let mut c = 0;
    while c < full {
        let xp: [*const f32; K] = std::array::from_fn(|j| xs[j * n + c..][..LANES].as_ptr());
        for (i, a) in acc.iter_mut().enumerate() {
            if ahead {
                w.prefetch(r0 + R + i, c);
            }
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
                    each4!(|k| _mm256_loadu_ps(wb[i].as_ptr().add(8 * k))),
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
unsafe fn rows_of<W: Load256, const R: usize>(
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

/// Rows `r0 .. r0 + R` dequantised into `buf` (`R × cols` f32, natural
/// column order) with the format's own loads: the values `dots` would use.
#[inline(always)]
unsafe fn dequantise<W: Load256, const R: usize>(w: &W, r0: usize, buf: &mut [f32]) {
    let n = w.cols();
    for i in 0..R {
        let row = &mut buf[i * n..(i + 1) * n];
        for c in (0..n).step_by(LANES) {
            // SAFETY: `n` is a multiple of 32 (the caller checks), so
            // `c + 32 <= n`; `row[c..c + 32]` holds 32 f32.
            unsafe {
                let v = w.load(r0 + i, c);
                let p = row[c..c + LANES].as_mut_ptr();
                for (k, vk) in v.into_iter().enumerate() {
                    _mm256_storeu_ps(p.add(8 * k), vk);
                }
            }
        }
    }
}

/// Group `k` (lanes of columns `c + 8k ..`, `c = 0, 32, 64, …` in order)
/// of the dot products of f32 rows `w[i]` with positions `x[j]`, over the
/// columns `cols` (a range of whole 32-column blocks), added to `acc`: the
/// same additions in the same order as `dots`' accumulator `k` when the
/// ranges are taken in order. Two rows and four positions: eight
/// independent sums, each weight and activation loaded once for the four
/// or two products that use it.
#[inline(always)]
unsafe fn group_2x4(
    w: [*const f32; 2],
    x: [*const f32; 4],
    cols: Range<usize>,
    k: usize,
    acc: &mut [[__m256; 4]; 2],
) {
    // SAFETY: the caller guarantees `cols.end` readable f32 at each
    // pointer, `cols` whole 32-column blocks, so every `c + 8 <= cols.end`.
    unsafe {
        let [
            [mut a00, mut a01, mut a02, mut a03],
            [mut a10, mut a11, mut a12, mut a13],
        ] = *acc;
        let mut c = cols.start + 8 * k;
        while c < cols.end {
            let w0 = _mm256_loadu_ps(w[0].add(c));
            let w1 = _mm256_loadu_ps(w[1].add(c));
            let x0 = _mm256_loadu_ps(x[0].add(c));
            a00 = _mm256_fmadd_ps(x0, w0, a00);
            a10 = _mm256_fmadd_ps(x0, w1, a10);
            let x1 = _mm256_loadu_ps(x[1].add(c));
            a01 = _mm256_fmadd_ps(x1, w0, a01);
            a11 = _mm256_fmadd_ps(x1, w1, a11);
            let x2 = _mm256_loadu_ps(x[2].add(c));
            a02 = _mm256_fmadd_ps(x2, w0, a02);
            a12 = _mm256_fmadd_ps(x2, w1, a12);
            let x3 = _mm256_loadu_ps(x[3].add(c));
            a03 = _mm256_fmadd_ps(x3, w0, a03);
            a13 = _mm256_fmadd_ps(x3, w1, a13);
            c += LANES;
        }
        *acc = [[a00, a01, a02, a03], [a10, a11, a12, a13]];
    }
}

/// Columns a chunk of [`pair_grouped`] covers: the two rows and four
/// positions of a chunk (6 × 4 KiB) stay in L1 while its four lane groups
/// walk them, instead of each group streaming whole rows from L2.
const CHUNK: usize = 1024;
const _: () = assert!(CHUNK.is_multiple_of(LANES));

/// All positions of rows `r0`, `r0 + 1`: dequantised once into `buf`, then
/// four positions at a time through [`group_2x4`]; the last `t % 4` as
/// `dots` takes them.
#[inline(always)]
unsafe fn pair_grouped<W: Load256>(
    w: &W,
    r0: usize,
    x: &[f32],
    t: usize,
    buf: &mut [f32],
    out: &mut [f32],
) {
    let n = w.cols();
    assert!(x.len() >= t * n && buf.len() >= 2 * n && n % LANES == 0);
    // SAFETY: forwarded from the caller.
    unsafe { dequantise::<W, 2>(w, r0, buf) };
    let rows = [buf.as_ptr(), buf[n..].as_ptr()];
    let mut j = 0;
    while j + 4 <= t {
        let pos: [*const f32; 4] = std::array::from_fn(|jj| x[(j + jj) * n..].as_ptr());
        // Lane group k's eight sums, carried from chunk to chunk.
        // SAFETY: register-only.
        let mut acc = unsafe { [[[_mm256_setzero_ps(); 4]; 2]; 4] };
        let mut c0 = 0;
        while c0 < n {
            let cols = c0..(c0 + CHUNK).min(n);
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: both rows of `buf` and positions j .. j + 4 of
                // `x` hold `n` f32 each (asserted above); `n` and CHUNK
                // are multiples of 32.
                unsafe { group_2x4(rows, pos, cols.clone(), k, a) };
            }
            c0 += CHUNK;
        }
        // SAFETY: register-only.
        let mut parts = unsafe { [[[_mm256_setzero_ps(); 4]; 4]; 2] };
        for (k, a) in acc.into_iter().enumerate() {
            for (pi, gi) in parts.iter_mut().zip(a) {
                for (pij, v) in pi.iter_mut().zip(gi) {
                    pij[k] = v;
                }
            }
        }
        for (i, pi) in parts.into_iter().enumerate() {
            for (jj, a) in pi.into_iter().enumerate() {
                // SAFETY: register-only folding.
                out[i * t + j + jj] = w.finish(r0 + i, unsafe { fold(a) });
            }
        }
        j += 4;
    }
    while j < t {
        // SAFETY: forwarded from the caller.
        unsafe { dots::<W, 2, 1>(w, r0, x, t, j, out) };
        j += 1;
    }
}

#[target_feature(enable = "avx2,fma")]
fn block<W: Load256>(w: &W, x: &[f32], t: usize, rows: Range<usize>, out: &mut [f32]) {
    // Four positions or more: each pair of rows is dequantised once, not
    // once a position (with two or three the copy costs what it saves).
    if t >= 4 && w.cols() % LANES == 0 {
        let mut buf = vec![0f32; 2 * w.cols()];
        let mut r = rows.start;
        while r + 2 <= rows.end {
            let o = &mut out[(r - rows.start) * t..];
            // SAFETY: this function is compiled with, and only reached on, AVX2 + FMA.
            unsafe { pair_grouped(w, r, x, t, &mut buf, o) };
            r += 2;
        }
        if r < rows.end {
            let o = &mut out[(r - rows.start) * t..];
            // SAFETY: as above.
            unsafe { rows_of::<W, 1>(w, r, x, t, o) };
        }
        return;
    }
    let mut r = rows.start;
    if W::FOUR_ROWS {
        while r + 4 <= rows.end {
            let o = &mut out[(r - rows.start) * t..];
            // SAFETY: this function is compiled with, and only reached on, AVX2 + FMA.
            unsafe { rows_of::<W, 4>(w, r, x, t, o) };
            r += 4;
        }
    }
    while r + NR <= rows.end {
        let o = &mut out[(r - rows.start) * t..];
        // SAFETY: this function is compiled with, and only reached on, AVX2 + FMA.
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

/// Table entry. Only `dispatch` references it, after detecting AVX2 and FMA.
pub(crate) fn entry<W: Load256>(w: &W, x: &[f32], t: usize, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the dispatch table holding this entry is built only when the CPU has AVX2 and FMA.
    unsafe { block(w, x, t, rows, out) }
}
