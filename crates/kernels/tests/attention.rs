//! The latent-cache attention kernel: bit-identical to its twin whatever
//! the number of queries per call or threads, and close to a float64
//! softmax reference.

use fathom_kernels::attention::{
    MlaAccum, MlaQuery, MlaShape, SPLIT, mla_attend, mla_attend_scalar,
};

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

fn reference(sh: &MlaShape, rows: &[f32], q: &MlaQuery<'_>) -> Vec<f64> {
    let (h, lora, rope, w) = (sh.heads, sh.lora, sh.rope, sh.width());
    let mut out = vec![0f64; h * lora];
    for hh in 0..h {
        let s: Vec<f64> = (0..q.n)
            .map(|r| {
                let row = &rows[r * w..(r + 1) * w];
                let a: f64 = (0..lora)
                    .map(|i| row[i] as f64 * q.q_lat[hh * lora + i] as f64)
                    .sum();
                let b: f64 = (0..rope)
                    .map(|i| row[lora + i] as f64 * q.q_rope[hh * rope + i] as f64)
                    .sum();
                (a + b) * sh.scale as f64
            })
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
        for (r, v) in s.iter().enumerate() {
            let p = (v - m).exp() / z;
            for i in 0..lora {
                out[hh * lora + i] += p * rows[r * w + i] as f64;
            }
        }
    }
    out
}

#[test]
fn any_grouping_or_thread_count_gives_the_twin_bit_for_bit() {
    for (heads, lora, rope, n_max) in [
        (3, 13, 5, 40),
        (6, 128, 16, 2 * SPLIT + 37),
        (2, 64, 0, SPLIT + 1),
        // Two full head tiles and a remainder.
        (19, 40, 12, SPLIT + 5),
        // A full tile whose context width is not a multiple of 8.
        (9, 13, 4, SPLIT + 3),
    ] {
        let sh = MlaShape {
            heads,
            lora,
            rope,
            scale: 0.125,
        };
        let w = sh.width();
        let rows = data(heads as u64, n_max * w, 2.0);
        let blocks: Vec<&[f32]> = rows.chunks(SPLIT * w).collect();
        let ns: Vec<usize> = vec![1, 2, n_max / 3 + 1, SPLIT.min(n_max), n_max - 1, n_max];
        let qs: Vec<(Vec<f32>, Vec<f32>)> = ns
            .iter()
            .enumerate()
            .map(|(i, _)| {
                (
                    data(100 + i as u64, heads * lora, 1.5),
                    data(200 + i as u64, heads * rope, 1.5),
                )
            })
            .collect();
        let queries: Vec<MlaQuery<'_>> = qs
            .iter()
            .zip(&ns)
            .map(|((a, b), &n)| MlaQuery {
                q_lat: a,
                q_rope: b,
                n,
            })
            .collect();
        let per = heads * lora;
        let mut twin = vec![0f32; queries.len() * per];
        mla_attend_scalar(&sh, &blocks, &queries, &mut twin);
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut all = vec![0f32; queries.len() * per];
            pool.install(|| mla_attend(&sh, &blocks, &queries, &mut all));
            assert_eq!(all, twin, "{threads} threads, all queries at once");
            // Handed in windows of any size (a cache read from disk a window at a time).
            for win in [1, 2, 3] {
                let mut acc = MlaAccum::new(sh, &queries);
                for (i, chunk) in blocks.chunks(win).enumerate() {
                    acc.add(i * win, chunk);
                }
                let mut windowed = vec![0f32; queries.len() * per];
                pool.install(|| acc.finish(&mut windowed));
                assert_eq!(windowed, twin, "{threads} threads, windows of {win} blocks");
            }
            for (i, q) in queries.iter().enumerate() {
                let mut one = vec![0f32; per];
                pool.install(|| mla_attend(&sh, &blocks, std::slice::from_ref(q), &mut one));
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
fn extreme_scores_stay_finite() {
    let sh = MlaShape {
        heads: 2,
        lora: 8,
        rope: 0,
        scale: 1.0,
    };
    let n = 3 * SPLIT;
    let mut rows = data(9, n * 8, 1.0);
    // One split is far above the others: its weight dominates, others underflow to 0.
    for v in &mut rows[SPLIT * 8..2 * SPLIT * 8] {
        *v *= 40.0;
    }
    let q = data(10, 16, 3.0);
    let mut out = vec![0f32; 16];
    let blocks: Vec<&[f32]> = rows.chunks(SPLIT * 8).collect();
    mla_attend(
        &sh,
        &blocks,
        &[MlaQuery {
            q_lat: &q,
            q_rope: &[],
            n,
        }],
        &mut out,
    );
    assert!(out.iter().all(|v| v.is_finite()), "{out:?}");
}
