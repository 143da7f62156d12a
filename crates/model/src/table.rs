//! The pieces of a tensor table shared by the families whose tensors fall
//! in the plain roles (DeepSeek-V3 / Kimi K2, Kimi-Linear, Qwen3-MoE): what
//! a tensor is for, one expected tensor, and the sums the RAM ledger and
//! the model's description read from a table.

use crate::memory::{TensorBytes, table_sums};

/// What a tensor is for; residency follows from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Embedding,
    /// RMSNorm weights (layer norms, per-head norms, the final norm).
    Norm,
    /// Attention projections, their biases and parameters.
    Attention,
    /// The dense MLP of the layers without experts.
    DenseMlp,
    /// The router (and its score-correction bias).
    Router,
    SharedExpert,
    /// A routed expert's matrices.
    RoutedExpert,
    Head,
}

impl Role {
    /// Everything but the routed experts is the resident "spine".
    pub fn is_spine(self) -> bool {
        self != Role::RoutedExpert
    }

    /// Quantised by `--spine int8`: attention, dense-MLP, shared-expert
    /// and head matrices.
    pub fn int8(self) -> bool {
        matches!(
            self,
            Role::Attention | Role::DenseMlp | Role::SharedExpert | Role::Head
        )
    }
}

/// One expected tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    pub layer: Option<usize>,
}

impl TensorSpec {
    /// Bytes as released: bf16, but a router's score-correction bias in f32.
    pub fn bytes(&self) -> u64 {
        let per = if self.name.ends_with("e_score_correction_bias") {
            4
        } else {
            2
        };
        per * self.shape.iter().product::<usize>() as u64
    }
}

/// A table's `(layer, shape, bytes, role, may be int8)` entry as the
/// ledger sees it.
pub fn tensor_bytes<'a>(
    (layer, shape, bytes, role, may): (Option<usize>, &'a [usize], u64, Role, bool),
) -> TensorBytes<'a> {
    TensorBytes {
        layer,
        shape,
        bytes,
        embedding: role == Role::Embedding,
        head: role == Role::Head,
        routed_expert: role == Role::RoutedExpert,
        int8: role.int8() && may,
    }
}

/// (spine, spine after int8, embedding, routed experts) bytes of a table's
/// `(layer, shape, bytes, role, may be int8)` entries.
pub fn ledger<'a>(
    entries: impl Iterator<Item = (Option<usize>, &'a [usize], u64, Role, bool)>,
) -> [u64; 4] {
    table_sums(entries.map(tensor_bytes))
}

/// The resident spine's bytes of a table's `(role, bytes)` entries: the
/// embedding is a row lookup, counted only when `tied` to the head.
pub fn spine_bytes(entries: impl Iterator<Item = (Role, u64)>, tied: bool) -> u64 {
    entries
        .filter(|&(role, _)| role.is_spine() && (tied || role != Role::Embedding))
        .map(|(_, bytes)| bytes)
        .sum()
}

/// What [`bf16_experts`] locates: `experts` routed experts in each layer
/// of `moe_layers` (of `layers`), each of three bf16 matrices of `shapes`
/// named by `name(layer, expert, matrix)`, `top_k` chosen a token.
pub struct Bf16Experts<N: Fn(usize, usize, usize) -> String> {
    pub layers: usize,
    pub experts: usize,
    pub top_k: usize,
    pub shapes: [[usize; 2]; 3],
    pub name: N,
}

/// Locators of every routed expert of `ck` as `t` describes them.
pub fn bf16_experts<N: Fn(usize, usize, usize) -> String>(
    t: &Bf16Experts<N>,
    moe_layers: impl Iterator<Item = usize>,
    ck: &fathom_weights::Checkpoint,
) -> crate::error::Result<crate::experts::ExpertTable> {
    use crate::experts::{ExpertFormat, ExpertLoc, ExpertTable};
    let mut layers = vec![Vec::new(); t.layers];
    for l in moe_layers {
        let mut v = Vec::with_capacity(t.experts);
        for e in 0..t.experts {
            let get = |m: usize| {
                let n = (t.name)(l, e, m);
                ck.get(&n)
                    .cloned()
                    .ok_or(fathom_weights::WeightsError::Missing(n))
            };
            v.push(ExpertLoc {
                parts: [(get(0)?, None), (get(1)?, None), (get(2)?, None)],
                format: ExpertFormat::Bf16,
            });
        }
        layers[l] = v;
    }
    Ok(ExpertTable {
        layers,
        shapes: t.shapes,
        top_k: t.top_k,
        format: ExpertFormat::Bf16,
    })
}
