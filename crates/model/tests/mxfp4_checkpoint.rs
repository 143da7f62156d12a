//! GPT-OSS's released format (`quant_method` `mxfp4`: each stacked expert
//! matrix as `_blocks` U8 `[E, out, in/32, 16]`, E2M1 codes low nibble
//! first, and `_scales` U8 `[E, out, in/32]`, E8M0 bias 127; biases bf16)
//! read as shipped: the `gpt_oss-tiny` fixture with its experts quantized
//! here (per 32 inputs, scale 2^(⌊log2 absmax⌋ − 2), nearest E2M1), against
//! the same fixture holding the dequantised values in its own bf16 layout
//! (`gate_up_proj [E, D, 2F]`, input-major: the transpose of the blocks).
//! Same greedy tokens, logits within the difference of the two kernels'
//! summation orders; swapping the nibble order or reading the blocks in the
//! bf16 orientation moves the logits far; a NaN scale is refused.

mod common;
mod qcommon;

use std::path::PathBuf;

use common::{Golden, data};
use fathom_model::experts::ExpertFormat;
use fathom_model::{GptOssModel, LoadOptions};
use qcommon::{Tensor, Tensors, compare, e2m1, e8m0, quantize_mxfp4_group, read_fixture};
use serde_json::{Value, json};

const FIXTURE: &str = "gpt_oss-tiny";
const MATRICES: [&str; 2] = ["gate_up_proj", "down_proj"];

/// How to lay the blocks out: as released, or two wrong ways (controls).
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    Released,
    /// High nibble first.
    SwappedNibbles,
    /// `gate_up_proj`'s blocks cut from the bf16 orientation (rows = inputs;
    /// the tiny fixture's `[D, 2F]` is square, so the shapes still fit).
    InputMajor,
}

fn mxfp4_config(config: &Value) -> Value {
    let mut c = config.clone();
    c["quantization_config"] = json!({"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]});
    c
}

/// (quantized tensors, dequantised reference tensors in the bf16 layout).
fn quantize(tensors: &Tensors, layout: Layout) -> (Tensors, Tensors) {
    let (mut q, mut r) = (tensors.clone(), tensors.clone());
    for (name, t) in tensors {
        if !MATRICES
            .iter()
            .any(|m| name.ends_with(&format!("experts.{m}")))
        {
            continue;
        }
        let [e, ins, outs] = t.shape[..] else {
            panic!("{name}: {:?}", t.shape)
        };
        let w = t.bf16_values();
        let transposed = layout == Layout::InputMajor && name.ends_with("gate_up_proj");
        let (rows, cols) = if transposed { (ins, outs) } else { (outs, ins) };
        let at = |x: usize, row: usize, col: usize| {
            let (k, o) = if transposed { (row, col) } else { (col, row) };
            w[(x * ins + k) * outs + o]
        };
        let (mut blocks, mut scales) = (Vec::new(), Vec::new());
        let mut deq = vec![0f32; w.len()];
        for x in 0..e {
            for row in 0..rows {
                for g in 0..cols / 32 {
                    let vals: Vec<f32> = (0..32).map(|i| at(x, row, g * 32 + i)).collect();
                    let (s, mut b) = quantize_mxfp4_group(&vals);
                    for (i, byte) in b.iter().enumerate() {
                        // The reference reads the released order: low nibble first.
                        for (half, code) in [(0, byte & 0xF), (1, byte >> 4)] {
                            let col = g * 32 + 2 * i + half;
                            let (k, o) = if transposed { (row, col) } else { (col, row) };
                            deq[(x * ins + k) * outs + o] = e2m1(code) * e8m0(s);
                        }
                    }
                    if layout == Layout::SwappedNibbles {
                        b.iter_mut().for_each(|v| *v = v.rotate_left(4));
                    }
                    blocks.extend(b);
                    scales.push(s);
                }
            }
        }
        q.remove(name);
        q.insert(
            format!("{name}_blocks"),
            Tensor::u8(vec![e, rows, cols / 32, 16], blocks),
        );
        q.insert(
            format!("{name}_scales"),
            Tensor::u8(vec![e, rows, cols / 32], scales),
        );
        r.insert(name.clone(), Tensor::bf16_exact(t.shape.clone(), &deq));
    }
    (q, r)
}

fn copies(layout: Layout, tag: &str) -> (PathBuf, PathBuf) {
    let (config, tensors) = read_fixture(&data(FIXTURE));
    let (q, r) = quantize(&tensors, layout);
    let (qd, rd) = (
        qcommon::temp_dir(&format!("mxfp4-{tag}")),
        qcommon::temp_dir(&format!("mxfp4-{tag}-ref")),
    );
    qcommon::write_checkpoint(&qd, &mxfp4_config(&config), &q);
    qcommon::write_checkpoint(&rd, &config, &r);
    (qd, rd)
}

fn prompts() -> Vec<Vec<u32>> {
    let g = Golden::load(&data(FIXTURE));
    (0..g.prompts).map(|i| g.input_ids(i)).collect()
}

#[test]
fn released_blocks_equal_the_dequantised_reference() {
    let (qd, rd) = copies(Layout::Released, "released");
    let m = GptOssModel::load(&qd).unwrap();
    assert_eq!(m.expert_table.format, ExpertFormat::Mxfp4Bias);
    // The ledger's figures (from config.json alone) are the stored bytes.
    let facts = fathom_model::registry::memory_facts(&qd).unwrap();
    assert_eq!(facts.expert_bytes, m.expert_table.expert_bytes());
    let quantized = fathom_model::load(&qd, LoadOptions::default()).unwrap();
    let reference = fathom_model::load(&rd, LoadOptions::default()).unwrap();
    compare(
        "MXFP4 experts",
        quantized.as_ref(),
        reference.as_ref(),
        &prompts(),
        1e-3,
    );
    for d in [qd, rd] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// The wrong nibble order or orientation is caught by the comparison: the
/// reference holds what the writer meant, fathom reads the released layout.
#[test]
fn negative_controls_nibble_order_and_orientation() {
    for (layout, tag) in [
        (Layout::SwappedNibbles, "swapped"),
        (Layout::InputMajor, "input-major"),
    ] {
        let (qd, rd) = copies(layout, tag);
        let a = fathom_model::load(&qd, LoadOptions::default()).unwrap();
        let b = fathom_model::load(&rd, LoadOptions::default()).unwrap();
        let p = &prompts()[0];
        let (mut sa, mut sb) = (a.new_state(), b.new_state());
        let la = a
            .forward(sa.as_mut(), p, fathom_model::Logits::Last)
            .unwrap();
        let lb = b
            .forward(sb.as_mut(), p, fathom_model::Logits::Last)
            .unwrap();
        let d = common::max_abs_diff(&la, &lb);
        eprintln!("{tag}: max |Δlogit| {d}");
        assert!(d > 1e-2, "{tag}: {d}");
        for dir in [qd, rd] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}

#[test]
fn a_nan_scale_is_refused() {
    let (config, tensors) = read_fixture(&data(FIXTURE));
    let (mut q, _) = quantize(&tensors, Layout::Released);
    // Expert 3 of layer 1, down_proj row 5 (one group of 32 inputs per row).
    let s = "model.layers.1.mlp.experts.down_proj_scales";
    q.get_mut(s).unwrap().bytes[3 * 64 + 5] = 0xFF;
    let d = qcommon::temp_dir("mxfp4-nan");
    qcommon::write_checkpoint(&d, &mxfp4_config(&config), &q);
    let e = fathom_model::load(&d, LoadOptions::default())
        .err()
        .expect("must not load")
        .to_string();
    assert!(
        e.contains("layer 1, expert 3, matrix 1") && e.contains("0xFF") && e.contains("row 5"),
        "{e}"
    );
    std::fs::remove_dir_all(d).unwrap();
}
