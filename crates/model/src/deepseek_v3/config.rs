//! `config.json` of a `deepseek_v3` or `kimi_k2` checkpoint → a validated
//! [`DeepseekV3Spec`]. Everything downstream reads the typed spec; an
//! unsupported or inconsistent value is rejected with its field and value.

use fathom_kernels::rope::yarn_mscale;
use serde_json::Value;

use crate::error::Result;
use crate::fields::{Fields, GroupFields};
use crate::hybrid::MlaDims;
use crate::moe::{SigmoidMoe, SigmoidRouter};
use crate::quant::{Method, Quant};
use crate::rotary::RopeConfig;

/// Epsilon of `q_a_layernorm` and `kv_a_layernorm`: the reference builds
/// them with the norm class's default, not `rms_norm_eps`.
pub const MLA_NORM_EPS: f32 = 1e-6;

/// The `model_type`s this family reads.
pub const MODEL_TYPES: [&str; 2] = ["deepseek_v3", "kimi_k2"];

/// Which feed-forward a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FfnKind {
    Dense,
    Moe,
}

/// The DeepSeek-V3 / Kimi K2 decoder's shape, validated.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DeepseekV3Spec {
    /// `"deepseek_v3"` or `"kimi_k2"`.
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// Width of the dense MLP of the first layers.
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    // MLA with decoupled RoPE
    pub num_heads: usize,
    /// Low-rank queries (`q_a_proj` → `q_a_layernorm` → `q_b_proj`), or
    /// `None` for a full-rank `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub rope: RopeConfig,
    /// Rotary pairs are adjacent channels (`rope_interleave`, default true).
    pub rope_interleave: bool,
    // MoE
    pub first_k_dense_replace: usize,
    pub n_routed_experts: usize,
    pub top_k: usize,
    pub n_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub n_group: usize,
    pub topk_group: usize,
    /// Multi-token-prediction layers the checkpoint ships after the
    /// decoder (layer indices `num_layers..`): not run, their tensors are
    /// left unread.
    pub num_nextn_predict_layers: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub max_position_embeddings: Option<usize>,
    /// How the weights are stored (`quantization_config`): float, the
    /// released FP8 with block scales (DeepSeek-V3, Kimi K2), or INT4
    /// pack-quantized routed experts (Kimi K2 Thinking).
    pub quant: Quant,
}

/// The quantized formats this family reads.
pub const QUANT_METHODS: [Method; 2] = [Method::Fp8Block, Method::PackedInt4];

/// Refuses the variants this reader does not implement.
fn check_supported(f: &Fields<'_>) -> Result<()> {
    f.expect_str("hidden_act", "silu", "silu")?;
    f.expect_str("topk_method", "noaux_tc", "noaux_tc")?;
    f.expect_str("scoring_func", "sigmoid", "sigmoid")?;
    if f.bool_or("attention_bias", false)? {
        return Err(f.err("attention_bias", "= true: not supported"));
    }
    if f.get("moe_layer_freq").and_then(Value::as_u64).unwrap_or(1) != 1 {
        return Err(f.err(
            "moe_layer_freq",
            "only 1 (every layer after the dense ones) is supported",
        ));
    }
    if f.bool_or("tie_word_embeddings", false)? {
        return Err(f.err("tie_word_embeddings", "= true: not supported"));
    }
    Ok(())
}

impl DeepseekV3Spec {
    pub fn from_json(root: &Value) -> Result<Self> {
        let f = Fields { v: root, path: "" };
        let model_type = f.str_or("model_type", "")?;
        if !MODEL_TYPES.contains(&model_type) {
            return Err(f.err(
                "model_type",
                format!("= {model_type:?}: this loader reads {MODEL_TYPES:?} checkpoints"),
            ));
        }
        check_supported(&f)?;
        let quant = crate::quant::parse(&f, "DeepSeek-V3 / Kimi K2", &QUANT_METHODS)?;
        let vocab_size = f.positive("vocab_size")?;
        let grouped = |name: &str| -> Result<usize> {
            match f.get(name) {
                Some(_) => f.positive(name),
                None => Ok(1),
            }
        };
        let spec = DeepseekV3Spec {
            model_type: model_type.to_string(),
            vocab_size,
            hidden_size: f.positive("hidden_size")?,
            num_layers: f.positive("num_hidden_layers")?,
            intermediate_size: f.positive("intermediate_size")?,
            rms_norm_eps: f.f32("rms_norm_eps")?,
            num_heads: f.positive("num_attention_heads")?,
            q_lora_rank: match f.get("q_lora_rank") {
                Some(_) => Some(f.positive("q_lora_rank")?),
                None => None,
            },
            kv_lora_rank: f.positive("kv_lora_rank")?,
            qk_nope_head_dim: f.positive("qk_nope_head_dim")?,
            qk_rope_head_dim: f.positive("qk_rope_head_dim")?,
            v_head_dim: f.positive("v_head_dim")?,
            rope: RopeConfig::from_config(&f)?,
            rope_interleave: f.bool_or("rope_interleave", true)?,
            first_k_dense_replace: f.usize("first_k_dense_replace")?,
            n_routed_experts: f.positive("n_routed_experts")?,
            top_k: f.positive("num_experts_per_tok")?,
            n_shared_experts: match f.get("n_shared_experts") {
                Some(_) => f.usize("n_shared_experts")?,
                None => 0,
            },
            moe_intermediate_size: f.positive("moe_intermediate_size")?,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            routed_scaling_factor: f.opt_f32("routed_scaling_factor")?.unwrap_or(1.0),
            n_group: grouped("n_group")?,
            topk_group: grouped("topk_group")?,
            num_nextn_predict_layers: match f.get("num_nextn_predict_layers") {
                Some(_) => f.usize("num_nextn_predict_layers")?,
                None => 0,
            },
            bos_token_id: f.token_ids("bos_token_id", vocab_size)?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id", vocab_size)?,
            max_position_embeddings: root
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .map(|x| x as usize),
            quant,
        };
        spec.validate(&f)?;
        Ok(spec)
    }

    fn validate(&self, f: &Fields<'_>) -> Result<()> {
        let bad = |name: &str, msg: String| Err(f.err(name, msg));
        if let Some(h) = f.get("num_key_value_heads").and_then(Value::as_u64)
            && h as usize != self.num_heads
        {
            return bad(
                "num_key_value_heads",
                format!("= {h}: MLA needs it equal to num_attention_heads"),
            );
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return bad(
                "qk_rope_head_dim",
                format!(
                    "= {}: rotary embedding needs an even width",
                    self.qk_rope_head_dim
                ),
            );
        }
        f.check_eps(self.rms_norm_eps)?;
        f.check_scaling(self.routed_scaling_factor)?;
        f.check_groups(&GroupFields {
            experts: self.n_routed_experts,
            groups: self.n_group,
            groups_key: "n_group",
            groups_word: "n_group",
            topk_group: self.topk_group,
            top_k: self.top_k,
            top_k_key: "num_experts_per_tok",
            first_k: self.first_k_dense_replace,
            layers: self.num_layers,
        })
    }

    /// The FP8 tile when the checkpoint is FP8 block-quantized.
    pub fn fp8_block(&self) -> Option<[usize; 2]> {
        match self.quant {
            Quant::Fp8Block { block } => Some(block),
            _ => None,
        }
    }

    pub fn ffn_kind(&self, layer: usize) -> FfnKind {
        if layer < self.first_k_dense_replace {
            FfnKind::Dense
        } else {
            FfnKind::Moe
        }
    }

    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.first_k_dense_replace..self.num_layers
    }

    /// Query/key head width (nope + rope).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The attention scale: `1/sqrt(qk_head_dim)`, times `mscale²` with
    /// `mscale = 0.1·mscale_all_dim·ln(factor) + 1` when YaRN sets
    /// `mscale_all_dim`.
    pub fn softmax_scale(&self) -> f32 {
        let m = self
            .rope
            .yarn
            .as_ref()
            .and_then(|y| {
                y.mscale_all_dim
                    .filter(|&a| a != 0.0)
                    .map(|a| (y.factor, a))
            })
            .map(|(factor, a)| yarn_mscale(factor, a));
        match m {
            None => MlaDims::plain_scale(self.qk_nope_head_dim, self.qk_rope_head_dim),
            Some(m) => ((self.qk_head_dim() as f64).powf(-0.5) * m * m) as f32,
        }
    }

    pub fn mla_dims(&self) -> MlaDims {
        MlaDims {
            heads: self.num_heads,
            kv_lora_rank: self.kv_lora_rank,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
            norm_eps: MLA_NORM_EPS,
            softmax_scale: self.softmax_scale(),
        }
    }

    /// The sparse block with this spec's dimensions.
    pub fn sparse_block(&self) -> SigmoidMoe {
        SigmoidMoe {
            router: SigmoidRouter {
                top_k: self.top_k,
                groups: self.n_group,
                topk_group: self.topk_group,
                renormalize: self.norm_topk_prob,
                scaling: self.routed_scaling_factor,
            },
            hidden: self.hidden_size,
            intermediate: self.moe_intermediate_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny(name: &str) -> Value {
        let p = format!(
            "{}/tests/data/{name}/config.json",
            env!("CARGO_MANIFEST_DIR")
        );
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn err_of(edit: impl Fn(&mut Value)) -> String {
        let mut v = tiny("deepseek_v3-tiny");
        edit(&mut v);
        DeepseekV3Spec::from_json(&v).unwrap_err().to_string()
    }

    #[test]
    fn parses_both_fixtures() {
        let s = DeepseekV3Spec::from_json(&tiny("deepseek_v3-tiny")).unwrap();
        assert_eq!((s.n_group, s.topk_group, s.top_k), (4, 2, 4));
        assert_eq!(s.q_lora_rank, Some(48));
        assert_eq!(s.moe_layers().collect::<Vec<_>>(), vec![1, 2, 3]);
        assert!(s.rope_interleave && s.rope.yarn.is_some());
        let m = 0.1 * 40f64.ln() + 1.0;
        let want = (24f64.powf(-0.5) * m * m) as f32;
        assert_eq!(s.softmax_scale(), want);
        let k = DeepseekV3Spec::from_json(&tiny("kimi_k2-tiny")).unwrap();
        assert_eq!((k.n_group, k.n_routed_experts, k.top_k), (1, 32, 8));
        let mut v = tiny("kimi_k2-tiny");
        v["model_type"] = "kimi_k2".into();
        let k = DeepseekV3Spec::from_json(&v).unwrap();
        assert_eq!(k.model_type, "kimi_k2");
    }

    #[test]
    fn reads_the_released_quantization_configs() {
        let mut v = tiny("deepseek_v3-tiny");
        v["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3",
            "weight_block_size": [128, 128], "activation_scheme": "dynamic"});
        let s = DeepseekV3Spec::from_json(&v).unwrap();
        assert_eq!(s.fp8_block(), Some([128, 128]));
        let e = err_of(|v| {
            v["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3",
                "weight_block_size": [128, 128], "activation_scheme": "static"})
        });
        assert!(
            e.contains("activation_scheme") && e.contains("static"),
            "{e}"
        );
        let e = err_of(|v| v["quantization_config"] = json!({"quant_method": "gptq", "bits": 4}));
        assert!(
            e.contains("quantization_config")
                && e.contains("\"gptq\"")
                && e.contains("DeepSeek-V3")
                && e.contains("supported: quant_method \"fp8\"")
                && e.contains("pack-quantized"),
            "{e}"
        );
    }

    #[test]
    fn rejects_with_field_and_value() {
        let e = err_of(|v| {
            v["quantization_config"] =
                json!({"quant_method": "compressed-tensors", "format": "marlin-24"})
        });
        assert!(
            e.contains("quantization_config.format") && e.contains("marlin-24"),
            "{e}"
        );
        let e = err_of(|v| v["scoring_func"] = "softmax".into());
        assert!(e.contains("scoring_func: = \"softmax\""), "{e}");
        let e = err_of(|v| v["topk_method"] = "greedy".into());
        assert!(e.contains("topk_method"), "{e}");
        let e = err_of(|v| v["n_group"] = 3.into());
        assert!(e.contains("n_group: = 3"), "{e}");
        let e = err_of(|v| v["rope_scaling"]["rope_type"] = "longrope".into());
        assert!(e.contains("longrope"), "{e}");
        let e = err_of(|v| v["model_type"] = "deepseek_v2".into());
        assert!(e.contains("deepseek_v2") && e.contains("kimi_k2"), "{e}");
        let e = err_of(|v| v["qk_rope_head_dim"] = 7.into());
        assert!(e.contains("qk_rope_head_dim: = 7"), "{e}");
    }

    #[test]
    fn full_rank_queries_and_no_scaling() {
        let mut v = tiny("deepseek_v3-tiny");
        v["q_lora_rank"] = Value::Null;
        v.as_object_mut().unwrap().remove("rope_scaling");
        let s = DeepseekV3Spec::from_json(&v).unwrap();
        assert_eq!(s.q_lora_rank, None);
        assert_eq!(s.softmax_scale(), 1.0 / 24f32.sqrt());
    }
}
