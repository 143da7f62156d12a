//! The Kimi-Linear tensor table: every tensor the checkpoint must hold, its
//! shape and role, derived from the spec; the loader's check lists every
//! missing, unexpected, mis-shaped or mis-typed tensor at once.

use fathom_weights::{Checkpoint, Dtype};

use super::config::{FfnKind, KimiLinearSpec};
use crate::error::Result;
use crate::experts::ExpertTable;
use crate::hybrid::AttnKind;

/// Name prefix of the decoder's tensors.
pub const PREFIX: &str = "model.";
pub const LM_HEAD: &str = "lm_head.weight";

/// What a tensor is for; residency follows from it.
pub use crate::table::Role;

/// An expert's matrices in the expert table's order: w1 (gate), w2 (down), w3 (up).
pub const EXPERT_MATRICES: [&str; 3] = ["w1", "w2", "w3"];

/// `[rows, cols]` of expert matrix `i` (w1, w3: `[F, D]`; w2: `[D, F]`).
pub fn expert_shape(spec: &KimiLinearSpec, i: usize) -> [usize; 2] {
    let (f, d) = (spec.moe_intermediate_size, spec.hidden_size);
    if i == 1 { [d, f] } else { [f, d] }
}

/// One expected tensor.
pub use crate::table::TensorSpec;

pub fn layer_name(i: usize, rest: &str) -> String {
    format!("{PREFIX}layers.{i}.{rest}")
}

/// Name of routed expert `e`'s matrix `m` (`"w1"`, …) in layer `l`.
pub fn expert_name(l: usize, e: usize, m: &str) -> String {
    layer_name(l, &expert_rest(e, m))
}

fn expert_rest(e: usize, m: &str) -> String {
    format!("block_sparse_moe.experts.{e}.{m}.weight")
}

fn attention_tensors(spec: &KimiLinearSpec, i: usize, l: &mut dyn FnMut(&str, Vec<usize>)) {
    let d = spec.hidden_size;
    match spec.attn_kinds[i] {
        AttnKind::Kda => {
            let (p, k, h) = (spec.kda_width(), spec.kda_head_dim, spec.kda_heads);
            for n in ["q", "k", "v"] {
                l(&format!("self_attn.{n}_proj.weight"), vec![p, d]);
                l(
                    &format!("self_attn.{n}_conv1d.weight"),
                    vec![p, 1, spec.conv_kernel],
                );
            }
            l("self_attn.f_a_proj.weight", vec![k, d]);
            l("self_attn.f_b_proj.weight", vec![p, k]);
            l("self_attn.g_a_proj.weight", vec![k, d]);
            l("self_attn.g_b_proj.weight", vec![p, k]);
            // Stored [1, 1, H, 1]; any shape of H values is read.
            l("self_attn.A_log", vec![1, 1, h, 1]);
            l("self_attn.dt_bias", vec![p]);
            l("self_attn.b_proj.weight", vec![h, d]);
            l("self_attn.o_norm.weight", vec![k]);
            l("self_attn.o_proj.weight", vec![d, p]);
        }
        AttnKind::Mla => {
            let (h, m) = (spec.mla_heads, spec.mla_dims());
            l("self_attn.q_proj.weight", vec![h * m.qk_head_dim(), d]);
            l(
                "self_attn.kv_a_proj_with_mqa.weight",
                vec![m.cache_width(), d],
            );
            l("self_attn.kv_a_layernorm.weight", vec![m.kv_lora_rank]);
            let kvb = h * (m.qk_nope_head_dim + m.v_head_dim);
            l("self_attn.kv_b_proj.weight", vec![kvb, m.kv_lora_rank]);
            l("self_attn.o_proj.weight", vec![d, h * m.v_head_dim]);
        }
    }
}

fn ffn_tensors(spec: &KimiLinearSpec, i: usize, l: &mut dyn FnMut(&str, Vec<usize>, Role)) {
    let d = spec.hidden_size;
    match spec.ffn_kind(i) {
        FfnKind::Dense => {
            let f = spec.intermediate_size;
            l("mlp.gate_proj.weight", vec![f, d], Role::DenseMlp);
            l("mlp.up_proj.weight", vec![f, d], Role::DenseMlp);
            l("mlp.down_proj.weight", vec![d, f], Role::DenseMlp);
        }
        FfnKind::Moe => {
            let e = spec.num_experts;
            l("block_sparse_moe.gate.weight", vec![e, d], Role::Router);
            l(
                "block_sparse_moe.gate.e_score_correction_bias",
                vec![e],
                Role::Router,
            );
            let sf = spec.num_shared_experts * spec.moe_intermediate_size;
            if sf > 0 {
                let r = Role::SharedExpert;
                l(
                    "block_sparse_moe.shared_experts.gate_proj.weight",
                    vec![sf, d],
                    r,
                );
                l(
                    "block_sparse_moe.shared_experts.up_proj.weight",
                    vec![sf, d],
                    r,
                );
                l(
                    "block_sparse_moe.shared_experts.down_proj.weight",
                    vec![d, sf],
                    r,
                );
            }
            for x in 0..e {
                for (m, name) in EXPERT_MATRICES.iter().enumerate() {
                    let shape = expert_shape(spec, m).to_vec();
                    l(&expert_rest(x, name), shape, Role::RoutedExpert);
                }
            }
        }
    }
}

/// Every tensor of the checkpoint described by `spec`, in a stable order.
pub fn tensor_table(spec: &KimiLinearSpec) -> Vec<TensorSpec> {
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
        push(
            layer_name(i, "input_layernorm.weight"),
            vec![d],
            Role::Norm,
            Some(i),
        );
        push(
            layer_name(i, "post_attention_layernorm.weight"),
            vec![d],
            Role::Norm,
            Some(i),
        );
        attention_tensors(spec, i, &mut |rest, shape| {
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

/// Every disagreement between the checkpoint and the spec, one line each.
/// Spine tensors may be stored in any float dtype; routed experts are read
/// as stored and must be bf16; `A_log` may have any shape of `num_heads`
/// values.
pub fn check_tensors(spec: &KimiLinearSpec, ck: &Checkpoint) -> Vec<String> {
    let table = tensor_table(spec);
    let mut problems = Vec::new();
    let mut expected = std::collections::HashSet::with_capacity(table.len());
    for t in &table {
        expected.insert(t.name.as_str());
        let Some(loc) = ck.get(&t.name) else {
            problems.push(format!("missing tensor {}", t.name));
            continue;
        };
        let expert = t.role == Role::RoutedExpert;
        if expert && loc.dtype != Dtype::BF16 {
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
        let shape_ok = if t.name.ends_with(".A_log") {
            loc.numel() == spec.kda_heads
        } else {
            loc.shape == t.shape
        };
        if !shape_ok {
            problems.push(format!(
                "tensor {}: shape {:?}, expected {:?}",
                t.name, loc.shape, t.shape
            ));
        }
    }
    for (name, _) in ck.tensors() {
        if !expected.contains(name) {
            problems.push(format!("unexpected tensor {name}"));
        }
    }
    problems
}

/// Locators of every routed expert (bf16 w1, w2, w3).
pub fn expert_table(spec: &KimiLinearSpec, ck: &Checkpoint) -> Result<ExpertTable> {
    let t = crate::table::Bf16Experts {
        layers: spec.num_layers,
        experts: spec.num_experts,
        top_k: spec.top_k,
        shapes: [0, 1, 2].map(|i| expert_shape(spec, i)),
        name: |l, e, m| expert_name(l, e, EXPERT_MATRICES[m]),
    };
    crate::table::bf16_experts(&t, spec.moe_layers(), ck)
}
