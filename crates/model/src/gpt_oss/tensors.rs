//! The GPT-OSS tensor table: every tensor the checkpoint must hold, its
//! shape and role, derived from the spec; the loader's check lists every
//! missing, unexpected, mis-shaped or mis-typed tensor at once.
//!
//! The routed experts are stacked per layer: `mlp.experts.gate_up_proj
//! [E, D, 2F]` (gate and up interleaved along the last axis), `down_proj
//! [E, F, D]` (both input-major, applied as `x·W`) and their biases
//! `[E, 2F]`, `[E, D]`; expert `e` is the `e`-th slice of each, which the
//! expert table locates without reading anything.
//!
//! The released checkpoint (`quant_method` `mxfp4`) stores each matrix as
//! `_blocks` (U8 `[E, out, in/32, 16]`, two E2M1 codes a byte, low nibble
//! first) and `_scales` (U8 `[E, out, in/32]`, E8M0): output-major, the
//! transpose of the bf16 layout (`gate_up_proj [E, D, 2F]` holds what
//! `gate_up_proj_blocks [E, 2F, D/32, 16]` does, gate and up interleaved
//! along 2F alike); the biases stay bf16.

use fathom_weights::{Checkpoint, Dtype, TensorLoc};

use super::config::GptOssSpec;
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
    /// q, k, v, o projections and biases, sinks.
    Attention,
    /// Router weight and bias.
    Router,
    /// The stacked routed experts and their biases.
    RoutedExpert,
    Head,
}

impl Role {
    /// Everything but the routed experts is the resident "spine".
    pub fn is_spine(self) -> bool {
        self != Role::RoutedExpert
    }
}

/// One expected tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    pub layer: Option<usize>,
    /// `Some(U8)` for MXFP4 blocks and scales; `None` for float tensors.
    pub dtype: Option<Dtype>,
}

impl TensorSpec {
    /// Bytes as stored (floats counted as bf16).
    pub fn bytes(&self) -> u64 {
        let n = self.shape.iter().product::<usize>() as u64;
        if self.dtype == Some(Dtype::U8) {
            n
        } else {
            2 * n
        }
    }
}

pub fn layer_name(i: usize, rest: &str) -> String {
    format!("{PREFIX}layers.{i}.{rest}")
}

/// The stacked expert tensors, in the expert table's order: each matrix
/// with its bias.
pub const EXPERT_TENSORS: [(&str, &str); 2] = [
    ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"),
    ("mlp.experts.down_proj", "mlp.experts.down_proj_bias"),
];

/// Stored `[in, out]` of expert matrix `i` (gate_up: `[D, 2F]`; down:
/// `[F, D]`; the table's third matrix is absent: `[0, 0]`) in bf16, or
/// `[out, in]` when the experts are MXFP4.
pub fn expert_shape(spec: &GptOssSpec, i: usize) -> [usize; 2] {
    let (f, d) = (spec.intermediate_size, spec.hidden_size);
    let [ins, outs] = match i {
        0 => [d, 2 * f],
        1 => [f, d],
        _ => return [0, 0],
    };
    if spec.mxfp4_experts() {
        [outs, ins]
    } else {
        [ins, outs]
    }
}

fn attention_tensors(spec: &GptOssSpec, l: &mut dyn FnMut(&str, Vec<usize>)) {
    let (d, hd) = (spec.hidden_size, spec.head_dim);
    let (q, kv) = (spec.num_heads * hd, spec.num_kv_heads * hd);
    for (name, rows, cols) in [("q", q, d), ("k", kv, d), ("v", kv, d), ("o", d, q)] {
        l(&format!("self_attn.{name}_proj.weight"), vec![rows, cols]);
        if spec.attention_bias {
            l(&format!("self_attn.{name}_proj.bias"), vec![rows]);
        }
    }
    l("self_attn.sinks", vec![spec.num_heads]);
}

/// Every tensor of the checkpoint described by `spec`, in a stable order.
pub fn tensor_table(spec: &GptOssSpec) -> Vec<TensorSpec> {
    let mut t = Vec::new();
    let (d, v, e) = (spec.hidden_size, spec.vocab_size, spec.num_experts);
    let mut push = |name: String, shape: Vec<usize>, role: Role, layer: Option<usize>| {
        // MXFP4 blocks and scales are bytes; everything else a float.
        let packed = name.ends_with("_blocks") || name.ends_with("_scales");
        t.push(TensorSpec {
            name,
            shape,
            role,
            layer,
            dtype: packed.then_some(Dtype::U8),
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
        push(
            layer_name(i, "mlp.router.weight"),
            vec![e, d],
            Role::Router,
            Some(i),
        );
        push(
            layer_name(i, "mlp.router.bias"),
            vec![e],
            Role::Router,
            Some(i),
        );
        for (m, (w, b)) in EXPERT_TENSORS.iter().enumerate() {
            let (n, ex) = (layer_name(i, w), Role::RoutedExpert);
            if spec.mxfp4_experts() {
                let [outs, ins] = expert_shape(spec, m);
                push(
                    format!("{n}_blocks"),
                    vec![e, outs, ins / 32, 16],
                    ex,
                    Some(i),
                );
                push(format!("{n}_scales"), vec![e, outs, ins / 32], ex, Some(i));
                push(layer_name(i, b), vec![e, outs], ex, Some(i));
            } else {
                let [ins, outs] = expert_shape(spec, m);
                push(n, vec![e, ins, outs], ex, Some(i));
                push(layer_name(i, b), vec![e, outs], ex, Some(i));
            }
        }
    }
    push(format!("{PREFIX}norm.weight"), vec![d], Role::Norm, None);
    push(LM_HEAD.to_string(), vec![v, d], Role::Head, None);
    t
}

/// Every disagreement between the checkpoint and the spec, one line each.
/// Spine tensors may be stored in any float dtype; the routed experts and
/// their biases are read as stored and must be bf16 (MXFP4 blocks and
/// scales: U8).
pub fn check_tensors(spec: &GptOssSpec, ck: &Checkpoint) -> Vec<String> {
    let table = tensor_table(spec);
    let mut problems = Vec::new();
    let mut expected = std::collections::HashSet::with_capacity(table.len());
    for t in &table {
        expected.insert(t.name.as_str());
        let Some(loc) = ck.get(&t.name) else {
            problems.push(format!("missing tensor {}", t.name));
            continue;
        };
        if let Some(want) = t.dtype {
            if loc.dtype != want {
                problems.push(format!(
                    "tensor {}: dtype {:?}, expected {want:?} (MXFP4 experts)",
                    t.name, loc.dtype
                ));
            }
        } else if t.role == Role::RoutedExpert && loc.dtype != Dtype::BF16 {
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
        if !expected.contains(name) {
            problems.push(format!("unexpected tensor {name}"));
        }
    }
    problems
}

/// Expert `e`'s slice of a stacked tensor `[E, …]`.
fn slice(loc: &TensorLoc, e: usize, experts: usize) -> TensorLoc {
    let per = loc.len / experts as u64;
    TensorLoc {
        shard: loc.shard,
        offset: loc.offset + e as u64 * per,
        len: per,
        dtype: loc.dtype,
        shape: loc.shape[1..].to_vec(),
    }
}

/// Locators of every routed expert: slices of the stacked tensors (bf16,
/// input-major, each matrix with its bias; or MXFP4 blocks with their
/// scales, the biases in the third slot).
pub fn expert_table(spec: &GptOssSpec, ck: &Checkpoint) -> Result<ExpertTable> {
    let n = spec.num_experts;
    let mxfp4 = spec.mxfp4_experts();
    let format = if mxfp4 {
        ExpertFormat::Mxfp4Bias
    } else {
        ExpertFormat::Bf16InputMajorBias
    };
    let mut layers = vec![Vec::new(); spec.num_layers];
    for (l, layer) in layers.iter_mut().enumerate() {
        let get = |name: &str| {
            let full = layer_name(l, name);
            ck.get(&full)
                .cloned()
                .ok_or(fathom_weights::WeightsError::Missing(full))
        };
        let [(gu, gub), (dn, dnb)] = EXPERT_TENSORS;
        let (gub, dnb) = (get(gub)?, get(dnb)?);
        *layer = if mxfp4 {
            let [gu_b, gu_s, dn_b, dn_s] = [
                get(&format!("{gu}_blocks"))?,
                get(&format!("{gu}_scales"))?,
                get(&format!("{dn}_blocks"))?,
                get(&format!("{dn}_scales"))?,
            ];
            (0..n)
                .map(|e| ExpertLoc {
                    parts: [
                        (slice(&gu_b, e, n), Some(slice(&gu_s, e, n))),
                        (slice(&dn_b, e, n), Some(slice(&dn_s, e, n))),
                        (slice(&gub, e, n), Some(slice(&dnb, e, n))),
                    ],
                    format,
                })
                .collect()
        } else {
            let (gu, dn) = (get(gu)?, get(dn)?);
            (0..n)
                .map(|e| ExpertLoc {
                    parts: [
                        (slice(&gu, e, n), Some(slice(&gub, e, n))),
                        (slice(&dn, e, n), Some(slice(&dnb, e, n))),
                        (ExpertLoc::absent(gu.shard), None),
                    ],
                    format,
                })
                .collect()
        };
    }
    Ok(ExpertTable {
        layers,
        shapes: [0, 1, 2].map(|i| expert_shape(spec, i)),
        top_k: spec.top_k,
        format,
    })
}
