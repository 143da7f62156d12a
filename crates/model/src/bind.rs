//! Reading named checkpoint tensors into typed bindings at load, and
//! reporting every disagreement between a checkpoint and a family's tensor
//! table at once.

use fathom_weights::{Checkpoint, Dtype, TensorLoc, WeightsError, int8_spine};

use crate::error::{ModelError, Result};
use crate::linear::{Linear, WeightData, load_vector};
use crate::mlp::MlpWeights;
use crate::words::Words;

/// Whether a dtype is a float format the spine loader converts.
pub(crate) fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32)
}

/// Reads tensors by name.
pub(crate) struct Binder<'a> {
    pub(crate) ck: &'a Checkpoint,
    /// The checkpoint's FP8 tile (`quantization_config.weight_block_size`):
    /// an `F8_E4M3` matrix `W` is then read with `W_scale_inv`.
    pub(crate) fp8_block: Option<[usize; 2]>,
}

impl<'a> Binder<'a> {
    /// A binder for float weights.
    pub(crate) fn new(ck: &'a Checkpoint) -> Self {
        Binder {
            ck,
            fp8_block: None,
        }
    }

    pub(crate) fn loc(&self, name: &str) -> Result<&TensorLoc> {
        self.ck
            .get(name)
            .ok_or_else(|| WeightsError::Missing(name.to_string()).into())
    }
    /// A matrix as stored: float, or FP8 with its `_scale_inv` tiles; or,
    /// where an int8 spine file is attached (`--spine int8`) and holds it,
    /// its int8 codes and row scales from there, the matrix a load would
    /// quantise it to.
    pub(crate) fn linear(&self, name: &str) -> Result<Linear> {
        if let Some(q) = self.ck.get(&int8_spine::q_name(name)) {
            return self.stored_int8(name, q).map_err(|e| naming(e, name));
        }
        let l = self.linear_as_stored(name).map_err(|e| naming(e, name))?;
        crate::int8_record::note(name, &l);
        Ok(l)
    }
    /// Matrix `name` from the int8 spine file (its shapes were checked
    /// when the file was attached).
    fn stored_int8(&self, name: &str, q: &TensorLoc) -> Result<Linear> {
        let scale = self.loc(&int8_spine::scale_name(name))?;
        let (rows, cols) = (q.shape[0], q.shape[1]);
        if let (Some(q), Some(scale)) = (
            Words::held_if_holding(self.ck, q)?,
            Words::held_if_holding(self.ck, scale)?,
        ) {
            let data = WeightData::Int8 { q, scale };
            return Ok(Linear { rows, cols, data });
        }
        let q: Vec<i8> = self.ck.read(q)?.into_iter().map(|b| b as i8).collect();
        let scale = fathom_weights::convert::to_f32(Dtype::F32, &self.ck.read(scale)?)
            .expect("f32 converts to f32");
        Ok(Linear {
            rows,
            cols,
            data: WeightData::Int8 {
                q: q.into(),
                scale: scale.into(),
            },
        })
    }
    fn linear_as_stored(&self, name: &str) -> Result<Linear> {
        let loc = self.loc(name)?;
        if loc.dtype != Dtype::F8_E4M3 {
            return Linear::load(self.ck, name, loc);
        }
        let block = self.fp8_block.ok_or_else(|| {
            ModelError::Tensor(format!(
                "{name}: F8_E4M3, but config.json declares no fp8 quantization_config"
            ))
        })?;
        let scale = format!("{name}_scale_inv");
        Linear::load_fp8(self.ck, (name, loc), (&scale, self.loc(&scale)?), block)
    }
    pub(crate) fn vector(&self, name: &str) -> Result<Vec<f32>> {
        load_vector(self.ck, name, self.loc(name)?).map_err(|e| naming(e, name))
    }
    /// `{prefix}gate_proj.weight`, `up_proj`, `down_proj`.
    pub(crate) fn mlp(&self, prefix: &str) -> Result<MlpWeights> {
        Ok(MlpWeights {
            gate_proj: self.linear(&format!("{prefix}gate_proj.weight"))?,
            up_proj: self.linear(&format!("{prefix}up_proj.weight"))?,
            down_proj: self.linear(&format!("{prefix}down_proj.weight"))?,
        })
    }
}

/// A read error of tensor `name` that names the tensor beside its file.
fn naming(e: ModelError, name: &str) -> ModelError {
    match e {
        ModelError::Weights(WeightsError::Io { path, err }) => {
            ModelError::Weights(WeightsError::BadTensor {
                path,
                tensor: name.to_string(),
                msg: err.to_string(),
            })
        }
        e => e,
    }
}

/// Fails with the list of problems (the first 20 shown), if any.
pub(crate) fn require_none(problems: &[String]) -> Result<()> {
    if problems.is_empty() {
        return Ok(());
    }
    let shown: Vec<_> = problems.iter().take(20).cloned().collect();
    let more = problems.len().saturating_sub(shown.len());
    let mut msg = shown.join("; ");
    if more > 0 {
        msg.push_str(&format!("; … and {more} more"));
    }
    Err(ModelError::Weights(WeightsError::Mismatch(msg)))
}
