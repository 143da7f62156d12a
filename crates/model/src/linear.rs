//! A resident weight matrix `[rows, cols]` applied as `x Wᵀ`, kept in its
//! stored precision (bf16 stays bf16: half the bytes, converted exactly in
//! registers; a released FP8 matrix stays FP8 with its block scales), or,
//! when asked for (`Spine::Int8`), quantised at load to per-row symmetric
//! int8 (half the bytes again; lossy).

use fathom_kernels::backend::{self, MatRef, Role, matmul_stable};
use fathom_kernels::formats::Fp8Rows;
use fathom_kernels::fp8::{e4m3, e4m3_is_nan};
use fathom_kernels::quant::quantize_rows_int8;
use fathom_weights::{Checkpoint, Dtype, TensorLoc, convert};

use crate::error::{ModelError, Result};
use crate::words::Words;

thread_local! {
    /// Set by [`loading_held`]: matrices as stored are mapped, not read.
    static HOLD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether a [`loading_held`] load is running on this thread.
pub fn holding() -> bool {
    HOLD.get()
}

/// Runs `load` with the matrices it loads as stored (bf16, f32, or int8
/// from the int8 spine file) mapped from the checkpoint and registered as held on the device
/// (`fathom_weights::mapped`) instead of read into RAM: a spine layer of
/// the device tier (`crate::tiers`). Matrices the load changes (int8,
/// transposed) become RAM copies; where a map is refused they are read.
pub fn loading_held<R>(load: impl FnOnce() -> R) -> R {
    let before = HOLD.replace(true);
    let r = load();
    HOLD.set(before);
    r
}

#[derive(Debug, Clone)]
pub enum WeightData {
    Bf16(Words<u16>),
    F32(Words<f32>),
    /// `W[r][c] = q[r·cols + c] · scale[r]` (see `fathom_kernels::quant`).
    Int8 {
        q: Words<i8>,
        scale: Words<f32>,
    },
    /// E4M3 codes with one f32 scale per `block = [br, bc]` tile (powers
    /// of two, `bc ≥ 32`): `W[r][c] = e4m3(q[r·cols + c]) · scale[r / br][c /
    /// bc]` over the grid `[⌈rows/br⌉, ⌈cols/bc⌉]` (DeepSeek-V3's
    /// `weight_scale_inv`). Row selections keep the format (a tile-unaligned
    /// one copies each row's scales, `br = 1`).
    Fp8 {
        q: Words<u8>,
        scale: Vec<f32>,
        block: [usize; 2],
    },
}

/// Precision of the resident spine matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Spine {
    /// As stored in the checkpoint (bf16/f32): exact.
    #[default]
    Bf16,
    /// Per-row symmetric int8, quantised at load: lossy.
    Int8,
}

impl Spine {
    pub fn name(self) -> &'static str {
        match self {
            Spine::Bf16 => "bf16",
            Spine::Int8 => "int8",
        }
    }

    pub fn lossy(self) -> bool {
        self == Spine::Int8
    }
}

#[derive(Debug, Clone)]
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

impl Linear {
    /// Reads a 2-D float tensor; the shape was checked when the checkpoint was bound.
    pub fn load(ck: &Checkpoint, name: &str, loc: &TensorLoc) -> Result<Self> {
        let (rows, cols) = match loc.shape[..] {
            [r, c] => (r, c),
            [r, 1, c] => (r, c),
            _ => {
                return Err(ModelError::Tensor(format!(
                    "{name}: expected a matrix, found {:?}",
                    loc.shape
                )));
            }
        };
        if let Some(data) = Self::held(ck, loc)? {
            return Ok(Linear { rows, cols, data });
        }
        let data = match loc.dtype {
            Dtype::BF16 => WeightData::Bf16(ck.read_u16(loc)?.into()),
            dt => WeightData::F32(
                convert::to_f32(dt, &ck.read(loc)?)
                    .ok_or_else(|| {
                        ModelError::Tensor(format!("{name}: {dt:?} is not a float dtype"))
                    })?
                    .into(),
            ),
        };
        Ok(Linear { rows, cols, data })
    }

    /// A bf16 or f32 matrix's bytes mapped and held during a
    /// [`loading_held`] load; `None` otherwise, for other dtypes or where
    /// the map is refused.
    fn held(ck: &Checkpoint, loc: &TensorLoc) -> Result<Option<WeightData>> {
        Ok(match loc.dtype {
            Dtype::BF16 => Words::held_if_holding(ck, loc)?.map(WeightData::Bf16),
            Dtype::F32 => Words::held_if_holding(ck, loc)?.map(WeightData::F32),
            _ => None,
        })
    }

    /// Whether this matrix's values (an FP8 matrix's codes; an int8
    /// matrix's codes and scales) are the checkpoint's mapped bytes held on
    /// the device.
    pub fn is_held(&self) -> bool {
        match &self.data {
            WeightData::Bf16(w) => w.is_held(),
            WeightData::F32(w) => w.is_held(),
            WeightData::Int8 { q, scale } => q.is_held() && scale.is_held(),
            WeightData::Fp8 { q, .. } => q.is_held(),
        }
    }

    /// Reads an FP8 matrix `name` (`F8_E4M3 [rows, cols]`) with its
    /// block scales `scale_name` (a float grid `[⌈rows/br⌉, ⌈cols/bc⌉]`),
    /// refusing NaN codes (0x7F, 0xFF) and non-finite scales by name.
    pub fn load_fp8(
        ck: &Checkpoint,
        (name, loc): (&str, &TensorLoc),
        (scale_name, scale_loc): (&str, &TensorLoc),
        block: [usize; 2],
    ) -> Result<Self> {
        let [rows, cols] = loc.shape[..] else {
            return Err(ModelError::Tensor(format!(
                "{name}: expected a matrix, found {:?}",
                loc.shape
            )));
        };
        let grid = [rows.div_ceil(block[0]), cols.div_ceil(block[1])];
        if loc.dtype != Dtype::F8_E4M3 || scale_loc.shape != grid {
            return Err(ModelError::Tensor(format!(
                "{name}: {:?} {:?} with scales {:?}: expected F8_E4M3 with a {grid:?} grid \
                 for blocks {block:?}",
                loc.dtype, loc.shape, scale_loc.shape
            )));
        }
        // Held on the device: the codes mapped, checked, and their pages
        // dropped again until the copy up reads them.
        let q = match Words::held_if_holding(ck, loc)? {
            Some(q) => q,
            None => Words::from(ck.read(loc)?),
        };
        if let Some(i) = q.iter().position(|&b| e4m3_is_nan(b)) {
            return Err(ModelError::Tensor(format!(
                "{name}: E4M3 code {:#04x} (NaN) at [{}, {}]: the checkpoint is corrupt",
                q[i],
                i / cols,
                i % cols
            )));
        }
        let scale = convert::to_f32(scale_loc.dtype, &ck.read(scale_loc)?).ok_or_else(|| {
            ModelError::Tensor(format!(
                "{scale_name}: {:?} is not a float dtype",
                scale_loc.dtype
            ))
        })?;
        if let Some(i) = scale.iter().position(|v| !v.is_finite()) {
            return Err(ModelError::Tensor(format!(
                "{scale_name}: scale {} at block [{}, {}] is not finite: the checkpoint is corrupt",
                scale[i],
                i / grid[1],
                i % grid[1]
            )));
        }
        q.release();
        Ok(Linear {
            rows,
            cols,
            data: WeightData::Fp8 { q, scale, block },
        })
    }

    /// The kernels' view of FP8 rows `r` (the whole matrix from `0`).
    fn fp8_rows<'a>(
        &self,
        q: &'a [u8],
        scale: &'a [f32],
        block: [usize; 2],
        r: std::ops::Range<usize>,
    ) -> Fp8Rows<'a> {
        let c = self.cols;
        Fp8Rows::new(&q[r.start * c..r.end * c], scale, c, block, r.start)
            .expect("an FP8 matrix is checked when made")
    }

    /// The whole matrix as the backend seam sees it (its bytes stay put
    /// until this `Linear` drops, which forgets them).
    pub fn as_mat(&self) -> MatRef<'_> {
        self.mat(0..self.rows)
    }

    /// Rows `r` as the backend seam sees them.
    fn mat(&self, r: std::ops::Range<usize>) -> MatRef<'_> {
        let (n, c) = (r.len(), self.cols);
        match &self.data {
            WeightData::Bf16(w) => MatRef::Bf16 {
                w: &w[r.start * c..r.end * c],
                rows: n,
                cols: c,
            },
            WeightData::F32(w) => MatRef::F32 {
                w: &w[r.start * c..r.end * c],
                rows: n,
                cols: c,
            },
            WeightData::Int8 { q, scale } => MatRef::Int8 {
                q: &q[r.start * c..r.end * c],
                scale: &scale[r],
                cols: c,
            },
            WeightData::Fp8 { q, scale, block } => MatRef::Fp8(self.fp8_rows(q, scale, *block, r)),
        }
    }

    /// `y[T, rows] = x[T, cols] Wᵀ`.
    pub fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        let mut y = vec![0f32; t * self.rows];
        self.forward_into(x, t, &mut y);
        y
    }

    /// `y[T, rows] = x[T, cols] Wᵀ` through the backend seam (the CPU
    /// kernels unless a device backend is installed; the same bits).
    pub fn forward_into(&self, x: &[f32], t: usize, y: &mut [f32]) {
        matmul_stable(&self.mat(0..self.rows), Role::Spine, x, t, y)
    }

    /// Several matrices applied to one input `x [T, cols]`: each result the
    /// one [`Linear::forward`] gives; a device backend takes them in one call.
    pub fn forward_many<const N: usize>(ls: [&Linear; N], x: &[f32], t: usize) -> [Vec<f32>; N] {
        let mut ys = ls.map(|l| vec![0f32; t * l.rows]);
        let mut ps: Vec<backend::Product<'_, '_>> = ls
            .iter()
            .zip(ys.iter_mut())
            .map(|(l, y)| backend::Product {
                w: l.mat(0..l.rows),
                role: Role::Spine,
                x,
                t,
                y,
            })
            .collect();
        backend::matmul_batch_stable(&mut ps, &backend::Hints::default());
        drop(ps);
        ys
    }

    /// `y[T, r.len()] = x[T, cols] W[r]ᵀ`: only the rows `r` (each row's
    /// result is the one `forward` gives for it).
    pub fn forward_rows(&self, r: std::ops::Range<usize>, x: &[f32], t: usize) -> Vec<f32> {
        let mut y = vec![0f32; t * r.len()];
        matmul_stable(&self.mat(r), Role::Spine, x, t, &mut y);
        y
    }

    /// `groups` products over equal row blocks: block `g` (rows
    /// `g·rows_g..(g + 1)·rows_g`) applied to its own `x[g]` (`[G, T, cols]`
    /// in, `[G, T, rows_g]` out). Each block's result is the one
    /// [`Linear::forward_rows`] gives for it; a device backend takes all
    /// blocks in one call.
    pub fn forward_groups(&self, groups: usize, x: &[f32], t: usize) -> Vec<f32> {
        assert!(
            groups > 0 && self.rows % groups == 0,
            "{} rows in {groups} groups",
            self.rows
        );
        let rg = self.rows / groups;
        let mut y = vec![0f32; groups * t * rg];
        if t == 0 || rg == 0 {
            return y;
        }
        if backend::matmul_groups_stable(&self.mat(0..self.rows), Role::Spine, groups, x, t, &mut y)
        {
            return y;
        }
        use rayon::prelude::*;
        let xs = t * self.cols;
        y.par_chunks_mut(t * rg).enumerate().for_each(|(g, yg)| {
            self.mat(g * rg..(g + 1) * rg)
                .cpu(&x[g * xs..][..xs], t, yg)
        });
        y
    }

    /// Tells the backend seam this matrix's bytes are going away.
    fn forget_data(&self) {
        match &self.data {
            WeightData::Bf16(w) => backend::forget(w),
            WeightData::F32(w) => backend::forget(w),
            WeightData::Int8 { q, scale } => {
                backend::forget(q);
                backend::forget(scale);
            }
            WeightData::Fp8 { q, scale, .. } => {
                backend::forget(q);
                backend::forget(scale);
            }
        }
    }

    /// Rows `rows` transposed: `[cols, rows.len()]`, in the same precision
    /// (exact for bf16/f32; an int8 matrix is decoded and re-quantised per row).
    pub fn transposed_rows(&self, rows: std::ops::Range<usize>) -> Linear {
        let (n, c) = (rows.len(), self.cols);
        let data = match &self.data {
            WeightData::Bf16(w) => WeightData::Bf16(
                (0..c)
                    .flat_map(|j| rows.clone().map(move |r| w[r * c + j]))
                    .collect(),
            ),
            WeightData::F32(w) => WeightData::F32(
                (0..c)
                    .flat_map(|j| rows.clone().map(move |r| w[r * c + j]))
                    .collect(),
            ),
            // Tile-aligned rows of a matrix whose row tiles are ≥ 32 wide
            // transpose into FP8 tiles `[bc, br]` (DeepSeek-V3's `kv_b_proj`
            // heads); anything else is dequantised to f32 (the same values).
            WeightData::Fp8 { q, scale, block } => {
                let [br, bc] = *block;
                if !rows.start.is_multiple_of(br) || br < 32 {
                    return Linear {
                        rows: c,
                        cols: n,
                        data: WeightData::F32(
                            (0..c)
                                .flat_map(|j| rows.clone().map(move |r| (r, j)))
                                .map(|(r, j)| self.at(r, j))
                                .collect(),
                        ),
                    };
                }
                let (gc, first) = (c.div_ceil(bc), rows.start / br);
                WeightData::Fp8 {
                    q: (0..c)
                        .flat_map(|j| rows.clone().map(move |r| q[r * c + j]))
                        .collect(),
                    scale: (0..gc)
                        .flat_map(|jb| (0..n.div_ceil(br)).map(move |kb| (jb, kb)))
                        .map(|(jb, kb)| scale[(first + kb) * gc + jb])
                        .collect(),
                    block: [bc, br],
                }
            }
            WeightData::Int8 { .. } => {
                let f: Vec<f32> = (0..c)
                    .flat_map(|j| rows.clone().map(move |r| (r, j)))
                    .map(|(r, j)| self.at(r, j))
                    .collect();
                let mut t = Linear {
                    rows: c,
                    cols: n,
                    data: WeightData::F32(f.into()),
                };
                t.quantize_int8();
                return t;
            }
        };
        Linear {
            rows: c,
            cols: n,
            data,
        }
    }

    /// Stacks matrices of one width row-wise: in their precision when they
    /// share it (FP8 parts: one block, every part but the last whole row
    /// tiles), else dequantised to f32 (the same values).
    pub fn stack(parts: Vec<Linear>) -> Linear {
        let cols = parts.first().map_or(0, |p| p.cols);
        let rows = parts.iter().map(|p| p.rows).sum();
        let kind = |p: &Linear| std::mem::discriminant(&p.data);
        let same = parts.windows(2).all(|w| kind(&w[0]) == kind(&w[1]));
        let fp8_ok = match parts.first().map(|p| &p.data) {
            Some(WeightData::Fp8 { block, .. }) => {
                let n = parts.len();
                parts.iter().enumerate().all(|(i, p)| match &p.data {
                    WeightData::Fp8 { block: b, .. } => {
                        b == block && (i + 1 == n || p.rows.is_multiple_of(block[0]))
                    }
                    _ => false,
                })
            }
            _ => true,
        };
        if !(same && fp8_ok) {
            let f: Vec<f32> = parts.iter().flat_map(Linear::dequantized).collect();
            return Linear {
                rows,
                cols,
                data: WeightData::F32(f.into()),
            };
        }
        let mut it = parts.into_iter();
        let mut data = it
            .next()
            .map_or(WeightData::F32(Vec::new().into()), |mut p| {
                std::mem::replace(&mut p.data, WeightData::F32(Vec::new().into()))
            });
        for mut p in it {
            let pd = std::mem::replace(&mut p.data, WeightData::F32(Vec::new().into()));
            match (&mut data, pd) {
                (WeightData::Bf16(a), WeightData::Bf16(b)) => a.vec_mut().extend_from_slice(&b),
                (WeightData::F32(a), WeightData::F32(b)) => a.vec_mut().extend_from_slice(&b),
                (WeightData::Int8 { q, scale }, WeightData::Int8 { q: q2, scale: s2 }) => {
                    q.vec_mut().extend_from_slice(&q2);
                    scale.vec_mut().extend_from_slice(&s2);
                }
                (
                    WeightData::Fp8 { q, scale, .. },
                    WeightData::Fp8 {
                        q: q2, scale: s2, ..
                    },
                ) => {
                    q.vec_mut().extend_from_slice(&q2);
                    scale.extend(s2);
                }
                _ => unreachable!("stacked parts share one precision"),
            }
        }
        Linear { rows, cols, data }
    }

    /// Rows `rows` as their own matrix.
    pub fn select_rows(&self, rows: std::ops::Range<usize>) -> Linear {
        let c = self.cols;
        let data = match &self.data {
            WeightData::Bf16(w) => {
                WeightData::Bf16(w[rows.start * c..rows.end * c].to_vec().into())
            }
            WeightData::F32(w) => WeightData::F32(w[rows.start * c..rows.end * c].to_vec().into()),
            WeightData::Int8 { q, scale } => WeightData::Int8 {
                q: q[rows.start * c..rows.end * c].to_vec().into(),
                scale: scale[rows.clone()].to_vec().into(),
            },
            WeightData::Fp8 { q, scale, block } => {
                let [br, bc] = *block;
                let gc = c.div_ceil(bc);
                let q: Words<u8> = q[rows.start * c..rows.end * c].to_vec().into();
                if rows.start.is_multiple_of(br) {
                    let grid = rows.start / br * gc..rows.end.div_ceil(br) * gc;
                    WeightData::Fp8 {
                        q,
                        scale: scale[grid].to_vec(),
                        block: *block,
                    }
                } else {
                    WeightData::Fp8 {
                        q,
                        scale: rows
                            .clone()
                            .flat_map(|r| scale[r / br * gc..(r / br + 1) * gc].iter().copied())
                            .collect(),
                        block: [1, bc],
                    }
                }
            }
        };
        Linear {
            rows: rows.len(),
            cols: c,
            data,
        }
    }

    /// Every weight as f32, row-major (exact for every stored format).
    pub fn dequantized(&self) -> Vec<f32> {
        (0..self.rows)
            .flat_map(|r| (0..self.cols).map(move |c| (r, c)))
            .map(|(r, c)| self.at(r, c))
            .collect()
    }

    /// Quantises to per-row int8 in place (no-op when already int8, and
    /// for FP8: already a byte a weight, re-quantising would only lose).
    pub fn quantize_int8(&mut self) {
        if matches!(self.data, WeightData::Int8 { .. } | WeightData::Fp8 { .. }) {
            return;
        }
        let noted = crate::int8_record::active()
            .then(|| crate::int8_record::key(self))
            .flatten();
        let (q, scale) = quantize_rows_int8(self.rows, self.cols, |r, out| self.row_into(r, out));
        if let Some(k) = noted {
            crate::int8_record::quantized(k, self.rows, self.cols, &q, &scale);
        }
        self.forget_data();
        self.data = WeightData::Int8 {
            q: q.into(),
            scale: scale.into(),
        };
    }

    /// Row `r` as f32 into `out` (`cols` long; exact for bf16): an
    /// embedding lookup, a row to quantise.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let range = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            WeightData::Bf16(w) => {
                for (o, &b) in out.iter_mut().zip(&w[range]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            WeightData::F32(w) => out.copy_from_slice(&w[range]),
            WeightData::Int8 { q, scale } => {
                for (o, &v) in out.iter_mut().zip(&q[range]) {
                    *o = v as f32 * scale[r];
                }
            }
            WeightData::Fp8 { .. } => {
                for (c, o) in out.iter_mut().enumerate() {
                    *o = self.at(r, c);
                }
            }
        }
    }

    /// Element `(r, c)` as f32.
    #[inline]
    pub fn at(&self, r: usize, c: usize) -> f32 {
        match &self.data {
            WeightData::Bf16(w) => f32::from_bits((w[r * self.cols + c] as u32) << 16),
            WeightData::F32(w) => w[r * self.cols + c],
            WeightData::Int8 { q, scale } => q[r * self.cols + c] as f32 * scale[r],
            WeightData::Fp8 { q, scale, block } => {
                let gc = self.cols.div_ceil(block[1]);
                e4m3(q[r * self.cols + c]) * scale[r / block[0] * gc + c / block[1]]
            }
        }
    }

    pub fn bytes(&self) -> usize {
        match &self.data {
            WeightData::Bf16(w) => w.len() * 2,
            WeightData::F32(w) => w.len() * 4,
            WeightData::Int8 { q, scale } => q.len() + scale.len() * 4,
            WeightData::Fp8 { q, scale, .. } => q.len() + scale.len() * 4,
        }
    }
}

/// Reads a float vector (norm weights, biases) as f32.
pub fn load_vector(ck: &Checkpoint, name: &str, loc: &TensorLoc) -> Result<Vec<f32>> {
    let bytes = ck.read(loc)?;
    convert::to_f32(loc.dtype, &bytes)
        .ok_or_else(|| ModelError::Tensor(format!("{name}: {:?} is not a float dtype", loc.dtype)))
}

/// A projection with its optional bias (`attention_bias`).
#[derive(Debug)]
pub struct Proj {
    pub weight: Linear,
    pub bias: Option<Vec<f32>>,
}

impl Proj {
    /// `x Wᵀ (+ b)` over `x [T, cols]`.
    pub fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        let mut y = self.weight.forward(x, t);
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(b.len()) {
                row.iter_mut().zip(b).for_each(|(a, c)| *a += c);
            }
        }
        y
    }
}

impl Drop for Linear {
    fn drop(&mut self) {
        self.forget_data();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An FP8 matrix with every finite code and varied tile scales.
    fn fp8(rows: usize, cols: usize, block: [usize; 2]) -> Linear {
        let q = (0..rows * cols)
            .map(|k| {
                let b = (k * 37 % 256) as u8;
                if e4m3_is_nan(b) { 0x11 } else { b }
            })
            .collect();
        let n = rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
        let scale = (0..n).map(|k| 0.01 + k as f32 * 3.7e-3).collect();
        Linear {
            rows,
            cols,
            data: WeightData::Fp8 { q, scale, block },
        }
    }

    fn f32_copy(m: &Linear) -> Linear {
        Linear {
            rows: m.rows,
            cols: m.cols,
            data: WeightData::F32(m.dequantized().into()),
        }
    }

    /// What the absorbed MLA form does to DeepSeek-V3's `kv_b_proj` (two
    /// heads of 128 + 128 rows, 128×128 tiles): the transposed key halves
    /// and the value halves stay FP8, hold the same values and give the
    /// same products as the f32 matrix; unaligned selections keep the values.
    #[test]
    fn fp8_selections_transposes_and_stacks_keep_every_value() {
        let m = fp8(512, 256, [128, 128]);
        let f = f32_copy(&m);
        let heads = |w: &Linear| {
            let uk = Linear::stack(
                (0..2)
                    .map(|h| w.transposed_rows(h * 256..h * 256 + 128))
                    .collect(),
            );
            let uv = Linear::stack(
                (0..2)
                    .map(|h| w.select_rows(h * 256 + 128..(h + 1) * 256))
                    .collect(),
            );
            (uk, uv)
        };
        let ((uk, uv), (fuk, fuv)) = (heads(&m), heads(&f));
        assert!(matches!(
            uk.data,
            WeightData::Fp8 {
                block: [128, 128],
                ..
            }
        ));
        assert!(matches!(
            uv.data,
            WeightData::Fp8 {
                block: [128, 128],
                ..
            }
        ));
        let x: Vec<f32> = (0..3 * 256).map(|i| (i % 17) as f32 * 0.1 - 0.8).collect();
        let xt: Vec<f32> = (0..3 * 128).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
        for (a, b, x) in [(&uk, &fuk, &xt), (&uv, &fuv, &x)] {
            assert_eq!(a.dequantized(), b.dequantized());
            assert_eq!(a.forward(x, 3), b.forward(x, 3));
            assert_eq!(
                a.forward_rows(200..256, x, 3),
                b.forward_rows(200..256, x, 3)
            );
            // Grouped: block g on its own input gives forward_rows' bits.
            let (cols, rg) = (a.cols, a.rows / 4);
            let xg: Vec<f32> = (0..4 * 2 * cols)
                .map(|i| (i % 23) as f32 * 0.07 - 0.7)
                .collect();
            let all = a.forward_groups(4, &xg, 2);
            for g in 0..4 {
                let one = a.forward_rows(g * rg..(g + 1) * rg, &xg[g * 2 * cols..][..2 * cols], 2);
                assert_eq!(all[g * 2 * rg..][..2 * rg], one[..], "group {g}");
            }
        }
        let s = m.select_rows(5..300);
        assert!(matches!(
            s.data,
            WeightData::Fp8 {
                block: [1, 128],
                ..
            }
        ));
        assert_eq!(s.dequantized(), f.select_rows(5..300).dequantized());
        assert_eq!(s.forward(&x, 3), f.select_rows(5..300).forward(&x, 3));
        let t = m.transposed_rows(5..40);
        assert!(matches!(t.data, WeightData::F32(_)));
        assert_eq!(t.dequantized(), f.transposed_rows(5..40).dequantized());
        let mixed = Linear::stack(vec![m.select_rows(0..128), m.select_rows(300..301)]);
        assert!(matches!(mixed.data, WeightData::F32(_)));
        assert_eq!(mixed.rows, 129);
        assert_eq!(
            &mixed.dequantized()[..128 * 256],
            &f.dequantized()[..128 * 256]
        );
    }
}
