//! The DeepSeek-V3 / Kimi K2 tensor table: every tensor the checkpoint must
//! hold, its shape and role, derived from the spec; the loader's check
//! lists every missing, unexpected, mis-shaped or mis-typed tensor at once.
//! The multi-token-prediction layers (`model.layers.{num_hidden_layers}…`)
//! are allowed and left unread.

use fathom_weights::{Checkpoint, Dtype};

use super::config::{DeepseekV3Spec, FfnKind};
use crate::error::Result;
use crate::experts::{ExpertFormat, ExpertLoc, ExpertTable};

/// Name prefix of the decoder's tensors.
pub const PREFIX: &str = "model.";
pub const LM_HEAD: &str = "lm_head.weight";

/// What a tensor is for; residency follows from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Embedding,
    Norm,
    /// MLA projections and norms.
    Attention,
    /// The dense MLP of the first layers.
    DenseMlp,
    /// Router weight and score-correction bias.
    Router,
    SharedExpert,
    /// Routed expert `gate_proj`, `down_proj`, `up_proj`.
    RoutedExpert,
    Head,
}

impl Role {
    /// Everything but the routed experts is the resident "spine".
    pub fn is_spine(self) -> bool {
        self != Role::RoutedExpert
    }
}

/// An expert's matrices in the expert table's order (what
/// [`crate::moe::SigmoidMoe`] reads: gate, down, up).
pub const EXPERT_MATRICES: [&str; 3] = ["gate_proj", "down_proj", "up_proj"];

/// `[rows, cols]` of expert matrix `i` (gate, up: `[F, D]`; down: `[D, F]`).
pub fn expert_shape(spec: &DeepseekV3Spec, i: usize) -> [usize; 2] {
    let (f, d) = (spec.moe_intermediate_size, spec.hidden_size);
    if i == 1 { [d, f] } else { [f, d] }
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
    /// Bytes as released: bf16, but the router's score-correction bias in f32.
    pub fn bytes(&self) -> u64 {
        let per = if self.name.ends_with("e_score_correction_bias") {
            4
        } else {
            2
        };
        per * self.shape.iter().product::<usize>() as u64
    }
}

pub fn layer_name(i: usize, rest: &str) -> String {
    format!("{PREFIX}layers.{i}.{rest}")
}

/// Name of routed expert `e`'s matrix `m` (`"gate_proj"`, …) in layer `l`.
pub fn expert_name(l: usize, e: usize, m: &str) -> String {
    layer_name(l, &expert_rest(e, m))
}

fn expert_rest(e: usize, m: &str) -> String {
    format!("mlp.experts.{e}.{m}.weight")
}

fn attention_tensors(spec: &DeepseekV3Spec, l: &mut dyn FnMut(&str, Vec<usize>)) {
    let (d, h) = (spec.hidden_size, spec.num_heads);
    let q_rows = h * spec.qk_head_dim();
    match spec.q_lora_rank {
        Some(r) => {
            l("self_attn.q_a_proj.weight", vec![r, d]);
            l("self_attn.q_a_layernorm.weight", vec![r]);
            l("self_attn.q_b_proj.weight", vec![q_rows, r]);
        }
        None => l("self_attn.q_proj.weight", vec![q_rows, d]),
    }
    let lora = spec.kv_lora_rank;
    l(
        "self_attn.kv_a_proj_with_mqa.weight",
        vec![lora + spec.qk_rope_head_dim, d],
    );
    l("self_attn.kv_a_layernorm.weight", vec![lora]);
    let kvb = h * (spec.qk_nope_head_dim + spec.v_head_dim);
    l("self_attn.kv_b_proj.weight", vec![kvb, lora]);
    l("self_attn.o_proj.weight", vec![d, h * spec.v_head_dim]);
}

fn ffn_tensors(spec: &DeepseekV3Spec, i: usize, l: &mut dyn FnMut(&str, Vec<usize>, Role)) {
    let d = spec.hidden_size;
    let mut mlp = |prefix: &str, f: usize, role: Role| {
        l(&format!("{prefix}gate_proj.weight"), vec![f, d], role);
        l(&format!("{prefix}up_proj.weight"), vec![f, d], role);
        l(&format!("{prefix}down_proj.weight"), vec![d, f], role);
    };
    match spec.ffn_kind(i) {
        FfnKind::Dense => mlp("mlp.", spec.intermediate_size, Role::DenseMlp),
        FfnKind::Moe => {
            let sf = spec.n_shared_experts * spec.moe_intermediate_size;
            if sf > 0 {
                mlp("mlp.shared_experts.", sf, Role::SharedExpert);
            }
            let e = spec.n_routed_experts;
            l("mlp.gate.weight", vec![e, d], Role::Router);
            l("mlp.gate.e_score_correction_bias", vec![e], Role::Router);
            for x in 0..e {
                for (m, name) in EXPERT_MATRICES.iter().enumerate() {
                    let shape = expert_shape(spec, m).to_vec();
                    l(&expert_rest(x, name), shape, Role::RoutedExpert);
                }
            }
        }
    }
}

/// Every tensor of the checkpoint described by `spec` (the decoder's; not
/// the multi-token-prediction layers), in a stable order.
pub fn tensor_table(spec: &DeepseekV3Spec) -> Vec<TensorSpec> {
    let mut t = Vec::new();
    let (d, v) = (spec.hidden_size, spec.vocab_size);
    let mut push = |name: String, shape: Vec<usize>, role: Role, layer: Option<usize>| {
        t.push(TensorSpec {
            name,
            shape,
            role,
            layer,
        })
    };
    push(
        format!("{PREFIX}embed_tokens.weight"),
        vec![v, d],
        Role::Embedding,
        None,
    );
    for i in 0..spec.num_layers {
        for norm in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
            push(layer_name(i, norm), vec![d], Role::Norm, Some(i));
        }
        attention_tensors(spec, &mut |rest, shape| {
            push(layer_name(i, rest), shape, Role::Attention, Some(i))
        });
        ffn_tensors(spec, i, &mut |rest, shape, role| {
            push(layer_name(i, rest), shape, role, Some(i))
        });
    }
    push(format!("{PREFIX}norm.weight"), vec![d], Role::Norm, None);
    push(LM_HEAD.to_string(), vec![v, d], Role::Head, None);
    t
}

/// Whether `name` belongs to a multi-token-prediction layer the spec
/// declares (layer index `num_layers..num_layers + num_nextn_predict_layers`).
fn is_mtp(spec: &DeepseekV3Spec, name: &str) -> bool {
    let Some(rest) = name.strip_prefix(&format!("{PREFIX}layers.")) else {
        return false;
    };
    let idx = rest.split('.').next().and_then(|i| i.parse::<usize>().ok());
    idx.is_some_and(|i| i >= spec.num_layers && i < spec.num_layers + spec.num_nextn_predict_layers)
}

/// Every disagreement between the checkpoint and the spec, one line each.
/// Spine tensors may be stored in any float dtype; routed experts are read
/// as stored and must be bf16.
pub fn check_tensors(spec: &DeepseekV3Spec, ck: &Checkpoint) -> Vec<String> {
    let table = tensor_table(spec);
    let mut problems = Vec::new();
    let mut expected = std::collections::HashSet::with_capacity(table.len());
    for t in &table {
        expected.insert(t.name.as_str());
        let Some(loc) = ck.get(&t.name) else {
            problems.push(format!("missing tensor {}", t.name));
            continue;
        };
        if t.role == Role::RoutedExpert && loc.dtype != Dtype::BF16 {
            problems.push(format!(
                "tensor {}: dtype {:?}, expected BF16 (routed experts are read as stored)",
                t.name, loc.dtype
            ));
        } else if !crate::bind::is_float(loc.dtype) {
            problems.push(format!(
                "tensor {}: dtype {:?}, expected a float dtype",
                t.name, loc.dtype
            ));
        }
        if loc.shape != t.shape {
            problems.push(format!(
                "tensor {}: shape {:?}, expected {:?}",
                t.name, loc.shape, t.shape
            ));
        }
    }
    for (name, _) in ck.tensors() {
        if !expected.contains(name) && !is_mtp(spec, name) {
            problems.push(format!("unexpected tensor {name}"));
        }
    }
    problems
}

/// Locators of every routed expert (bf16 gate, down, up).
pub fn expert_table(spec: &DeepseekV3Spec, ck: &Checkpoint) -> Result<ExpertTable> {
    let mut layers = vec![Vec::new(); spec.num_layers];
    for l in spec.moe_layers() {
        let mut v = Vec::with_capacity(spec.n_routed_experts);
        for e in 0..spec.n_routed_experts {
            let get = |m: &str| {
                let n = expert_name(l, e, m);
                ck.get(&n)
                    .cloned()
                    .ok_or(fathom_weights::WeightsError::Missing(n))
            };
            v.push(ExpertLoc {
                parts: [
                    (get(EXPERT_MATRICES[0])?, None),
                    (get(EXPERT_MATRICES[1])?, None),
                    (get(EXPERT_MATRICES[2])?, None),
                ],
                format: ExpertFormat::Bf16,
            });
        }
        layers[l] = v;
    }
    Ok(ExpertTable {
        layers,
        shapes: [0, 1, 2].map(|i| expert_shape(spec, i)),
        top_k: spec.top_k,
        format: ExpertFormat::Bf16,
    })
}
