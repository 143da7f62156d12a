//! Model shapes: the named presets, user overrides, the `config.json` they
//! become, and the search that picks a layer count for a target size.
//!
//! The config is written in the released layout (root `kimi_k3` wrapper,
//! `text_config` with `linear_attn_config` and `quantization_config` inside,
//! as in `crates/model/tests/data/k3-tiny/checkpoint/config.json`) and then
//! parsed back with [`K3Spec::from_json`], so the synthetic checkpoint is
//! described by exactly the code that will load it.

use fathom_model::kimi_k3::config::K3Spec;
use fathom_model::kimi_k3::tensors::tensor_table;
use serde_json::{Value, json};

use crate::error::{Result, SynthError};
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

/// The named starting points of `fathom synth --preset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// k3-tiny's shapes (hidden 128, 9 layers, 32 experts) with a vocabulary
    /// big enough for a real tokenizer (1024 ranks + 256 specials).
    Tiny,
    /// The released Kimi K3 shapes (k3-model.md §1). 93 layers is ~1.5 TB;
    /// `--layers 3` checks the byte layout at ~35 GB.
    K3,
    /// Real expert count (896) and top-16 with narrower widths, so that
    /// 10–60 GB models with K3's routing fan-out are quick to make.
    K3Mini,
}

impl Preset {
    pub const NAMES: [&'static str; 3] = ["tiny", "k3", "k3-mini"];

    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "tiny" => Ok(Preset::Tiny),
            "k3" => Ok(Preset::K3),
            "k3-mini" => Ok(Preset::K3Mini),
            _ => Err(SynthError::Invalid(format!(
                "--preset {name:?}: unknown preset (choose one of {})",
                Preset::NAMES.join(", ")
            ))),
        }
    }

    pub fn dims(self) -> Dims {
        match self {
            Preset::Tiny => Dims {
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
            },
            Preset::K3 => Dims {
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
            },
            // Widths scaled by ~2/7 from K3 where that keeps them realistic;
            // head dims, kv_lora (the MLA cache width) and vocab stay real.
            Preset::K3Mini => Dims {
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
            },
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
    /// Checks what `config.json` validation would not explain in terms of
    /// the synth flags.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(SynthError::Invalid(m));
        if self.num_layers == 0 {
            return bad("--layers must be at least 1".into());
        }
        if self.num_experts == 0 || self.top_k == 0 {
            return bad("--experts and --top-k must be at least 1".into());
        }
        if self.top_k > self.num_experts {
            return bad(format!(
                "--top-k {} exceeds the number of experts ({})",
                self.top_k, self.num_experts
            ));
        }
        if self.vocab_size <= NUM_SPECIALS + 256 {
            return bad(format!(
                "vocab_size {} leaves no room for 256 byte tokens and {NUM_SPECIALS} specials",
                self.vocab_size
            ));
        }
        Ok(())
    }

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
        self.validate()?;
        K3Spec::from_json(&self.config_json()).map_err(|e| SynthError::Invalid(e.to_string()))
    }

    /// Bytes of tensor data of the model (headers excluded).
    pub fn data_bytes(&self) -> Result<u64> {
        Ok(tensor_table(&self.spec()?).iter().map(|t| t.bytes()).sum())
    }
}

/// What the user fixed on the command line.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub layers: Option<usize>,
    pub experts: Option<usize>,
    pub top_k: Option<usize>,
    /// Aim for this many bytes of tensor data by choosing the layer count
    /// (and, below two layers' worth, the expert count).
    pub target_size: Option<u64>,
}

/// The dims chosen for a preset and overrides, and what the size search did.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub dims: Dims,
    /// Human-readable account of choices made for `--target-size`.
    pub note: Option<String>,
}

/// Applies the overrides to a preset, searching sizes if asked.
pub fn resolve(preset: Preset, o: &Overrides) -> Result<Resolved> {
    let mut d = preset.dims();
    if let Some(l) = o.layers {
        d.num_layers = l;
    }
    if let Some(e) = o.experts {
        d.num_experts = e;
    }
    if let Some(k) = o.top_k {
        d.top_k = k;
    }
    d.validate()?;
    let Some(target) = o.target_size else {
        return Ok(Resolved {
            dims: d,
            note: None,
        });
    };
    if o.layers.is_some() && o.experts.is_some() {
        return Err(SynthError::Invalid(
            "--target-size needs --layers or --experts left free to choose".into(),
        ));
    }
    let note;
    if o.layers.is_none() {
        // Total size grows with the layer count: largest count that fits,
        // then the neighbour above if it lands closer.
        let size_at = |l: usize| {
            let mut x = d.clone();
            x.num_layers = l;
            x.data_bytes()
        };
        let (mut lo, mut hi) = (1usize, 2usize);
        while size_at(hi)? <= target && hi < 1 << 14 {
            lo = hi;
            hi *= 2;
        }
        let lo = largest_fitting(lo, hi, target, size_at)?;
        let pick = if size_at(lo)?.abs_diff(target) <= size_at(lo + 1)?.abs_diff(target) {
            lo
        } else {
            lo + 1
        };
        if size_at(2)? > target && o.experts.is_none() {
            d.num_layers = 2;
            d.num_experts = search_experts(&d, target)?;
            note = Some(format!(
                "2 layers (the fewest with a MoE layer) and {} experts",
                d.num_experts
            ));
        } else {
            d.num_layers = pick.max(2);
            note = Some(format!("{} layers", d.num_layers));
        }
    } else {
        d.num_experts = search_experts(&d, target)?;
        note = Some(format!("{} experts", d.num_experts));
    }
    Ok(Resolved { dims: d, note })
}

/// Largest expert count in `top_k..=num_experts` whose model fits `target`
/// (at least `top_k`).
fn search_experts(d: &Dims, target: u64) -> Result<usize> {
    let size_at = |e: usize| {
        let mut x = d.clone();
        x.num_experts = e;
        x.data_bytes()
    };
    let (lo, hi) = (d.top_k, d.num_experts);
    if size_at(hi)? <= target {
        return Ok(hi);
    }
    largest_fitting(lo, hi, target, size_at)
}

/// Bisects `lo .. hi` for the largest count whose size fits `target`, sizes
/// growing with the count and `size_at(hi)` over it; `lo` when none above it fits.
fn largest_fitting(
    mut lo: usize,
    mut hi: usize,
    target: u64,
    size_at: impl Fn(usize) -> Result<u64>,
) -> Result<usize> {
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if size_at(mid)? <= target {
            lo = mid
        } else {
            hi = mid
        }
    }
    Ok(lo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_model::kimi_k3::config::AttnKind;

    #[test]
    fn layer_rule_matches_k3_and_tiny() {
        assert_eq!(full_attn_layers(9), vec![4, 8, 9]);
        let k3 = full_attn_layers(93);
        assert_eq!(k3.len(), 24);
        assert_eq!(&k3[k3.len() - 2..], &[92, 93]);
        let s = Preset::K3.dims().spec().unwrap();
        assert_eq!(s.attn_kinds[3], AttnKind::Mla);
        assert_eq!(s.attn_kinds[91], AttnKind::Mla);
        assert_eq!(s.attn_kinds[90], AttnKind::Kda);
        assert_eq!(s.bos_token_id, Some(163_584));
        assert_eq!(s.eos_token_id, Some(163_586));
    }

    #[test]
    fn overrides_are_checked() {
        let o = Overrides {
            top_k: Some(40),
            ..Default::default()
        };
        let e = resolve(Preset::Tiny, &o).unwrap_err().to_string();
        assert!(e.contains("--top-k 40"), "{e}");
        assert!(Preset::from_name("huge").is_err());
    }

    #[test]
    fn target_size_picks_layers_near_the_target() {
        let one = Preset::K3Mini.dims();
        let o = Overrides {
            target_size: Some(10_000_000_000),
            ..Default::default()
        };
        let r = resolve(Preset::K3Mini, &o).unwrap();
        let got = r.dims.data_bytes().unwrap();
        let per_layer = one.num_experts as u64 * 1_253_376;
        assert!(got.abs_diff(10_000_000_000) <= per_layer, "{got}");
        // Below two layers' worth the expert count shrinks instead.
        let mut small = Preset::Tiny.dims();
        small.num_layers = 2;
        small.num_experts = 10;
        let o = Overrides {
            target_size: Some(small.data_bytes().unwrap() + 100),
            ..Default::default()
        };
        let r = resolve(Preset::Tiny, &o).unwrap();
        assert_eq!(r.dims.num_layers, 2);
        assert_eq!(r.dims.num_experts, 10);
    }
}
