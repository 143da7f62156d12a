//! `config.json` of a `gpt_oss` checkpoint → a validated [`GptOssSpec`].
//! Everything downstream reads the typed spec; an unsupported or
//! inconsistent value is rejected with its field and value.

use serde_json::Value;

use crate::error::Result;
use crate::fields::Fields;
use crate::quant::{Method, Quant, mxfp4_converts};
use crate::rotary::RopeConfig;

/// GPT-OSS's SwiGLU slope when the config does not give `swiglu_alpha`.
pub const DEFAULT_SWIGLU_ALPHA: f32 = 1.702;

/// Which attention a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnType {
    /// Over the latest `sliding_window` positions only.
    Sliding,
    Full,
}

/// The GPT-OSS decoder's shape, validated.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GptOssSpec {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub rms_norm_eps: f32,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope: RopeConfig,
    /// Biases on q, k, v and o.
    pub attention_bias: bool,
    /// Per layer, 0-based.
    pub layer_types: Vec<AttnType>,
    pub sliding_window: usize,
    pub num_experts: usize,
    pub top_k: usize,
    /// Expert hidden width F (`intermediate_size`).
    pub intermediate_size: usize,
    /// The clamped SwiGLU: `g ≤ limit`, `|u| ≤ limit`,
    /// `(u + 1)·g·σ(alpha·g)`.
    pub swiglu_limit: f32,
    pub swiglu_alpha: f32,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub max_position_embeddings: Option<usize>,
    /// How the weights are stored: float, or the released MXFP4 experts
    /// (`quant_method` `mxfp4`).
    pub quant: Quant,
}

/// `layer_types`, or the reference's default: sliding, full, sliding, …
fn layer_types(f: &Fields<'_>, num_layers: usize) -> Result<Vec<AttnType>> {
    let Some(v) = f.get("layer_types") else {
        return Ok((0..num_layers)
            .map(|i| {
                if i % 2 == 0 {
                    AttnType::Sliding
                } else {
                    AttnType::Full
                }
            })
            .collect());
    };
    let list = v
        .as_array()
        .ok_or_else(|| f.err("layer_types", format!("= {v}: expected a list")))?;
    if list.len() != num_layers {
        return Err(f.err(
            "layer_types",
            format!("has {} entries for {num_layers} layers", list.len()),
        ));
    }
    list.iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(AttnType::Sliding),
            Some("full_attention") => Ok(AttnType::Full),
            _ => Err(f.err(
                "layer_types",
                format!(
                    "entry {t}: only \"sliding_attention\" and \"full_attention\" are supported"
                ),
            )),
        })
        .collect()
}

impl GptOssSpec {
    pub fn from_json(root: &Value) -> Result<Self> {
        let f = Fields { v: root, path: "" };
        f.expect_model_type("gpt_oss")?;
        let quant = crate::quant::parse(&f, "GPT-OSS", &[Method::Mxfp4])?;
        if f.bool_or("tie_word_embeddings", false)? {
            return Err(f.err("tie_word_embeddings", "= true: not supported"));
        }
        let vocab_size = f.positive("vocab_size")?;
        let num_layers = f.positive("num_hidden_layers")?;
        let top_k_name = if f.get("num_experts_per_tok").is_some() {
            "num_experts_per_tok"
        } else {
            "experts_per_token"
        };
        let spec = GptOssSpec {
            vocab_size,
            hidden_size: f.positive("hidden_size")?,
            num_layers,
            rms_norm_eps: f.f32("rms_norm_eps")?,
            num_heads: f.positive("num_attention_heads")?,
            num_kv_heads: f.positive("num_key_value_heads")?,
            head_dim: f.positive("head_dim")?,
            rope: RopeConfig::from_config(&f)?,
            attention_bias: f.bool_or("attention_bias", true)?,
            layer_types: layer_types(&f, num_layers)?,
            sliding_window: match f.get("sliding_window") {
                Some(_) => f.positive("sliding_window")?,
                None => 128,
            },
            num_experts: f.positive("num_local_experts")?,
            top_k: f.positive(top_k_name)?,
            intermediate_size: f.positive("intermediate_size")?,
            swiglu_limit: f.opt_f32("swiglu_limit")?.unwrap_or(7.0),
            swiglu_alpha: f.opt_f32("swiglu_alpha")?.unwrap_or(DEFAULT_SWIGLU_ALPHA),
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
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(
                "num_key_value_heads",
                format!(
                    "= {}: must divide num_attention_heads ({})",
                    self.num_kv_heads, self.num_heads
                ),
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(
                "head_dim",
                format!("= {}: rotary embedding needs an even width", self.head_dim),
            );
        }
        let eps = self.rms_norm_eps;
        if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
            return bad(
                "rms_norm_eps",
                format!("= {eps}: must be a number in (0, 1)"),
            );
        }
        if self.top_k > self.num_experts {
            return bad(
                "num_experts_per_tok",
                format!(
                    "= {} exceeds num_local_experts = {}",
                    self.top_k, self.num_experts
                ),
            );
        }
        for (name, v) in [
            ("swiglu_limit", self.swiglu_limit),
            ("swiglu_alpha", self.swiglu_alpha),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(name, format!("= {v}: must be a positive number"));
            }
        }
        if let Quant::Mxfp4 {
            modules_to_not_convert: keep,
        } = &self.quant
        {
            let converted: Vec<bool> = (0..self.num_layers)
                .map(|l| mxfp4_converts(keep, &format!("model.layers.{l}.mlp.experts")))
                .collect();
            if converted.iter().any(|&c| c != converted[0]) {
                return bad(
                    "quantization_config.modules_to_not_convert",
                    "keeps some layers' experts float and converts others: not supported".into(),
                );
            }
            let (d, f) = (self.hidden_size, self.intermediate_size);
            if converted[0] && !(d.is_multiple_of(32) && f.is_multiple_of(32)) {
                return bad(
                    "quantization_config",
                    format!(
                        "MXFP4 experts need hidden_size ({d}) and intermediate_size ({f}) \
                         to be multiples of 32"
                    ),
                );
            }
        }
        Ok(())
    }

    /// Whether the routed experts are stored as MXFP4 `_blocks` / `_scales`
    /// (`quant_method` `mxfp4` without the experts in `modules_to_not_convert`).
    pub fn mxfp4_experts(&self) -> bool {
        match &self.quant {
            Quant::Mxfp4 {
                modules_to_not_convert,
            } => mxfp4_converts(modules_to_not_convert, "model.layers.0.mlp.experts"),
            _ => false,
        }
    }

    /// The attention window of `layer`, if it slides.
    pub fn window(&self, layer: usize) -> Option<usize> {
        match self.layer_types[layer] {
            AttnType::Sliding => Some(self.sliding_window),
            AttnType::Full => None,
        }
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
            "/tests/data/gpt_oss-tiny/config.json"
        );
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn err_of(edit: impl Fn(&mut Value)) -> String {
        let mut v = tiny();
        edit(&mut v);
        GptOssSpec::from_json(&v).unwrap_err().to_string()
    }

    #[test]
    fn parses_tiny() {
        let s = GptOssSpec::from_json(&tiny()).unwrap();
        use AttnType::{Full, Sliding};
        assert_eq!(s.layer_types, vec![Sliding, Full, Sliding, Full]);
        assert_eq!((s.window(0), s.window(1)), (Some(8), None));
        assert_eq!((s.num_experts, s.top_k, s.intermediate_size), (16, 4, 32));
        assert_eq!((s.swiglu_limit, s.swiglu_alpha), (7.0, 1.702));
        let y = s.rope.yarn.as_ref().unwrap();
        assert!(!y.truncate && y.factor == 32.0);
        let mut v = tiny();
        v.as_object_mut().unwrap().remove("layer_types");
        let s = GptOssSpec::from_json(&v).unwrap();
        assert_eq!(s.layer_types, vec![Sliding, Full, Sliding, Full]);
    }

    #[test]
    fn reads_the_released_mxfp4_config() {
        let mut v = tiny();
        v["quantization_config"] = json!({"quant_method": "mxfp4", "modules_to_not_convert":
            ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]});
        assert!(GptOssSpec::from_json(&v).unwrap().mxfp4_experts());
        v["quantization_config"]["modules_to_not_convert"] = json!(["model.layers.*.mlp.experts"]);
        assert!(!GptOssSpec::from_json(&v).unwrap().mxfp4_experts());
        assert!(!GptOssSpec::from_json(&tiny()).unwrap().mxfp4_experts());
        let e = err_of(|v| {
            v["quantization_config"] = json!({"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.1.mlp.experts"]})
        });
        assert!(e.contains("modules_to_not_convert"), "{e}");
    }

    #[test]
    fn rejects_with_field_and_value() {
        let e = err_of(|v| {
            v["quantization_config"] =
                json!({"quant_method": "fp8", "weight_block_size": [128, 128]})
        });
        assert!(
            e.contains("quantization_config")
                && e.contains("\"fp8\"")
                && e.contains("supported: quant_method \"mxfp4\""),
            "{e}"
        );
        let e = err_of(|v| v["layer_types"][1] = "chunked_attention".into());
        assert!(
            e.contains("layer_types") && e.contains("chunked_attention"),
            "{e}"
        );
        let e = err_of(|v| v["layer_types"] = json!(["full_attention"]));
        assert!(e.contains("1 entries for 4 layers"), "{e}");
        let e = err_of(|v| v["num_key_value_heads"] = 3.into());
        assert!(e.contains("num_key_value_heads: = 3"), "{e}");
        let e = err_of(|v| v["swiglu_limit"] = (-1.0).into());
        assert!(e.contains("swiglu_limit"), "{e}");
    }
}
