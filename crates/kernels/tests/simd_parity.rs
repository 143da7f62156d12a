//! Every instruction set this CPU supports must reproduce the scalar
//! reference bit for bit, on random shapes (odd column counts, T = 1..16),
//! for every weight format, and independently of the thread count.

use fathom_kernels::{Isa, Kernels, supported_isas};
use fathom_weights::mxfp4::Mxfp4Ref;

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
    /// Values over several binades, with exact zeros and negative zeros.
    fn value(&mut self) -> f32 {
        match self.below(16) {
            0 => 0.0,
            1 => -0.0,
            _ => {
                let m = self.next() as f32 / (1u64 << 31) as f32 - 0.5;
                m * 2f32.powi(self.below(12) as i32 - 6)
            }
        }
    }
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.value()).collect()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

fn simd_tables() -> Vec<&'static Kernels> {
    let isas = supported_isas();
    eprintln!("testing {:?} against scalar", isas);
    isas.into_iter()
        .filter(|&i| i != Isa::Scalar)
        .map(|i| Kernels::for_isa(i).unwrap())
        .collect()
}

/// Runs `f(kernels)` for scalar and every SIMD table and asserts equal bits.
fn check(what: &str, mut f: impl FnMut(&Kernels) -> Vec<f32>) {
    let want = f(Kernels::for_isa(Isa::Scalar).unwrap());
    for k in simd_tables() {
        assert_eq!(
            bits(&f(k)),
            bits(&want),
            "{what}: {:?} differs from scalar",
            k.isa
        );
    }
}

#[test]
fn dense_formats_are_bit_identical_to_scalar() {
    dense_cases(1, 60, (1, 1), |g| 1 + g.below(300));
}

/// Whole 32-column groups: several positions take the path that
/// dequantises each weight row once for all of them.
#[test]
fn dense_formats_on_whole_column_groups_are_bit_identical_to_scalar() {
    dense_cases(4, 40, (1, 1), |g| 32 * (1 + g.below(24)));
}

/// Rows wider than the multi-position path's column chunk (1,024), at
/// four positions or more and two rows or more (the path's own): the sums
/// carried from chunk to chunk in order, exact chunk multiples and a last
/// chunk cut short.
#[test]
fn dense_formats_across_several_column_chunks_are_bit_identical_to_scalar() {
    let widths = [1024, 2048, 1056, 3072 + 96];
    let i = std::cell::Cell::new(0);
    dense_cases(7, 12, (4, 2), |g| {
        let k = i.get();
        i.set(k + 1);
        widths.get(k).copied().unwrap_or(32 * (33 + g.below(80)))
    });
}

/// `cases` random products (at least `least` = (positions, rows) each).
fn dense_cases(seed: u64, cases: usize, least: (usize, usize), cols: impl Fn(&mut Rng) -> usize) {
    let mut g = Rng(seed);
    for case in 0..cases {
        let (t, rows) = (least.0.max(1 + g.below(16)), least.1.max(1 + g.below(40)));
        let cols = cols(&mut g);
        let x = g.values(t * cols);
        let wf = g.values(rows * cols);
        let wb: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let q: Vec<i8> = (0..rows * cols)
            .map(|_| (g.below(255) as i32 - 127) as i8)
            .collect();
        let scale: Vec<f32> = (0..rows).map(|_| g.value().abs() / 127.0).collect();
        let what = format!("case {case}: t={t} rows={rows} cols={cols}");
        let mut y = vec![0f32; t * rows];
        check(&format!("f32 {what}"), |k| {
            k.matmul_f32(&x, t, &wf, rows, cols, &mut y);
            y.clone()
        });
        check(&format!("bf16 {what}"), |k| {
            k.matmul_bf16(&x, t, &wb, rows, cols, &mut y);
            y.clone()
        });
        check(&format!("int8 {what}"), |k| {
            k.matmul_int8(&x, t, &q, &scale, cols, &mut y);
            y.clone()
        });
    }
}

#[test]
fn mxfp4_is_bit_identical_to_scalar() {
    let mut g = Rng(2);
    for case in 0..40 {
        let (t, rows, cols) = (1 + g.below(16), 1 + g.below(40), 32 * (1 + g.below(12)));
        let x = g.values(t * cols);
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| g.below(256) as u8).collect();
        // Scale bytes 0 (a subnormal power of two) to 160, including 127 (×1).
        let scales: Vec<u8> = (0..rows * cols / 32).map(|_| g.below(161) as u8).collect();
        let m = Mxfp4Ref::new(rows, cols, &packed, &scales).unwrap();
        let mut y = vec![0f32; t * rows];
        check(
            &format!("mxfp4 case {case}: t={t} rows={rows} cols={cols}"),
            |k| {
                k.matmul_mxfp4(&x, t, m, &mut y);
                y.clone()
            },
        );
    }
}

#[test]
fn a_row_does_not_depend_on_t_or_threads() {
    let mut g = Rng(3);
    let (rows, cols) = (300, 517);
    let x = g.values(16 * cols);
    let q: Vec<i8> = (0..rows * cols)
        .map(|_| (g.below(255) as i32 - 127) as i8)
        .collect();
    let scale: Vec<f32> = (0..rows)
        .map(|_| 0.01 + g.below(100) as f32 * 1e-3)
        .collect();
    for isa in supported_isas() {
        let k = Kernels::for_isa(isa).unwrap();
        let run = |threads: usize, t: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut y = vec![0f32; t * rows];
            pool.install(|| k.matmul_int8(&x[..t * cols], t, &q, &scale, cols, &mut y));
            y
        };
        let all = run(2, 16);
        for t in [1, 3, 16] {
            for threads in [1, 2, 3] {
                let y = run(threads, t);
                assert_eq!(
                    bits(&y),
                    bits(&all[..t * rows]),
                    "{isa:?} t={t} threads={threads}"
                );
            }
        }
    }
}

#[test]
fn int8_matches_a_float64_reference() {
    let mut g = Rng(4);
    let (t, rows, cols) = (3, 50, 333);
    let x = g.values(t * cols);
    let q: Vec<i8> = (0..rows * cols)
        .map(|_| (g.below(255) as i32 - 127) as i8)
        .collect();
    let scale: Vec<f32> = (0..rows).map(|r| 0.001 * (1 + r) as f32).collect();
    let mut y = vec![0f32; t * rows];
    fathom_kernels::matmul_int8(&x, t, &q, &scale, cols, &mut y);
    for ti in 0..t {
        for r in 0..rows {
            let want: f64 = (0..cols)
                .map(|c| x[ti * cols + c] as f64 * q[r * cols + c] as f64 * scale[r] as f64)
                .sum();
            let got = y[ti * rows + r] as f64;
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{got} vs {want}"
            );
        }
    }
}

/// The input-major bf16 product (GPT-OSS's stacked experts): every table
/// gives the scalar bits, at any thread count; and it is `x · W`.
#[test]
fn bf16_input_major_matches_scalar_and_reference() {
    let mut rng = Rng(0x0B16_1A3E);
    for (ins, outs, t) in [(5, 3, 1), (64, 300, 7), (33, 517, 16), (256, 256, 2)] {
        let x = rng.values(t * ins);
        let w: Vec<u16> = rng
            .values(ins * outs)
            .iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect();
        let run = |k: &Kernels| {
            let mut y = vec![0f32; t * outs];
            k.matmul_bf16_in_major(&x, t, &w, ins, outs, &mut y);
            y
        };
        check("bf16 input-major", run);
        let scalar = Kernels::for_isa(Isa::Scalar).unwrap();
        let want = run(scalar);
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            assert_eq!(bits(&pool.install(|| run(scalar))), bits(&want));
        }
        for ti in 0..t {
            for o in 0..outs {
                let terms: Vec<f64> = (0..ins)
                    .map(|k| {
                        let wv = f32::from_bits((w[k * outs + o] as u32) << 16);
                        x[ti * ins + k] as f64 * wv as f64
                    })
                    .collect();
                let r: f64 = terms.iter().sum();
                let scale: f64 = terms.iter().map(|v| v.abs()).sum();
                let g = want[ti * outs + o] as f64;
                assert!(
                    (g - r).abs() <= 1e-6 * (scale + 1e-30),
                    "{ins}x{outs} row {ti} col {o}: {g} vs {r}"
                );
            }
        }
    }
}

/// On aarch64 the NEON table is among those compared with scalar above (a
/// detection that dropped it would leave these tests checking scalar alone).
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_is_compared_on_aarch64() {
    assert_eq!(supported_isas(), vec![Isa::Scalar, Isa::Neon]);
    assert!(Kernels::for_isa(Isa::Neon).is_some_and(|k| k.isa == Isa::Neon));
}
