//! Qwen3-MoE (`qwen3_moe`): grouped-query attention with per-head q/k
//! norms, softmax-routed experts in every layer, no shared expert; bf16
//! throughout, as released.

use fathom_model::qwen3_moe::config::Qwen3MoeSpec;
use fathom_model::qwen3_moe::tensors::{Role, tensor_table};
use fathom_weights::Dtype;
use serde_json::{Value, json};

use crate::error::Result;
use crate::init::float_init;
use crate::model::{
    Shape, SynthTensor, check_hidden, config_error, expert_of, round32, scale_heads, special_id,
};

/// Every width of a Qwen3-MoE model (field names follow `config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3Dims {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// Width of a dense MLP (none in the released MoE models; kept in the config).
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub moe_intermediate_size: usize,
    pub max_position_embeddings: usize,
}

impl Qwen3Dims {
    /// Qwen3-235B-A22B.
    pub fn qwen3_235b() -> Self {
        Qwen3Dims {
            vocab_size: 151_936,
            hidden_size: 4096,
            num_layers: 94,
            intermediate_size: 12_288,
            num_heads: 64,
            num_kv_heads: 4,
            head_dim: 128,
            num_experts: 128,
            top_k: 8,
            moe_intermediate_size: 1536,
            max_position_embeddings: 40_960,
        }
    }

    /// Qwen3-30B-A3B.
    pub fn qwen3_30b() -> Self {
        Qwen3Dims {
            hidden_size: 2048,
            num_layers: 48,
            intermediate_size: 6144,
            num_heads: 32,
            moe_intermediate_size: 768,
            ..Self::qwen3_235b()
        }
    }
}

/// `(heads, kv_heads)` scaled by `s`: at least one kv head, and a whole
/// number of query heads per kv head.
pub(crate) fn scale_gqa(heads: usize, kv: usize, s: f64) -> (usize, usize) {
    let kv2 = scale_heads(kv, s);
    let per = scale_heads(heads, s) as f64 / kv2 as f64;
    (kv2 * (per.round() as usize).max(1), kv2)
}

impl Shape for Qwen3Dims {
    fn family(&self) -> &'static str {
        "qwen3_moe"
    }

    fn precision(&self) -> &'static str {
        "bf16"
    }

    crate::model::knob_fields!();

    fn scale_to_hidden(&mut self, h: usize) -> Result<()> {
        check_hidden(h)?;
        let s = h as f64 / self.hidden_size as f64;
        self.hidden_size = h;
        (self.num_heads, self.num_kv_heads) = scale_gqa(self.num_heads, self.num_kv_heads, s);
        self.intermediate_size = round32(self.intermediate_size as f64 * s);
        self.moe_intermediate_size = round32(self.moe_intermediate_size as f64 * s);
        Ok(())
    }

    fn dense_layers(&self) -> usize {
        0
    }

    fn config_json(&self) -> Value {
        let v = self.vocab_size;
        json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": special_id(v, 0),
            "decoder_sparse_step": 1,
            "eos_token_id": special_id(v, 1),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_layers,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": true,
            "num_attention_heads": self.num_heads,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_kv_heads,
            "output_router_logits": false,
            "rms_norm_eps": 1e-6,
            "rope_scaling": null,
            "rope_theta": 1_000_000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": null,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "use_cache": true,
            "use_sliding_window": false,
            "vocab_size": v
        })
    }

    fn tensors(&self) -> Result<Vec<SynthTensor>> {
        let spec = Qwen3MoeSpec::from_json(&self.config_json())
            .map_err(|e| config_error("Qwen3-MoE", e))?;
        Ok(tensor_table(&spec)
            .into_iter()
            .map(|t| SynthTensor {
                init: float_init(&t.name, &t.shape, spec.hidden_size, t.role == Role::Router),
                expert: (t.role == Role::RoutedExpert)
                    .then(|| expert_of(&t.name, t.layer))
                    .flatten(),
                dtype: Dtype::BF16,
                name: t.name,
                shape: t.shape,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gqa_scales_keep_whole_groups() {
        assert_eq!(scale_gqa(64, 4, 1.0), (64, 4));
        assert_eq!(scale_gqa(64, 4, 128.0 / 4096.0), (2, 1));
        assert_eq!(scale_gqa(64, 8, 64.0 / 2880.0), (1, 1));
        assert_eq!(scale_gqa(32, 4, 0.5), (16, 2));
    }
}
