//! Stored element types → fp32. bf16 → f32 is a 16-bit shift, so exact.

use safetensors::Dtype;

/// Converts little-endian bf16 bytes to f32.
pub fn bf16_bytes_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
        .collect()
}

/// Converts little-endian f32 bytes to f32.
pub fn f32_bytes_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Converts a stored float tensor (BF16, F16 or F32) to f32; `None` for other dtypes.
pub fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    match dtype {
        Dtype::BF16 => Some(bf16_bytes_to_f32(bytes)),
        Dtype::F32 => Some(f32_bytes_to_f32(bytes)),
        Dtype::F16 => Some(
            bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        _ => None,
    }
}

/// f32 → bf16 bits, round to nearest even (NaN kept quiet).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_is_exact_for_bf16_values() {
        for bits in [0u16, 0x3f80, 0xbf80, 0x4049, 0x0001, 0x7f7f, 0xff7f] {
            let f = bf16_bytes_to_f32(&bits.to_le_bytes())[0];
            assert_eq!(f32_to_bf16_bits(f), bits);
        }
        assert_eq!(bf16_bytes_to_f32(&0x3f80u16.to_le_bytes())[0], 1.0);
    }
}
