//! KDA kernels: the dispatched delta rule equals its baseline twin bit for
//! bit, and T positions in one call equal T one-position calls (and so do
//! the convolution windows).

use fathom_kernels::kda::{DeltaInputs, delta_rule, delta_rule_scalar, log_decay, short_conv};

fn data(seed: u64, n: usize, amp: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

fn normalise(v: &mut [f32], d: usize) {
    for r in v.chunks_exact_mut(d) {
        let n = r.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
        r.iter_mut().for_each(|x| *x /= n);
    }
}

#[test]
fn delta_rule_twin_and_position_split_agree_bitwise() {
    for (kd, vd, t) in [(8, 8, 5), (64, 64, 17), (16, 24, 9)] {
        let mut q = data(1, t * kd, 1.0);
        let mut k = data(2, t * kd, 1.0);
        normalise(&mut q, kd);
        normalise(&mut k, kd);
        let v = data(3, t * vd, 1.0);
        let la: Vec<f32> = data(4, t * kd, 1.0)
            .iter()
            .map(|&f| log_decay(f, 0.7, 0.1, Some(-5.0)))
            .collect();
        let beta: Vec<f32> = data(5, t, 3.0)
            .iter()
            .map(|&b| 1.0 / (1.0 + (-b).exp()))
            .collect();
        let s0 = data(6, kd * vd, 0.1);
        let all = DeltaInputs {
            q: &q,
            k: &k,
            v: &v,
            log_alpha: &la,
            beta: &beta,
            kd,
            vd,
        };
        let (mut s1, mut o1) = (s0.clone(), vec![0f32; t * vd]);
        delta_rule(&mut s1, &all, &mut o1);
        let (mut s2, mut o2) = (s0.clone(), vec![0f32; t * vd]);
        delta_rule_scalar(&mut s2, &all, &mut o2);
        assert_eq!(
            (&s1, &o1),
            (&s2, &o2),
            "dispatched vs twin, kd {kd} vd {vd}"
        );
        let (mut s3, mut o3) = (s0.clone(), vec![0f32; t * vd]);
        for i in 0..t {
            let one = DeltaInputs {
                q: &q[i * kd..(i + 1) * kd],
                k: &k[i * kd..(i + 1) * kd],
                v: &v[i * vd..(i + 1) * vd],
                log_alpha: &la[i * kd..(i + 1) * kd],
                beta: &beta[i..i + 1],
                kd,
                vd,
            };
            delta_rule(&mut s3, &one, &mut o3[i * vd..(i + 1) * vd]);
        }
        assert_eq!((&s1, &o1), (&s3, &o3), "one call vs position by position");
        assert!(o1.iter().chain(&s1).all(|x| x.is_finite()));
    }
}

#[test]
fn short_conv_windows_carry_across_calls() {
    let (p, kernel, t) = (6, 4, 11);
    let pre = data(7, t * p, 1.0);
    let taps = data(8, p * kernel, 0.5);
    let w0 = data(9, (kernel - 1) * p, 1.0);
    let mut w1 = w0.clone();
    let all = short_conv(&pre, &mut w1, &taps, p, kernel);
    let mut w2 = w0.clone();
    let mut parts = Vec::new();
    for c in pre.chunks(2 * p) {
        parts.extend(short_conv(c, &mut w2, &taps, p, kernel));
    }
    assert_eq!(all, parts);
    assert_eq!(w1, w2);
    assert_eq!(&w1[..], &pre[(t - kernel + 1) * p..]);
}
