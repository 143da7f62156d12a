//! FP8 E4M3 (the `float8_e4m3fn` of DeepSeek-V3's and Kimi K2's released
//! weights) and the two block-scaled weight formats built on small codes:
//! FP8 with one f32 scale per `[br, bc]` tile, and compressed-tensors'
//! symmetric INT4 (`pack-quantized`) with one bf16 scale per group.
//!
//! E4M3: bit 7 the sign, bits 3–6 the exponent (bias 7), bits 0–2 the
//! mantissa; exponent 0 is subnormal (`m · 2⁻⁹`); there are no infinities,
//! and `0x7F` / `0xFF` are NaN (the largest finite magnitude is 448). Every
//! code is exact in f32. The SIMD kernels decode with the same three cases
//! (normal by re-biasing the exponent bits, subnormal by an exact
//! int→float product, NaN by a blend), so they produce these very bits.

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// `2⁻⁹`, the E4M3 subnormal step.
pub const E4M3_SUB_STEP: f32 = 1.0 / 512.0;

/// The f32 bits of E4M3 code `b` (quiet NaN, sign kept, for 0x7F / 0xFF).
pub const fn e4m3_bits(b: u8) -> u32 {
    let mag = (b & 0x7F) as u32;
    let bits = if mag == 0x7F {
        0x7FC0_0000
    } else if mag < 8 {
        (mag as f32 * E4M3_SUB_STEP).to_bits()
    } else {
        (mag << 20) + (120 << 23)
    };
    bits | ((b as u32 & 0x80) << 24)
}

/// Every E4M3 code as f32.
pub static E4M3: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = f32::from_bits(e4m3_bits(b as u8));
        b += 1;
    }
    t
};

/// Value of one E4M3 byte.
#[inline(always)]
pub fn e4m3(b: u8) -> f32 {
    E4M3[b as usize]
}

/// Whether an E4M3 byte is NaN (`0x7F`, `0xFF`).
#[inline]
pub fn e4m3_is_nan(b: u8) -> bool {
    b & 0x7F == 0x7F
}

/// Value of a pack-quantized INT4 nibble (stored offset by 8: `code − 8`).
#[inline(always)]
pub fn int4(code: u8) -> f32 {
    ((code & 0x0F) as i32 - 8) as f32
}

/// bf16 bits → f32 (exact).
#[inline(always)]
pub fn bf16(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the textbook definition, computed independently with powi.
    #[test]
    fn every_code_matches_the_definition() {
        for b in 0..=255u8 {
            let (s, e, m) = (b >> 7, (b >> 3) & 0xF, b & 7);
            let mag = if e == 15 && m == 7 {
                f32::NAN
            } else if e == 0 {
                m as f32 / 8.0 * 2f32.powi(-6)
            } else {
                (1.0 + m as f32 / 8.0) * 2f32.powi(e as i32 - 7)
            };
            let want = if s == 1 { -mag } else { mag };
            let got = e4m3(b);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "code {b:#04x}: {got} vs {want}"
            );
            assert_eq!(got.is_nan(), e4m3_is_nan(b));
        }
        assert_eq!(e4m3(0x7E), E4M3_MAX);
        assert_eq!(e4m3(0xFE), -E4M3_MAX);
        assert_eq!(e4m3(0x01), 2f32.powi(-9));
        assert_eq!(e4m3(0x38), 1.0);
        assert_eq!(e4m3(0x80).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn int4_is_offset_by_eight() {
        assert_eq!((int4(0), int4(8), int4(15)), (-8.0, 0.0, 7.0));
    }
}
