//! Quantized copies of the tiny fixtures, made in the test (the fixtures
//! carry float weights only), and the checks every quantized format gets.
//!
//! For a format, a test writes two checkpoints in a temporary directory:
//! the fixture with its chosen tensors quantized by a simple deterministic
//! quantizer, in the released layout with the released
//! `quantization_config`; and the fixture with each of those tensors
//! replaced by its dequantised values, computed here by a scalar decoder
//! written from the format's definition (nothing of fathom's kernels).
//! fathom must give the same logits and greedy tokens on both.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fathom_model::{CausalLm, Logits};
use fathom_weights::Checkpoint;
use serde_json::Value;

/// One tensor to write: safetensors dtype name, shape, little-endian bytes.
#[derive(Clone)]
pub struct Tensor {
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl Tensor {
    pub fn f32(shape: Vec<usize>, v: &[f32]) -> Tensor {
        Tensor {
            dtype: "F32".into(),
            shape,
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// bf16 values that must be exact (asserted).
    pub fn bf16_exact(shape: Vec<usize>, v: &[f32]) -> Tensor {
        let bytes = v
            .iter()
            .flat_map(|&x| {
                let h = (x.to_bits() >> 16) as u16;
                assert_eq!(bf16(h).to_bits(), x.to_bits(), "{x} is not a bf16 value");
                h.to_le_bytes()
            })
            .collect();
        Tensor {
            dtype: "BF16".into(),
            shape,
            bytes,
        }
    }

    pub fn u8(shape: Vec<usize>, v: Vec<u8>) -> Tensor {
        Tensor {
            dtype: "U8".into(),
            shape,
            bytes: v,
        }
    }

    pub fn i32(shape: Vec<usize>, v: &[i32]) -> Tensor {
        Tensor {
            dtype: "I32".into(),
            shape,
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// The values of a BF16 tensor.
    pub fn bf16_values(&self) -> Vec<f32> {
        assert_eq!(self.dtype, "BF16");
        self.bytes
            .chunks_exact(2)
            .map(|b| bf16(u16::from_le_bytes([b[0], b[1]])))
            .collect()
    }
}

pub type Tensors = BTreeMap<String, Tensor>;

pub fn bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 → bf16 bits, round to nearest even (finite inputs).
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// The fixture's config and every tensor.
pub fn read_fixture(dir: &Path) -> (Value, Tensors) {
    let config =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let tensors = ck
        .tensors()
        .map(|(name, loc)| {
            let t = Tensor {
                dtype: format!("{:?}", loc.dtype),
                shape: loc.shape.clone(),
                bytes: ck.read(loc).unwrap(),
            };
            (name.to_string(), t)
        })
        .collect();
    (config, tensors)
}

/// A fresh directory under the system temp dir, unique to this process.
pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fathom-q-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes `config.json` and a single `model.safetensors` (header JSON
/// padded to 8 bytes, tensors in name order).
pub fn write_checkpoint(dir: &Path, config: &Value, tensors: &Tensors) {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for (name, t) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": t.dtype, "shape": t.shape,
                "data_offsets": [at, at + t.bytes.len()]}),
        );
        at += t.bytes.len();
    }
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    for t in tensors.values() {
        out.extend_from_slice(&t.bytes);
    }
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
}

// ---- A multi-token-prediction layer (the fixtures carry none) ----

/// How the written MTP layer combines its two inputs.
#[derive(Clone, Copy, PartialEq)]
pub enum Mix {
    /// `[0 | I]`, outputs zeroed: passes `hnorm(h)` through.
    Hidden,
    /// `[I | 0]`, outputs zeroed: passes `enorm(embed(t))` through.
    Embedding,
    /// `[I/2 | I/2]`, layer 3's weights unchanged: a working layer.
    Working,
}

/// A copy of deepseek_v3-tiny (at `fixture`) with a multi-token-prediction
/// layer at index 4: layer 3's weights, plus `enorm`, `hnorm` (ones),
/// `eh_proj` as `mix` says and the shared head (`lm_head`'s copy).
pub fn with_mtp(fixture: &Path, tag: &str, mix: Mix) -> PathBuf {
    let (mut config, mut tensors) = read_fixture(fixture);
    let d = config["hidden_size"].as_u64().unwrap() as usize;
    config["num_nextn_predict_layers"] = 1.into();
    let copied: Vec<(String, Tensor)> = tensors
        .iter()
        .filter_map(|(n, t)| {
            let rest = n.strip_prefix("model.layers.3.")?;
            let mut t = t.clone();
            let output = rest.ends_with("o_proj.weight") || rest.ends_with("down_proj.weight");
            if mix != Mix::Working && output {
                t.bytes.iter_mut().for_each(|b| *b = 0);
            }
            Some((format!("model.layers.4.{rest}"), t))
        })
        .collect();
    tensors.extend(copied);
    let ones = vec![1f32; d];
    for n in ["enorm", "hnorm", "shared_head.norm"] {
        tensors.insert(
            format!("model.layers.4.{n}.weight"),
            Tensor::f32(vec![d], &ones),
        );
    }
    let mut eh = vec![0f32; d * 2 * d];
    for i in 0..d {
        match mix {
            Mix::Hidden => eh[i * 2 * d + d + i] = 1.0,
            Mix::Embedding => eh[i * 2 * d + i] = 1.0,
            Mix::Working => {
                eh[i * 2 * d + i] = 0.5;
                eh[i * 2 * d + d + i] = 0.5;
            }
        }
    }
    tensors.insert(
        "model.layers.4.eh_proj.weight".into(),
        Tensor::f32(vec![d, 2 * d], &eh),
    );
    let head = tensors["lm_head.weight"].clone();
    tensors.insert("model.layers.4.shared_head.head.weight".into(), head);
    let dir = temp_dir(&format!("mtp-{tag}"));
    write_checkpoint(&dir, &config, &tensors);
    dir
}

// ---- FP8 E4M3 (bias 7, no infinities, 0x7F / 0xFF NaN) ----

/// E4M3 by its definition.
pub fn e4m3(b: u8) -> f32 {
    let (e, m) = (((b >> 3) & 0xF) as i32, (b & 7) as f32);
    let mag = if e == 15 && m == 7.0 {
        f32::NAN
    } else if e == 0 {
        m * 2f32.powi(-9)
    } else {
        (8.0 + m) * 2f32.powi(e - 10)
    };
    if b & 0x80 != 0 { -mag } else { mag }
}

/// The E4M3 code nearest `x` (ties to the even code), saturating at ±448.
pub fn e4m3_encode(x: f32) -> u8 {
    let a = x.abs();
    let mut best = 0u8;
    for c in 1..0x7Fu8 {
        let (d, db) = ((e4m3(c) - a).abs(), (e4m3(best) - a).abs());
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    if x.is_sign_negative() && best != 0 {
        best | 0x80
    } else {
        best
    }
}

/// `w [rows, cols]` → (E4M3 codes, f32 scale per `block` tile): scale =
/// tile absmax / 448 (1 for a zero tile), code = nearest(w / scale).
pub fn quantize_fp8(w: &[f32], rows: usize, cols: usize, block: [usize; 2]) -> (Vec<u8>, Vec<f32>) {
    let (gr, gc) = (rows.div_ceil(block[0]), cols.div_ceil(block[1]));
    let mut scale = vec![0f32; gr * gc];
    for (k, s) in scale.iter_mut().enumerate() {
        let (bi, bj) = (k / gc, k % gc);
        let mut amax = 0f32;
        for r in bi * block[0]..((bi + 1) * block[0]).min(rows) {
            for c in bj * block[1]..((bj + 1) * block[1]).min(cols) {
                amax = amax.max(w[r * cols + c].abs());
            }
        }
        *s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
    }
    let q = (0..rows * cols)
        .map(|k| {
            let (r, c) = (k / cols, k % cols);
            e4m3_encode(w[k] / scale[(r / block[0]) * gc + c / block[1]])
        })
        .collect();
    (q, scale)
}

/// The dequantised matrix: `e4m3(q) · scale` per weight (one f32 product).
pub fn dequantize_fp8(q: &[u8], scale: &[f32], cols: usize, block: [usize; 2]) -> Vec<f32> {
    let gc = cols.div_ceil(block[1]);
    q.iter()
        .enumerate()
        .map(|(k, &b)| e4m3(b) * scale[(k / cols / block[0]) * gc + (k % cols) / block[1]])
        .collect()
}

// ---- INT4 pack-quantized (symmetric, bf16 group scales) ----

/// `w [rows, cols]` → (int32 words `[rows, cols/8]`, bf16 scales `[rows,
/// cols/group]`): scale = bf16(group absmax / 7), value = round(w / scale)
/// clamped to −8..7, stored + 8, eight to a word, first column lowest.
pub fn quantize_int4(w: &[f32], rows: usize, cols: usize, group: usize) -> (Vec<i32>, Vec<u16>) {
    let mut scales = Vec::with_capacity(rows * cols / group);
    let mut words = vec![0u32; rows * cols / 8];
    for r in 0..rows {
        for g in 0..cols / group {
            let vals = &w[r * cols + g * group..][..group];
            let amax = vals.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = to_bf16(amax / 7.0);
            scales.push(s);
            for (i, v) in vals.iter().enumerate() {
                let q = if bf16(s) == 0.0 {
                    0
                } else {
                    (v / bf16(s)).round_ties_even().clamp(-8.0, 7.0) as i32
                };
                let col = r * cols + g * group + i;
                words[col / 8] |= ((q + 8) as u32) << (4 * (col % 8));
            }
        }
    }
    (words.into_iter().map(|w| w as i32).collect(), scales)
}

/// The dequantised matrix: `(nibble − 8) · scale`.
pub fn dequantize_int4(words: &[i32], scales: &[u16], cols: usize, group: usize) -> Vec<f32> {
    (0..words.len() * 8)
        .map(|k| {
            let code = ((words[k / 8] as u32 >> (4 * (k % 8))) & 0xF) as i32 - 8;
            let (r, c) = (k / cols, k % cols);
            code as f32 * bf16(scales[r * (cols / group) + c / group])
        })
        .collect()
}

// ---- MXFP4 (E2M1 codes, E8M0 scale per 32) ----

const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

pub fn e2m1(code: u8) -> f32 {
    let m = E2M1[(code & 7) as usize];
    if code & 8 != 0 { -m } else { m }
}

pub fn e8m0(b: u8) -> f32 {
    2f32.powi(b as i32 - 127)
}

/// One row's 32 values → (E8M0 scale byte, 16 bytes, low nibble first):
/// scale `2^(⌊log2 absmax⌋ − 2)`, code the nearest E2M1 (saturating at 6,
/// ties to the even code).
pub fn quantize_mxfp4_group(v: &[f32]) -> (u8, [u8; 16]) {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let e = if amax > 0.0 {
        (amax.log2().floor() as i32 - 2).clamp(-127, 127)
    } else {
        -127
    };
    let s = 2f32.powi(e);
    let mut out = [0u8; 16];
    for (i, x) in v.iter().enumerate() {
        let a = (x / s).abs();
        let mut best = 0usize;
        for (c, m) in E2M1.iter().enumerate().skip(1) {
            let (d, db) = ((m - a).abs(), (E2M1[best] - a).abs());
            if d < db || (d == db && c % 2 == 0) {
                best = c;
            }
        }
        let code = best as u8 | if *x < 0.0 && best != 0 { 8 } else { 0 };
        out[i / 2] |= code << (4 * (i % 2));
    }
    ((e + 127) as u8, out)
}

// ---- running both copies ----

/// Prefill `prompt`, then `steps` greedy tokens one at a time: every
/// step's logits and the tokens.
pub fn greedy(model: &dyn CausalLm, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut st = model.new_state();
    let mut logits = model
        .forward(st.as_mut(), prompt, Logits::Last)
        .expect("forward");
    let (mut all, mut ids) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let next = argmax(&logits);
        all.push(logits);
        ids.push(next);
        logits = model.forward(st.as_mut(), &[next], Logits::Last).unwrap();
    }
    all.push(logits);
    (all, ids)
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Runs both models over `prompts`: greedy ids must be identical and every
/// step's logits within `tol`. Returns the worst |Δlogit|.
pub fn compare(
    what: &str,
    quantized: &dyn CausalLm,
    reference: &dyn CausalLm,
    prompts: &[Vec<u32>],
    tol: f32,
) -> f32 {
    let mut worst = 0f32;
    for (i, p) in prompts.iter().enumerate() {
        let (a, ida) = greedy(quantized, p, 8);
        let (b, idb) = greedy(reference, p, 8);
        assert_eq!(ida, idb, "{what}: prompt {i}: greedy tokens differ");
        for (x, y) in a.iter().zip(&b) {
            let d = x
                .iter()
                .zip(y)
                .map(|(u, v)| (u - v).abs())
                .fold(0f32, f32::max);
            assert!(x.iter().all(|v| v.is_finite()), "{what}: non-finite logits");
            worst = worst.max(d);
        }
    }
    eprintln!("{what}: max |Δlogit| quantized vs dequantised reference: {worst:e}");
    assert!(worst <= tol, "{what}: logits differ by {worst}");
    worst
}
