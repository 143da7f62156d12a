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
//! shape of the distribution.

use fathom_model::kimi_k3::config::K3Spec;
use fathom_model::kimi_k3::tensors::{LM_HEAD, TensorSpec};
use fathom_weights::Dtype;

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
    /// tail, k3-model.md §7.2).
    ALog {
        heads: usize,
        center: f32,
        half: f32,
    },
    /// MXFP4 packed nibbles: every byte is two valid E2M1 codes.
    Bytes,
    /// E8M0 scale bytes: `base` or `base + 1`.
    Scale { base: u8 },
}

/// The RMS of an E2M1 value whose code is uniform over all 16 nibbles:
/// √(mean of {0, .25, 1, 2.25, 4, 9, 16, 36}) ≈ 2.93.
const E2M1_RMS: f32 = 2.926;

/// E8M0 base byte giving expert entries of RMS ≈ `1/√fan_in` when the scale
/// is `base` or `base + 1` with equal odds (mean square factor 2.5).
fn scale_base(fan_in: usize) -> u8 {
    let target = 1.0 / (fan_in as f32).sqrt() / (E2M1_RMS * 2.5f32.sqrt());
    (127 + target.log2().round() as i32).clamp(1, 253) as u8
}

/// Chooses the distribution of one tensor of the table.
pub fn init_for(spec: &K3Spec, t: &TensorSpec) -> Init {
    let n = t.name.as_str();
    let d = spec.hidden_size as f32;
    let uni = |center: f32, half: f32| Init::Uniform { center, half };
    // Uniform(±h) has standard deviation h/√3.
    let std = |s: f32| uni(0.0, s * 3f32.sqrt());
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
    } else if n.ends_with(".A_log") {
        Init::ALog {
            heads: spec.kda_heads,
            center: 0.0,
            half: 0.5,
        }
    } else if n.ends_with(".dt_bias") {
        uni(-2.0, 1.0)
    } else if n.ends_with("conv1d.weight") {
        // Four taps of 0.5 RMS keep the convolution's output at RMS ≈ 1.
        std(0.5)
    } else if n.ends_with("e_score_correction_bias") {
        uni(0.0, 0.02)
    } else if n.ends_with("norm.weight") {
        uni(1.0, 0.1)
    } else if n.ends_with("_res_proj.weight") {
        // Pseudo-query over RMS-normalised values: scores of O(1).
        std(1.0 / d.sqrt())
    } else if n.ends_with("embed_tokens.weight") {
        std(1.0)
    } else if n.ends_with("block_sparse_moe.gate.weight") {
        std(1.5 / d.sqrt())
    } else if n == LM_HEAD {
        // Logits of standard deviation ≈ 3, like trained models: greedy
        // choices are clear, not decided by rounding.
        std(3.0 / d.sqrt())
    } else {
        // A projection [out, in].
        let fan_in = *t.shape.last().unwrap_or(&1) as f32;
        std(1.0 / fan_in.sqrt())
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
    pub fn new(seed: u64, spec: &K3Spec, t: &TensorSpec) -> Self {
        Stream {
            init: init_for(spec, t),
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
