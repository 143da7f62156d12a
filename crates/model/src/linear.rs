//! A resident weight matrix `[rows, cols]` applied as `x Wᵀ`, kept in its
//! stored precision (bf16 stays bf16: half the bytes, converted exactly in
//! registers), or, when asked for (`Spine::Int8`), quantised at load to
//! per-row symmetric int8 (half the bytes again; lossy).

use fathom_kernels::quant::quantize_rows_int8;
use fathom_kernels::{matmul_bf16, matmul_f32, matmul_int8};
use fathom_weights::{Checkpoint, Dtype, TensorLoc, convert};

use crate::error::{ModelError, Result};

#[derive(Debug, Clone)]
pub enum WeightData {
    Bf16(Vec<u16>),
    F32(Vec<f32>),
    /// `W[r][c] = q[r·cols + c] · scale[r]` (see `fathom_kernels::quant`).
    Int8 {
        q: Vec<i8>,
        scale: Vec<f32>,
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
        let data = match loc.dtype {
            Dtype::BF16 => WeightData::Bf16(ck.read_u16(loc)?),
            dt => WeightData::F32(convert::to_f32(dt, &ck.read(loc)?).ok_or_else(|| {
                ModelError::Tensor(format!("{name}: {dt:?} is not a float dtype"))
            })?),
        };
        Ok(Linear { rows, cols, data })
    }

    /// `y[T, rows] = x[T, cols] Wᵀ`.
    pub fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        let mut y = vec![0f32; t * self.rows];
        self.forward_into(x, t, &mut y);
        y
    }

    pub fn forward_into(&self, x: &[f32], t: usize, y: &mut [f32]) {
        match &self.data {
            WeightData::Bf16(w) => matmul_bf16(x, t, w, self.rows, self.cols, y),
            WeightData::F32(w) => matmul_f32(x, t, w, self.rows, self.cols, y),
            WeightData::Int8 { q, scale } => matmul_int8(x, t, q, scale, self.cols, y),
        }
    }

    /// `y[T, r.len()] = x[T, cols] W[r]ᵀ`: only the rows `r` (each row's
    /// result is the one `forward` gives for it).
    pub fn forward_rows(&self, r: std::ops::Range<usize>, x: &[f32], t: usize) -> Vec<f32> {
        let (n, c) = (r.len(), self.cols);
        let mut y = vec![0f32; t * n];
        match &self.data {
            WeightData::Bf16(w) => matmul_bf16(x, t, &w[r.start * c..r.end * c], n, c, &mut y),
            WeightData::F32(w) => matmul_f32(x, t, &w[r.start * c..r.end * c], n, c, &mut y),
            WeightData::Int8 { q, scale } => matmul_int8(
                x,
                t,
                &q[r.start * c..r.end * c],
                &scale[r.clone()],
                c,
                &mut y,
            ),
        }
        y
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
            WeightData::Int8 { .. } => {
                let f: Vec<f32> = (0..c)
                    .flat_map(|j| rows.clone().map(move |r| (r, j)))
                    .map(|(r, j)| self.at(r, j))
                    .collect();
                let mut t = Linear {
                    rows: c,
                    cols: n,
                    data: WeightData::F32(f),
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

    /// Stacks matrices of one width and precision row-wise.
    pub fn stack(parts: Vec<Linear>) -> Linear {
        let cols = parts.first().map_or(0, |p| p.cols);
        let rows = parts.iter().map(|p| p.rows).sum();
        let mut it = parts.into_iter();
        let mut data = it.next().map_or(WeightData::F32(Vec::new()), |p| p.data);
        for p in it {
            match (&mut data, p.data) {
                (WeightData::Bf16(a), WeightData::Bf16(b)) => a.extend(b),
                (WeightData::F32(a), WeightData::F32(b)) => a.extend(b),
                (WeightData::Int8 { q, scale }, WeightData::Int8 { q: q2, scale: s2 }) => {
                    q.extend(q2);
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
            WeightData::Bf16(w) => WeightData::Bf16(w[rows.start * c..rows.end * c].to_vec()),
            WeightData::F32(w) => WeightData::F32(w[rows.start * c..rows.end * c].to_vec()),
            WeightData::Int8 { q, scale } => WeightData::Int8 {
                q: q[rows.start * c..rows.end * c].to_vec(),
                scale: scale[rows.clone()].to_vec(),
            },
        };
        Linear {
            rows: rows.len(),
            cols: c,
            data,
        }
    }

    /// Quantises to per-row int8 in place (no-op when already int8).
    pub fn quantize_int8(&mut self) {
        if matches!(self.data, WeightData::Int8 { .. }) {
            return;
        }
        let (q, scale) = quantize_rows_int8(self.rows, self.cols, |r, out| {
            for (c, o) in out.iter_mut().enumerate() {
                *o = self.at(r, c);
            }
        });
        self.data = WeightData::Int8 { q, scale };
    }

    /// Row `r` as f32 (embedding lookup; exact for bf16).
    pub fn row(&self, r: usize) -> Vec<f32> {
        let range = r * self.cols..(r + 1) * self.cols;
        match &self.data {
            WeightData::Bf16(w) => w[range]
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect(),
            WeightData::F32(w) => w[range].to_vec(),
            WeightData::Int8 { q, scale } => {
                q[range].iter().map(|&v| v as f32 * scale[r]).collect()
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
        }
    }

    pub fn bytes(&self) -> usize {
        match &self.data {
            WeightData::Bf16(w) => w.len() * 2,
            WeightData::F32(w) => w.len() * 4,
            WeightData::Int8 { q, scale } => q.len() + scale.len() * 4,
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
