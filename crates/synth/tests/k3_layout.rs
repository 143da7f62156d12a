//! The `k3` preset reproduces the released tensor table (docs/k3-model.md §7.1)
//! byte for byte in its headers — checked on the plan, so CI never writes
//! the multi-GB files.

use std::collections::HashMap;

use fathom_synth::{Overrides, Plan, Preset, resolve};
use serde_json::Value;

/// name → (shape, dtype) from docs/k3-model.md §7.1, for a 3-layer K3
/// (layers 0, 1: KDA; layer 2: MLA, being the last).
fn released() -> Vec<(&'static str, Vec<usize>, &'static str)> {
    vec![
        ("embed_tokens.weight", vec![163_840, 7168], "BF16"),
        ("layers.0.input_layernorm.weight", vec![7168], "BF16"),
        (
            "layers.0.self_attention_res_proj.weight",
            vec![1, 7168],
            "BF16",
        ),
        (
            "layers.0.self_attn.q_proj.weight",
            vec![12_288, 7168],
            "BF16",
        ),
        (
            "layers.0.self_attn.q_conv1d.weight",
            vec![12_288, 1, 4],
            "F32",
        ),
        (
            "layers.0.self_attn.f_a_proj.weight",
            vec![128, 7168],
            "BF16",
        ),
        (
            "layers.0.self_attn.f_b_proj.weight",
            vec![12_288, 128],
            "BF16",
        ),
        ("layers.0.self_attn.A_log", vec![128], "F32"),
        ("layers.0.self_attn.dt_bias", vec![12_288], "F32"),
        ("layers.0.self_attn.b_proj.weight", vec![96, 7168], "BF16"),
        (
            "layers.0.self_attn.g_proj.weight",
            vec![12_288, 7168],
            "BF16",
        ),
        ("layers.0.self_attn.o_norm.weight", vec![128], "F32"),
        (
            "layers.0.self_attn.o_proj.weight",
            vec![7168, 12_288],
            "BF16",
        ),
        ("layers.0.mlp.gate_proj.weight", vec![33_792, 7168], "BF16"),
        ("layers.0.mlp.down_proj.weight", vec![7168, 33_792], "BF16"),
        (
            "layers.1.block_sparse_moe.gate.weight",
            vec![896, 7168],
            "BF16",
        ),
        (
            "layers.1.block_sparse_moe.gate.e_score_correction_bias",
            vec![896],
            "F32",
        ),
        (
            "layers.1.block_sparse_moe.routed_expert_down_proj.weight",
            vec![3584, 7168],
            "BF16",
        ),
        (
            "layers.1.block_sparse_moe.routed_expert_norm.weight",
            vec![3584],
            "BF16",
        ),
        (
            "layers.1.block_sparse_moe.routed_expert_up_proj.weight",
            vec![7168, 3584],
            "BF16",
        ),
        (
            "layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
            vec![6144, 7168],
            "BF16",
        ),
        (
            "layers.1.block_sparse_moe.shared_experts.down_proj.weight",
            vec![7168, 6144],
            "BF16",
        ),
        (
            "layers.1.block_sparse_moe.experts.895.w1.weight_packed",
            vec![3072, 1792],
            "U8",
        ),
        (
            "layers.1.block_sparse_moe.experts.895.w1.weight_scale",
            vec![3072, 112],
            "U8",
        ),
        (
            "layers.2.block_sparse_moe.experts.0.w2.weight_packed",
            vec![3584, 1536],
            "U8",
        ),
        (
            "layers.2.block_sparse_moe.experts.0.w2.weight_scale",
            vec![3584, 96],
            "U8",
        ),
        (
            "layers.2.block_sparse_moe.experts.7.w3.weight_packed",
            vec![3072, 1792],
            "U8",
        ),
        (
            "layers.2.self_attn.q_a_proj.weight",
            vec![1536, 7168],
            "BF16",
        ),
        (
            "layers.2.self_attn.q_a_layernorm.weight",
            vec![1536],
            "BF16",
        ),
        (
            "layers.2.self_attn.q_b_proj.weight",
            vec![18_432, 1536],
            "BF16",
        ),
        (
            "layers.2.self_attn.kv_a_proj_with_mqa.weight",
            vec![576, 7168],
            "BF16",
        ),
        (
            "layers.2.self_attn.kv_a_layernorm.weight",
            vec![512],
            "BF16",
        ),
        (
            "layers.2.self_attn.kv_b_proj.weight",
            vec![24_576, 512],
            "BF16",
        ),
        (
            "layers.2.self_attn.g_proj.weight",
            vec![12_288, 7168],
            "BF16",
        ),
        (
            "layers.2.self_attn.o_proj.weight",
            vec![7168, 12_288],
            "BF16",
        ),
        ("norm.weight", vec![7168], "BF16"),
        ("output_attn_res_proj.weight", vec![1, 7168], "BF16"),
    ]
}

/// Parses a planned shard header back: name → (dtype, shape, begin, end).
fn header(bytes: &[u8]) -> HashMap<String, (String, Vec<usize>, u64, u64)> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(bytes.len(), 8 + n);
    let v: Value = serde_json::from_slice(&bytes[8..]).unwrap();
    v.as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, e)| {
            let shape = e["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize);
            let off = &e["data_offsets"];
            (
                k.clone(),
                (
                    e["dtype"].as_str().unwrap().to_string(),
                    shape.collect(),
                    off[0].as_u64().unwrap(),
                    off[1].as_u64().unwrap(),
                ),
            )
        })
        .collect()
}

#[test]
fn k3_with_three_layers_matches_the_released_table() {
    let o = Overrides {
        layers: Some(3),
        ..Default::default()
    };
    let model = resolve(Preset::K3, &o).unwrap().model;
    let plan = Plan::new(model, 0, fathom_synth::DEFAULT_SHARD_SIZE).unwrap();
    assert!(plan.shards.len() >= 8, "{} shards", plan.shards.len());
    let mut all = HashMap::new();
    for s in &plan.shards {
        for (k, v) in header(&s.header) {
            all.insert(k, (s.file_name.clone(), v));
        }
    }
    for (name, shape, dtype) in released() {
        let full = format!("language_model.model.{name}");
        let (_, (dt, sh, _, _)) = all.get(&full).unwrap_or_else(|| panic!("{full} missing"));
        assert_eq!((dt.as_str(), sh), (dtype, &shape), "{full}");
    }
    let head = &all["language_model.lm_head.weight"].1;
    assert_eq!(head.1, vec![163_840, 7168]);

    // Each expert's six tensors are adjacent, in name order, in one shard.
    for (layer, e) in [(1, 0), (1, 413), (2, 895)] {
        let pre = format!("language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.");
        let parts: Vec<_> = ["w1", "w2", "w3"]
            .iter()
            .flat_map(|m| ["weight_packed", "weight_scale"].map(|p| format!("{pre}{m}.{p}")))
            .map(|n| all[&n].clone())
            .collect();
        for w in parts.windows(2) {
            assert_eq!(w[0].0, w[1].0, "expert {layer}/{e} straddles shards");
            assert_eq!(w[0].1.3, w[1].1.2, "expert {layer}/{e} is not contiguous");
        }
    }
    // Index: every tensor once, total size = Σ tensor bytes.
    let index: serde_json::Value = serde_json::from_slice(&plan.index_bytes()).unwrap();
    assert_eq!(index["weight_map"].as_object().unwrap().len(), all.len());
    let total: u64 = all.values().map(|(_, (_, _, b, e))| e - b).sum();
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total));
}
