//! `config.json` of a `kimi_k3` checkpoint → a validated [`K3Spec`].
//!
//! The released file nests the text decoder under `text_config` (with
//! `linear_attn_config` and `quantization_config` inside it). Everything
//! downstream reads the typed spec, never the JSON. Unsupported or
//! inconsistent values are rejected with the JSON path of the field.

use serde_json::Value;

use crate::error::Result;

/// Epsilon of the MLA low-rank norms (`q_a_layernorm`, `kv_a_layernorm`):
/// the released modelling code builds them with the class default 1e-6, not
/// `rms_norm_eps` (docs/k3-model.md §5, §8).
pub const MLA_LOW_RANK_NORM_EPS: f32 = 1e-6;
pub use crate::hybrid::AttnKind;
pub use crate::hybrid::kda::KDA_L2_EPS;
use crate::hybrid::{HybridDims, KdaDims, MlaDims};

/// Which feed-forward a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FfnKind {
    Dense,
    Moe,
}

/// The K3 text decoder's shape, validated.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct K3Spec {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    // MLA
    pub mla_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    // KDA
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv_kernel: usize,
    pub gate_lower_bound: Option<f32>,
    // MoE
    pub first_k_dense_replace: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub num_shared_experts: usize,
    /// Expert hidden width F (`moe_intermediate_size`).
    pub moe_intermediate_size: usize,
    /// Latent width L (`routed_expert_hidden_size`).
    pub latent_size: usize,
    pub latent_moe_use_norm: bool,
    pub moe_renormalize: bool,
    pub routed_scaling_factor: f32,
    // activation and residuals
    pub situ_beta: f32,
    pub situ_linear_beta: Option<f32>,
    pub attn_res_block_size: usize,
    /// Layer kinds, 0-based.
    pub attn_kinds: Vec<AttnKind>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// The longest context the checkpoint declares (`max_position_embeddings`).
    pub max_position_embeddings: Option<usize>,
}

use crate::fields::Fields;
pub use crate::fields::MAX_DIM;

fn opt_token(v: &Value, name: &str) -> Option<u64> {
    match v.get(name)? {
        Value::Number(n) => n.as_u64(),
        Value::Array(a) => a.first()?.as_u64(),
        _ => None,
    }
}

/// A token id from `text_config` or the top level, checked to fit 32 bits.
fn token_id(t: &Fields<'_>, tv: &Value, root: &Value, name: &str) -> Result<Option<u32>> {
    match opt_token(tv, name).or_else(|| opt_token(root, name)) {
        None => Ok(None),
        Some(x) => u32::try_from(x).map(Some).map_err(|_| {
            t.err(
                name,
                format!("= {x}: not a token id (at most {})", u32::MAX),
            )
        }),
    }
}

impl K3Spec {
    pub fn from_json(root: &Value) -> Result<Self> {
        let r = Fields { v: root, path: "" };
        r.expect_model_type("kimi_k3")?;
        let tv = r.req("text_config")?;
        let t = Fields {
            v: tv,
            path: "text_config",
        };
        let lv = t.req("linear_attn_config")?;
        let l = Fields {
            v: lv,
            path: "text_config.linear_attn_config",
        };

        t.expect_str("hidden_act", "situ", "situ")?;
        t.expect_str("moe_router_activation_func", "sigmoid", "sigmoid")?;
        t.expect_str("topk_method", "noaux_tc", "noaux_tc")?;
        t.expect_true("mla_use_nope", true)?;
        t.expect_true("mla_use_output_gate", true)?;
        l.expect_true("use_full_rank_gate", false)?;
        if t.bool_or("tie_word_embeddings", false)? {
            return Err(t.err("tie_word_embeddings", "= true: K3 has a separate lm_head"));
        }
        let groups = t
            .get("num_expert_group")
            .and_then(Value::as_u64)
            .unwrap_or(1);
        let topk_group = t.get("topk_group").and_then(Value::as_u64).unwrap_or(1);
        if groups > 1 && topk_group < groups {
            return Err(t.err(
                "topk_group",
                format!(
                    "= {topk_group} of {groups} groups: group-limited routing is not supported"
                ),
            ));
        }
        if t.get("moe_layer_freq").and_then(Value::as_u64).unwrap_or(1) != 1 {
            return Err(t.err(
                "moe_layer_freq",
                "only 1 (every layer after the dense ones) is supported",
            ));
        }
        if let Some(q) = t.get("quantization_config") {
            let qf = Fields {
                v: q,
                path: "text_config.quantization_config",
            };
            qf.expect_str("format", "mxfp4-pack-quantized", "mxfp4-pack-quantized")?;
            let gs = q
                .pointer("/config_groups/group_0/weights/group_size")
                .and_then(Value::as_u64);
            if let Some(g) = gs.filter(|&g| g != 32) {
                return Err(qf.err(
                    "config_groups.group_0.weights.group_size",
                    format!("= {g}: MXFP4 needs 32"),
                ));
            }
        }

        let num_layers = t.positive("num_hidden_layers")?;
        let kda_layers = l.usize_list("kda_layers")?;
        let full_layers = l.usize_list("full_attn_layers")?;
        let mut attn_kinds = Vec::with_capacity(num_layers);
        for i in 1..=num_layers {
            let (k, f) = (kda_layers.contains(&i), full_layers.contains(&i));
            attn_kinds.push(match (k, f) {
                (true, false) => AttnKind::Kda,
                (false, true) => AttnKind::Mla,
                (true, true) => {
                    return Err(l.err(
                        "kda_layers",
                        format!("layer {i} (1-based) is also in full_attn_layers"),
                    ));
                }
                (false, false) => {
                    return Err(l.err(
                        "kda_layers",
                        format!(
                            "layer {i} (1-based) is in neither kda_layers nor full_attn_layers"
                        ),
                    ));
                }
            });
        }
        if let Some(&bad) = kda_layers
            .iter()
            .chain(&full_layers)
            .find(|&&i| i == 0 || i > num_layers)
        {
            return Err(l.err(
                "kda_layers",
                format!("layer {bad} is outside 1..={num_layers}"),
            ));
        }

        let spec = K3Spec {
            vocab_size: t.positive("vocab_size")?,
            hidden_size: t.positive("hidden_size")?,
            num_layers,
            intermediate_size: t.positive("intermediate_size")?,
            rms_norm_eps: t.f32("rms_norm_eps")?,
            mla_heads: t.positive("num_attention_heads")?,
            q_lora_rank: t.positive("q_lora_rank")?,
            kv_lora_rank: t.positive("kv_lora_rank")?,
            qk_nope_head_dim: t.positive("qk_nope_head_dim")?,
            qk_rope_head_dim: t.usize("qk_rope_head_dim")?,
            v_head_dim: t.positive("v_head_dim")?,
            kda_heads: l.positive("num_heads")?,
            kda_head_dim: l.positive("head_dim")?,
            conv_kernel: l.positive("short_conv_kernel_size")?,
            gate_lower_bound: l.opt_f32("gate_lower_bound")?,
            first_k_dense_replace: t.usize("first_k_dense_replace")?,
            num_experts: t.positive("num_experts")?,
            top_k: t.positive("num_experts_per_token")?,
            num_shared_experts: t.usize("num_shared_experts")?,
            moe_intermediate_size: t.positive("moe_intermediate_size")?,
            latent_size: t.positive("routed_expert_hidden_size")?,
            latent_moe_use_norm: t.bool_or("latent_moe_use_norm", false)?,
            moe_renormalize: t.bool_or("moe_renormalize", true)?,
            routed_scaling_factor: t.opt_f32("routed_scaling_factor")?.unwrap_or(1.0),
            situ_beta: t.opt_f32("activation_situ_beta")?.unwrap_or(1.0),
            situ_linear_beta: t.opt_f32("activation_situ_linear_beta")?,
            attn_res_block_size: t.positive("attn_res_block_size")?,
            attn_kinds,
            bos_token_id: token_id(&t, tv, root, "bos_token_id")?,
            eos_token_id: token_id(&t, tv, root, "eos_token_id")?,
            max_position_embeddings: tv
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .map(|x| x as usize),
        };
        if let Some(h) = t.get("num_key_value_heads").and_then(Value::as_u64) {
            if h as usize != spec.mla_heads {
                return Err(t.err(
                    "num_key_value_heads",
                    format!(
                        "= {h}: MLA needs it equal to num_attention_heads ({})",
                        spec.mla_heads
                    ),
                ));
            }
        }
        for (name, id) in [
            ("bos_token_id", spec.bos_token_id),
            ("eos_token_id", spec.eos_token_id),
        ] {
            if let Some(id) = id.filter(|&i| i as usize >= spec.vocab_size) {
                return Err(t.err(
                    name,
                    format!(
                        "= {id}: outside the vocabulary (vocab_size {})",
                        spec.vocab_size
                    ),
                ));
            }
        }
        let eps = spec.rms_norm_eps;
        if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
            return Err(t.err(
                "rms_norm_eps",
                format!("= {eps}: must be a number in (0, 1)"),
            ));
        }
        let rsf = spec.routed_scaling_factor;
        if !(rsf.is_finite() && rsf > 0.0 && rsf <= 1e4) {
            return Err(t.err(
                "routed_scaling_factor",
                format!("= {rsf}: must be a number in (0, 10000]"),
            ));
        }
        if spec.top_k > spec.num_experts {
            return Err(t.err(
                "num_experts_per_token",
                format!(
                    "= {} exceeds num_experts = {}",
                    spec.top_k, spec.num_experts
                ),
            ));
        }
        for (name, v) in [
            ("moe_intermediate_size", spec.moe_intermediate_size),
            ("routed_expert_hidden_size", spec.latent_size),
        ] {
            if v % 32 != 0 {
                return Err(t.err(name, format!("= {v}: MXFP4 experts need a multiple of 32")));
            }
        }
        if spec.first_k_dense_replace > num_layers {
            return Err(t.err(
                "first_k_dense_replace",
                format!(
                    "= {} exceeds num_hidden_layers = {num_layers}",
                    spec.first_k_dense_replace
                ),
            ));
        }
        if spec.conv_kernel < 1 || spec.situ_beta == 0.0 || spec.situ_linear_beta == Some(0.0) {
            return Err(t.err("activation_situ_beta", "must be non-zero"));
        }
        Ok(spec)
    }

    pub fn ffn_kind(&self, layer: usize) -> FfnKind {
        if layer < self.first_k_dense_replace {
            FfnKind::Dense
        } else {
            FfnKind::Moe
        }
    }

    /// The KDA layers' dimensions.
    pub fn kda_dims(&self) -> KdaDims {
        KdaDims {
            heads: self.kda_heads,
            head_dim: self.kda_head_dim,
            conv_kernel: self.conv_kernel,
            gate_lower_bound: self.gate_lower_bound,
            norm_eps: self.rms_norm_eps,
        }
    }

    /// The MLA layers' dimensions.
    pub fn mla_dims(&self) -> MlaDims {
        MlaDims {
            heads: self.mla_heads,
            kv_lora_rank: self.kv_lora_rank,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
            norm_eps: MLA_LOW_RANK_NORM_EPS,
            softmax_scale: MlaDims::plain_scale(self.qk_nope_head_dim, self.qk_rope_head_dim),
        }
    }

    /// What a K3 sequence state is shaped by.
    pub fn hybrid_dims(&self) -> HybridDims {
        HybridDims {
            attn_kinds: self.attn_kinds.clone(),
            kda: self.kda_dims(),
            mla: self.mla_dims(),
            family: "Kimi K3",
            magic: *b"K3ST",
        }
    }

    /// KDA projection width P = heads × head_dim.
    pub fn kda_width(&self) -> usize {
        self.kda_heads * self.kda_head_dim
    }

    /// MLA query/key head width (nope + "rope" part; no rotation is applied).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Floats cached per token per MLA layer: the normalised latent + the shared key part.
    pub fn mla_cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (self.first_k_dense_replace..self.num_layers).filter(|&i| self.ffn_kind(i) == FfnKind::Moe)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> Value {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/k3-tiny/checkpoint/config.json"
        );
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    #[test]
    fn parses_tiny() {
        let s = K3Spec::from_json(&tiny()).unwrap();
        assert_eq!(s.hidden_size, 128);
        assert_eq!(s.num_layers, 9);
        assert_eq!(
            s.attn_kinds.iter().filter(|k| **k == AttnKind::Mla).count(),
            3
        );
        assert_eq!(s.attn_kinds[3], AttnKind::Mla);
        assert_eq!(s.gate_lower_bound, Some(-5.0));
        assert_eq!(s.top_k, 4);
    }

    fn err_of(edit: impl Fn(&mut Value)) -> String {
        let mut v = tiny();
        edit(&mut v);
        K3Spec::from_json(&v).unwrap_err().to_string()
    }

    /// Every field of k3-tiny's config set to hostile values: parsing ends
    /// in a spec or an error naming a field, never a panic.
    #[test]
    fn hostile_values_in_any_field_never_panic() {
        let base = tiny();
        let hostile = [
            json!(0),
            json!(-1),
            json!(1e12),
            json!(1e308),
            json!(u64::MAX),
            json!("x"),
            json!(null),
            json!(true),
            json!([]),
            json!({}),
        ];
        let mut paths: Vec<Vec<String>> = Vec::new();
        for (k, v) in base["text_config"].as_object().unwrap() {
            paths.push(vec!["text_config".into(), k.clone()]);
            if let Some(o) = v.as_object() {
                for k2 in o.keys() {
                    paths.push(vec!["text_config".into(), k.clone(), k2.clone()]);
                }
            }
        }
        for p in &paths {
            for h in &hostile {
                let mut v = base.clone();
                let mut slot = &mut v;
                for key in p {
                    slot = &mut slot[key.as_str()];
                }
                *slot = h.clone();
                if let Err(e) = K3Spec::from_json(&v) {
                    assert!(e.to_string().starts_with("config.json"), "{p:?} = {h}: {e}");
                }
            }
        }
        assert!(paths.len() > 30);
    }

    #[test]
    fn out_of_range_values_are_refused_before_use() {
        let cases: Vec<(Box<dyn Fn(&mut Value)>, &str)> = vec![
            (
                Box::new(|v| v["text_config"]["num_hidden_layers"] = 1_000_000_000_000u64.into()),
                "num_hidden_layers: = 1000000000000: larger than",
            ),
            (
                Box::new(|v| v["text_config"]["num_experts"] = 1_000_000_000_000u64.into()),
                "num_experts: = 1000000000000",
            ),
            (
                Box::new(|v| v["text_config"]["rms_norm_eps"] = (-1.0).into()),
                "rms_norm_eps: = -1: must be a number in (0, 1)",
            ),
            (
                Box::new(|v| v["text_config"]["routed_scaling_factor"] = 1e30.into()),
                "routed_scaling_factor: = 1000000000000000000000000000000",
            ),
            (
                Box::new(|v| v["text_config"]["eos_token_id"] = (1u64 << 40).into()),
                "eos_token_id: = 1099511627776: not a token id",
            ),
            (
                Box::new(|v| v["text_config"]["eos_token_id"] = 5000.into()),
                "eos_token_id: = 5000: outside the vocabulary",
            ),
        ];
        for (edit, want) in cases {
            let e = err_of(edit);
            assert!(e.contains(want), "{e:?} lacks {want:?}");
        }
    }

    #[test]
    fn rejects_with_field_and_value() {
        let e = err_of(|v| v["text_config"]["hidden_act"] = "gelu".into());
        assert_eq!(
            e,
            "config.json: text_config.hidden_act: = \"gelu\": only \"situ\" is supported"
        );
        let e = err_of(|v| v["model_type"] = "llama".into());
        assert!(e.contains("model_type") && e.contains("llama"), "{e}");
        let e = err_of(|v| v["text_config"]["num_experts_per_token"] = 64.into());
        assert!(
            e.contains("num_experts_per_token") && e.contains("64"),
            "{e}"
        );
        let e = err_of(|v| {
            v["text_config"]["linear_attn_config"]["kda_layers"] = serde_json::json!([1, 2, 3, 4])
        });
        assert!(e.contains("kda_layers") && e.contains("layer 4"), "{e}");
        let e = err_of(|v| v["text_config"]["moe_intermediate_size"] = 100.into());
        assert!(
            e.contains("moe_intermediate_size") && e.contains("100"),
            "{e}"
        );
        let e = err_of(|v| {
            v["text_config"]
                .as_object_mut()
                .unwrap()
                .remove("hidden_size");
        });
        assert_eq!(e, "config.json: text_config.hidden_size: missing");
    }
}
