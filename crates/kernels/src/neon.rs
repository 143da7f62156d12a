//! aarch64 NEON kernels: 32 lanes = eight q-register accumulators per row
//! and position, two rows or two positions per pass. The operations mirror
//! `formats::block_scalar` one for one; CI runs the kernels' tests for
//! aarch64 under qemu-user, comparing every result bit for bit with it.

use std::arch::aarch64::*;
use std::ops::Range;

use fathom_weights::mxfp4::{GROUP, e8m0};

use crate::formats::{Bf16Rows, F32Rows, Fp8Rows, Int4Rows, Int8Rows, LANES, Mxfp4Rows, Rows};
use crate::fp8::E4M3_SUB_STEP;

type V = [float32x4_t; 8];

/// Formats that can load 32 dequantised weights into eight q registers.
pub trait LoadNeon: Rows {
    /// # Safety
    /// `c + 32 <= cols`.
    unsafe fn load(&self, r: usize, c: usize) -> V;
}

impl LoadNeon for F32Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let p = self.w[r * self.cols + c..][..LANES].as_ptr();
        // SAFETY: the slice above holds 32 f32.
        unsafe { std::array::from_fn(|k| vld1q_f32(p.add(4 * k))) }
    }
}

impl LoadNeon for Bf16Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let p = self.w[r * self.cols + c..][..LANES].as_ptr();
        // SAFETY: the slice above holds 32 u16; bf16 → f32 is a 16-bit widening shift.
        unsafe {
            std::array::from_fn(|k| {
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p.add(4 * k))))
            })
        }
    }
}

impl LoadNeon for Int8Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let p = self.q[r * self.cols + c..][..LANES].as_ptr();
        // SAFETY: the slice above holds 32 bytes; i8 → i32 → f32 is exact.
        unsafe {
            let b = [vld1q_s8(p), vld1q_s8(p.add(16))];
            std::array::from_fn(|k| {
                let h = if (k / 2) % 2 == 0 {
                    vget_low_s8(b[k / 4])
                } else {
                    vget_high_s8(b[k / 4])
                };
                let w16 = vmovl_s8(h);
                let w32 = if k % 2 == 0 {
                    vmovl_s16(vget_low_s16(w16))
                } else {
                    vmovl_s16(vget_high_s16(w16))
                };
                vcvtq_f32_s32(w32)
            })
        }
    }
}

impl LoadNeon for Mxfp4Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let m = &self.0;
        let bytes = m.packed[(r * m.cols + c) / 2..][..LANES / 2].as_ptr();
        // Twice the E2M1 values are the integers −12..12; `(2m)·(s/2) = m·s`
        // exactly (s/2 ≥ 2^-128 is representable), so this matches the scalar product.
        let half_scale = e8m0(m.scales[(r * m.cols + c) / GROUP]) * 0.5;
        const TWICE: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
        // SAFETY: 16 packed bytes are in range (slice above); the rest is register work.
        unsafe {
            let lut = vld1q_s8(TWICE.as_ptr());
            let b = vld1q_u8(bytes);
            let lo = vandq_u8(b, vdupq_n_u8(0x0F));
            let hi = vshrq_n_u8::<4>(b);
            let cols = [vzip1q_u8(lo, hi), vzip2q_u8(lo, hi)];
            let vals = [vqtbl1q_s8(lut, cols[0]), vqtbl1q_s8(lut, cols[1])];
            let s = vdupq_n_f32(half_scale);
            std::array::from_fn(|k| {
                let h = if (k / 2) % 2 == 0 {
                    vget_low_s8(vals[k / 4])
                } else {
                    vget_high_s8(vals[k / 4])
                };
                let w16 = vmovl_s8(h);
                let w32 = if k % 2 == 0 {
                    vmovl_s16(vget_low_s16(w16))
                } else {
                    vmovl_s16(vget_high_s16(w16))
                };
                vmulq_f32(vcvtq_f32_s32(w32), s)
            })
        }
    }
}

/// Four E4M3 codes (one per lane) as f32, with the bits of `fp8::E4M3`
/// (the three cases of `avx2::e4m3_8`, selected with bit-select).
#[inline(always)]
unsafe fn e4m3_4(v: uint32x4_t) -> float32x4_t {
    // SAFETY: register-only intrinsics.
    unsafe {
        let mag = vandq_u32(v, vdupq_n_u32(0x7F));
        let sign = vshlq_n_u32::<24>(vandq_u32(v, vdupq_n_u32(0x80)));
        let normal =
            vreinterpretq_f32_u32(vaddq_u32(vshlq_n_u32::<20>(mag), vdupq_n_u32(120 << 23)));
        let sub = vmulq_f32(vcvtq_f32_u32(mag), vdupq_n_f32(E4M3_SUB_STEP));
        let x = vbslq_f32(vcltq_u32(mag, vdupq_n_u32(8)), sub, normal);
        let x = vbslq_f32(vceqq_u32(mag, vdupq_n_u32(0x7F)), vdupq_n_f32(f32::NAN), x);
        vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(x), sign))
    }
}

impl LoadNeon for Fp8Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let p = self.q[r * self.cols + c..][..LANES].as_ptr();
        let s = self.scale[self.scale_index(r, c)];
        // SAFETY: the slice above holds 32 bytes; the rest is register work.
        unsafe {
            let s = vdupq_n_f32(s);
            let b = [vld1q_u8(p), vld1q_u8(p.add(16))];
            std::array::from_fn(|k| {
                let h = if (k / 2) % 2 == 0 {
                    vget_low_u8(b[k / 4])
                } else {
                    vget_high_u8(b[k / 4])
                };
                let w16 = vmovl_u8(h);
                let w32 = if k % 2 == 0 {
                    vmovl_u16(vget_low_u16(w16))
                } else {
                    vmovl_u16(vget_high_u16(w16))
                };
                vmulq_f32(e4m3_4(w32), s)
            })
        }
    }
}

impl LoadNeon for Int4Rows<'_> {
    #[inline(always)]
    unsafe fn load(&self, r: usize, c: usize) -> V {
        let bytes = self.packed[(r * self.cols + c) / 2..][..LANES / 2].as_ptr();
        let s = self.scale_at(r, c);
        // SAFETY: 16 packed bytes are in range (slice above); the rest is register work.
        unsafe {
            let b = vld1q_u8(bytes);
            let lo = vandq_u8(b, vdupq_n_u8(0x0F));
            let hi = vshrq_n_u8::<4>(b);
            let codes = [vzip1q_u8(lo, hi), vzip2q_u8(lo, hi)];
            let vals = codes.map(|c| vsubq_s8(vreinterpretq_s8_u8(c), vdupq_n_s8(8)));
            let s = vdupq_n_f32(s);
            std::array::from_fn(|k| {
                let h = if (k / 2) % 2 == 0 {
                    vget_low_s8(vals[k / 4])
                } else {
                    vget_high_s8(vals[k / 4])
                };
                let w16 = vmovl_s8(h);
                let w32 = if k % 2 == 0 {
                    vmovl_s16(vget_low_s16(w16))
                } else {
                    vmovl_s16(vget_high_s16(w16))
                };
                vmulq_f32(vcvtq_f32_s32(w32), s)
            })
        }
    }
}

/// Folds eight q registers exactly as `formats::fold32`.
#[inline(always)]
unsafe fn fold(a: V) -> f32 {
    // SAFETY: register-only intrinsics.
    unsafe {
        let b: [float32x4_t; 4] = std::array::from_fn(|k| vaddq_f32(a[k], a[k + 4]));
        let c = [vaddq_f32(b[0], b[2]), vaddq_f32(b[1], b[3])];
        let d = vaddq_f32(c[0], c[1]);
        let e = vadd_f32(vget_low_f32(d), vget_high_f32(d));
        vget_lane_f32::<0>(e) + vget_lane_f32::<1>(e)
    }
}

/// Dot products of rows `r0 .. r0 + R` with positions `j0 .. j0 + P`:
/// `out[i·t + j0 + p]`. Each (row, position) keeps its own eight
/// accumulators, adding its columns in order as `formats::block_scalar`
/// does, so the grouping never changes a result; a block of weights is
/// decoded once for all P positions, and the R·P·8 independent sums keep
/// the FMA pipes busy through the instruction's latency. The columns past
/// the last full block are zero-padded, as the scalar reference pads.
#[inline(always)]
unsafe fn dots<W: LoadNeon, const R: usize, const P: usize>(
    w: &W,
    r0: usize,
    x: &[f32],
    t: usize,
    j0: usize,
    out: &mut [f32],
) {
    let n = w.cols();
    let full = n / LANES * LANES;
    let xs: [&[f32]; P] = std::array::from_fn(|p| &x[(j0 + p) * n..(j0 + p + 1) * n]);
    let mut wb = [[0f32; LANES]; R];
    let mut xb = [[0f32; LANES]; P];
    for col in full..n {
        for (i, row) in wb.iter_mut().enumerate() {
            row[col - full] = w.at(r0 + i, col);
        }
        for (p, row) in xb.iter_mut().enumerate() {
            row[col - full] = xs[p][col];
        }
    }
    // SAFETY: NEON is part of the aarch64 baseline; every load reads 32
    // f32 inside `xs[p]` (c + 32 <= full <= n), `wb` or `xb`.
    unsafe {
        let mut acc: [[V; P]; R] = [[[vdupq_n_f32(0.0); 8]; P]; R];
        let mut c = 0;
        while c < full {
            for (i, ai) in acc.iter_mut().enumerate() {
                let wv = w.load(r0 + i, c);
                for (a, xr) in ai.iter_mut().zip(&xs) {
                    let xp = xr.as_ptr().add(c);
                    for (q, aq) in a.iter_mut().enumerate() {
                        *aq = vfmaq_f32(*aq, vld1q_f32(xp.add(4 * q)), wv[q]);
                    }
                }
            }
            c += LANES;
        }
        if full < n {
            for (ai, wr) in acc.iter_mut().zip(&wb) {
                let wv: V = std::array::from_fn(|q| vld1q_f32(wr.as_ptr().add(4 * q)));
                for (a, xr) in ai.iter_mut().zip(&xb) {
                    for (q, aq) in a.iter_mut().enumerate() {
                        *aq = vfmaq_f32(*aq, vld1q_f32(xr.as_ptr().add(4 * q)), wv[q]);
                    }
                }
            }
        }
        for (i, ai) in acc.into_iter().enumerate() {
            for (p, a) in ai.into_iter().enumerate() {
                out[i * t + j0 + p] = w.finish(r0 + i, fold(a));
            }
        }
    }
}

/// Rows `rows` at `t` positions: one position takes two rows at a time
/// (sixteen sums in flight); several take one row at a time, two positions
/// sharing each decoded block of weights.
fn block<W: LoadNeon>(w: &W, x: &[f32], t: usize, rows: Range<usize>, out: &mut [f32]) {
    let mut r = rows.start;
    while r < rows.end {
        let o = &mut out[(r - rows.start) * t..];
        if t == 1 && r + 2 <= rows.end {
            // SAFETY: rows r, r + 1 and position 0 are in range.
            unsafe { dots::<W, 2, 1>(w, r, x, t, 0, o) };
            r += 2;
            continue;
        }
        let mut j = 0;
        while j + 2 <= t {
            // SAFETY: row r and positions j, j + 1 are in range.
            unsafe { dots::<W, 1, 2>(w, r, x, t, j, o) };
            j += 2;
        }
        if j < t {
            // SAFETY: row r and position j are in range.
            unsafe { dots::<W, 1, 1>(w, r, x, t, j, o) };
        }
        r += 1;
    }
}

/// Table entry (NEON is always present on aarch64).
pub(crate) fn entry<W: LoadNeon>(w: &W, x: &[f32], t: usize, rows: Range<usize>, out: &mut [f32]) {
    block(w, x, t, rows, out)
}
