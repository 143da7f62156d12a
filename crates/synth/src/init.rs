//! Seeded, well-conditioned synthetic weights, computable at any byte offset.
//!
//! Every tensor's bytes are a pure function of (seed, tensor name, byte
//! position): the stream is cut into 8-byte blocks and block `k` is
//! a counter-based random word (wyrand's mixer on `key + k·γ`) turned into
//! values, with `key` hashed from the seed and the name. So any range of any tensor can be produced independently —
//! the writer fills one buffer from many threads, in any split, and the files
//! are byte-identical for one seed whatever the thread count or buffer size.
//!
//! Scales keep the fp32 forward pass well conditioned through every layer:
//! inputs to every projection are RMS-normalised (or L2-normalised, in KDA),
//! so each matrix `[out, in]` gets entries of standard deviation `1/√in` and
//! its outputs stay O(1); norm weights are 1 ± 0.1; the router is a little
//! sharper (1.5/√D) so routing depends clearly on the token, and the head
//! gives logits of spread ≈ 3; the KDA decay
//! (`A_log`, `dt_bias`) keeps α in a useful (0.6, 1) range. Values are
//! uniform rather than Gaussian: cheaper, and nothing here depends on the
//! shape of the distribution. Quantized matrices get random codes of zero
//! mean (MXFP4 and INT4 nibbles, E4M3 bytes) and scales chosen so that the
//! dequantised entries have that same `1/√in` spread.

use fathom_kernels::fp8::{E4M3_MAX, e4m3};
use fathom_weights::Dtype;

use crate::model::SynthTensor;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 output function: a bijective 64-bit mixer.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Per-tensor stream key from the seed and the tensor's name (FNV-1a, mixed).
pub fn tensor_key(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    mix(mix(seed ^ GOLDEN) ^ h)
}

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Uniform in `center ± half`.
    Uniform { center: f32, half: f32 },
    /// `A_log`: the first `heads` entries uniform in `center ± half`, the
    /// rest exactly zero (the released files store `[head_dim]` with a zero
    /// tail, docs/k3-model.md §7.2).
    ALog {
        heads: usize,
        center: f32,
        half: f32,
    },
    /// MXFP4 packed nibbles: every byte is two valid E2M1 codes.
    Bytes,
    /// E8M0 scale bytes: `base` or `base + 1`.
    Scale { base: u8 },
    /// FP8 E4M3 codes of values uniform in ±448 (never a NaN code); the
    /// tile scales carry the magnitude.
    E4m3,
    /// pack-quantized INT4 words: nibbles of values uniform in −7..7 with
    /// 0 twice as likely (mean zero; code 0, i.e. −8, is not drawn).
    Int4,
    /// Two little-endian i32 (`weight_shape`).
    I32Pair([i32; 2]),
}

/// Uniform(±h) has standard deviation h/√3: entries of standard deviation `s`.
pub fn std(s: f32) -> Init {
    Init::Uniform {
        center: 0.0,
        half: s * 3f32.sqrt(),
    }
}

pub fn uniform(center: f32, half: f32) -> Init {
    Init::Uniform { center, half }
}

/// The RMS of an E2M1 value whose code is uniform over all 16 nibbles:
/// √(mean of {0, .25, 1, 2.25, 4, 9, 16, 36}) ≈ 2.93.
const E2M1_RMS: f32 = 2.926;

/// E8M0 base byte giving expert entries of RMS ≈ `1/√fan_in` when the scale
/// is `base` or `base + 1` with equal odds (mean square factor 2.5).
pub fn scale_base(fan_in: usize) -> u8 {
    let target = 1.0 / (fan_in as f32).sqrt() / (E2M1_RMS * 2.5f32.sqrt());
    (127 + target.log2().round() as i32).clamp(1, 253) as u8
}

/// f32 `weight_scale_inv` tiles of an FP8 matrix with `fan_in` inputs:
/// with [`Init::E4m3`] codes (standard deviation 448/√3) the weights get
/// a standard deviation of `1/√fan_in`, ±10 % from tile to tile.
pub fn fp8_scale(fan_in: usize) -> Init {
    let s = 3f32.sqrt() / (E4M3_MAX * (fan_in as f32).sqrt());
    uniform(s, 0.1 * s)
}

/// The RMS of an [`Init::Int4`] value: √(2·(1² + … + 7²)/16).
const INT4_RMS: f32 = 4.183;

/// bf16 group scales of an INT4 matrix with `fan_in` inputs: weights of
/// RMS `1/√fan_in`, ±10 % from group to group.
pub fn int4_scale(fan_in: usize) -> Init {
    let s = 1.0 / (INT4_RMS * (fan_in as f32).sqrt());
    uniform(s, 0.1 * s)
}

/// The rules every family shares for float tensors, by name: norms 1 ±
/// 0.1, the embedding of standard deviation 1, a head giving logits of
/// spread ≈ 3, routers a little sharper than a projection (1.5/√D) so
/// routing depends clearly on the token, biases and score corrections
/// small, attention sinks O(1), and any other matrix `[…, out, in]` of
/// standard deviation `1/√in` (its inputs are normalised, its outputs O(1)).
pub fn float_init(name: &str, shape: &[usize], hidden: usize, router: bool) -> Init {
    let d = hidden as f32;
    if name.ends_with("norm.weight") {
        uniform(1.0, 0.1)
    } else if name.ends_with("embed_tokens.weight") {
        std(1.0)
    } else if name == "lm_head.weight" || name.ends_with(".lm_head.weight") {
        std(3.0 / d.sqrt())
    } else if router && shape.len() == 2 {
        std(1.5 / d.sqrt())
    } else if name.ends_with("bias") {
        uniform(0.0, 0.02)
    } else if name.ends_with(".sinks") {
        uniform(0.0, 1.0)
    } else {
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        std(1.0 / fan_in.sqrt())
    }
}

/// The KDA parameters K3 and Kimi-Linear share: `A_log` (the first
/// `heads` values in ±0.5), `dt_bias` (−2 ± 1) and the short-convolution
/// taps (four of RMS 0.5 keep the output at RMS ≈ 1).
pub fn kda_init(name: &str, heads: usize) -> Option<Init> {
    if name.ends_with(".A_log") {
        Some(Init::ALog {
            heads,
            center: 0.0,
            half: 0.5,
        })
    } else if name.ends_with(".dt_bias") {
        Some(uniform(-2.0, 1.0))
    } else if name.ends_with("conv1d.weight") {
        Some(std(0.5))
    } else {
        None
    }
}

/// A tensor's byte stream: its distribution, stored dtype and key.
#[derive(Debug, Clone, Copy)]
pub struct Stream {
    pub init: Init,
    pub dtype: Dtype,
    pub key: u64,
}

/// Maps 32 random bits to (−1, 1).
#[inline]
fn unit32(r: u64) -> f32 {
    (((r & 0xFFFF_FFFF) as f64 + 0.5) * (2.0 / 4_294_967_296.0) - 1.0) as f32
}

impl Stream {
    pub fn new(seed: u64, t: &SynthTensor) -> Self {
        Stream {
            init: t.init,
            dtype: t.dtype,
            key: tensor_key(seed, &t.name),
        }
    }

    /// Writes the tensor's bytes `start .. start + out.len()` into `out`.
    pub fn fill(&self, start: u64, out: &mut [u8]) {
        let key = self.key;
        // One monomorphic loop per kind: the per-block work is a few
        // multiplies, so a per-block branch or call would dominate.
        match (self.init, self.dtype) {
            (Init::Bytes, _) => fill_blocks(start, out, |k| random(key, k).to_le_bytes()),
            (Init::Scale { base }, _) => {
                let base = u64::from_le_bytes([base; 8]);
                // Adds 0 or 1 to each byte; base ≤ 253 so no carry crosses bytes.
                fill_blocks(start, out, move |k| {
                    (base + (random(key, k) & 0x0101_0101_0101_0101)).to_le_bytes()
                })
            }
            (Init::E4m3, _) => {
                let t = e4m3_table();
                fill_blocks(start, out, move |k| {
                    random(key, k).to_le_bytes().map(|b| t[b as usize])
                })
            }
            (Init::Int4, _) => {
                let t = int4_table();
                fill_blocks(start, out, move |k| {
                    random(key, k).to_le_bytes().map(|b| t[b as usize])
                })
            }
            (Init::I32Pair([a, b]), _) => {
                let mut v = [0u8; 8];
                v[..4].copy_from_slice(&a.to_le_bytes());
                v[4..].copy_from_slice(&b.to_le_bytes());
                // The stream is the pair, then zeros (the tensor is 8 bytes).
                fill_blocks(start, out, move |k| if k == 0 { v } else { [0; 8] })
            }
            (Init::Uniform { center, half }, Dtype::BF16) => {
                // 4096 uniform levels, converted once per call: a table
                // lookup per element instead of float math and rounding.
                let table: Vec<u64> = (0..BF16_LEVELS)
                    .map(|i| bf16_bits(center + half * level(i)) as u64)
                    .collect();
                let t = |r: u64| table[(r & (BF16_LEVELS as u64 - 1)) as usize];
                fill_blocks(start, out, move |k| {
                    let r = random(key, k);
                    (t(r) | t(r >> 16) << 16 | t(r >> 32) << 32 | t(r >> 48) << 48).to_le_bytes()
                })
            }
            (Init::Uniform { center, half }, _) => fill_blocks(start, out, move |k| {
                let r = random(key, k);
                f32_pair(center + half * unit32(r), center + half * unit32(r >> 32))
            }),
            (
                Init::ALog {
                    heads,
                    center,
                    half,
                },
                _,
            ) => fill_blocks(start, out, move |k| {
                let r = random(key, k);
                let e = 2 * k as usize;
                let v = |i: usize, bits: u64| {
                    if i < heads {
                        center + half * unit32(bits)
                    } else {
                        0.0
                    }
                };
                f32_pair(v(e, r), v(e + 1, r >> 32))
            }),
        }
    }
}

/// Byte → the E4M3 code nearest `448·u` for 256 levels `u` evenly spaced
/// in (−1, 1): codes of values uniform in ±448, symmetric, never NaN.
fn e4m3_table() -> &'static [u8; 256] {
    static T: std::sync::OnceLock<[u8; 256]> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        std::array::from_fn(|i| {
            let x = E4M3_MAX * ((i as f32 + 0.5) / 128.0 - 1.0);
            // The nearest of the finite positive codes 0..=0x7E.
            let a = x.abs();
            let mut best = 0u8;
            for c in 1..0x7Fu8 {
                if (e4m3(c) - a).abs() < (e4m3(best) - a).abs() {
                    best = c;
                }
            }
            if x < 0.0 { best | 0x80 } else { best }
        })
    })
}

/// Byte → two INT4 nibbles (stored `+8`), each 1..=15 with 0 mapped to 8:
/// values −7..7, zero twice as likely, mean zero.
fn int4_table() -> &'static [u8; 256] {
    static T: std::sync::OnceLock<[u8; 256]> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let nib = |n: u8| if n == 0 { 8 } else { n };
        std::array::from_fn(|i| nib(i as u8 & 0xF) | nib(i as u8 >> 4) << 4)
    })
}

/// Block `k` of the stream with `key`: wyrand's output function applied to
/// a counter (one 64×64→128-bit multiply per 8 bytes).
#[inline(always)]
fn random(key: u64, k: u64) -> u64 {
    let s = key.wrapping_add(k.wrapping_mul(0xA076_1D64_78BD_642F));
    let t = (s as u128).wrapping_mul((s ^ 0xE703_7ED1_A0B4_28DB) as u128);
    (t >> 64) as u64 ^ t as u64
}

/// Distinct values of a bf16 uniform tensor (finer than bf16's own
/// resolution over most of the range).
const BF16_LEVELS: usize = 4096;

/// Level `i` of [`BF16_LEVELS`], evenly spaced in (−1, 1).
fn level(i: usize) -> f32 {
    (i as f32 + 0.5) * (2.0 / BF16_LEVELS as f32) - 1.0
}

/// f32 → bf16 bits, round to nearest even (inputs here are finite).
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// Writes bytes `start .. start + out.len()` of the stream whose 8-byte
/// block `k` is `block(k)`.
#[inline(always)]
fn fill_blocks(start: u64, out: &mut [u8], block: impl Fn(u64) -> [u8; 8]) {
    let mut o = 0usize;
    let mut k = start / 8;
    let lead = (start % 8) as usize;
    if lead != 0 {
        let b = block(k);
        let n = (8 - lead).min(out.len());
        out[..n].copy_from_slice(&b[lead..lead + n]);
        o = n;
        k += 1;
    }
    let mut chunks = out[o..].chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&block(k));
        k += 1;
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let n = rest.len();
        rest.copy_from_slice(&block(k)[..n]);
    }
}

fn f32_pair(lo: f32, hi: f32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&lo.to_le_bytes());
    b[4..].copy_from_slice(&hi.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(init: Init, dtype: Dtype) -> Stream {
        Stream {
            init,
            dtype,
            key: tensor_key(7, "x"),
        }
    }

    #[test]
    fn any_split_gives_the_same_bytes() {
        for s in [
            stream(Init::Bytes, Dtype::U8),
            stream(
                Init::Uniform {
                    center: 0.0,
                    half: 1.0,
                },
                Dtype::BF16,
            ),
            stream(Init::Scale { base: 120 }, Dtype::U8),
        ] {
            let mut whole = vec![0u8; 203];
            s.fill(0, &mut whole);
            for cut in [1usize, 3, 8, 13, 100, 202] {
                let mut a = vec![0u8; cut];
                let mut b = vec![0u8; 203 - cut];
                s.fill(0, &mut a);
                s.fill(cut as u64, &mut b);
                a.extend(b);
                assert_eq!(a, whole, "cut {cut}");
            }
        }
    }

    #[test]
    fn values_follow_the_distribution() {
        let s = stream(
            Init::Uniform {
                center: 1.0,
                half: 0.1,
            },
            Dtype::BF16,
        );
        let mut b = vec![0u8; 8000];
        s.fill(0, &mut b);
        let v = fathom_weights::convert::bf16_bytes_to_f32(&b);
        assert!(v.iter().all(|x| (0.89..=1.11).contains(x)));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        assert!((mean - 1.0).abs() < 0.01, "{mean}");
        let a = stream(
            Init::ALog {
                heads: 3,
                center: 0.0,
                half: 0.5,
            },
            Dtype::F32,
        );
        let mut b = vec![0u8; 32];
        a.fill(0, &mut b);
        let v = fathom_weights::convert::f32_bytes_to_f32(&b);
        assert!(v[..3].iter().all(|x| x.abs() <= 0.5 && *x != 0.0));
        assert!(v[3..].iter().all(|x| *x == 0.0));
    }

    #[test]
    fn keys_differ_by_seed_and_name() {
        assert_ne!(tensor_key(1, "a"), tensor_key(2, "a"));
        assert_ne!(tensor_key(1, "a"), tensor_key(1, "b"));
        assert_eq!(tensor_key(1, "a"), tensor_key(1, "a"));
    }
}
