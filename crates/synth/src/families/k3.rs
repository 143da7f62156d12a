//! Kimi K3: the shapes of the `tiny`, `k3` and `k3-mini` presets, the
//! released `config.json` layout (root `kimi_k3` wrapper, `text_config`
//! with `linear_attn_config` and `quantization_config` inside, as in
//! `crates/model/tests/data/k3-tiny/checkpoint/config.json`) parsed back
//! with [`K3Spec::from_json`], and the K3 tensor table with each tensor's
//! distribution.

use fathom_model::kimi_k3::config::K3Spec;
use fathom_model::kimi_k3::tensors::{Role, TensorSpec, tensor_table};
use serde_json::{Value, json};

use crate::error::{Result, SynthError};
use crate::init::{Init, float_init, kda_init, scale_base};
use crate::model::{Model, Shape, SynthTensor, config_error, expert_of};
use crate::tokenizer::NUM_SPECIALS;

/// Every width of a K3-shaped model (field names follow `config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct Dims {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub intermediate_size: usize,
    pub mla_heads: usize,
    pub q_lora_rank: usize,
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
    pub latent_size: usize,
    pub attn_res_block_size: usize,
}

impl Dims {
    /// k3-tiny's shapes with a vocabulary big enough for a real tokenizer.
    pub fn tiny() -> Dims {
        Dims {
            vocab_size: 1024 + NUM_SPECIALS,
            hidden_size: 128,
            num_layers: 9,
            intermediate_size: 320,
            mla_heads: 4,
            q_lora_rank: 64,
            kv_lora_rank: 40,
            qk_nope_head_dim: 32,
            qk_rope_head_dim: 16,
            v_head_dim: 24,
            kda_heads: 4,
            kda_head_dim: 48,
            num_experts: 32,
            top_k: 4,
            num_shared_experts: 2,
            moe_intermediate_size: 96,
            latent_size: 64,
            attn_res_block_size: 3,
        }
    }

    /// The released Kimi K3 shapes (docs/k3-model.md §1).
    pub fn k3() -> Dims {
        Dims {
            vocab_size: 163_840,
            hidden_size: 7168,
            num_layers: 93,
            intermediate_size: 33_792,
            mla_heads: 96,
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            kda_heads: 96,
            kda_head_dim: 128,
            num_experts: 896,
            top_k: 16,
            num_shared_experts: 2,
            moe_intermediate_size: 3072,
            latent_size: 3584,
            attn_res_block_size: 12,
        }
    }

    /// K3's expert count and top-16 with narrower widths.
    pub fn k3_mini() -> Dims {
        // Widths scaled by ~2/7 from K3 where that keeps them realistic;
        // head dims, kv_lora (the MLA cache width) and vocab stay real.
        Dims {
            vocab_size: 163_840,
            hidden_size: 2048,
            num_layers: 8,
            intermediate_size: 9728,
            mla_heads: 16,
            q_lora_rank: 512,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            kda_heads: 16,
            kda_head_dim: 128,
            num_experts: 896,
            top_k: 16,
            num_shared_experts: 2,
            moe_intermediate_size: 768,
            latent_size: 1024,
            attn_res_block_size: 12,
        }
    }
}

/// 1-based layer numbers that run MLA under K3's rule: every 4th layer and
/// the last (K3: 4, 8, …, 92, 93); the rest run KDA.
pub fn full_attn_layers(num_layers: usize) -> Vec<usize> {
    (1..=num_layers)
        .filter(|&i| i % 4 == 0 || i == num_layers)
        .collect()
}

impl Dims {
    /// Id of special `offset` (0 = `[BOS]`, see `tokenizer.rs`).
    pub fn special_id(&self, offset: usize) -> usize {
        self.vocab_size - NUM_SPECIALS + offset
    }

    /// The `config.json` of this model, in the released layout.
    pub fn config_json(&self) -> Value {
        let n = self.num_layers;
        let full = full_attn_layers(n);
        let kda: Vec<usize> = (1..=n).filter(|i| !full.contains(i)).collect();
        let (bos, eos, pad) = (self.special_id(0), self.special_id(2), self.special_id(255));
        let quant = json!({
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized",
                "input_activations": null,
                "output_activations": null,
                "targets": ["Linear"],
                "weights": {
                    "actorder": null, "block_structure": null, "dynamic": false,
                    "group_size": 32, "num_bits": 4, "observer": "minmax",
                    "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                    "strategy": "group", "symmetric": true, "type": "float",
                    "zp_dtype": null
                }
            }},
            "format": "mxfp4-pack-quantized",
            "global_compression_ratio": null,
            "ignore": [
                "re:.*self_attn.*", "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
                "re:.*vision_tower.*", "re:.*mm_projector.*"
            ],
            "kv_cache_scheme": null,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed"
        });
        let text = json!({
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0,
            "architectures": ["KimiLinearForCausalLM"],
            "attn_res_block_size": self.attn_res_block_size,
            "auto_map": {
                "AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"
            },
            "bos_token_id": bos,
            "dtype": "bfloat16",
            "eos_token_id": eos,
            "first_k_dense_replace": 1,
            "hidden_act": "situ",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "kv_lora_rank": self.kv_lora_rank,
            "latent_moe_use_norm": true,
            "linear_attn_config": {
                "full_attn_layers": full,
                "gate_lower_bound": -5.0,
                "head_dim": self.kda_head_dim,
                "kda_layers": kda,
                "num_heads": self.kda_heads,
                "short_conv_kernel_size": 4,
                "use_full_rank_gate": true
            },
            "max_position_embeddings": 1_048_576,
            "mla_use_nope": true,
            "mla_use_output_gate": true,
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
            "pad_token_id": pad,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "quantization_config": quant,
            "rms_norm_eps": 1e-5,
            "routed_expert_hidden_size": self.latent_size,
            "routed_scaling_factor": 1.0,
            "tie_word_embeddings": false,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "use_cache": true,
            "use_grouped_topk": true,
            "v_head_dim": self.v_head_dim,
            "vocab_size": self.vocab_size
        });
        json!({
            "architectures": ["KimiK3ForConditionalGeneration"],
            "auto_map": {
                "AutoConfig": "configuration_kimi_k3.KimiK3Config",
                "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"
            },
            "bos_token_id": bos,
            "dtype": "bfloat16",
            "eos_token_id": eos,
            "model_type": "kimi_k3",
            "pad_token_id": pad,
            "text_config": text,
            "tie_word_embeddings": false
        })
    }

    /// The validated spec the loader will read from [`Dims::config_json`].
    pub fn spec(&self) -> Result<K3Spec> {
        Model::from(self).validate()?;
        K3Spec::from_json(&self.config_json()).map_err(|e| config_error("Kimi K3", e))
    }

    /// Bytes of tensor data of the model (headers excluded).
    pub fn data_bytes(&self) -> Result<u64> {
        Model::from(self).data_bytes()
    }
}

impl Shape for Dims {
    fn family(&self) -> &'static str {
        "kimi_k3"
    }

    fn precision(&self) -> &'static str {
        "bf16, MXFP4 routed experts (group 32, E8M0 scales)"
    }

    crate::model::knob_fields!();

    fn scale_to_hidden(&mut self, h: usize) -> Result<()> {
        Err(SynthError::Invalid(format!(
            "--hidden {h}: the K3 presets have their own widths: use tiny (hidden 128) or \
             k3-mini (hidden 2048) for a smaller K3"
        )))
    }

    fn dense_layers(&self) -> usize {
        1
    }

    fn config_json(&self) -> Value {
        Dims::config_json(self)
    }

    fn data_bytes(&self) -> Result<u64> {
        let spec =
            K3Spec::from_json(&self.config_json()).map_err(|e| config_error("Kimi K3", e))?;
        Ok(tensor_table(&spec).iter().map(TensorSpec::bytes).sum())
    }

    fn tensors(&self) -> Result<Vec<SynthTensor>> {
        let spec =
            K3Spec::from_json(&self.config_json()).map_err(|e| config_error("Kimi K3", e))?;
        Ok(tensor_table(&spec)
            .into_iter()
            .map(|t| SynthTensor {
                init: init_for(&spec, &t),
                expert: if t.role == Role::RoutedExpert {
                    expert_of(&t.name, t.layer)
                } else {
                    None
                },
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
            })
            .collect())
    }
}

/// Chooses the distribution of one tensor of the K3 table.
fn init_for(spec: &K3Spec, t: &TensorSpec) -> Init {
    let n = t.name.as_str();
    if n.ends_with("weight_packed") {
        Init::Bytes
    } else if n.ends_with("weight_scale") {
        let fan_in = if n.contains(".w2.") {
            spec.moe_intermediate_size
        } else {
            spec.latent_size
        };
        Init::Scale {
            base: scale_base(fan_in),
        }
    } else if let Some(i) = kda_init(n, spec.kda_heads) {
        i
    } else {
        let router = t.role == Role::Router;
        float_init(n, &t.shape, spec.hidden_size, router)
    }
}
