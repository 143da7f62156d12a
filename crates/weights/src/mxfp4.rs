//! MXFP4 as written by compressed-tensors `mxfp4-pack-quantized`.
//!
//! For a weight `W [out, in]` (`in` is the dimension contracted with the
//! activation):
//!
//! * `weight_packed: u8 [out, in/2]`: byte `(r, j)` holds column `2j` in bits
//!   0–3 (low nibble) and column `2j+1` in bits 4–7.
//! * a nibble is E2M1: bit 3 the sign, bits 0–2 an index into
//!   `{0, 0.5, 1, 1.5, 2, 3, 4, 6}`.
//! * `weight_scale: u8 [out, in/32]`: E8M0, the factor `2^(byte − 127)` for
//!   columns `32b .. 32b+31` of the row.
//!
//! Every dequantised value is exact in bf16 and f32 (except scale bytes so
//! extreme that the product leaves the f32 range; 0xFF is NaN in E8M0).

/// The eight E2M1 magnitudes.
pub const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Columns sharing one E8M0 scale.
pub const GROUP: usize = 32;

/// Value of one E2M1 nibble.
#[inline]
pub fn e2m1(code: u8) -> f32 {
    let m = E2M1[(code & 7) as usize];
    if code & 8 != 0 { -m } else { m }
}

/// Value of one E8M0 scale byte, `2^(byte − 127)` (NaN for 0xFF).
#[inline]
pub fn e8m0(byte: u8) -> f32 {
    match byte {
        0xFF => f32::NAN,
        // 2^-127 is subnormal in f32: build it from the bit pattern.
        0 => f32::from_bits(0x0040_0000),
        b => f32::from_bits((b as u32) << 23),
    }
}

/// A borrowed MXFP4 matrix `[rows, cols]`.
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4Ref<'a> {
    pub rows: usize,
    pub cols: usize,
    pub packed: &'a [u8],
    pub scales: &'a [u8],
}

impl<'a> Mxfp4Ref<'a> {
    /// Checks the byte lengths against the shape. `cols` must be a multiple of 32.
    pub fn new(rows: usize, cols: usize, packed: &'a [u8], scales: &'a [u8]) -> Option<Self> {
        (cols.is_multiple_of(GROUP)
            && packed.len() == rows * cols / 2
            && scales.len() == rows * cols / GROUP)
            .then_some(Mxfp4Ref {
                rows,
                cols,
                packed,
                scales,
            })
    }

    /// Dequantises row `r` into `out` (scalar reference).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let packed = &self.packed[r * self.cols / 2..(r + 1) * self.cols / 2];
        let scales = &self.scales[r * self.cols / GROUP..(r + 1) * self.cols / GROUP];
        for (c, pair) in out.chunks_exact_mut(2).enumerate() {
            let s = e8m0(scales[2 * c / GROUP]);
            let b = packed[c];
            pair[0] = e2m1(b & 0x0F) * s;
            pair[1] = e2m1(b >> 4) * s;
        }
    }

    /// The whole matrix in f32 (tests and tools only; never on the hot path).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, row);
        }
        out
    }
}

/// Quantises one group of 32 values to (scale byte, 16 packed bytes), the way
/// compressed-tensors does: scale = 2^floor(log2(absmax / 6)), round each value
/// to the nearest E2M1 magnitude (ties to the even code). Used by synthetic
/// checkpoint writers and tests.
pub fn quantize_group(vals: &[f32; GROUP]) -> (u8, [u8; GROUP / 2]) {
    let absmax = vals.iter().fold(0f32, |a, v| a.max(v.abs()));
    let exp = if absmax > 0.0 {
        (absmax / 6.0).log2().floor().clamp(-127.0, 127.0) as i32
    } else {
        -127
    };
    let scale_byte = (exp + 127) as u8;
    let s = e8m0(scale_byte);
    let mut packed = [0u8; GROUP / 2];
    for (i, v) in vals.iter().enumerate() {
        let code = nearest_e2m1(v / s);
        packed[i / 2] |= code << (4 * (i % 2));
    }
    (scale_byte, packed)
}

/// The E2M1 code nearest to `x` (saturating at ±6, ties to the even index).
pub fn nearest_e2m1(x: f32) -> u8 {
    let m = x.abs();
    let mut best = 0usize;
    for i in 1..8 {
        let d = (E2M1[i] - m).abs();
        let db = (E2M1[best] - m).abs();
        if d < db || (d == db && i % 2 == 0) {
            best = i;
        }
    }
    let sign = if x.is_sign_negative() && best != 0 {
        8
    } else {
        0
    };
    best as u8 | sign
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibble_order_low_first() {
        // byte 0x21: column 0 = code 1 (0.5), column 1 = code 2 (1.0); scale 2^0.
        let packed = [0x21u8; 16];
        let scales = [127u8];
        let m = Mxfp4Ref::new(1, 32, &packed, &scales).unwrap();
        let row = m.dequantize();
        assert_eq!(row[0], 0.5);
        assert_eq!(row[1], 1.0);
    }

    #[test]
    fn sign_and_scale() {
        assert_eq!(e2m1(0x8 | 7), -6.0);
        assert_eq!(e8m0(128), 2.0);
        assert_eq!(e8m0(126), 0.5);
        assert_eq!(e8m0(0), 2f32.powi(-127));
    }

    #[test]
    fn quantize_round_trips_representable_values() {
        let mut g = [0f32; GROUP];
        for (i, v) in g.iter_mut().enumerate() {
            *v = E2M1[i % 8] * if i % 3 == 0 { -0.25 } else { 0.25 };
        }
        let (s, p) = quantize_group(&g);
        let m = Mxfp4Ref::new(1, 32, &p, std::slice::from_ref(&s)).unwrap();
        assert_eq!(m.dequantize(), g.to_vec());
    }
}
