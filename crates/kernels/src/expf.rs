//! `e^x` for softmax weights, defined by its operations so a vector build
//! gives the scalar's bits (a library `expf` has no vector twin).
//!
//! ```text
//! x < −87.33654 (e^x below f32's normal range): 0
//! n = round_ties_even(x · log2 e)            (one rounded multiply)
//! r = fma(−n, ln2_hi, x);  r = fma(−n, ln2_lo, r)       (Cody–Waite)
//! p = 1 + r + r²/2! + … + r⁷/7!              (Horner, fused, from r⁷ down)
//! e^x = p · 2ⁿ                                 (2ⁿ built from its bits)
//! ```
//! |r| ≤ ln2/2, so the truncated series is within 5e-9 relative of e^r;
//! the result is within 2 ulp of the exact value over the range the
//! attention kernels use (x ≤ 0). NaN gives NaN.

/// Below this, `e^x` is under f32's smallest normal and counts as 0.
pub const MIN_ARG: f32 = -87.336_54;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1/7!, 1/6!, …, 1/2! (then 1, 1).
const C: [f32; 6] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
];

/// The scalar definition (fused multiply-adds: a library call in builds
/// without FMA, one instruction in the kernels' AVX2 builds; same bits).
#[inline(always)]
pub fn exp_softmax(x: f32) -> f32 {
    if x < MIN_ARG {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = C[0];
    for c in &C[1..] {
        p = p.mul_add(r, *c);
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // n ∈ [−126, 128] here: 128 only from `exp_fixed` (x ≥ 88.38), giving
    // the bits of +∞ (NaN casts to 0 and stays NaN through p).
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    p * scale
}

/// Above this, `e^x` is past f32's largest finite value: `+∞`.
pub const MAX_ARG: f32 = 88.722_83;

/// `e^x` over the whole line, for the element-wise functions a device
/// kernel computes too (sigmoid, SiLU and the decays of linear attention):
/// [`exp_softmax`]'s operations, `+∞` above [`MAX_ARG`] (and from about
/// 88.38 on, where `2ⁿ` reaches `2¹²⁸`). A CUDA twin repeats these
/// operations one for one (`kda.cu`), so both devices give the same bits.
#[inline(always)]
pub fn exp_fixed(x: f32) -> f32 {
    if x > MAX_ARG {
        return f32::INFINITY;
    }
    exp_softmax(x)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::{C, LN2_HI, LN2_LO, LOG2E, MIN_ARG};

    /// [`super::exp_softmax`] of eight values, the same operations.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp8(x: __m256) -> __m256 {
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(C[0]);
        for c in &C[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        let y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        let small = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(MIN_ARG));
        _mm256_andnot_ps(small, y)
    }

    /// [`super::exp_softmax`] of sixteen values, the same operations.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(crate) fn exp16(x: __m512) -> __m512 {
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(C[0]);
        for c in &C[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        let y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
        let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(MIN_ARG));
        _mm512_maskz_mov_ps(!small, y)
    }

    /// `out[i] = exp_softmax(a[i] − m)` for every `i`, eight or sixteen at a
    /// time, the tail with the scalar definition.
    ///
    /// # Safety
    /// The CPU supports AVX2 and FMA, and AVX-512 F when `wide`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp_shifted(wide: bool, a: &[f32], m: f32, out: &mut [f32]) {
        let n = a.len().min(out.len());
        let mut i = 0;
        if wide {
            while i + 16 <= n {
                // SAFETY: `i + 16 <= n` for both slices; AVX-512 F is the caller's CPU.
                unsafe {
                    let x = _mm512_sub_ps(_mm512_loadu_ps(a.as_ptr().add(i)), _mm512_set1_ps(m));
                    _mm512_storeu_ps(out.as_mut_ptr().add(i), exp16(x));
                }
                i += 16;
            }
        }
        while i + 8 <= n {
            // SAFETY: `i + 8 <= n` for both slices.
            unsafe {
                let x = _mm256_sub_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_set1_ps(m));
                _mm256_storeu_ps(out.as_mut_ptr().add(i), exp8(x));
            }
            i += 8;
        }
        while i < n {
            out[i] = super::exp_softmax(a[i] - m);
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<f32> {
        let mut v: Vec<f32> = (0..200_000).map(|i| -(i as f32) * 4.4e-4).collect();
        v.extend([
            0.0,
            -0.0,
            -1e-30,
            MIN_ARG,
            MIN_ARG + 1e-3,
            -87.0,
            -88.0,
            -1e9,
            f32::NEG_INFINITY,
        ]);
        v.extend((0..1000).map(|i| i as f32 * 0.05));
        v
    }

    #[test]
    fn close_to_the_library_exp() {
        for x in samples() {
            let (got, want) = (exp_softmax(x), (x as f64).exp());
            if x < MIN_ARG {
                assert_eq!(got, 0.0, "{x}");
                continue;
            }
            let rel = ((got as f64 - want) / want).abs();
            assert!(rel < 2.5e-7, "exp({x}) = {got}, want {want} (rel {rel})");
        }
        assert!(exp_softmax(f32::NAN).is_nan());
        assert_eq!(exp_softmax(0.0), 1.0);
    }

    #[test]
    fn fixed_exp_covers_the_whole_line() {
        let mut xs = samples();
        xs.extend((0..17_700).map(|i| i as f32 * 0.005));
        for x in xs {
            let (got, want) = (exp_fixed(x), (x as f64).exp());
            if x < MIN_ARG {
                assert_eq!(got, 0.0, "{x}");
            } else if want > f32::MAX as f64 || x >= 88.38 {
                assert!(
                    got.is_infinite() || (got as f64 - want).abs() / want < 2.5e-7,
                    "{x}"
                );
            } else {
                let rel = ((got as f64 - want) / want).abs();
                assert!(rel < 2.5e-7, "exp({x}) = {got}, want {want} (rel {rel})");
            }
        }
        for x in [88.8f32, 100.0, 1e9, f32::INFINITY] {
            assert_eq!(exp_fixed(x), f32::INFINITY, "{x}");
        }
        assert!(exp_fixed(f32::NAN).is_nan());
        assert_eq!(crate::ops::sigmoid_fixed(-1e9), 0.0);
        assert_eq!(crate::ops::sigmoid_fixed(1e9), 1.0);
        for x in [-30.0f32, -3.0, -0.5, 0.0, 0.25, 2.0, 17.0] {
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            let got = crate::ops::sigmoid_fixed(x) as f64;
            assert!(
                (got - want).abs() <= 2e-7 * want,
                "sigmoid({x}) = {got}, want {want}"
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_builds_give_the_scalar_bits() {
        if !crate::Isa::Avx2.supported() {
            eprintln!("skipped: no AVX2 here");
            return;
        }
        let xs = samples();
        let m = -0.25f32;
        let want: Vec<u32> = xs.iter().map(|&x| exp_softmax(x - m).to_bits()).collect();
        for wide in [false, true] {
            if wide && !crate::Isa::Avx512.supported() {
                eprintln!("AVX-512 not here: the 16-wide build is checked where it is");
                continue;
            }
            let mut out = vec![0f32; xs.len()];
            // SAFETY: the CPU supports the width asked for (checked above).
            unsafe { x86::exp_shifted(wide, &xs, m, &mut out) };
            let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "wide {wide}");
        }
        let mut nan = [0f32; 8];
        // SAFETY: AVX2 checked above.
        unsafe { x86::exp_shifted(false, &[f32::NAN; 8], 0.0, &mut nan) };
        assert!(nan.iter().all(|v| v.is_nan()));
    }
}
