//! Kimi-Linear (`kimi_linear`): three KDA (linear attention) layers to one
//! MLA layer (NoPE, full-rank queries), a dense first layer, then
//! sigmoid-routed experts with a shared expert; bf16 throughout as
//! released (the score-correction bias f32).

use fathom_model::kimi_linear::config::KimiLinearSpec;
use fathom_model::kimi_linear::tensors::{Role, tensor_table};
use fathom_weights::Dtype;
use serde_json::{Value, json};

use crate::error::Result;
use crate::families::k3::full_attn_layers;
use crate::init::{float_init, kda_init};
use crate::model::{
    Shape, SynthTensor, check_hidden, config_error, expert_of, round32, scale_heads, special_id,
};

/// Every width of a Kimi-Linear model (field names follow `config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct KimiLinearDims {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub intermediate_size: usize,
    pub mla_heads: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
}

impl KimiLinearDims {
    /// Kimi-Linear-48B-A3B.
    pub fn kimi_linear_48b() -> Self {
        KimiLinearDims {
            vocab_size: 163_840,
            hidden_size: 2304,
            num_layers: 27,
            intermediate_size: 9216,
            mla_heads: 32,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            kda_heads: 32,
            kda_head_dim: 128,
            num_experts: 256,
            top_k: 8,
            num_shared_experts: 1,
            moe_intermediate_size: 1024,
        }
    }
}

impl Shape for KimiLinearDims {
    fn family(&self) -> &'static str {
        "kimi_linear"
    }

    fn precision(&self) -> &'static str {
        "bf16"
    }

    crate::model::knob_fields!();

    fn scale_to_hidden(&mut self, h: usize) -> Result<()> {
        check_hidden(h)?;
        let s = h as f64 / self.hidden_size as f64;
        self.hidden_size = h;
        self.mla_heads = scale_heads(self.mla_heads, s);
        self.kda_heads = scale_heads(self.kda_heads, s);
        self.kv_lora_rank = round32(self.kv_lora_rank as f64 * s);
        self.intermediate_size = round32(self.intermediate_size as f64 * s);
        self.moe_intermediate_size = round32(self.moe_intermediate_size as f64 * s);
        Ok(())
    }

    fn dense_layers(&self) -> usize {
        1
    }

    fn config_json(&self) -> Value {
        let (v, n) = (self.vocab_size, self.num_layers);
        // MLA at every 4th layer and the last (27 layers: 4, 8, …, 24, 27).
        let full = full_attn_layers(n);
        let kda: Vec<usize> = (1..=n).filter(|i| !full.contains(i)).collect();
        json!({
            "architectures": ["KimiLinearForCausalLM"],
            "bos_token_id": special_id(v, 0),
            "eos_token_id": special_id(v, 1),
            "first_k_dense_replace": 1,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "kv_lora_rank": self.kv_lora_rank,
            "linear_attn_config": {
                "full_attn_layers": full,
                "head_dim": self.kda_head_dim,
                "kda_layers": kda,
                "num_heads": self.kda_heads,
                "short_conv_kernel_size": 4
            },
            "mla_use_nope": true,
            "model_max_length": 1_048_576,
            "model_type": "kimi_linear",
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_layer_freq": 1,
            "moe_renormalize": true,
            "moe_router_activation_func": "sigmoid",
            "num_attention_heads": self.mla_heads,
            "num_expert_group": 1,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.top_k,
            "num_hidden_layers": n,
            "num_key_value_heads": self.mla_heads,
            "num_nextn_predict_layers": 0,
            "num_shared_experts": self.num_shared_experts,
            "pad_token_id": special_id(v, 255),
            "q_lora_rank": null,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "rms_norm_eps": 1e-5,
            "rope_scaling": null,
            "rope_theta": 10_000.0,
            "routed_scaling_factor": 2.446,
            "tie_word_embeddings": false,
            "topk_group": 1,
            "torch_dtype": "bfloat16",
            "use_cache": true,
            "use_grouped_topk": true,
            "v_head_dim": self.v_head_dim,
            "vocab_size": v
        })
    }

    fn tensors(&self) -> Result<Vec<SynthTensor>> {
        let spec = KimiLinearSpec::from_json(&self.config_json())
            .map_err(|e| config_error("Kimi-Linear", e))?;
        Ok(tensor_table(&spec)
            .into_iter()
            .map(|t| {
                let numel = t.shape.iter().product::<usize>() as u64;
                // The table's byte count says which tensors are released in f32.
                let dtype = if t.bytes() == 4 * numel {
                    Dtype::F32
                } else {
                    Dtype::BF16
                };
                let init = kda_init(&t.name, spec.kda_heads).unwrap_or_else(|| {
                    float_init(&t.name, &t.shape, spec.hidden_size, t.role == Role::Router)
                });
                SynthTensor {
                    init,
                    dtype,
                    expert: (t.role == Role::RoutedExpert)
                        .then(|| expert_of(&t.name, t.layer))
                        .flatten(),
                    name: t.name,
                    shape: t.shape,
                }
            })
            .collect())
    }
}
