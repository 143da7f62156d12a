//! The DeepSeek-V3 / Kimi K2 tensor table: every tensor the checkpoint must
//! hold, its shape and role, derived from the spec; the loader's check
//! lists every missing, unexpected, mis-shaped or mis-typed tensor at once.
//! The multi-token-prediction layers (`model.layers.{num_hidden_layers}…`)
//! are allowed and left unread.
//!
//! Quantized checkpoints as released: with `fp8`, a linear weight `W` may
//! be `F8_E4M3` beside `W_scale_inv` (its dtype decides); with
//! `pack-quantized`, a routed expert's `W` is `weight_packed`,
//! `weight_scale` and `weight_shape` instead, unless `ignore` keeps it
//! float. Routed experts share one format.

use fathom_weights::{Checkpoint, Dtype, TensorLoc};

use super::config::{DeepseekV3Spec, FfnKind};
use crate::error::{ModelError, Result};
use crate::experts::{ExpertFormat, ExpertLoc, ExpertTable};
use crate::quant::{Int4Modules, Quant};

/// Name prefix of the decoder's tensors.
pub const PREFIX: &str = "model.";
pub const LM_HEAD: &str = "lm_head.weight";

/// What a tensor is for; residency follows from it.
pub use crate::table::Role;

/// An expert's matrices in the expert table's order (what
/// [`crate::moe::SigmoidMoe`] reads: gate, down, up).
pub const EXPERT_MATRICES: [&str; 3] = ["gate_proj", "down_proj", "up_proj"];

/// `[rows, cols]` of expert matrix `i` (gate, up: `[F, D]`; down: `[D, F]`).
pub fn expert_shape(spec: &DeepseekV3Spec, i: usize) -> [usize; 2] {
    let (f, d) = (spec.moe_intermediate_size, spec.hidden_size);
    if i == 1 { [d, f] } else { [f, d] }
}

/// How a matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// bf16 (or another float dtype).
    Float,
    /// E4M3 with f32 tile scales (`_scale_inv`).
    Fp8 { block: [usize; 2] },
    /// pack-quantized INT4 with bf16 group scales.
    Int4 { group: usize },
}

/// One expected tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    pub layer: Option<usize>,
    /// As the config says the release stores it (an FP8 checkpoint may
    /// still keep a matrix float: its dtype decides).
    pub storage: Storage,
}

impl TensorSpec {
    /// Bytes as stored (floats as bf16, the router's score-correction bias
    /// as f32), scales included.
    pub fn bytes(&self) -> u64 {
        let n = self.shape.iter().product::<usize>() as u64;
        match (self.storage, &self.shape[..]) {
            (Storage::Fp8 { block }, &[r, c]) => {
                n + 4 * (r.div_ceil(block[0]) * c.div_ceil(block[1])) as u64
            }
            // (`weight_shape`'s 8 bytes are not read with the expert.)
            (Storage::Int4 { group }, _) => n / 2 + 2 * n / group as u64,
            _ if self.name.ends_with("e_score_correction_bias") => 4 * n,
            _ => 2 * n,
        }
    }

    /// The linear module's name (`….weight` without the suffix).
    pub fn module(&self) -> &str {
        self.name.strip_suffix(".weight").unwrap_or(&self.name)
    }

    /// The tensors a release of this storage holds for this one, as
    /// `(name, dtype, shape)`: a float tensor in bf16 (the score-correction
    /// bias in f32); an FP8 matrix as `F8_E4M3` codes beside its f32
    /// `_scale_inv` tiles; an INT4 module as `weight_packed`,
    /// `weight_scale` and `weight_shape`. [`check_tensors`] accepts these
    /// (and float variants); synthetic checkpoints are written from them.
    pub fn stored_parts(&self) -> Vec<(String, Dtype, Vec<usize>)> {
        match (self.storage, &self.shape[..]) {
            (Storage::Fp8 { block: [br, bc] }, &[r, c]) => vec![
                (self.name.clone(), Dtype::F8_E4M3, self.shape.clone()),
                (
                    format!("{}_scale_inv", self.name),
                    Dtype::F32,
                    vec![r.div_ceil(br), c.div_ceil(bc)],
                ),
            ],
            (Storage::Int4 { group }, &[r, c]) => {
                let m = self.module();
                vec![
                    (format!("{m}.weight_packed"), Dtype::I32, vec![r, c / 8]),
                    (format!("{m}.weight_scale"), Dtype::BF16, vec![r, c / group]),
                    (format!("{m}.weight_shape"), Dtype::I32, vec![2]),
                ]
            }
            _ if self.name.ends_with("e_score_correction_bias") => {
                vec![(self.name.clone(), Dtype::F32, self.shape.clone())]
            }
            _ => vec![(self.name.clone(), Dtype::BF16, self.shape.clone())],
        }
    }
}

/// Whether a role's matrices are linear modules a quantized release may store quantized.
fn quantizable(role: Role, shape: &[usize]) -> bool {
    shape.len() == 2
        && matches!(
            role,
            Role::Attention | Role::DenseMlp | Role::SharedExpert | Role::RoutedExpert
        )
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
    let (d, v) = (spec.hidden_size, spec.vocab_size);
    let mut t = Vec::new();
    let mut push = pusher(spec, &mut t);
    push(
        format!("{PREFIX}embed_tokens.weight"),
        vec![v, d],
        Role::Embedding,
        None,
    );
    for i in 0..spec.num_layers {
        decoder_layer(spec, i, &mut push);
    }
    push(format!("{PREFIX}norm.weight"), vec![d], Role::Norm, None);
    push(LM_HEAD.to_string(), vec![v, d], Role::Head, None);
    drop(push);
    t
}

/// The tensors of the first multi-token-prediction layer (index
/// `num_layers`) that its drafter reads: a decoder layer plus `enorm`,
/// `hnorm`, `eh_proj` and the shared head's norm and matrix (its copy of the
/// embedding is not read: the decoder's serves). Empty when the config
/// declares none.
pub fn mtp_tensor_table(spec: &DeepseekV3Spec) -> Vec<TensorSpec> {
    let mut t = Vec::new();
    if spec.num_nextn_predict_layers == 0 {
        return t;
    }
    let (d, v, l) = (spec.hidden_size, spec.vocab_size, spec.num_layers);
    let mut push = pusher(spec, &mut t);
    for norm in ["enorm.weight", "hnorm.weight", "shared_head.norm.weight"] {
        push(layer_name(l, norm), vec![d], Role::Norm, Some(l));
    }
    push(
        layer_name(l, "eh_proj.weight"),
        vec![d, 2 * d],
        Role::Attention,
        Some(l),
    );
    push(
        layer_name(l, "shared_head.head.weight"),
        vec![v, d],
        Role::Head,
        Some(l),
    );
    decoder_layer(spec, l, &mut push);
    drop(push);
    t
}

type Push<'a> = Box<dyn FnMut(String, Vec<usize>, Role, Option<usize>) + 'a>;

/// Appends a tensor to `t` with the storage the config gives its module.
fn pusher<'a>(spec: &'a DeepseekV3Spec, t: &'a mut Vec<TensorSpec>) -> Push<'a> {
    let int4 = match &spec.quant {
        Quant::PackedInt4 {
            group,
            targets,
            ignore,
        } => Some((*group, Int4Modules::new(targets, ignore))),
        _ => None,
    };
    Box::new(move |name, shape, role, layer| {
        let mut storage = Storage::Float;
        if quantizable(role, &shape) {
            if let Some(block) = spec.fp8_block() {
                storage = Storage::Fp8 { block };
            }
            if let Some((group, m)) = &int4
                && m.quantized(name.strip_suffix(".weight").unwrap_or(&name))
            {
                storage = Storage::Int4 { group: *group };
            }
        }
        t.push(TensorSpec {
            name,
            shape,
            role,
            layer,
            storage,
        })
    })
}

/// Decoder layer `i`'s norms, attention and feed-forward tensors.
fn decoder_layer(spec: &DeepseekV3Spec, i: usize, push: &mut Push<'_>) {
    let d = spec.hidden_size;
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
/// Spine tensors may be stored in any float dtype, matrices also as FP8
/// when the config says so; routed experts are read as stored: bf16, f32,
/// FP8 or pack-quantized INT4.
pub fn check_tensors(spec: &DeepseekV3Spec, ck: &Checkpoint) -> Vec<String> {
    let mut problems = Vec::new();
    let expected = check_table(ck, &tensor_table(spec), &mut problems);
    for (name, _) in ck.tensors() {
        if !expected.contains(name) && !is_mtp(spec, name) {
            problems.push(format!("unexpected tensor {name}"));
        }
    }
    problems
}

/// [`check_tensors`] for the multi-token-prediction layer a drafter reads.
pub fn check_mtp_tensors(spec: &DeepseekV3Spec, ck: &Checkpoint) -> Vec<String> {
    let mut problems = Vec::new();
    check_table(ck, &mtp_tensor_table(spec), &mut problems);
    problems
}

/// Checks every tensor of `table`; returns the names it accounts for.
fn check_table(
    ck: &Checkpoint,
    table: &[TensorSpec],
    problems: &mut Vec<String>,
) -> std::collections::HashSet<String> {
    let mut expected = std::collections::HashSet::with_capacity(table.len());
    for t in table {
        const FLOAT: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];
        if let Storage::Int4 { group } = t.storage {
            let (m, c) = (t.module(), t.shape[1]);
            if t.role != Role::RoutedExpert {
                expected.insert(t.name.clone());
                problems.push(format!(
                    "module {m}: quantization_config (targets, ignore) makes it pack-quantized, \
                     but only routed experts are read pack-quantized"
                ));
                continue;
            }
            if !c.is_multiple_of(group) {
                expected.insert(t.name.clone());
                problems.push(format!(
                    "module {m}: {c} inputs are not a multiple of group_size {group}"
                ));
                continue;
            }
            for (name, dtype, shape) in t.stored_parts() {
                expect_tensor(ck, problems, (&name, &[dtype], &shape));
                expected.insert(name);
            }
            continue;
        }
        let dtypes: &[Dtype] = match (t.role, t.storage) {
            (Role::RoutedExpert, Storage::Fp8 { .. }) => &[Dtype::BF16, Dtype::F32, Dtype::F8_E4M3],
            (Role::RoutedExpert, _) => &[Dtype::BF16, Dtype::F32],
            (_, Storage::Fp8 { .. }) => &[Dtype::BF16, Dtype::F16, Dtype::F32, Dtype::F8_E4M3],
            _ => &FLOAT,
        };
        expect_tensor(ck, problems, (&t.name, dtypes, &t.shape));
        expected.insert(t.name.clone());
        let fp8 = ck.get(&t.name).is_some_and(|l| l.dtype == Dtype::F8_E4M3);
        if let (Storage::Fp8 { .. }, true) = (t.storage, fp8) {
            let (name, _, grid) = t.stored_parts().swap_remove(1);
            let scale: &[Dtype] = if t.role == Role::RoutedExpert {
                &[Dtype::F32]
            } else {
                &FLOAT
            };
            expect_tensor(ck, problems, (&name, scale, &grid));
            expected.insert(name);
        }
    }
    expected
}

/// Notes a missing, mis-typed or mis-shaped tensor.
fn expect_tensor(
    ck: &Checkpoint,
    problems: &mut Vec<String>,
    (name, dtypes, shape): (&str, &[Dtype], &[usize]),
) {
    let Some(loc) = ck.get(name) else {
        problems.push(format!("missing tensor {name}"));
        return;
    };
    if !dtypes.contains(&loc.dtype) {
        problems.push(format!(
            "tensor {name}: dtype {:?}, expected {}",
            loc.dtype,
            dtypes
                .iter()
                .map(|d| format!("{d:?}"))
                .collect::<Vec<_>>()
                .join(" or ")
        ));
    }
    if loc.shape != shape {
        problems.push(format!(
            "tensor {name}: shape {:?}, expected {shape:?}",
            loc.shape
        ));
    }
}

/// Routed expert matrix `m` of layer `l`, expert `e`: its tensor, its
/// companion (scales) and its format, as stored.
fn expert_part(
    spec: &DeepseekV3Spec,
    ck: &Checkpoint,
    (l, e, m): (usize, usize, &str),
) -> Result<((TensorLoc, Option<TensorLoc>), ExpertFormat)> {
    let get = |n: String| {
        ck.get(&n)
            .cloned()
            .ok_or(fathom_weights::WeightsError::Missing(n))
    };
    let name = expert_name(l, e, m);
    let module = name.strip_suffix(".weight").unwrap_or(&name);
    if let Quant::PackedInt4 { group, .. } = spec.quant
        && ck.get(&format!("{module}.weight_packed")).is_some()
    {
        let parts = (
            get(format!("{module}.weight_packed"))?,
            Some(get(format!("{module}.weight_scale"))?),
        );
        return Ok((parts, ExpertFormat::Int4 { group }));
    }
    let loc = get(name.clone())?;
    Ok(match (loc.dtype, spec.fp8_block()) {
        (Dtype::F8_E4M3, Some(block)) => {
            let scale = get(format!("{name}_scale_inv"))?;
            if scale.dtype != Dtype::F32 {
                return Err(ModelError::Tensor(format!(
                    "{name}_scale_inv: {:?}; a routed expert's FP8 scales are read as stored, F32",
                    scale.dtype
                )));
            }
            ((loc, Some(scale)), ExpertFormat::Fp8 { block })
        }
        (Dtype::BF16, _) => ((loc, None), ExpertFormat::Bf16),
        (Dtype::F32, _) => ((loc, None), ExpertFormat::F32),
        (dt, _) => {
            return Err(ModelError::Tensor(format!(
                "{name}: {dt:?} is not a routed-expert format this checkpoint's config allows"
            )));
        }
    })
}

/// Locators of every routed expert (gate, down, up), in the one format
/// they are all stored in.
/// With `mtp`, the first multi-token-prediction layer's experts too (at
/// index `num_layers`).
pub fn expert_table(spec: &DeepseekV3Spec, ck: &Checkpoint, mtp: bool) -> Result<ExpertTable> {
    let extra = usize::from(mtp && spec.num_nextn_predict_layers > 0);
    let mut layers = vec![Vec::new(); spec.num_layers + extra];
    let mut format = None;
    let mtp_layer = (extra > 0).then_some(spec.num_layers);
    for l in spec.moe_layers().chain(mtp_layer) {
        let mut v = Vec::with_capacity(spec.n_routed_experts);
        for e in 0..spec.n_routed_experts {
            let mut parts = Vec::with_capacity(3);
            for m in EXPERT_MATRICES {
                let (part, f) = expert_part(spec, ck, (l, e, m))?;
                if format.is_some_and(|g| g != f) {
                    return Err(ModelError::Tensor(format!(
                        "{}: stored as {f:?}, earlier routed experts as {:?}: all routed experts \
                         must share one format",
                        expert_name(l, e, m),
                        format.unwrap_or(f)
                    )));
                }
                format = Some(f);
                parts.push(part);
            }
            let format = format.unwrap_or(ExpertFormat::Bf16);
            let parts: [_; 3] = parts.try_into().expect("three matrices");
            v.push(ExpertLoc { parts, format });
        }
        layers[l] = v;
    }
    Ok(ExpertTable {
        layers,
        shapes: [0, 1, 2].map(|i| expert_shape(spec, i)),
        top_k: spec.top_k,
        format: format.unwrap_or(ExpertFormat::Bf16),
    })
}
