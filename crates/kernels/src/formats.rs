//! Weight formats as seen by the kernels, and the scalar reference dot
//! product that fixes the reduction order every SIMD path reproduces.
//!
//! # Reduction order (the contract between scalar and SIMD)
//!
//! A dot product `x · w` over `n` columns uses [`LANES`] = 32 interleaved
//! partial sums. The row is treated as zero-padded to a multiple of 32;
//! column `i` goes to lane `i % 32` as `acc[l] = fma(x[i], w[i], acc[l])`,
//! one fused multiply-add rounded once (`f32::mul_add`; every SIMD ISA has
//! the same IEEE operation: `vfmadd` on AVX-512/AVX2+FMA, `vfmaq_f32` on NEON).
//! The fused form is the contract because it is what the hardware does
//! fastest; on a CPU without FMA the scalar reference becomes a libm call
//! per element: correct, slow, and only used as the reference and as the
//! fallback for such CPUs. The 32 lanes are then folded in halves, `acc[i] += acc[i + h]` for
//! `h = 16, 8, 4, 2, 1`. Each weight is first dequantised *exactly* to f32
//! (bf16 and int8 always are; an MXFP4 value is `e2m1 * 2^e`, one correctly
//! rounded f32 product); int8 rows multiply the folded sum by the row scale.
//!
//! 32 lanes are two AVX-512 registers, four AVX2 registers or eight NEON
//! registers: every ISA keeps independent FMA chains (hiding their latency at
//! T = 1) and performs the very same IEEE operations, so the SIMD results are
//! bit-identical to this reference (NaN payloads excepted).

use fathom_weights::mxfp4::{GROUP, Mxfp4Ref, e2m1, e8m0};

/// Interleaved partial sums of every dot product.
pub const LANES: usize = 32;

/// A set of weight rows `[rows, cols]` whose elements dequantise exactly to f32.
pub trait Rows: Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Weight `(r, i)` as f32 (exact).
    fn at(&self, r: usize, i: usize) -> f32;
    /// Turns the folded dot product of row `r` into the output (row scale).
    #[inline(always)]
    fn finish(&self, _r: usize, dot: f32) -> f32 {
        dot
    }
}

/// f32 weights.
#[derive(Clone, Copy)]
pub struct F32Rows<'a> {
    pub w: &'a [f32],
    pub cols: usize,
}

/// bf16 weights as raw bit patterns.
#[derive(Clone, Copy)]
pub struct Bf16Rows<'a> {
    pub w: &'a [u16],
    pub cols: usize,
}

/// Symmetric int8 weights with one f32 scale per row: `w[r][i] = q[r][i] · scale[r]`.
#[derive(Clone, Copy)]
pub struct Int8Rows<'a> {
    pub q: &'a [i8],
    pub scale: &'a [f32],
    pub cols: usize,
}

/// MXFP4 weights (`cols` is a multiple of 32, so a lane block is one scale group).
#[derive(Clone, Copy)]
pub struct Mxfp4Rows<'a>(pub Mxfp4Ref<'a>);

impl Rows for F32Rows<'_> {
    fn rows(&self) -> usize {
        self.w.len() / self.cols.max(1)
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn at(&self, r: usize, i: usize) -> f32 {
        self.w[r * self.cols + i]
    }
}

impl Rows for Bf16Rows<'_> {
    fn rows(&self) -> usize {
        self.w.len() / self.cols.max(1)
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn at(&self, r: usize, i: usize) -> f32 {
        f32::from_bits((self.w[r * self.cols + i] as u32) << 16)
    }
}

impl Rows for Int8Rows<'_> {
    fn rows(&self) -> usize {
        self.scale.len()
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn at(&self, r: usize, i: usize) -> f32 {
        self.q[r * self.cols + i] as f32
    }
    #[inline(always)]
    fn finish(&self, r: usize, dot: f32) -> f32 {
        dot * self.scale[r]
    }
}

impl Rows for Mxfp4Rows<'_> {
    fn rows(&self) -> usize {
        self.0.rows
    }
    fn cols(&self) -> usize {
        self.0.cols
    }
    #[inline(always)]
    fn at(&self, r: usize, i: usize) -> f32 {
        let m = &self.0;
        let b = m.packed[(r * m.cols + i) / 2];
        let code = if i & 1 == 0 { b & 0x0F } else { b >> 4 };
        e2m1(code) * e8m0(m.scales[(r * m.cols + i) / GROUP])
    }
}

/// Folds 32 partial sums in halves (the order every SIMD path reproduces).
#[inline(always)]
pub fn fold32(mut acc: [f32; LANES]) -> f32 {
    let mut h = LANES / 2;
    while h > 0 {
        for i in 0..h {
            acc[i] += acc[i + h];
        }
        h /= 2;
    }
    acc[0]
}

/// Scalar reference: `out[k·t + j] = finish(r, x_j · w_r)` for the rows of
/// `rows` (`k` counts from the block's first row).
pub fn block_scalar<W: Rows>(
    w: &W,
    x: &[f32],
    t: usize,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let n = w.cols();
    for (k, r) in rows.enumerate() {
        for j in 0..t {
            let xr = &x[j * n..(j + 1) * n];
            let mut acc = [0f32; LANES];
            for c in (0..n).step_by(LANES) {
                for (l, a) in acc.iter_mut().enumerate() {
                    let i = c + l;
                    let (xv, wv) = if i < n {
                        (xr[i], w.at(r, i))
                    } else {
                        (0.0, 0.0)
                    };
                    *a = xv.mul_add(wv, *a);
                }
            }
            out[k * t + j] = w.finish(r, fold32(acc));
        }
    }
}
