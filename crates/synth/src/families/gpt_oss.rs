//! gpt-oss (`gpt_oss`): grouped-query attention with biases and sinks,
//! alternating sliding-window (128) and full layers, softmax-routed
//! experts stacked per layer, in the released precision: the experts as
//! MXFP4 `_blocks` (E2M1 codes) and `_scales` (E8M0 per 32 inputs), their
//! biases and everything else bf16.

use fathom_model::gpt_oss::config::GptOssSpec;
use fathom_model::gpt_oss::tensors::{Role, tensor_table};
use fathom_weights::Dtype;
use serde_json::{Value, json};

use crate::error::Result;
use crate::families::qwen3::scale_gqa;
use crate::init::{Init, float_init, scale_base};
use crate::model::{Shape, SynthTensor, check_hidden, config_error, round32, special_id};

/// Every width of a gpt-oss model (field names follow `config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct GptOssDims {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub num_experts: usize,
    pub top_k: usize,
    /// Expert hidden width.
    pub intermediate_size: usize,
    pub sliding_window: usize,
}

impl GptOssDims {
    /// gpt-oss-120b.
    pub fn gpt_oss_120b() -> Self {
        GptOssDims {
            vocab_size: 201_088,
            hidden_size: 2880,
            num_layers: 36,
            num_heads: 64,
            num_kv_heads: 8,
            head_dim: 64,
            num_experts: 128,
            top_k: 4,
            intermediate_size: 2880,
            sliding_window: 128,
        }
    }

    /// gpt-oss-20b.
    pub fn gpt_oss_20b() -> Self {
        GptOssDims {
            num_layers: 24,
            num_experts: 32,
            ..Self::gpt_oss_120b()
        }
    }
}

impl Shape for GptOssDims {
    fn family(&self) -> &'static str {
        "gpt_oss"
    }

    fn precision(&self) -> &'static str {
        "MXFP4 routed experts (E2M1, E8M0 scale per 32), bf16 rest"
    }

    crate::model::knob_fields!();

    fn scale_to_hidden(&mut self, h: usize) -> Result<()> {
        check_hidden(h)?;
        let s = h as f64 / self.hidden_size as f64;
        self.hidden_size = h;
        (self.num_heads, self.num_kv_heads) = scale_gqa(self.num_heads, self.num_kv_heads, s);
        self.intermediate_size = round32(self.intermediate_size as f64 * s);
        Ok(())
    }

    fn dense_layers(&self) -> usize {
        0
    }

    fn config_json(&self) -> Value {
        let v = self.vocab_size;
        // Sliding, full, sliding, … as released.
        let layer_types: Vec<&str> = (0..self.num_layers)
            .map(|i| {
                if i % 2 == 0 {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        json!({
            "architectures": ["GptOssForCausalLM"],
            "attention_bias": true,
            "attention_dropout": 0.0,
            "bos_token_id": special_id(v, 0),
            "eos_token_id": special_id(v, 1),
            "experts_per_token": self.top_k,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initial_context_length": 4096,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": layer_types,
            "max_position_embeddings": 131_072,
            "model_type": "gpt_oss",
            "num_attention_heads": self.num_heads,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_kv_heads,
            "num_local_experts": self.num_experts,
            "output_router_logits": false,
            "pad_token_id": special_id(v, 255),
            "quantization_config": {
                "modules_to_not_convert": [
                    "model.layers.*.self_attn", "model.layers.*.mlp.router",
                    "model.embed_tokens", "lm_head"
                ],
                "quant_method": "mxfp4"
            },
            "rms_norm_eps": 1e-5,
            "rope_scaling": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "rope_type": "yarn",
                "truncate": false
            },
            "rope_theta": 150_000.0,
            "router_aux_loss_coef": 0.9,
            "sliding_window": self.sliding_window,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "use_cache": true,
            "vocab_size": v
        })
    }

    fn tensors(&self) -> Result<Vec<SynthTensor>> {
        let spec =
            GptOssSpec::from_json(&self.config_json()).map_err(|e| config_error("gpt-oss", e))?;
        Ok(tensor_table(&spec)
            .into_iter()
            .map(|t| {
                let init = if t.name.ends_with("_blocks") {
                    Init::Bytes
                } else if t.name.ends_with("_scales") {
                    // [E, out, in/32]
                    Init::Scale {
                        base: scale_base(t.shape[2] * 32),
                    }
                } else {
                    float_init(&t.name, &t.shape, spec.hidden_size, t.role == Role::Router)
                };
                SynthTensor {
                    init,
                    dtype: t.dtype.unwrap_or(Dtype::BF16),
                    // Stacked: one tensor holds every expert of a layer.
                    expert: None,
                    name: t.name,
                    shape: t.shape,
                }
            })
            .collect())
    }
}
