//! GEMV bandwidth of the weight formats against the machine's memory bandwidth.
//!
//! `cargo run --release -p fathom-kernels --example bench_kernels [-- --quick] [--all-isas] [--t 16]`
//!
//! For each thread count (1 and 2) it measures a STREAM-style triad
//! `a = b + s·c` (3 × 256 MiB, bytes counted as 3 arrays) and then `y = x Wᵀ`
//! for bf16, int8 and MXFP4 weights at Kimi K3 shapes. The effective
//! bandwidth is weight bytes ÷ time (activations are small and cached); the
//! ratio to the triad says how close a kernel is to the memory limit.
//! `FATHOM_KERNELS` picks the instruction set, `--all-isas` runs each.

use std::time::Instant;

use fathom_kernels::{Isa, Kernels, kernels, supported_isas};
use fathom_weights::mxfp4::Mxfp4Ref;
use rayon::prelude::*;

fn fill_u8(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    v.par_chunks_mut(1 << 20).enumerate().for_each(|(k, c)| {
        let mut s = seed ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for b in c {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *b = (s >> 56) as u8;
        }
    });
    v
}

/// Median seconds of `f` over enough repetitions to take about `budget` s.
fn time(budget: f64, mut f: impl FnMut()) -> f64 {
    f();
    let t0 = Instant::now();
    f();
    let once = t0.elapsed().as_secs_f64().max(1e-6);
    let reps = ((budget / once) as usize).clamp(3, 200);
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[reps / 2]
}

fn triad(n: usize, budget: f64) -> f64 {
    let b = vec![1f32; n];
    let c = vec![2f32; n];
    let mut a = vec![0f32; n];
    let s = time(budget, || {
        a.par_chunks_mut(1 << 16)
            .zip(b.par_chunks(1 << 16).zip(c.par_chunks(1 << 16)))
            .for_each(|(a, (b, c))| {
                for i in 0..a.len() {
                    a[i] = b[i] + 3.0 * c[i];
                }
            })
    });
    std::hint::black_box(&a);
    (3 * n * 4) as f64 / s / 1e9
}

enum W {
    Bf16(Vec<u16>),
    Int8(Vec<i8>, Vec<f32>),
    Mxfp4(Vec<u8>, Vec<u8>),
}

impl W {
    fn new(kind: &str, rows: usize, cols: usize) -> W {
        match kind {
            // Random finite bf16 in [-2, 2): sign, exponent 126..127, random mantissa.
            "bf16" => W::Bf16(
                fill_u8(rows * cols, 5)
                    .into_iter()
                    .map(|b| 0x3F00 | ((b as u16 & 0x80) << 8) | (b as u16 & 0x7F))
                    .collect(),
            ),
            "int8" => W::Int8(
                fill_u8(rows * cols, 6)
                    .into_iter()
                    .map(|b| b as i8)
                    .collect(),
                vec![1e-3; rows],
            ),
            _ => W::Mxfp4(fill_u8(rows * cols / 2, 7), vec![120; rows * cols / 32]),
        }
    }
    fn bytes(&self) -> usize {
        match self {
            W::Bf16(w) => w.len() * 2,
            W::Int8(q, s) => q.len() + s.len() * 4,
            W::Mxfp4(p, s) => p.len() + s.len(),
        }
    }
    fn run(&self, k: &Kernels, x: &[f32], t: usize, rows: usize, cols: usize, y: &mut [f32]) {
        match self {
            W::Bf16(w) => k.matmul_bf16(x, t, w, rows, cols, y),
            W::Int8(q, s) => k.matmul_int8(x, t, q, s, cols, y),
            W::Mxfp4(p, s) => k.matmul_mxfp4(x, t, Mxfp4Ref::new(rows, cols, p, s).unwrap(), y),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let t = args
        .iter()
        .position(|a| a == "--t")
        .map_or(1, |i| args[i + 1].parse().expect("--t N"));
    let isas: Vec<Isa> = if args.iter().any(|a| a == "--all-isas") {
        supported_isas()
    } else {
        vec![kernels().isa]
    };
    let budget = if quick { 0.3 } else { 1.0 };
    let shapes: &[(&str, usize, usize)] = if quick {
        &[("7168x7168", 7168, 7168), ("expert 3072x3584", 3072, 3584)]
    } else {
        &[
            ("7168x7168", 7168, 7168),
            ("head 163840x7168", 163840, 7168),
            ("expert 3072x3584", 3072, 3584),
        ]
    };
    let max_threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let pools: Vec<(usize, rayon::ThreadPool)> = [1, max_threads.min(2)]
        .into_iter()
        .map(|n| {
            (
                n,
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .unwrap(),
            )
        })
        .collect();
    let triads: Vec<f64> = pools
        .iter()
        .map(|(_, p)| p.install(|| triad(64 << 20, budget)))
        .collect();
    for ((n, _), gb) in pools.iter().zip(&triads) {
        println!("triad {n} thread(s): {gb:.2} GB/s");
    }
    println!("T = {t}");
    println!(
        "{:<18} {:<6} {:<7} {:>7} {:>10} {:>9} {:>7}",
        "shape", "format", "isa", "threads", "ms", "GB/s", "ratio"
    );
    for &(name, rows, cols) in shapes {
        for kind in ["bf16", "int8", "mxfp4"] {
            let w = W::new(kind, rows, cols);
            let x: Vec<f32> = (0..t * cols)
                .map(|i| ((i % 17) as f32 - 8.0) * 0.01)
                .collect();
            let mut y = vec![0f32; t * rows];
            for &isa in &isas {
                let k = Kernels::for_isa(isa).unwrap();
                for ((n, pool), tri) in pools.iter().zip(&triads) {
                    let s = pool.install(|| time(budget, || w.run(k, &x, t, rows, cols, &mut y)));
                    let gb = w.bytes() as f64 / s / 1e9;
                    println!(
                        "{name:<18} {kind:<6} {:<7} {n:>7} {:>10.3} {gb:>9.2} {:>7.3}",
                        isa.name(),
                        s * 1e3,
                        gb / tri
                    );
                }
            }
        }
    }
}
