//! Kimi K2 Thinking's released format (`compressed-tensors`
//! `pack-quantized`: symmetric INT4 routed experts, a bf16 scale per 32
//! inputs, eight codes per int32 with the first column lowest) read as
//! shipped: the `kimi_k2-tiny` fixture with its routed experts quantized
//! here (group absmax / 7, round, clamp to −8..7) and K2 Thinking's
//! `ignore` list keeping attention, shared experts and the dense MLP bf16,
//! against the same fixture holding the experts dequantised by the test's
//! own decoder (f32). Same logits and greedy tokens; a corrupt scale is
//! refused; configs this reader does not implement say what it reads.

mod common;
mod qcommon;

use std::path::PathBuf;

use common::{Golden, data};
use fathom_model::experts::ExpertFormat;
use fathom_model::{CausalLm, DeepseekV3Model, LoadOptions};
use qcommon::{Tensor, Tensors, compare, dequantize_int4, quantize_int4, read_fixture};
use serde_json::{Value, json};

const FIXTURE: &str = "kimi_k2-tiny";
const GROUP: usize = 32;

/// K2 Thinking's `quantization_config` (its fields, in its shape).
fn int4_config(config: &Value) -> Value {
    let mut c = config.clone();
    c["model_type"] = "kimi_k2".into();
    c["quantization_config"] = json!({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": null,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "input_activations": null,
            "output_activations": null,
            "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
                "group_size": GROUP, "dynamic": false, "actorder": null,
                "block_structure": null, "observer": "minmax", "observer_kwargs": {}}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
    });
    c
}

/// (quantized tensors, dequantised reference tensors).
fn quantize(tensors: &Tensors) -> (Tensors, Tensors) {
    let (mut q, mut r) = (tensors.clone(), tensors.clone());
    let mut n = 0;
    for (name, t) in tensors {
        if !name.contains(".mlp.experts.") {
            continue;
        }
        let [rows, cols] = t.shape[..] else {
            panic!("{name}: {:?}", t.shape)
        };
        let module = name.strip_suffix(".weight").unwrap();
        let (words, scales) = quantize_int4(&t.bf16_values(), rows, cols, GROUP);
        let deq = dequantize_int4(&words, &scales, cols, GROUP);
        q.remove(name);
        q.insert(
            format!("{module}.weight_packed"),
            Tensor::i32(vec![rows, cols / 8], &words),
        );
        q.insert(
            format!("{module}.weight_scale"),
            Tensor {
                dtype: "BF16".into(),
                shape: vec![rows, cols / GROUP],
                bytes: scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            },
        );
        q.insert(
            format!("{module}.weight_shape"),
            Tensor::i32(vec![2], &[rows as i32, cols as i32]),
        );
        r.insert(name.clone(), Tensor::f32(t.shape.clone(), &deq));
        n += 1;
    }
    assert_eq!(n, 3 * 32 * 3, "three MoE layers of 32 experts");
    (q, r)
}

fn copies() -> (PathBuf, PathBuf) {
    let (config, tensors) = read_fixture(&data(FIXTURE));
    let (q, r) = quantize(&tensors);
    let (qd, rd) = (qcommon::temp_dir("int4"), qcommon::temp_dir("int4-ref"));
    qcommon::write_checkpoint(&qd, &int4_config(&config), &q);
    let mut rc = config.clone();
    rc["model_type"] = "kimi_k2".into();
    qcommon::write_checkpoint(&rd, &rc, &r);
    (qd, rd)
}

#[test]
fn packed_experts_equal_the_dequantised_reference() {
    let (qd, rd) = copies();
    let m = DeepseekV3Model::load(&qd).unwrap();
    assert_eq!(m.expert_table.format, ExpertFormat::Int4 { group: GROUP });
    assert_eq!(m.info().model_type, "kimi_k2");
    // The ledger's figures (from config.json alone) are the stored bytes.
    let facts = fathom_model::registry::memory_facts(&qd).unwrap();
    assert_eq!(facts.expert_bytes, m.expert_table.expert_bytes());
    let quantized = fathom_model::load(&qd, LoadOptions::default()).unwrap();
    let reference = fathom_model::load(&rd, LoadOptions::default()).unwrap();
    let g = Golden::load(&data(FIXTURE));
    let prompts: Vec<Vec<u32>> = (0..g.prompts).map(|i| g.input_ids(i)).collect();
    let worst = compare(
        "INT4 experts",
        quantized.as_ref(),
        reference.as_ref(),
        &prompts,
        1e-3,
    );
    // Every weight (code − 8) · scale is exact in f32 and the lanes match.
    assert_eq!(worst, 0.0);
    for d in [qd, rd] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

fn load_err(config: &Value, tensors: &Tensors, tag: &str) -> String {
    let d = qcommon::temp_dir(tag);
    qcommon::write_checkpoint(&d, config, tensors);
    let e = fathom_model::load(&d, LoadOptions::default())
        .err()
        .expect("must not load")
        .to_string();
    std::fs::remove_dir_all(d).unwrap();
    e
}

#[test]
fn a_nan_scale_is_refused() {
    let (config, tensors) = read_fixture(&data(FIXTURE));
    let (mut q, _) = quantize(&tensors);
    let s = "model.layers.2.mlp.experts.9.down_proj.weight_scale";
    // Row 3's only group (down_proj has 32 inputs): a bf16 NaN.
    q.get_mut(s).unwrap().bytes[6..8].copy_from_slice(&0x7FC0u16.to_le_bytes());
    let e = load_err(&int4_config(&config), &q, "int4-nan");
    assert!(
        e.contains("layer 2, expert 9, matrix 1")
            && e.contains("row 3")
            && e.contains("not finite"),
        "{e}"
    );
}

#[test]
fn configs_it_does_not_implement_say_what_it_reads() {
    let (config, tensors) = read_fixture(&data(FIXTURE));
    let (q, _) = quantize(&tensors);
    let base = int4_config(&config);
    // An ignore list that leaves attention quantized: only experts are read packed.
    let mut c = base.clone();
    c["quantization_config"]["ignore"] = json!([
        "lm_head",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"
    ]);
    let e = load_err(&c, &q, "int4-attn");
    assert!(
        e.contains("self_attn.o_proj") && e.contains("only routed experts"),
        "{e}"
    );
    let w = "/quantization_config/config_groups/group_0/weights";
    for (field, value, want) in [
        ("num_bits", json!(8), "num_bits: = 8"),
        ("symmetric", json!(false), "symmetric: = false"),
        ("group_size", json!(48), "group_size: = 48"),
        ("actorder", json!("group"), "actorder"),
    ] {
        let mut c = base.clone();
        c.pointer_mut(w).unwrap()[field] = value;
        let e = load_err(&c, &q, "int4-field");
        assert!(
            e.contains(want) && e.contains("supported: quant_method \"fp8\""),
            "{field}: {e}"
        );
    }
    // The experts left float by `ignore`, while the file holds them packed.
    let mut c = base.clone();
    c["quantization_config"]["ignore"]
        .as_array_mut()
        .unwrap()
        .push("re:.*experts.*".into());
    let e = load_err(&c, &q, "int4-ignored-experts");
    assert!(
        e.contains("missing tensor model.layers.1.mlp.experts.0.gate_proj.weight"),
        "{e}"
    );
}
