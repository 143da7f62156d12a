//! A gated feed-forward block `down(act(gate(x), up(x)))` (dense layers,
//! shared experts), with the activation chosen by the family.

use crate::linear::Linear;

#[derive(Debug)]
pub struct MlpWeights {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl MlpWeights {
    /// `down(act(gate(x), up(x)))` over `x [T, D]`; `act(g, u)` writes the
    /// gated activation into `g`.
    pub fn forward(&self, x: &[f32], t: usize, act: impl FnOnce(&mut [f32], &[f32])) -> Vec<f32> {
        let [mut g, u] = Linear::forward_many([&self.gate_proj, &self.up_proj], x, t);
        act(&mut g, &u);
        self.down_proj.forward(&g, t)
    }

    /// Quantises the three matrices to per-row int8.
    pub fn quantize_int8(&mut self) {
        for l in [&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj] {
            l.quantize_int8();
        }
    }
}
