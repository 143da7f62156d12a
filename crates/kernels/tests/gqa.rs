//! The grouped-query attention kernel: bit-identical to its twin whatever
//! the number of queries per call or threads, with or without a sliding
//! window and attention sinks, close to a float64 softmax reference; a
//! windowed cache handed from its first needed block gives the same bits;
//! and the rotary embedding against a float64 reference.

use fathom_kernels::attention::SPLIT;
use fathom_kernels::gqa::{GqaAccum, GqaQuery, GqaShape, gqa_attend, gqa_attend_scalar};
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

fn reference(sh: &GqaShape, rows: &[f32], q: &GqaQuery<'_>, sinks: Option<&[f32]>) -> Vec<f64> {
    let (h, d, w) = (sh.heads, sh.head_dim, sh.width());
    let (kvw, group) = (sh.kv_heads * d, sh.heads / sh.kv_heads);
    let mut out = vec![0f64; h * d];
    for hh in 0..h {
        let g = hh / group;
        let lo = sh.window.map_or(0, |w| q.n.saturating_sub(w));
        let s: Vec<f64> = (lo..q.n)
            .map(|r| {
                let key = &rows[r * w + g * d..][..d];
                let dot: f64 = (0..d).map(|i| key[i] as f64 * q.q[hh * d + i] as f64).sum();
                dot * sh.scale as f64
            })
            .collect();
        let sink = sinks.map(|x| x[hh] as f64);
        let m = s
            .iter()
            .copied()
            .chain(sink)
            .fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().chain(&sink).map(|v| (v - m).exp()).sum();
        for (i, v) in s.iter().enumerate() {
            let r = lo + i;
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
    for (heads, kv_heads, head_dim, n_max, window, sinks) in [
        (4, 2, 16, 40, None, false),
        (8, 1, 64, 2 * SPLIT + 37, None, false),
        (3, 3, 13, SPLIT + 1, None, false),
        (4, 2, 16, 40, Some(8), true),
        (8, 2, 32, 2 * SPLIT + 37, Some(SPLIT + 3), true),
        (4, 1, 16, 2 * SPLIT + 5, Some(1), false),
        (2, 2, 8, SPLIT + 9, None, true),
    ] {
        let sh = GqaShape {
            heads,
            kv_heads,
            head_dim,
            scale: (head_dim as f32).powf(-0.5),
            window,
        };
        let sink_vals = data(7 + heads as u64, heads, 3.0);
        let sinks = sinks.then_some(&sink_vals[..]);
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
        gqa_attend_scalar(&sh, &blocks, &queries, sinks, &mut twin);
        for threads in [1, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut all = vec![0f32; queries.len() * per];
            pool.install(|| gqa_attend(&sh, &blocks, &queries, sinks, &mut all));
            assert_eq!(all, twin, "{threads} threads, all queries at once");
            for (i, q) in queries.iter().enumerate() {
                let mut one = vec![0f32; per];
                let one_q = std::slice::from_ref(q);
                pool.install(|| gqa_attend(&sh, &blocks, one_q, sinks, &mut one));
                assert_eq!(
                    one[..],
                    twin[i * per..(i + 1) * per],
                    "query {i} alone, {threads} threads"
                );
            }
        }
        for (i, q) in queries.iter().enumerate() {
            let want = reference(&sh, &rows, q, sinks);
            for (j, (&g, &r)) in twin[i * per..(i + 1) * per].iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - r).abs() <= 1e-5 * (1.0 + r.abs()),
                    "query {i} value {j}: {g} vs {r}"
                );
            }
        }
    }
}

/// With a window, blocks before the first needed one are never asked for:
/// handing the rest, one block at a time, gives `gqa_attend`'s bits.
#[test]
fn windowed_cache_from_its_first_needed_block() {
    let sh = GqaShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        scale: 0.3,
        window: Some(40),
    };
    let (w, n) = (sh.width(), 3 * SPLIT + 20);
    let rows = data(5, n * w, 1.0);
    let blocks: Vec<&[f32]> = rows.chunks(SPLIT * w).collect();
    let qs: Vec<Vec<f32>> = (0..3).map(|i| data(50 + i, 4 * 8, 1.0)).collect();
    let queries: Vec<GqaQuery<'_>> = qs
        .iter()
        .zip([n - 2, n - 1, n])
        .map(|(q, n)| GqaQuery { q, n })
        .collect();
    let sinks = [0.5f32, -1.0, 2.0, 0.0];
    let mut want = vec![0f32; 3 * 32];
    gqa_attend(&sh, &blocks, &queries, Some(&sinks), &mut want);
    let mut acc = GqaAccum::new(sh, &queries).with_sinks(&sinks);
    let first = acc.first_block();
    assert_eq!(first, 2, "blocks before the earliest window are skipped");
    for (i, b) in blocks[first..].iter().enumerate() {
        acc.add(first + i, std::slice::from_ref(b));
    }
    let mut got = vec![0f32; 3 * 32];
    acc.finish(&mut got);
    assert_eq!(got, want);
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
