//! The grouped-query attention kernel: bit-identical to its twin whatever
//! the number of queries per call or threads, close to a float64 softmax
//! reference; and the rotary embedding against a float64 reference.

use fathom_kernels::attention::SPLIT;
use fathom_kernels::gqa::{GqaQuery, GqaShape, gqa_attend, gqa_attend_scalar};
use fathom_kernels::rope::Rope;

/// A small deterministic generator (splitmix64) for test data.
fn data(seed: u64, n: usize, amp: f32) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

fn reference(sh: &GqaShape, rows: &[f32], q: &GqaQuery<'_>) -> Vec<f64> {
    let (h, d, w) = (sh.heads, sh.head_dim, sh.width());
    let (kvw, group) = (sh.kv_heads * d, sh.heads / sh.kv_heads);
    let mut out = vec![0f64; h * d];
    for hh in 0..h {
        let g = hh / group;
        let s: Vec<f64> = (0..q.n)
            .map(|r| {
                let key = &rows[r * w + g * d..][..d];
                let dot: f64 = (0..d).map(|i| key[i] as f64 * q.q[hh * d + i] as f64).sum();
                dot * sh.scale as f64
            })
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
        for (r, v) in s.iter().enumerate() {
            let p = (v - m).exp() / z;
            for i in 0..d {
                out[hh * d + i] += p * rows[r * w + kvw + g * d + i] as f64;
            }
        }
    }
    out
}

#[test]
fn any_grouping_or_thread_count_gives_the_twin_bit_for_bit() {
    for (heads, kv_heads, head_dim, n_max) in [
        (4, 2, 16, 40),
        (8, 1, 64, 2 * SPLIT + 37),
        (3, 3, 13, SPLIT + 1),
    ] {
        let sh = GqaShape {
            heads,
            kv_heads,
            head_dim,
            scale: (head_dim as f32).powf(-0.5),
        };
        let w = sh.width();
        let rows = data(heads as u64, n_max * w, 2.0);
        let blocks: Vec<&[f32]> = rows.chunks(SPLIT * w).collect();
        let ns: Vec<usize> = vec![1, 2, n_max / 3 + 1, SPLIT.min(n_max), n_max - 1, n_max];
        let per = heads * head_dim;
        let qs: Vec<Vec<f32>> = (0..ns.len())
            .map(|i| data(100 + i as u64, per, 1.5))
            .collect();
        let queries: Vec<GqaQuery<'_>> = qs
            .iter()
            .zip(&ns)
            .map(|(q, &n)| GqaQuery { q, n })
            .collect();
        let mut twin = vec![0f32; queries.len() * per];
        gqa_attend_scalar(&sh, &blocks, &queries, &mut twin);
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut all = vec![0f32; queries.len() * per];
            pool.install(|| gqa_attend(&sh, &blocks, &queries, &mut all));
            assert_eq!(all, twin, "{threads} threads, all queries at once");
            for (i, q) in queries.iter().enumerate() {
                let mut one = vec![0f32; per];
                pool.install(|| gqa_attend(&sh, &blocks, std::slice::from_ref(q), &mut one));
                assert_eq!(
                    one[..],
                    twin[i * per..(i + 1) * per],
                    "query {i} alone, {threads} threads"
                );
            }
        }
        for (i, q) in queries.iter().enumerate() {
            let want = reference(&sh, &rows, q);
            for (j, (&g, &r)) in twin[i * per..(i + 1) * per].iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()),
                    "query {i} value {j}: {g} vs {r}"
                );
            }
        }
    }
}

#[test]
fn rope_rotates_half_pairs_like_the_reference() {
    let (d, theta) = (16, 1e6);
    let rope = Rope::new(d, theta);
    for pos in [0usize, 1, 17, 4095] {
        let mut x = data(pos as u64, 3 * d, 1.0);
        let orig = x.clone();
        let (mut c, mut s) = (vec![0f32; d / 2], vec![0f32; d / 2]);
        rope.angles(pos, &mut c, &mut s);
        rope.rotate(&mut x, &c, &s);
        for (head, o) in x.chunks(d).zip(orig.chunks(d)) {
            for i in 0..d {
                let j = i % (d / 2);
                let a = pos as f64 / theta.powf(2.0 * j as f64 / d as f64);
                let rot = if i < d / 2 {
                    -(o[i + d / 2] as f64)
                } else {
                    o[i - d / 2] as f64
                };
                let want = o[i] as f64 * a.cos() + rot * a.sin();
                let tol = 1e-6 * (1.0 + pos as f64);
                assert!(
                    (head[i] as f64 - want).abs() <= tol,
                    "pos {pos} channel {i}"
                );
            }
        }
        if pos == 0 {
            assert_eq!(x, orig, "position 0 is the identity");
        }
    }
}
