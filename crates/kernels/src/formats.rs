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
//! (bf16 and int8 always are; an MXFP4 value is `e2m1 * 2^e` and an INT4
//! value `(code − 8) · bf16 scale`, exact products; an FP8 value is
//! `e4m3 · scale`, one correctly rounded f32 product); int8 rows multiply
//! the folded sum by the row scale.
//!
//! 32 lanes are two AVX-512 registers, four AVX2 registers or eight NEON
//! registers: every ISA keeps independent FMA chains (hiding their latency at
//! T = 1) and performs the very same IEEE operations, so the SIMD results are
//! bit-identical to this reference (NaN payloads excepted).

use fathom_weights::mxfp4::{GROUP, Mxfp4Ref, e2m1, e8m0};

use crate::fp8::{bf16, e4m3, int4};

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

/// FP8 E4M3 weights `[rows, cols]` with one f32 scale per `[br, bc]` tile
/// (DeepSeek-V3's `weight_scale_inv [⌈out/br⌉, ⌈in/bc⌉]`): `w[r][i] =
/// e4m3(q[r][i]) · scale[(row0 + r) / br][i / bc]`. Both block sides are
/// powers of two and `bc ≥ 32`, so a 32-column lane block has one scale.
#[derive(Clone, Copy)]
pub struct Fp8Rows<'a> {
    pub q: &'a [u8],
    pub scale: &'a [f32],
    pub cols: usize,
    /// `log2` of the tile's rows and columns.
    pub shift: [u32; 2],
    /// Scale-grid columns, `⌈cols / bc⌉`.
    pub grid_cols: usize,
    /// Index of `q`'s first row in the scale grid's row space (a product
    /// over some rows of a larger matrix).
    pub row0: usize,
}

impl<'a> Fp8Rows<'a> {
    /// Checks the block (powers of two, `bc ≥ 32`) and the lengths.
    pub fn new(
        q: &'a [u8],
        scale: &'a [f32],
        cols: usize,
        block: [usize; 2],
        row0: usize,
    ) -> Option<Self> {
        let [br, bc] = block;
        let rows = q.len().checked_div(cols)?;
        let ok = br.is_power_of_two()
            && bc.is_power_of_two()
            && bc >= LANES
            && q.len() == rows * cols
            && scale.len() >= (row0 + rows).div_ceil(br) * cols.div_ceil(bc);
        ok.then_some(Fp8Rows {
            q,
            scale,
            cols,
            shift: [br.trailing_zeros(), bc.trailing_zeros()],
            grid_cols: cols.div_ceil(bc),
            row0,
        })
    }

    /// Index into `scale` of the tile holding `(r, i)`.
    #[inline(always)]
    pub fn scale_index(&self, r: usize, i: usize) -> usize {
        ((self.row0 + r) >> self.shift[0]) * self.grid_cols + (i >> self.shift[1])
    }
}

/// Symmetric INT4 weights as compressed-tensors `pack-quantized` stores
/// them: eight 4-bit codes per little-endian int32, column `c` in byte
/// `c / 2` (low nibble for even `c`), value `code − 8`, times a bf16 scale
/// per `group` columns (a power of two ≥ 32; `cols` a multiple of it).
#[derive(Clone, Copy)]
pub struct Int4Rows<'a> {
    pub packed: &'a [u8],
    /// bf16 bit patterns, `[rows, cols / group]`.
    pub scale: &'a [u16],
    pub cols: usize,
    /// `log2(group)`.
    pub group_shift: u32,
}

impl<'a> Int4Rows<'a> {
    /// Checks the group and the lengths for `[rows, cols]`.
    pub fn new(
        packed: &'a [u8],
        scale: &'a [u16],
        rows: usize,
        cols: usize,
        group: usize,
    ) -> Option<Self> {
        let ok = group.is_power_of_two()
            && group >= LANES
            && cols.is_multiple_of(group)
            && packed.len() == rows * cols / 2
            && scale.len() == rows * cols / group;
        ok.then_some(Int4Rows {
            packed,
            scale,
            cols,
            group_shift: group.trailing_zeros(),
        })
    }

    /// The scale of column `i` of row `r`.
    #[inline(always)]
    pub fn scale_at(&self, r: usize, i: usize) -> f32 {
        bf16(self.scale[(r * self.cols + i) >> self.group_shift])
    }
}

impl Rows for Fp8Rows<'_> {
    fn rows(&self) -> usize {
        self.q.len() / self.cols.max(1)
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn at(&self, r: usize, i: usize) -> f32 {
        e4m3(self.q[r * self.cols + i]) * self.scale[self.scale_index(r, i)]
    }
}

impl Rows for Int4Rows<'_> {
    fn rows(&self) -> usize {
        2 * self.packed.len() / self.cols.max(1)
    }
    fn cols(&self) -> usize {
        self.cols
    }
    #[inline(always)]
    fn at(&self, r: usize, i: usize) -> f32 {
        let b = self.packed[(r * self.cols + i) / 2];
        let code = if i & 1 == 0 { b & 0x0F } else { b >> 4 };
        int4(code) * self.scale_at(r, i)
    }
}

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

/// [`block_scalar`] over every row, laid out as a product's result
/// `y[T, rows]` (`y[j·rows + r]`): the scalar twin the device kernels'
/// parity tests compare against.
pub fn scalar_product<W: Rows>(w: &W, x: &[f32], t: usize) -> Vec<f32> {
    let rows = w.rows();
    let mut o = vec![0f32; rows * t];
    block_scalar(w, x, t, 0..rows, &mut o);
    let mut y = vec![0f32; t * rows];
    for r in 0..rows {
        for j in 0..t {
            y[j * rows + r] = o[r * t + j];
        }
    }
    y
}
