//! DeepSeek-V3 and Kimi K2 (`deepseek_v3` / `kimi_k2`): MLA attention with
//! low-rank queries, dense first layers, sigmoid-routed experts with a
//! shared expert, in the released precisions — FP8 E4M3 with 128×128
//! block scales on every linear weight of attention, the dense MLP and the
//! experts (DeepSeek-V3, Kimi K2), or INT4 pack-quantized routed experts,
//! group 32, with bf16 elsewhere (Kimi K2 Thinking). Embedding, norms,
//! routers and the head are bf16, the score-correction bias f32. The
//! stored tensors are the family table's `stored_parts`.
//!
//! Like the DeepSeek-V3 release, the `deepseek-v3` preset carries one
//! multi-token-prediction layer (index `num_layers`,
//! `num_nextn_predict_layers` 1: the family's `mtp_tensor_table`), which
//! `fathom run --draft mtp` drafts with; the Kimi K2 releases ship none.

use fathom_model::deepseek_v3::config::DeepseekV3Spec;
use fathom_model::deepseek_v3::tensors::{Role, mtp_tensor_table, tensor_table};
use fathom_weights::Dtype;
use serde_json::{Value, json};

use crate::error::Result;
use crate::init::{Init, float_init, fp8_scale, int4_scale};
use crate::model::{
    Shape, SynthTensor, check_hidden, config_error, expert_of, round32, scale_heads, special_id,
};

/// How the weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// FP8 E4M3, 128×128 tiles (DeepSeek-V3, Kimi K2).
    Fp8,
    /// INT4 routed experts, group 32; bf16 elsewhere (Kimi K2 Thinking).
    Int4Experts,
}

/// Every width of a DeepSeek-V3-shaped model (field names follow `config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct DeepseekDims {
    pub model_type: &'static str,
    pub precision: Precision,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub first_k_dense_replace: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    /// Expert groups and groups kept as released; [`groups`] fits them to
    /// the expert count.
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f64,
    pub rope_theta: f64,
    /// YaRN: factor, beta_fast, beta_slow (original context 4096, mscale 1).
    pub yarn: [f64; 3],
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
}

impl DeepseekDims {
    /// DeepSeek-V3 (671B total, 37B active).
    pub fn deepseek_v3() -> Self {
        DeepseekDims {
            model_type: "deepseek_v3",
            precision: Precision::Fp8,
            vocab_size: 129_280,
            hidden_size: 7168,
            num_layers: 61,
            intermediate_size: 18_432,
            num_heads: 128,
            q_lora_rank: 1536,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            first_k_dense_replace: 3,
            num_experts: 256,
            top_k: 8,
            num_shared_experts: 1,
            moe_intermediate_size: 2048,
            n_group: 8,
            topk_group: 4,
            routed_scaling_factor: 2.5,
            rope_theta: 10_000.0,
            yarn: [40.0, 32.0, 1.0],
            max_position_embeddings: 163_840,
            rms_norm_eps: 1e-6,
        }
    }

    /// Kimi K2 Instruct (1T total, 32B active).
    pub fn kimi_k2() -> Self {
        DeepseekDims {
            model_type: "kimi_k2",
            vocab_size: 163_840,
            num_heads: 64,
            first_k_dense_replace: 1,
            num_experts: 384,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 2.827,
            rope_theta: 50_000.0,
            yarn: [32.0, 1.0, 1.0],
            max_position_embeddings: 131_072,
            ..Self::deepseek_v3()
        }
    }

    /// Kimi K2 Thinking: K2 with INT4 experts and a 256K context.
    pub fn kimi_k2_thinking() -> Self {
        DeepseekDims {
            precision: Precision::Int4Experts,
            yarn: [64.0, 1.0, 1.0],
            max_position_embeddings: 262_144,
            ..Self::kimi_k2()
        }
    }
}

/// `(n_group, topk_group)` for `e` experts and top-`k`: the released
/// grouping where it divides the experts (groups of at least 2), else the
/// largest group count below it that does; enough groups kept to hold top-k.
pub fn groups(e: usize, k: usize, n_group: usize, topk_group: usize) -> (usize, usize) {
    for g in (1..=n_group.max(1)).rev() {
        if !e.is_multiple_of(g) || (g > 1 && e / g < 2) {
            continue;
        }
        let mut tg = topk_group.clamp(1, g);
        while tg < g && k > tg * (e / g) {
            tg += 1;
        }
        if k <= tg * (e / g) {
            return (g, tg);
        }
    }
    (1, 1)
}

fn quantization_config(p: Precision) -> Value {
    match p {
        Precision::Fp8 => json!({
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128]
        }),
        Precision::Int4Experts => json!({
            "config_groups": {"group_0": {
                "input_activations": null,
                "output_activations": null,
                "targets": ["Linear"],
                "weights": {
                    "actorder": null, "block_structure": null, "dynamic": false,
                    "group_size": 32, "num_bits": 4, "observer": "minmax",
                    "observer_kwargs": {}, "strategy": "group", "symmetric": true,
                    "type": "int"
                }
            }},
            "format": "pack-quantized",
            "ignore": [
                "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"
            ],
            "kv_cache_scheme": null,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed"
        }),
    }
}

impl Shape for DeepseekDims {
    fn family(&self) -> &'static str {
        "deepseek_v3"
    }

    fn precision(&self) -> &'static str {
        match self.precision {
            Precision::Fp8 => "FP8 E4M3 linear weights (128×128 f32 block scales), bf16 rest",
            Precision::Int4Experts => "INT4 routed experts (group 32, bf16 scales), bf16 rest",
        }
    }

    crate::model::knob_fields!();

    fn scale_to_hidden(&mut self, h: usize) -> Result<()> {
        check_hidden(h)?;
        let s = h as f64 / self.hidden_size as f64;
        self.hidden_size = h;
        self.num_heads = scale_heads(self.num_heads, s);
        self.q_lora_rank = round32(self.q_lora_rank as f64 * s);
        self.kv_lora_rank = round32(self.kv_lora_rank as f64 * s);
        self.intermediate_size = round32(self.intermediate_size as f64 * s);
        self.moe_intermediate_size = round32(self.moe_intermediate_size as f64 * s);
        Ok(())
    }

    fn dense_layers(&self) -> usize {
        self.first_k_dense_replace
    }

    fn config_json(&self) -> Value {
        let (g, tg) = groups(self.num_experts, self.top_k, self.n_group, self.topk_group);
        let v = self.vocab_size;
        let [factor, beta_fast, beta_slow] = self.yarn;
        json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": special_id(v, 0),
            "eos_token_id": special_id(v, 1),
            "first_k_dense_replace": self.first_k_dense_replace,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "kv_lora_rank": self.kv_lora_rank,
            "max_position_embeddings": self.max_position_embeddings,
            "model_type": self.model_type,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_layer_freq": 1,
            "n_group": g,
            "n_routed_experts": self.num_experts,
            "n_shared_experts": self.num_shared_experts,
            "norm_topk_prob": true,
            "num_attention_heads": self.num_heads,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_heads,
            "num_nextn_predict_layers": usize::from(self.model_type == "deepseek_v3"),
            "pad_token_id": special_id(v, 255),
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "quantization_config": quantization_config(self.precision),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": {
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
                "factor": factor,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "type": "yarn"
            },
            "rope_theta": self.rope_theta,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": "sigmoid",
            "tie_word_embeddings": false,
            "topk_group": tg,
            "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16",
            "use_cache": true,
            "v_head_dim": self.v_head_dim,
            "vocab_size": v
        })
    }

    fn tensors(&self) -> Result<Vec<SynthTensor>> {
        let spec = DeepseekV3Spec::from_json(&self.config_json())
            .map_err(|e| config_error("DeepSeek-V3 / Kimi K2", e))?;
        let mut out = Vec::new();
        for t in tensor_table(&spec)
            .into_iter()
            .chain(mtp_tensor_table(&spec))
        {
            let expert = (t.role == Role::RoutedExpert)
                .then(|| expert_of(&t.name, t.layer))
                .flatten();
            let fan_in = *t.shape.last().unwrap_or(&1);
            for (name, dtype, shape) in t.stored_parts() {
                let init = if dtype == Dtype::F8_E4M3 {
                    Init::E4m3
                } else if name.ends_with("_scale_inv") {
                    fp8_scale(fan_in)
                } else if name.ends_with(".weight_packed") {
                    Init::Int4
                } else if name.ends_with(".weight_scale") {
                    int4_scale(fan_in)
                } else if name.ends_with(".weight_shape") {
                    Init::I32Pair([t.shape[0] as i32, t.shape[1] as i32])
                } else {
                    float_init(&name, &shape, spec.hidden_size, t.role == Role::Router)
                };
                out.push(SynthTensor {
                    name,
                    dtype,
                    shape,
                    init,
                    expert,
                });
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_follow_the_expert_count() {
        assert_eq!(groups(256, 8, 8, 4), (8, 4));
        assert_eq!(groups(16, 8, 8, 4), (8, 4));
        // Groups of one are refused by the loader: fewer, larger groups.
        assert_eq!(groups(8, 8, 8, 4), (4, 4));
        assert_eq!(groups(10, 4, 8, 4), (5, 4));
        assert_eq!(groups(7, 3, 8, 4), (1, 1));
        assert_eq!(groups(384, 8, 1, 1), (1, 1));
    }

    #[test]
    fn released_parts_and_dtypes() {
        let mut d = DeepseekDims::kimi_k2_thinking();
        d.num_layers = 2;
        d.num_experts = 4;
        d.top_k = 2;
        let t = d.tensors().unwrap();
        let get = |n: &str| t.iter().find(|x| x.name == n).unwrap();
        let p = get("model.layers.1.mlp.experts.3.down_proj.weight_packed");
        assert_eq!((p.dtype, &p.shape[..]), (Dtype::I32, &[7168, 256][..]));
        assert_eq!(p.expert, Some((1, 3)));
        let s = get("model.layers.1.mlp.experts.3.down_proj.weight_shape");
        assert_eq!(s.init, Init::I32Pair([7168, 2048]));
        assert_eq!(
            get("model.layers.1.self_attn.o_proj.weight").dtype,
            Dtype::BF16
        );
        let fp8 = DeepseekDims::deepseek_v3();
        let mut d = fp8.clone();
        d.num_layers = 4;
        let t = d.tensors().unwrap();
        let get = |n: &str| t.iter().find(|x| x.name == n).unwrap();
        let w = get("model.layers.3.mlp.experts.255.up_proj.weight");
        assert_eq!((w.dtype, w.init), (Dtype::F8_E4M3, Init::E4m3));
        let s = get("model.layers.0.self_attn.q_b_proj.weight_scale_inv");
        assert_eq!((s.dtype, &s.shape[..]), (Dtype::F32, &[192, 12][..]));
        let r = get("model.layers.3.mlp.gate.e_score_correction_bias");
        assert_eq!(r.dtype, Dtype::F32);
        assert_eq!(get("lm_head.weight").dtype, Dtype::BF16);
    }
}
