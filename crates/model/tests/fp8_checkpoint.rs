//! DeepSeek-V3's released FP8 format (`quant_method` `fp8`, E4M3 weights
//! with `weight_scale_inv` tile scales) read as shipped: the
//! `deepseek_v3-tiny` fixture with every linear weight of attention, the
//! dense MLP, the shared and the routed experts quantized here (tile
//! absmax / 448, nearest E4M3), against the same fixture holding those
//! weights dequantised by the test's own decoder (f32). Both give the same
//! logits and greedy tokens, for the released 128×128 tiles and for small
//! tiles that cut every matrix into many; corrupt codes and scales are
//! refused by name; unsupported variants name what is supported.

mod common;
mod qcommon;

use std::path::PathBuf;

use common::{Golden, data};
use fathom_model::experts::ExpertFormat;
use fathom_model::linear::WeightData;
use fathom_model::{DeepseekV3Model, LoadOptions};
use qcommon::{Tensor, Tensors, compare, dequantize_fp8, quantize_fp8, read_fixture};
use serde_json::{Value, json};

const FIXTURE: &str = "deepseek_v3-tiny";

/// A linear weight the release stores in FP8 (not the router `mlp.gate`,
/// the embedding or the head).
fn quantized_in_release(name: &str) -> bool {
    name.ends_with("_proj.weight") || name.ends_with("kv_a_proj_with_mqa.weight")
}

fn fp8_config(config: &Value, block: [usize; 2]) -> Value {
    let mut c = config.clone();
    c["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3",
        "activation_scheme": "dynamic", "weight_block_size": block});
    c
}

/// (quantized tensors, dequantised reference tensors).
fn quantize(tensors: &Tensors, block: [usize; 2]) -> (Tensors, Tensors) {
    let (mut q, mut r) = (tensors.clone(), tensors.clone());
    let mut n = 0;
    for (name, t) in tensors {
        if !quantized_in_release(name) {
            continue;
        }
        let [rows, cols] = t.shape[..] else {
            panic!("{name}: {:?}", t.shape)
        };
        let (codes, scale) = quantize_fp8(&t.bf16_values(), rows, cols, block);
        let deq = dequantize_fp8(&codes, &scale, cols, block);
        let grid = vec![rows.div_ceil(block[0]), cols.div_ceil(block[1])];
        q.insert(
            name.clone(),
            Tensor {
                dtype: "F8_E4M3".into(),
                shape: t.shape.clone(),
                bytes: codes,
            },
        );
        q.insert(format!("{name}_scale_inv"), Tensor::f32(grid, &scale));
        r.insert(name.clone(), Tensor::f32(t.shape.clone(), &deq));
        n += 1;
    }
    // 4 layers × 5 attention matrices, 3 dense, 3 × (3 shared + 16 × 3 routed).
    assert_eq!(n, 20 + 3 + 3 * (3 + 48));
    (q, r)
}

/// Writes the quantized copy and its dequantised reference.
fn copies(block: [usize; 2], tag: &str) -> (PathBuf, PathBuf) {
    let (config, tensors) = read_fixture(&data(FIXTURE));
    let (q, r) = quantize(&tensors, block);
    let (qd, rd) = (
        qcommon::temp_dir(&format!("fp8-{tag}")),
        qcommon::temp_dir(&format!("fp8-{tag}-ref")),
    );
    qcommon::write_checkpoint(&qd, &fp8_config(&config, block), &q);
    qcommon::write_checkpoint(&rd, &config, &r);
    (qd, rd)
}

fn prompts() -> Vec<Vec<u32>> {
    let g = Golden::load(&data(FIXTURE));
    (0..g.prompts).map(|i| g.input_ids(i)).collect()
}

fn same_as_dequantised(block: [usize; 2], tag: &str) {
    let (qd, rd) = copies(block, tag);
    // The quantized copy really runs FP8: spine and experts.
    let m = DeepseekV3Model::load(&qd).unwrap();
    assert_eq!(m.expert_table.format, ExpertFormat::Fp8 { block });
    let a = &m.weights.layers.resident_layer(2).unwrap().self_attn;
    assert!(matches!(a.o_proj.data, WeightData::Fp8 { .. }));
    assert!(matches!(a.kv_b_proj.uv.data, WeightData::Fp8 { .. }));
    // `--spine int8` leaves FP8 matrices FP8 (the bf16 head becomes int8).
    let mut m8 = DeepseekV3Model::load(&qd).unwrap();
    m8.weights.quantize_spine_int8();
    assert!(matches!(
        m8.weights
            .layers
            .resident_layer(2)
            .unwrap()
            .self_attn
            .o_proj
            .data,
        WeightData::Fp8 { .. }
    ));
    assert!(matches!(
        m8.weights.lm_head.resident().unwrap().data,
        WeightData::Int8 { .. }
    ));
    // The ledger's figures (from config.json alone) are the stored bytes.
    let facts = fathom_model::registry::memory_facts(&qd).unwrap();
    assert_eq!(facts.expert_bytes, m.expert_table.expert_bytes());
    let ck = fathom_weights::Checkpoint::open(&qd).unwrap();
    let spine: u64 = ck
        .tensors()
        .filter(|(n, _)| !n.contains(".mlp.experts."))
        .map(|(_, l)| l.len)
        .sum();
    assert_eq!(facts.spine_bytes, spine);
    let quantized = fathom_model::load(&qd, LoadOptions::default()).unwrap();
    let reference = fathom_model::load(&rd, LoadOptions::default()).unwrap();
    let what = format!("FP8 {block:?} tiles");
    let worst = compare(
        &what,
        quantized.as_ref(),
        reference.as_ref(),
        &prompts(),
        1e-3,
    );
    // Each weight is the same f32 either way and the lanes are the same:
    // the fused kernel equals dequantise-then-multiply exactly.
    assert_eq!(worst, 0.0, "{what}");
    // How far the quantization itself moves the float fixture (context only).
    let float = fathom_model::load(&data(FIXTURE), LoadOptions::default()).unwrap();
    let mut st = (float.new_state(), quantized.new_state());
    let p = &prompts()[0];
    let x = float.forward(st.0.as_mut(), p, fathom_model::Logits::Last);
    let y = quantized.forward(st.1.as_mut(), p, fathom_model::Logits::Last);
    eprintln!(
        "{what}: quantization error vs the float fixture: {:e}",
        common::max_abs_diff(&x.unwrap(), &y.unwrap())
    );
    for d in [qd, rd] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn released_128_tiles_equal_the_dequantised_reference() {
    same_as_dequantised([128, 128], "128");
}

/// 16×32 tiles: every matrix spans several tiles each way, partial ones at
/// its edges, and `kv_b_proj`'s per-head row blocks start mid-grid.
#[test]
fn small_tiles_equal_the_dequantised_reference() {
    same_as_dequantised([16, 32], "16x32");
}

/// Layers held for the device (`LayerPlan::device`) keep their FP8 codes
/// mapped from the checkpoint, not read; with no device the CPU computes
/// them from the map, with the resident model's logits.
#[test]
fn held_fp8_layers_are_mapped_and_give_the_resident_logits() {
    let (qd, rd) = copies([16, 32], "held");
    let resident = fathom_model::load(&qd, LoadOptions::default()).unwrap();
    let layers = fathom_model::ModelConfig::read(&qd)
        .unwrap()
        .memory_facts()
        .unwrap()
        .layers
        .len();
    let opts = LoadOptions {
        layers: fathom_model::LayerPlan {
            device: vec![true; layers],
            ..fathom_model::LayerPlan::streamed(0, 2)
        },
        ..Default::default()
    };
    let m =
        DeepseekV3Model::load_config(&fathom_model::ModelConfig::read(&qd).unwrap(), opts).unwrap();
    assert_eq!(m.weights.layers.on_device(), layers);
    let a = &m.weights.layers.resident_layer(2).unwrap().self_attn;
    assert!(matches!(a.o_proj.data, WeightData::Fp8 { .. }) && a.o_proj.is_held());
    let worst = compare("held FP8", &m, resident.as_ref(), &prompts(), 0.0);
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
fn corrupt_codes_and_scales_are_refused_by_name() {
    let block = [128, 128];
    let (config, tensors) = read_fixture(&data(FIXTURE));
    let (q, _) = quantize(&tensors, block);
    let config = fp8_config(&config, block);
    let nan = f32::NAN.to_le_bytes();

    let mut t = q.clone();
    let s = "model.layers.2.self_attn.q_a_proj.weight_scale_inv";
    t.get_mut(s).unwrap().bytes[..4].copy_from_slice(&nan);
    let e = load_err(&config, &t, "fp8-nan-scale");
    assert!(e.contains(s) && e.contains("not finite"), "{e}");

    let mut t = q.clone();
    let w = "model.layers.1.self_attn.o_proj.weight";
    t.get_mut(w).unwrap().bytes[70] = 0xFF;
    let e = load_err(&config, &t, "fp8-nan-code");
    assert!(
        e.contains(w) && e.contains("0xff") && e.contains("[1, 6]"),
        "{e}"
    );

    let mut t = q.clone();
    let s = "model.layers.3.mlp.experts.5.up_proj.weight_scale_inv";
    t.get_mut(s).unwrap().bytes[..4].copy_from_slice(&nan);
    let e = load_err(&config, &t, "fp8-nan-expert");
    assert!(
        e.contains("layer 3, expert 5, matrix 2") && e.contains("not finite"),
        "{e}"
    );

    let mut t = q.clone();
    let w = "model.layers.1.mlp.experts.0.gate_proj.weight";
    t.get_mut(w).unwrap().bytes[3] = 0x7F;
    let e = load_err(&config, &t, "fp8-nan-expert-code");
    assert!(
        e.contains("layer 1, expert 0, matrix 0") && e.contains("0x7f"),
        "{e}"
    );
}

#[test]
fn mismatches_and_unsupported_variants_say_what_is_read() {
    let (config, tensors) = read_fixture(&data(FIXTURE));
    let (q, _) = quantize(&tensors, [128, 128]);
    // FP8 tensors without the config's say-so.
    let e = load_err(&config, &q, "fp8-no-config");
    assert!(
        e.contains("F8_E4M3") && e.contains("q_a_proj.weight"),
        "{e}"
    );
    // A scale grid for another tile.
    let e = load_err(&fp8_config(&config, [64, 64]), &q, "fp8-other-tile");
    assert!(e.contains("_scale_inv: shape [1, 1], expected"), "{e}");
    for (edit, want) in [
        (
            json!({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}),
            "e5m2",
        ),
        (
            json!({"quant_method": "fp8", "fmt": "e4m3"}),
            "weight_block_size",
        ),
        (json!({"quant_method": "awq", "bits": 4}), "\"awq\""),
        (
            json!({"quant_method": "compressed-tensors", "format": "float-quantized"}),
            "float-quantized",
        ),
    ] {
        let mut c = config.clone();
        c["quantization_config"] = edit;
        let e = load_err(&c, &q, "fp8-unsupported");
        assert!(
            e.contains(want) && e.contains("supported: quant_method \"fp8\""),
            "{e}"
        );
    }
}
