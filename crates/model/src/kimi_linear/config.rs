//! `config.json` of a `kimi_linear` checkpoint → a validated
//! [`KimiLinearSpec`]. Everything downstream reads the typed spec; an
//! unsupported or inconsistent value is rejected with its field and value.

use serde_json::Value;

use crate::error::Result;
use crate::fields::{Fields, GroupFields};
use crate::hybrid::{AttnKind, HybridDims, KdaDims, MlaDims};
use crate::moe::{SigmoidMoe, SigmoidRouter};

/// Epsilon of `kv_a_layernorm`: Moonshot's modelling code builds it with
/// the norm class's default, not `rms_norm_eps` (as for K3).
pub const MLA_KV_NORM_EPS: f32 = 1e-6;

/// Which feed-forward a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FfnKind {
    Dense,
    Moe,
}

/// The Kimi-Linear decoder's shape, validated.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KimiLinearSpec {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    // MLA (NoPE, full-rank queries, no output gate)
    pub mla_heads: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    // KDA (low-rank output gate)
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv_kernel: usize,
    pub gate_lower_bound: Option<f32>,
    /// Layer kinds, 0-based.
    pub attn_kinds: Vec<AttnKind>,
    // MoE
    pub first_k_dense_replace: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub moe_renormalize: bool,
    pub routed_scaling_factor: f32,
    /// Expert groups (1 without `use_grouped_topk`) and how many are kept.
    pub num_expert_group: usize,
    pub topk_group: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub max_position_embeddings: Option<usize>,
}

/// Layer kinds from the 1-based `kda_layers` / `full_attn_layers`.
fn attn_kinds(l: &Fields<'_>, num_layers: usize) -> Result<Vec<AttnKind>> {
    let kda = l.usize_list("kda_layers")?;
    let full = l.usize_list("full_attn_layers")?;
    if let Some(&bad) = kda.iter().chain(&full).find(|&&i| i == 0 || i > num_layers) {
        return Err(l.err(
            "kda_layers",
            format!("layer {bad} is outside 1..={num_layers}"),
        ));
    }
    (1..=num_layers)
        .map(|i| match (kda.contains(&i), full.contains(&i)) {
            (true, false) => Ok(AttnKind::Kda),
            (false, true) => Ok(AttnKind::Mla),
            (true, true) => Err(l.err(
                "kda_layers",
                format!("layer {i} (1-based) is also in full_attn_layers"),
            )),
            (false, false) => Err(l.err(
                "kda_layers",
                format!("layer {i} (1-based) is in neither kda_layers nor full_attn_layers"),
            )),
        })
        .collect()
}

/// Refuses the variants this reader does not implement.
fn check_supported(f: &Fields<'_>, l: &Fields<'_>) -> Result<()> {
    f.expect_str("hidden_act", "silu", "silu")?;
    f.expect_str("moe_router_activation_func", "sigmoid", "sigmoid")?;
    f.expect_true("mla_use_nope", false)?;
    if f.bool_or("mla_use_output_gate", false)? {
        return Err(f.err(
            "mla_use_output_gate",
            "= true: not supported for kimi_linear",
        ));
    }
    if l.bool_or("use_full_rank_gate", false)? {
        return Err(l.err(
            "use_full_rank_gate",
            "= true: not supported for kimi_linear",
        ));
    }
    if let Some(v) = f.get("q_lora_rank") {
        return Err(f.err(
            "q_lora_rank",
            format!("= {v}: only full-rank queries (null) are supported"),
        ));
    }
    if f.get("moe_layer_freq").and_then(Value::as_u64).unwrap_or(1) != 1 {
        return Err(f.err("moe_layer_freq", "only 1 is supported"));
    }
    if f.bool_or("tie_word_embeddings", false)? {
        return Err(f.err("tie_word_embeddings", "= true: not supported"));
    }
    Ok(())
}

impl KimiLinearSpec {
    pub fn from_json(root: &Value) -> Result<Self> {
        let f = Fields { v: root, path: "" };
        f.expect_model_type("kimi_linear")?;
        let lv = f.req("linear_attn_config")?;
        let l = Fields {
            v: lv,
            path: "linear_attn_config",
        };
        check_supported(&f, &l)?;
        let num_layers = f.positive("num_hidden_layers")?;
        let vocab_size = f.positive("vocab_size")?;
        let grouped = f.bool_or("use_grouped_topk", false)?;
        let spec = KimiLinearSpec {
            vocab_size,
            hidden_size: f.positive("hidden_size")?,
            num_layers,
            intermediate_size: f.positive("intermediate_size")?,
            rms_norm_eps: f.f32("rms_norm_eps")?,
            mla_heads: f.positive("num_attention_heads")?,
            kv_lora_rank: f.positive("kv_lora_rank")?,
            qk_nope_head_dim: f.positive("qk_nope_head_dim")?,
            qk_rope_head_dim: f.usize("qk_rope_head_dim")?,
            v_head_dim: f.positive("v_head_dim")?,
            kda_heads: l.positive("num_heads")?,
            kda_head_dim: l.positive("head_dim")?,
            conv_kernel: l.positive("short_conv_kernel_size")?,
            gate_lower_bound: l.opt_f32("gate_lower_bound")?,
            attn_kinds: attn_kinds(&l, num_layers)?,
            first_k_dense_replace: f.usize("first_k_dense_replace")?,
            num_experts: f.positive("num_experts")?,
            top_k: f.positive("num_experts_per_token")?,
            num_shared_experts: f.usize("num_shared_experts")?,
            moe_intermediate_size: f.positive("moe_intermediate_size")?,
            moe_renormalize: f.bool_or("moe_renormalize", true)?,
            routed_scaling_factor: f.opt_f32("routed_scaling_factor")?.unwrap_or(1.0),
            num_expert_group: if grouped {
                f.positive("num_expert_group")?
            } else {
                1
            },
            topk_group: if grouped {
                f.positive("topk_group")?
            } else {
                1
            },
            tie_word_embeddings: false,
            bos_token_id: f.token_ids("bos_token_id", vocab_size)?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id", vocab_size)?,
            max_position_embeddings: root
                .get("max_position_embeddings")
                .or_else(|| root.get("model_max_length"))
                .and_then(Value::as_u64)
                .map(|x| x as usize),
        };
        spec.validate(&f)?;
        Ok(spec)
    }

    fn validate(&self, f: &Fields<'_>) -> Result<()> {
        let bad = |name: &str, msg: String| Err(f.err(name, msg));
        if let Some(h) = f.get("num_key_value_heads").and_then(Value::as_u64)
            && h as usize != self.mla_heads
        {
            return bad(
                "num_key_value_heads",
                format!("= {h}: MLA needs it equal to num_attention_heads"),
            );
        }
        f.check_eps(self.rms_norm_eps)?;
        f.check_scaling(self.routed_scaling_factor)?;
        f.check_groups(&GroupFields {
            experts: self.num_experts,
            groups: self.num_expert_group,
            groups_key: "num_expert_group",
            groups_word: "groups",
            topk_group: self.topk_group,
            top_k: self.top_k,
            top_k_key: "num_experts_per_token",
            first_k: self.first_k_dense_replace,
            layers: self.num_layers,
        })
    }

    pub fn ffn_kind(&self, layer: usize) -> FfnKind {
        if layer < self.first_k_dense_replace {
            FfnKind::Dense
        } else {
            FfnKind::Moe
        }
    }

    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (self.first_k_dense_replace..self.num_layers).filter(|&i| self.ffn_kind(i) == FfnKind::Moe)
    }

    /// KDA projection width P = heads × head_dim.
    pub fn kda_width(&self) -> usize {
        self.kda_heads * self.kda_head_dim
    }

    pub fn kda_dims(&self) -> KdaDims {
        KdaDims {
            heads: self.kda_heads,
            head_dim: self.kda_head_dim,
            conv_kernel: self.conv_kernel,
            gate_lower_bound: self.gate_lower_bound,
            norm_eps: self.rms_norm_eps,
        }
    }

    pub fn mla_dims(&self) -> MlaDims {
        MlaDims {
            heads: self.mla_heads,
            kv_lora_rank: self.kv_lora_rank,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
            norm_eps: MLA_KV_NORM_EPS,
            softmax_scale: MlaDims::plain_scale(self.qk_nope_head_dim, self.qk_rope_head_dim),
        }
    }

    /// What a Kimi-Linear sequence state is shaped by.
    pub fn hybrid_dims(&self) -> HybridDims {
        HybridDims {
            attn_kinds: self.attn_kinds.clone(),
            kda: self.kda_dims(),
            mla: self.mla_dims(),
            family: "Kimi-Linear",
            magic: *b"KLST",
        }
    }

    /// The sparse block with this spec's dimensions.
    pub fn sparse_block(&self) -> SigmoidMoe {
        SigmoidMoe {
            router: self.router(),
            hidden: self.hidden_size,
            intermediate: self.moe_intermediate_size,
        }
    }

    pub fn router(&self) -> SigmoidRouter {
        SigmoidRouter {
            top_k: self.top_k,
            groups: self.num_expert_group,
            topk_group: self.topk_group,
            renormalize: self.moe_renormalize,
            scaling: self.routed_scaling_factor,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> Value {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/kimi_linear-tiny/config.json"
        );
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn err_of(edit: impl Fn(&mut Value)) -> String {
        let mut v = tiny();
        edit(&mut v);
        KimiLinearSpec::from_json(&v).unwrap_err().to_string()
    }

    #[test]
    fn parses_tiny() {
        let s = KimiLinearSpec::from_json(&tiny()).unwrap();
        use AttnKind::{Kda, Mla};
        assert_eq!(s.attn_kinds, vec![Kda, Kda, Mla, Kda, Kda, Mla]);
        assert_eq!((s.num_expert_group, s.topk_group, s.top_k), (4, 2, 4));
        assert_eq!(s.moe_layers().collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);
        assert_eq!((s.kda_heads, s.kda_head_dim, s.kv_lora_rank), (4, 16, 32));
        assert_eq!(s.gate_lower_bound, None);
    }

    #[test]
    fn rejects_with_field_and_value() {
        let e = err_of(|v| v["q_lora_rank"] = 48.into());
        assert!(e.contains("q_lora_rank: = 48"), "{e}");
        let e = err_of(|v| v["mla_use_nope"] = false.into());
        assert!(e.contains("mla_use_nope"), "{e}");
        let e = err_of(|v| v["num_expert_group"] = 3.into());
        assert!(e.contains("num_expert_group: = 3"), "{e}");
        let e = err_of(|v| v["linear_attn_config"]["kda_layers"] = json!([1, 2, 3, 4, 5]));
        assert!(e.contains("layer 3 (1-based) is also"), "{e}");
        let e = err_of(|v| v["hidden_act"] = "gelu".into());
        assert!(e.contains("hidden_act"), "{e}");
        let e = err_of(|v| v["model_type"] = "kimi_k3".into());
        assert!(e.contains("model_type"), "{e}");
    }
}
