//! `config.json` of a `qwen3_moe` checkpoint → a validated [`Qwen3MoeSpec`].
//!
//! Everything downstream reads the typed spec, never the JSON. Unsupported
//! or inconsistent values are rejected with the field's name and value.

use serde_json::Value;

use crate::error::Result;
use crate::fields::Fields;
use crate::rotary::RopeConfig;

/// Which feed-forward a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FfnKind {
    /// `Qwen3MoeMLP` with `intermediate_size`.
    Dense,
    /// Routed experts (no shared expert).
    Moe,
}

/// The Qwen3-MoE decoder's shape, validated.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Qwen3MoeSpec {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// Width of the dense MLP layers.
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// `rope_theta` and, when `rope_scaling` declares it, YaRN.
    pub rope: RopeConfig,
    pub attention_bias: bool,
    pub num_experts: usize,
    pub top_k: usize,
    /// Expert hidden width F.
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    /// Per layer, 0-based.
    pub ffn_kinds: Vec<FfnKind>,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub max_position_embeddings: Option<usize>,
}

/// `name` if present (positive, bounded), else `default`.
fn opt_positive(f: &Fields<'_>, name: &str, default: usize) -> Result<usize> {
    match f.get(name) {
        Some(_) => f.positive(name),
        None => Ok(default),
    }
}

/// The expert count and each layer's feed-forward: routed experts where
/// `(layer + 1) % decoder_sparse_step == 0` and the layer is not in
/// `mlp_only_layers` (and there are experts), else the dense MLP.
fn layer_plan(f: &Fields<'_>, num_layers: usize) -> Result<(usize, Vec<FfnKind>)> {
    let name = if f.get("num_experts").is_none() && f.get("num_local_experts").is_some() {
        "num_local_experts"
    } else {
        "num_experts"
    };
    let num_experts = opt_positive(f, name, 0)?;
    let sparse_step = opt_positive(f, "decoder_sparse_step", 1)?;
    let mlp_only = match f.get("mlp_only_layers") {
        Some(_) => f.usize_list("mlp_only_layers")?,
        None => Vec::new(),
    };
    if let Some(&bad) = mlp_only.iter().find(|&&i| i >= num_layers) {
        return Err(f.err(
            "mlp_only_layers",
            format!("layer {bad} is outside 0..{num_layers}"),
        ));
    }
    let kinds = (0..num_layers)
        .map(|i| {
            if !mlp_only.contains(&i) && num_experts > 0 && (i + 1) % sparse_step == 0 {
                FfnKind::Moe
            } else {
                FfnKind::Dense
            }
        })
        .collect();
    Ok((num_experts, kinds))
}

impl Qwen3MoeSpec {
    pub fn from_json(root: &Value) -> Result<Self> {
        let f = Fields { v: root, path: "" };
        f.expect_model_type("qwen3_moe")?;
        f.expect_str("hidden_act", "silu", "silu")?;
        if f.bool_or("use_sliding_window", false)? {
            return Err(f.err(
                "use_sliding_window",
                "= true: sliding-window attention is not supported",
            ));
        }
        let rope = RopeConfig::from_config(&f)?;
        let num_layers = f.positive("num_hidden_layers")?;
        let num_heads = f.positive("num_attention_heads")?;
        let hidden_size = f.positive("hidden_size")?;
        let head_dim = opt_positive(&f, "head_dim", hidden_size / num_heads)?;
        let (num_experts, ffn_kinds) = layer_plan(&f, num_layers)?;
        let any_moe = ffn_kinds.contains(&FfnKind::Moe);
        let any_dense = ffn_kinds.contains(&FfnKind::Dense);
        let vocab_size = f.positive("vocab_size")?;
        let spec = Qwen3MoeSpec {
            vocab_size,
            hidden_size,
            num_layers,
            intermediate_size: if any_dense {
                f.positive("intermediate_size")?
            } else {
                f.usize("intermediate_size").unwrap_or(0)
            },
            rms_norm_eps: f.f32("rms_norm_eps")?,
            num_heads,
            num_kv_heads: opt_positive(&f, "num_key_value_heads", num_heads)?,
            head_dim,
            rope,
            attention_bias: f.bool_or("attention_bias", false)?,
            num_experts,
            top_k: if any_moe {
                f.positive("num_experts_per_tok")?
            } else {
                0
            },
            moe_intermediate_size: if any_moe {
                f.positive("moe_intermediate_size")?
            } else {
                0
            },
            norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
            ffn_kinds,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            bos_token_id: f.token_ids("bos_token_id", vocab_size)?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id", vocab_size)?,
            max_position_embeddings: root
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .map(|x| x as usize),
        };
        spec.validate(&f)?;
        Ok(spec)
    }

    fn validate(&self, f: &Fields<'_>) -> Result<()> {
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(f.err(
                "num_key_value_heads",
                format!(
                    "= {}: must divide num_attention_heads ({})",
                    self.num_kv_heads, self.num_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim == 0 {
            return Err(f.err(
                "head_dim",
                format!("= {}: rotary embedding needs an even width", self.head_dim),
            ));
        }
        let eps = self.rms_norm_eps;
        if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
            return Err(f.err(
                "rms_norm_eps",
                format!("= {eps}: must be a number in (0, 1)"),
            ));
        }
        if self.top_k > self.num_experts {
            return Err(f.err(
                "num_experts_per_tok",
                format!(
                    "= {} exceeds num_experts = {}",
                    self.top_k, self.num_experts
                ),
            ));
        }
        Ok(())
    }

    pub fn ffn_kind(&self, layer: usize) -> FfnKind {
        self.ffn_kinds[layer]
    }

    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.num_layers).filter(|&i| self.ffn_kinds[i] == FfnKind::Moe)
    }

    /// Floats cached per token per layer: keys then values of every kv head.
    pub fn kv_width(&self) -> usize {
        2 * self.num_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny() -> Value {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/qwen3_moe-tiny/config.json"
        );
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn err_of(edit: impl Fn(&mut Value)) -> String {
        let mut v = tiny();
        edit(&mut v);
        Qwen3MoeSpec::from_json(&v).unwrap_err().to_string()
    }

    #[test]
    fn parses_tiny() {
        let s = Qwen3MoeSpec::from_json(&tiny()).unwrap();
        assert_eq!((s.hidden_size, s.num_layers, s.head_dim), (64, 4, 16));
        assert_eq!((s.num_heads, s.num_kv_heads), (4, 2));
        assert_eq!(
            (s.num_experts, s.top_k, s.moe_intermediate_size),
            (16, 4, 32)
        );
        assert!(s.norm_topk_prob && !s.tie_word_embeddings);
        assert_eq!(s.moe_layers().count(), 4);
        assert_eq!(s.eos_token_ids, vec![1]);
        assert_eq!((s.rope.theta, s.rope.yarn.is_none()), (1e6, true));
    }

    #[test]
    fn reads_yarn_as_qwen3_declares_it() {
        let mut v = tiny();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768});
        let s = Qwen3MoeSpec::from_json(&v).unwrap();
        let y = s.rope.yarn.as_ref().expect("yarn read");
        assert_eq!(
            (y.factor, y.original_max_position_embeddings),
            (4.0, 32768.0)
        );
        assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (32.0, 1.0, true));
        // No DeepSeek mscales: the default magnitude 0.1·ln(factor) + 1.
        assert!((y.attention_factor() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
        assert_ne!(
            s.rope.rope(s.head_dim),
            RopeConfig {
                theta: s.rope.theta,
                yarn: None
            }
            .rope(s.head_dim)
        );
    }

    #[test]
    fn layer_kinds_follow_sparse_step_and_mlp_only_layers() {
        let mut v = tiny();
        v["decoder_sparse_step"] = json!(2);
        v["mlp_only_layers"] = json!([3]);
        let s = Qwen3MoeSpec::from_json(&v).unwrap();
        use FfnKind::{Dense, Moe};
        assert_eq!(s.ffn_kinds, vec![Dense, Moe, Dense, Dense]);
    }

    #[test]
    fn rejects_with_field_and_value() {
        let e = err_of(|v| v["hidden_act"] = "gelu".into());
        assert_eq!(
            e,
            "config.json: hidden_act: = \"gelu\": only \"silu\" is supported"
        );
        let e = err_of(|v| v["num_key_value_heads"] = 3.into());
        assert!(e.contains("num_key_value_heads: = 3"), "{e}");
        let e = err_of(|v| v["rope_scaling"] = json!({"rope_type": "linear", "factor": 4.0}));
        assert!(e.contains("rope_scaling") && e.contains("linear"), "{e}");
        let e = err_of(|v| v["use_sliding_window"] = true.into());
        assert!(e.contains("use_sliding_window"), "{e}");
        let e = err_of(|v| v["num_experts_per_tok"] = 17.into());
        assert!(e.contains("num_experts_per_tok") && e.contains("17"), "{e}");
        let e = err_of(|v| v["eos_token_id"] = 5000.into());
        assert!(e.contains("eos_token_id: = 5000: outside"), "{e}");
        let e = err_of(|v| v["model_type"] = "llama".into());
        assert!(e.contains("model_type") && e.contains("llama"), "{e}");
        let e = err_of(|v| v["mlp_only_layers"] = json!([9]));
        assert!(
            e.contains("mlp_only_layers") && e.contains("layer 9"),
            "{e}"
        );
    }
}
