//! The Qwen3-MoE tensor table: every tensor the checkpoint must hold, its
//! shape and role, derived from the spec. One table serves the loader's
//! check (missing, unexpected, mis-shaped, mis-typed tensors, all listed at
//! once), the resident-bytes count and the expert table.

use fathom_weights::{Checkpoint, Dtype};

use super::config::{FfnKind, Qwen3MoeSpec};
use crate::error::Result;
use crate::experts::ExpertTable;

/// Name prefix of the decoder's tensors.
pub const PREFIX: &str = "model.";
/// The output head (absent when tied to the embedding).
pub const LM_HEAD: &str = "lm_head.weight";

/// What a tensor is for; residency follows from it.
pub use crate::table::Role;

/// An expert's three matrices, in the expert table's order.
pub const EXPERT_MATRICES: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// `[rows, cols]` of expert matrix `i` (gate, up: `[F, D]`; down: `[D, F]`).
pub fn expert_shape(spec: &Qwen3MoeSpec, i: usize) -> [usize; 2] {
    let (f, d) = (spec.moe_intermediate_size, spec.hidden_size);
    if i == 2 { [d, f] } else { [f, d] }
}

/// One expected tensor.
pub use crate::table::TensorSpec;

/// Name of layer `i`'s tensor `rest` (e.g. `"self_attn.q_proj.weight"`).
pub fn layer_name(i: usize, rest: &str) -> String {
    format!("{PREFIX}layers.{i}.{rest}")
}

/// Name of routed expert `e`'s matrix `m` (`"gate_proj"`, …) in layer `l`.
pub fn expert_name(l: usize, e: usize, m: &str) -> String {
    layer_name(l, &format!("mlp.experts.{e}.{m}.weight"))
}

/// Every tensor of the checkpoint described by `spec`, in a stable order.
pub fn tensor_table(spec: &Qwen3MoeSpec) -> Vec<TensorSpec> {
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
    let (q, kv, hd) = (
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.head_dim,
    );
    for i in 0..spec.num_layers {
        let mut l = |rest: &str, shape: Vec<usize>, role: Role| {
            push(layer_name(i, rest), shape, role, Some(i))
        };
        l("input_layernorm.weight", vec![d], Role::Norm);
        l("post_attention_layernorm.weight", vec![d], Role::Norm);
        let a = Role::Attention;
        for (p, rows, cols) in [("q", q, d), ("k", kv, d), ("v", kv, d), ("o", d, q)] {
            l(&format!("self_attn.{p}_proj.weight"), vec![rows, cols], a);
            if spec.attention_bias {
                l(&format!("self_attn.{p}_proj.bias"), vec![rows], a);
            }
        }
        l("self_attn.q_norm.weight", vec![hd], Role::Norm);
        l("self_attn.k_norm.weight", vec![hd], Role::Norm);
        match spec.ffn_kind(i) {
            FfnKind::Dense => {
                let f = spec.intermediate_size;
                l("mlp.gate_proj.weight", vec![f, d], Role::DenseMlp);
                l("mlp.up_proj.weight", vec![f, d], Role::DenseMlp);
                l("mlp.down_proj.weight", vec![d, f], Role::DenseMlp);
            }
            FfnKind::Moe => {
                l("mlp.gate.weight", vec![spec.num_experts, d], Role::Router);
                for e in 0..spec.num_experts {
                    for (m, name) in EXPERT_MATRICES.iter().enumerate() {
                        let shape = expert_shape(spec, m).to_vec();
                        push(expert_name(i, e, name), shape, Role::RoutedExpert, Some(i));
                    }
                }
            }
        }
    }
    push(format!("{PREFIX}norm.weight"), vec![d], Role::Norm, None);
    if !spec.tie_word_embeddings {
        push(LM_HEAD.to_string(), vec![v, d], Role::Head, None);
    }
    t
}

/// Every disagreement between the checkpoint and the spec, one line each.
/// Float tensors may be stored in any float dtype, except routed experts,
/// which are read as stored and must be bf16.
pub fn check_tensors(spec: &Qwen3MoeSpec, ck: &Checkpoint) -> Vec<String> {
    let table = tensor_table(spec);
    let mut problems = Vec::new();
    let mut expected = std::collections::HashSet::with_capacity(table.len());
    for t in &table {
        expected.insert(t.name.as_str());
        let Some(loc) = ck.get(&t.name) else {
            problems.push(format!("missing tensor {}", t.name));
            continue;
        };
        let dtype_ok = if t.role == Role::RoutedExpert {
            loc.dtype == Dtype::BF16
        } else {
            crate::bind::is_float(loc.dtype)
        };
        if !dtype_ok {
            let want = if t.role == Role::RoutedExpert {
                "BF16 (routed experts are read as stored)"
            } else {
                "a float dtype"
            };
            problems.push(format!(
                "tensor {}: dtype {:?}, expected {want}",
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
        // A tied head may still be stored; rotary tables are recomputed.
        let ignorable =
            (name == LM_HEAD && spec.tie_word_embeddings) || name.ends_with("rotary_emb.inv_freq");
        if !expected.contains(name) && !ignorable {
            problems.push(format!("unexpected tensor {name}"));
        }
    }
    problems
}

/// Locators of every routed expert (bf16 gate, up, down).
pub fn expert_table(spec: &Qwen3MoeSpec, ck: &Checkpoint) -> Result<ExpertTable> {
    let t = crate::table::Bf16Experts {
        layers: spec.num_layers,
        experts: spec.num_experts,
        top_k: spec.top_k,
        shapes: [0, 1, 2].map(|i| expert_shape(spec, i)),
        name: |l, e, m| expert_name(l, e, EXPERT_MATRICES[m]),
    };
    crate::table::bf16_experts(&t, spec.moe_layers(), ck)
}
