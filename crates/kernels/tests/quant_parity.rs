//! The block-scaled FP8 and group-scaled INT4 products: every instruction
//! set this CPU supports reproduces the scalar twin bit for bit (partial
//! tiles, a scale grid entered mid-way, odd column counts, T = 1..16), the
//! result equals the f32 product over the matrix dequantised by an
//! independent decoder (same lanes, same bits), and a NaN code or scale
//! reaches the output.

use fathom_kernels::formats::{Fp8Rows, Int4Rows};
use fathom_kernels::{Isa, Kernels, supported_isas};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn value(&mut self) -> f32 {
        let m = self.next() as f32 / (1u64 << 31) as f32 - 0.5;
        m * 2f32.powi(self.below(12) as i32 - 6)
    }
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.value()).collect()
    }
    /// Any E4M3 code but the two NaNs.
    fn fp8_code(&mut self) -> u8 {
        let b = self.below(256) as u8;
        if b & 0x7F == 0x7F { b ^ 1 } else { b }
    }
}

/// E4M3 by its definition (sign, 4-bit exponent with bias 7, 3-bit
/// mantissa, subnormals at exponent 0), written independently of the crate.
fn e4m3_ref(b: u8) -> f32 {
    let (e, m) = (((b >> 3) & 0xF) as i32, (b & 7) as f32);
    let mag = if e == 0 {
        m * 2f32.powi(-9)
    } else {
        (8.0 + m) * 2f32.powi(e - 10)
    };
    if b & 0x80 != 0 { -mag } else { mag }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn tables() -> Vec<&'static Kernels> {
    let isas = supported_isas();
    eprintln!("testing {isas:?}");
    isas.into_iter()
        .map(|i| Kernels::for_isa(i).unwrap())
        .collect()
}

fn scalar() -> &'static Kernels {
    Kernels::for_isa(Isa::Scalar).unwrap()
}

/// One random FP8 case: codes, scale grid (arbitrary f32 scales, zeros
/// included), block and the grid row of the first row.
struct Fp8Case {
    rows: usize,
    cols: usize,
    q: Vec<u8>,
    scale: Vec<f32>,
    block: [usize; 2],
    row0: usize,
}

impl Fp8Case {
    fn random(g: &mut Rng) -> Self {
        let (rows, cols) = (1 + g.below(40), 1 + g.below(300));
        let block = [[1, 2, 16, 128][g.below(4)], [32, 64, 128][g.below(3)]];
        let row0 = [0, 3, 17][g.below(3)];
        let q = (0..rows * cols).map(|_| g.fp8_code()).collect();
        let n = (row0 + rows).div_ceil(block[0]) * cols.div_ceil(block[1]);
        let scale = (0..n)
            .map(|_| {
                if g.below(20) == 0 {
                    0.0
                } else {
                    g.value() / 448.0
                }
            })
            .collect();
        Fp8Case {
            rows,
            cols,
            q,
            scale,
            block,
            row0,
        }
    }

    fn rows(&self) -> Fp8Rows<'_> {
        Fp8Rows::new(&self.q, &self.scale, self.cols, self.block, self.row0).unwrap()
    }

    /// Dequantised independently: one f32 product per weight.
    fn dequantised(&self) -> Vec<f32> {
        let [br, bc] = self.block;
        let gc = self.cols.div_ceil(bc);
        (0..self.rows * self.cols)
            .map(|k| {
                let (r, c) = (k / self.cols, k % self.cols);
                e4m3_ref(self.q[k]) * self.scale[((self.row0 + r) / br) * gc + c / bc]
            })
            .collect()
    }
}

#[test]
fn fp8_is_bit_identical_across_isas_and_to_the_dequantised_product() {
    let mut g = Rng(21);
    for case in 0..60 {
        let c = Fp8Case::random(&mut g);
        let t = 1 + g.below(16);
        let x = g.values(t * c.cols);
        let what = format!(
            "case {case}: t={t} rows={} cols={} block={:?} row0={}",
            c.rows, c.cols, c.block, c.row0
        );
        let mut want = vec![0f32; t * c.rows];
        scalar().matmul_f32(&x, t, &c.dequantised(), c.rows, c.cols, &mut want);
        for k in tables() {
            let mut y = vec![0f32; t * c.rows];
            k.matmul_fp8(&x, t, c.rows(), &mut y);
            assert_eq!(bits(&y), bits(&want), "{what}: {:?}", k.isa);
        }
    }
}

#[test]
fn fp8_matches_a_float64_reference() {
    let mut g = Rng(22);
    let c = Fp8Case {
        block: [128, 128],
        row0: 0,
        ..Fp8Case::random(&mut g)
    };
    let c = Fp8Case {
        scale: vec![0.003; c.rows.div_ceil(128) * c.cols.div_ceil(128)],
        ..c
    };
    let t = 3;
    let x = g.values(t * c.cols);
    let mut y = vec![0f32; t * c.rows];
    fathom_kernels::matmul_fp8(&x, t, c.rows(), &mut y);
    for ti in 0..t {
        for r in 0..c.rows {
            let terms: Vec<f64> = (0..c.cols)
                .map(|i| {
                    x[ti * c.cols + i] as f64
                        * e4m3_ref(c.q[r * c.cols + i]) as f64
                        * 0.003f32 as f64
                })
                .collect();
            let want: f64 = terms.iter().sum();
            let mag: f64 = terms.iter().map(|v| v.abs()).sum();
            let got = y[ti * c.rows + r] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * (mag + 1e-30),
                "{got} vs {want}"
            );
        }
    }
}

/// A NaN code (0x7F / 0xFF) or a NaN scale makes its row NaN in every table.
#[test]
fn fp8_nan_codes_and_scales_reach_the_output() {
    let (rows, cols) = (4, 96);
    for (bad_code, bad_scale) in [(0x7F, false), (0xFF, false), (0x38, true)] {
        let mut q = vec![0x38u8; rows * cols];
        let mut scale = vec![1.0f32; 1];
        q[2 * cols + 50] = bad_code;
        if bad_scale {
            scale[0] = f32::NAN;
        }
        let w = Fp8Rows::new(&q, &scale, cols, [128, 128], 0).unwrap();
        let x = vec![1.0f32; cols];
        for k in tables() {
            let mut y = vec![0f32; rows];
            k.matmul_fp8(&x, 1, w, &mut y);
            assert!(y[2].is_nan(), "{:?}", k.isa);
            assert_eq!(y[0].is_nan(), bad_scale, "{:?}", k.isa);
        }
    }
}

#[test]
fn fp8_views_refuse_bad_blocks_and_short_grids() {
    let q = vec![0u8; 4 * 64];
    let s = vec![1.0f32; 2];
    assert!(Fp8Rows::new(&q, &s, 64, [128, 128], 0).is_some());
    assert!(
        Fp8Rows::new(&q, &s, 64, [128, 16], 0).is_none(),
        "columns < 32"
    );
    assert!(
        Fp8Rows::new(&q, &s, 64, [96, 128], 0).is_none(),
        "not a power of two"
    );
    assert!(Fp8Rows::new(&q, &s, 64, [2, 128], 0).is_some());
    assert!(
        Fp8Rows::new(&q, &s, 64, [1, 128], 0).is_none(),
        "grid too short"
    );
}

/// One random INT4 case: eight codes per little-endian int32, bf16 scales.
struct Int4Case {
    rows: usize,
    cols: usize,
    group: usize,
    words: Vec<u32>,
    scale: Vec<u16>,
}

impl Int4Case {
    fn random(g: &mut Rng) -> Self {
        let group = [32, 64, 128][g.below(3)];
        let (rows, cols) = (1 + g.below(40), group * (1 + g.below(5)));
        let words = (0..rows * cols / 8).map(|_| g.next() as u32).collect();
        let scale = (0..rows * cols / group)
            .map(|_| (g.value().abs().to_bits() >> 16) as u16)
            .collect();
        Int4Case {
            rows,
            cols,
            group,
            words,
            scale,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// Dequantised independently: value `i` of word `j` is bits `4i..4i+4`
    /// of the word, column `8j + i`, minus 8, times its group's scale.
    fn dequantised(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (j, w) in self.words.iter().enumerate() {
            for i in 0..8 {
                let k = 8 * j + i;
                let code = ((w >> (4 * i)) & 0xF) as i32 - 8;
                let s = f32::from_bits((self.scale[k / self.group] as u32) << 16);
                out[k] = code as f32 * s;
            }
        }
        out
    }
}

#[test]
fn int4_is_bit_identical_across_isas_and_to_the_dequantised_product() {
    let mut g = Rng(23);
    for case in 0..40 {
        let c = Int4Case::random(&mut g);
        let t = 1 + g.below(16);
        let x = g.values(t * c.cols);
        let bytes = c.bytes();
        let w = Int4Rows::new(&bytes, &c.scale, c.rows, c.cols, c.group).unwrap();
        let mut want = vec![0f32; t * c.rows];
        scalar().matmul_f32(&x, t, &c.dequantised(), c.rows, c.cols, &mut want);
        for k in tables() {
            let mut y = vec![0f32; t * c.rows];
            k.matmul_int4(&x, t, w, &mut y);
            assert_eq!(
                bits(&y),
                bits(&want),
                "case {case}: t={t} rows={} cols={} group={}: {:?}",
                c.rows,
                c.cols,
                c.group,
                k.isa
            );
        }
    }
}

#[test]
fn int4_views_refuse_bad_groups() {
    let (p, s) = (vec![0u8; 2 * 64 / 2], vec![0u16; 2 * 64 / 32]);
    assert!(Int4Rows::new(&p, &s, 2, 64, 32).is_some());
    assert!(Int4Rows::new(&p, &s, 2, 64, 16).is_none(), "group < 32");
    assert!(
        Int4Rows::new(&p, &s[..2], 2, 64, 32).is_none(),
        "short scales"
    );
}
