//! Throughput of the latent-cache attention kernel at Kimi K3's shapes (96
//! heads, 512 + 64 wide rows), one decode query, against its FMA count.
//!
//! `cargo run --release -p fathom-kernels --example bench_mla [-- 1024,32768 [1,8,16]]`
//!
//! For each depth and thread count it prints milliseconds per call and the
//! achieved GFLOP/s (2 × heads × depth × (width + lora) flops), so the
//! kernel's scaling with threads can be told apart from the rest of a step.
//! `FATHOM_KERNELS` picks the instruction set.

use std::time::Instant;

use fathom_kernels::attention::{MlaQuery, MlaShape, SPLIT, mla_attend};
use fathom_kernels::kernels;

fn data(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
        })
        .collect()
}

fn list(arg: Option<String>, default: &[usize]) -> Vec<usize> {
    arg.map(|s| s.split(',').filter_map(|v| v.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

fn main() {
    let mut args = std::env::args().skip(1);
    let depths = list(args.next(), &[1024, 32768]);
    let threads = list(args.next(), &[1, 2]);
    let sh = MlaShape {
        heads: 96,
        lora: 512,
        rope: 64,
        scale: 0.07,
    };
    let w = sh.width();
    println!("kernels: {}", kernels().isa.name());
    let (ql, qr) = (data(1, sh.heads * sh.lora), data(2, sh.heads * sh.rope));
    for &n in &depths {
        let rows = data(3, n * w);
        let blocks: Vec<&[f32]> = rows.chunks(SPLIT * w).collect();
        let q = [MlaQuery {
            q_lat: &ql,
            q_rope: &qr,
            n,
        }];
        let mut out = vec![0f32; sh.heads * sh.lora];
        let flops = 2.0 * (sh.heads * n * (w + sh.lora)) as f64;
        for &t in &threads {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .expect("thread pool");
            pool.install(|| mla_attend(&sh, &blocks, &q, &mut out));
            let reps = (2e10 / flops / t as f64).clamp(3.0, 200.0) as usize;
            let mut v: Vec<f64> = (0..reps)
                .map(|_| {
                    let t0 = Instant::now();
                    pool.install(|| mla_attend(&sh, &blocks, &q, &mut out));
                    t0.elapsed().as_secs_f64()
                })
                .collect();
            v.sort_by(f64::total_cmp);
            let med = v[v.len() / 2];
            println!(
                "depth {n:>8}  threads {t:>3}  {:>9.3} ms  {:>7.1} GFLOP/s  ({:.1} per thread)",
                med * 1e3,
                flops / med / 1e9,
                flops / med / 1e9 / t as f64
            );
        }
    }
}
