//! The K3 tensor table: every tensor of the released checkpoint, its shape,
//! stored dtype and role, derived from the spec (docs/k3-model.md §7.1).
//!
//! One table serves the loader (expected shapes, missing/unexpected names),
//! `verify`, `inspect` (bytes by component) and the synthetic checkpoint
//! writer (which must produce exactly these names, shapes and dtypes).

use fathom_weights::Dtype;

use super::config::{AttnKind, FfnKind, K3Spec};

/// Name prefix of the text decoder's tensors.
pub const PREFIX: &str = "language_model.model.";
/// The output head (outside `.model.`).
pub const LM_HEAD: &str = "language_model.lm_head.weight";

/// What a tensor is for; residency and quantisation follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Embedding,
    /// RMSNorm weights.
    Norm,
    /// Block attention-residual pseudo-queries.
    AttnRes,
    /// KDA and MLA projections and parameters.
    Attention,
    /// The dense SiTU MLP of the first layers.
    DenseMlp,
    /// Router weight and score-correction bias.
    Router,
    /// LatentMoE down/up projections and latent norm.
    Latent,
    SharedExpert,
    /// Routed expert `w1/w2/w3` packed nibbles or scales.
    RoutedExpert,
    Head,
}

impl Role {
    /// Everything but the routed experts is the resident "spine".
    pub fn is_spine(self) -> bool {
        self != Role::RoutedExpert
    }
}

/// Which of an expert's three matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertMatrix {
    /// gate, `[F, L]`
    W1,
    /// down, `[L, F]`
    W2,
    /// up, `[F, L]`
    W3,
}

impl ExpertMatrix {
    pub const ALL: [ExpertMatrix; 3] = [ExpertMatrix::W1, ExpertMatrix::W2, ExpertMatrix::W3];
    pub fn name(self) -> &'static str {
        match self {
            ExpertMatrix::W1 => "w1",
            ExpertMatrix::W2 => "w2",
            ExpertMatrix::W3 => "w3",
        }
    }
    /// `[rows, cols]` of the dequantised matrix.
    pub fn shape(self, spec: &K3Spec) -> [usize; 2] {
        let (f, l) = (spec.moe_intermediate_size, spec.latent_size);
        match self {
            ExpertMatrix::W1 | ExpertMatrix::W3 => [f, l],
            ExpertMatrix::W2 => [l, f],
        }
    }
}

/// One expected tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    /// The dtype the released checkpoint stores.
    pub dtype: Dtype,
    pub role: Role,
    /// Layer index, if the tensor belongs to one.
    pub layer: Option<usize>,
}

impl TensorSpec {
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.bitsize() as u64 / 8
    }
}

/// Name of layer `i`'s tensor `rest` (e.g. `"self_attn.q_proj.weight"`).
pub fn layer_name(i: usize, rest: &str) -> String {
    format!("{PREFIX}layers.{i}.{rest}")
}

/// Name of an expert tensor; `part` is `"weight_packed"` or `"weight_scale"`.
pub fn expert_name(layer: usize, expert: usize, m: ExpertMatrix, part: &str) -> String {
    layer_name(
        layer,
        &format!("block_sparse_moe.experts.{expert}.{}.{part}", m.name()),
    )
}

/// Every tensor of the checkpoint described by `spec`, in a stable order.
pub fn tensor_table(spec: &K3Spec) -> Vec<TensorSpec> {
    let mut t = Vec::new();
    let d = spec.hidden_size;
    let mut push =
        |name: String, shape: Vec<usize>, dtype: Dtype, role: Role, layer: Option<usize>| {
            t.push(TensorSpec {
                name,
                shape,
                dtype,
                role,
                layer,
            })
        };
    use Dtype::{BF16, F32, U8};
    push(
        format!("{PREFIX}embed_tokens.weight"),
        vec![spec.vocab_size, d],
        BF16,
        Role::Embedding,
        None,
    );
    for i in 0..spec.num_layers {
        let mut l = |rest: &str, shape: Vec<usize>, dtype: Dtype, role: Role| {
            push(layer_name(i, rest), shape, dtype, role, Some(i))
        };
        l("input_layernorm.weight", vec![d], BF16, Role::Norm);
        l("post_attention_layernorm.weight", vec![d], BF16, Role::Norm);
        l(
            "self_attention_res_norm.weight",
            vec![d],
            BF16,
            Role::AttnRes,
        );
        l(
            "self_attention_res_proj.weight",
            vec![1, d],
            BF16,
            Role::AttnRes,
        );
        l("mlp_res_norm.weight", vec![d], BF16, Role::AttnRes);
        l("mlp_res_proj.weight", vec![1, d], BF16, Role::AttnRes);
        let a = Role::Attention;
        match spec.attn_kinds[i] {
            AttnKind::Kda => {
                let (p, k, h) = (spec.kda_width(), spec.kda_head_dim, spec.kda_heads);
                for n in ["q", "k", "v"] {
                    l(&format!("self_attn.{n}_proj.weight"), vec![p, d], BF16, a);
                    l(
                        &format!("self_attn.{n}_conv1d.weight"),
                        vec![p, 1, spec.conv_kernel],
                        F32,
                        a,
                    );
                }
                l("self_attn.f_a_proj.weight", vec![k, d], BF16, a);
                l("self_attn.f_b_proj.weight", vec![p, k], BF16, a);
                // Released shards store A_log with head_dim entries; the first
                // `num_heads` are used (docs/k3-model.md §7.2).
                l("self_attn.A_log", vec![k.max(h)], F32, a);
                l("self_attn.dt_bias", vec![p], F32, a);
                l("self_attn.b_proj.weight", vec![h, d], BF16, a);
                l("self_attn.g_proj.weight", vec![p, d], BF16, a);
                l("self_attn.o_norm.weight", vec![k], F32, a);
                l("self_attn.o_proj.weight", vec![d, p], BF16, a);
            }
            AttnKind::Mla => {
                let h = spec.mla_heads;
                l(
                    "self_attn.q_a_proj.weight",
                    vec![spec.q_lora_rank, d],
                    BF16,
                    a,
                );
                l(
                    "self_attn.q_a_layernorm.weight",
                    vec![spec.q_lora_rank],
                    BF16,
                    a,
                );
                l(
                    "self_attn.q_b_proj.weight",
                    vec![h * spec.qk_head_dim(), spec.q_lora_rank],
                    BF16,
                    a,
                );
                l(
                    "self_attn.kv_a_proj_with_mqa.weight",
                    vec![spec.mla_cache_width(), d],
                    BF16,
                    a,
                );
                l(
                    "self_attn.kv_a_layernorm.weight",
                    vec![spec.kv_lora_rank],
                    BF16,
                    a,
                );
                l(
                    "self_attn.kv_b_proj.weight",
                    vec![
                        h * (spec.qk_nope_head_dim + spec.v_head_dim),
                        spec.kv_lora_rank,
                    ],
                    BF16,
                    a,
                );
                l(
                    "self_attn.g_proj.weight",
                    vec![h * spec.v_head_dim, d],
                    BF16,
                    a,
                );
                l(
                    "self_attn.o_proj.weight",
                    vec![d, h * spec.v_head_dim],
                    BF16,
                    a,
                );
            }
        }
        match spec.ffn_kind(i) {
            FfnKind::Dense => {
                let f = spec.intermediate_size;
                l("mlp.gate_proj.weight", vec![f, d], BF16, Role::DenseMlp);
                l("mlp.up_proj.weight", vec![f, d], BF16, Role::DenseMlp);
                l("mlp.down_proj.weight", vec![d, f], BF16, Role::DenseMlp);
            }
            FfnKind::Moe => {
                let (e, lat) = (spec.num_experts, spec.latent_size);
                let sf = spec.num_shared_experts * spec.moe_intermediate_size;
                l(
                    "block_sparse_moe.gate.weight",
                    vec![e, d],
                    BF16,
                    Role::Router,
                );
                l(
                    "block_sparse_moe.gate.e_score_correction_bias",
                    vec![e],
                    F32,
                    Role::Router,
                );
                l(
                    "block_sparse_moe.routed_expert_down_proj.weight",
                    vec![lat, d],
                    BF16,
                    Role::Latent,
                );
                l(
                    "block_sparse_moe.routed_expert_norm.weight",
                    vec![lat],
                    BF16,
                    Role::Latent,
                );
                l(
                    "block_sparse_moe.routed_expert_up_proj.weight",
                    vec![d, lat],
                    BF16,
                    Role::Latent,
                );
                if sf > 0 {
                    l(
                        "block_sparse_moe.shared_experts.gate_proj.weight",
                        vec![sf, d],
                        BF16,
                        Role::SharedExpert,
                    );
                    l(
                        "block_sparse_moe.shared_experts.up_proj.weight",
                        vec![sf, d],
                        BF16,
                        Role::SharedExpert,
                    );
                    l(
                        "block_sparse_moe.shared_experts.down_proj.weight",
                        vec![d, sf],
                        BF16,
                        Role::SharedExpert,
                    );
                }
                for x in 0..e {
                    for m in ExpertMatrix::ALL {
                        let [r, c] = m.shape(spec);
                        // Two nibbles per byte; one E8M0 scale per 32 columns.
                        for (part, cols) in [("weight_packed", c / 2), ("weight_scale", c / 32)] {
                            let name = expert_name(i, x, m, part);
                            push(name, vec![r, cols], U8, Role::RoutedExpert, Some(i));
                        }
                    }
                }
            }
        }
    }
    push(
        format!("{PREFIX}norm.weight"),
        vec![d],
        BF16,
        Role::Norm,
        None,
    );
    push(
        format!("{PREFIX}output_attn_res_norm.weight"),
        vec![d],
        BF16,
        Role::AttnRes,
        None,
    );
    push(
        format!("{PREFIX}output_attn_res_proj.weight"),
        vec![1, d],
        BF16,
        Role::AttnRes,
        None,
    );
    push(
        LM_HEAD.to_string(),
        vec![spec.vocab_size, d],
        BF16,
        Role::Head,
        None,
    );
    t
}

/// Bytes of one routed expert (all six tensors).
pub fn expert_bytes(spec: &K3Spec) -> u64 {
    ExpertMatrix::ALL
        .iter()
        .map(|m| {
            let [r, c] = m.shape(spec);
            (r * c / 2 + r * c / 32) as u64
        })
        .sum()
}

/// Locators of every routed expert of a K3 checkpoint.
pub fn expert_table(
    spec: &K3Spec,
    ck: &fathom_weights::Checkpoint,
) -> crate::error::Result<crate::experts::ExpertTable> {
    use crate::experts::{ExpertFormat, ExpertLoc, ExpertTable};
    let mut layers = vec![Vec::new(); spec.num_layers];
    for l in spec.moe_layers() {
        let mut v = Vec::with_capacity(spec.num_experts);
        for e in 0..spec.num_experts {
            let get = |m, part| {
                let n = expert_name(l, e, m, part);
                ck.get(&n)
                    .cloned()
                    .ok_or(fathom_weights::WeightsError::Missing(n))
            };
            let mut parts = Vec::with_capacity(3);
            for m in ExpertMatrix::ALL {
                parts.push((get(m, "weight_packed")?, Some(get(m, "weight_scale")?)));
            }
            let parts: [_; 3] = parts.try_into().expect("three matrices");
            v.push(ExpertLoc {
                parts,
                format: ExpertFormat::Mxfp4,
            });
        }
        layers[l] = v;
    }
    Ok(ExpertTable {
        layers,
        shapes: ExpertMatrix::ALL.map(|m| m.shape(spec)),
        top_k: spec.top_k,
        format: ExpertFormat::Mxfp4,
    })
}
