//! A resident weight matrix `[rows, cols]` applied as `x Wᵀ`, kept in its
//! stored precision (bf16 stays bf16: half the bytes, converted exactly in
//! registers).

use fathom_kernels::{matmul_bf16, matmul_f32};
use fathom_weights::{Checkpoint, Dtype, TensorLoc, convert};

use crate::error::{ModelError, Result};

#[derive(Debug, Clone)]
pub enum WeightData {
    Bf16(Vec<u16>),
    F32(Vec<f32>),
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
            [r, one, c] if one == 1 => (r, c),
            _ => {
                return Err(ModelError::Experts(format!(
                    "{name}: expected a matrix, found {:?}",
                    loc.shape
                )));
            }
        };
        let bytes = ck.read(loc)?;
        let data = match loc.dtype {
            Dtype::BF16 => WeightData::Bf16(convert::bytes_to_u16(&bytes)),
            dt => WeightData::F32(convert::to_f32(dt, &bytes).ok_or_else(|| {
                ModelError::Experts(format!("{name}: {dt:?} is not a float dtype"))
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
        }
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
        }
    }

    /// Element `(r, c)` as f32.
    #[inline]
    pub fn at(&self, r: usize, c: usize) -> f32 {
        match &self.data {
            WeightData::Bf16(w) => f32::from_bits((w[r * self.cols + c] as u32) << 16),
            WeightData::F32(w) => w[r * self.cols + c],
        }
    }

    pub fn bytes(&self) -> usize {
        match &self.data {
            WeightData::Bf16(w) => w.len() * 2,
            WeightData::F32(w) => w.len() * 4,
        }
    }
}

/// Reads a float vector (norm weights, biases) as f32.
pub fn load_vector(ck: &Checkpoint, name: &str, loc: &TensorLoc) -> Result<Vec<f32>> {
    let bytes = ck.read(loc)?;
    convert::to_f32(loc.dtype, &bytes)
        .ok_or_else(|| ModelError::Experts(format!("{name}: {:?} is not a float dtype", loc.dtype)))
}
