//! A gated feed-forward block `down(act(gate(x), up(x)))` (dense layers,
//! shared experts), with the activation chosen by the family.

use fathom_kernels::backend::{self, GluProduct, Role};
use fathom_kernels::ops::GluAct;

use crate::linear::Linear;

#[derive(Debug)]
pub struct MlpWeights {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl MlpWeights {
    /// `down(act(gate(x), up(x)))` over `x [T, D]`: through the backend
    /// seam as one gated product ([`backend::glu_batch_stable`]: a device
    /// may keep the activation on its side; the same bits).
    pub fn forward(&self, x: &[f32], t: usize, act: GluAct) -> Vec<f32> {
        let mut y = vec![0f32; t * self.down_proj.rows];
        let job = self.job(x, t, &mut y);
        backend::glu_batch_stable(&mut [job], act, &backend::Hints::default());
        y
    }

    /// The block over `x [T, D]` as one gated product of the seam, its
    /// output `y [T, D]`.
    pub fn job<'a, 'b>(&'a self, x: &'b [f32], t: usize, y: &'b mut [f32]) -> GluProduct<'a, 'b> {
        GluProduct {
            gate: self.gate_proj.as_mat(),
            up: self.up_proj.as_mat(),
            down: self.down_proj.as_mat(),
            role: Role::Spine,
            x,
            t,
            y,
        }
    }

    /// The block as a gated MLP of a [`fathom_kernels::backend::Then`], its output `y`.
    pub fn then_glu<'a>(&'a self, y: &'a mut [f32]) -> fathom_kernels::backend::ThenGlu<'a> {
        fathom_kernels::backend::ThenGlu {
            gate: self.gate_proj.as_mat(),
            up: self.up_proj.as_mat(),
            down: self.down_proj.as_mat(),
            y,
        }
    }

    /// Quantises the three matrices to per-row int8.
    pub fn quantize_int8(&mut self) {
        for l in [&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj] {
            l.quantize_int8();
        }
    }
}
