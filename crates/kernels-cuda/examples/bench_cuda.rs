//! Times single products on the device with their weights already in VRAM:
//! the fixed cost of one product (a tiny matrix) and the weight bandwidth
//! of decode-sized ones, beside the device-memory bandwidth measured when
//! the backend opened. Expert-sized matrices rotate through copies that
//! together outgrow the device's L2 cache, so their bytes come from HBM.
//! The single products run twice: replayed as CUDA graphs (the default;
//! a repeated call is one graph launch) and issued one by one.
//! `cargo run --release -p fathom-kernels-cuda --example bench_cuda`
//! (prints why and exits 0 without a device).

use std::time::Instant;

use fathom_kernels::backend::{Backend, MatRef, Role};
use fathom_kernels_cuda::CudaBackend;
use fathom_weights::mxfp4::Mxfp4Ref;

/// Seconds a call takes (wall) and its kernels take (device time, from
/// the backend's `kernel_ms`), each the mean over `reps`.
fn time(b: &CudaBackend, ms: &[MatRef<'_>], groups: usize, t: usize, reps: usize) -> (f64, f64) {
    let x = vec![0.25f32; groups * t * ms[0].cols()];
    let mut y = vec![0f32; t * ms[0].rows()];
    let go = |m: &MatRef<'_>, y: &mut [f32]| {
        if groups == 1 {
            b.matmul(m, Role::Spine, &x, t, y)
        } else {
            b.matmul_groups(m, Role::Spine, groups, &x, t, y)
        }
    };
    // Twice: a repeated call is captured as a graph the second time, so
    // the timed calls are replays (or, graphs off, plain calls).
    for _ in 0..2 {
        for m in ms {
            assert!(go(m, &mut y), "declined");
        }
    }
    let k0 = b.stats().kernel_ms;
    let start = Instant::now();
    for i in 0..reps {
        go(&ms[i % ms.len()], &mut y);
    }
    let wall = start.elapsed().as_secs_f64() / reps as f64;
    (wall, (b.stats().kernel_ms - k0) / 1e3 / reps as f64)
}

fn main() {
    let b = match CudaBackend::open(0, None) {
        Ok(b) => b,
        Err(e) => {
            println!("skipped: no CUDA backend here ({e})");
            return;
        }
    };
    let st = b.stats();
    println!(
        "{}: device memory {:.0} GB/s (copy, read + write), host→device {:.1} GB/s (page-locked)",
        b.name(),
        st.hbm_bytes_per_s / 1e9,
        st.h2d_bytes_per_s / 1e9
    );
    let w = Weights::new();
    batch_cases(&b, &w);
    for graphs in [true, false] {
        b.set_graphs(graphs);
        println!("graphs {}:", if graphs { "on" } else { "off" });
        for (what, ms, groups, t) in w.cases() {
            let bytes: usize = fathom_kernels::backend::segments(&ms[0])
                .iter()
                .map(|s| s.len())
                .sum();
            let (s, k) = time(&b, &ms, groups, t, 24);
            println!(
                "{what:<36} {:>9.1} µs  {:>7.0} GB/s of weights; kernels {:>8.1} µs  {:>7.0} GB/s",
                s * 1e6,
                bytes as f64 / s / 1e9,
                k * 1e6,
                bytes as f64 / k / 1e9
            );
        }
    }
}

/// Copies of the expert-sized weights: 8 × 14.7 MB, past an H200's 50 MB L2.
const COPIES: usize = 8;

/// The matrices timed (all values constant: only the shapes matter).
struct Weights {
    tiny: Vec<u16>,
    sq: Vec<u16>,
    head: Vec<u16>,
    heads: Vec<u16>,
    packed: Vec<u8>,
    scales: Vec<u8>,
}

impl Weights {
    fn new() -> Self {
        let bf = |rows: usize, cols: usize| vec![0x3f80u16; rows * cols];
        Weights {
            tiny: bf(64, 64),
            sq: bf(7168, 7168),
            head: bf(163_840, 7168),
            heads: bf(96 * 512, 128),
            packed: vec![0x21u8; COPIES * 4096 * 7168 / 2],
            scales: vec![127u8; COPIES * 4096 * 7168 / 32],
        }
    }

    /// The `i`th copy of an MXFP4 `rows × cols` matrix.
    fn mx(&self, i: usize, rows: usize, cols: usize) -> MatRef<'_> {
        let (p, s) = (rows * cols / 2, rows * cols / 32);
        let m = Mxfp4Ref::new(
            rows,
            cols,
            &self.packed[i * p..(i + 1) * p],
            &self.scales[i * s..(i + 1) * s],
        );
        MatRef::Mxfp4(m.unwrap())
    }

    /// (label, matrices taken in turn, groups, positions).
    fn cases(&self) -> Vec<(&'static str, Vec<MatRef<'_>>, usize, usize)> {
        let bf = |w, rows, cols| vec![MatRef::Bf16 { w, rows, cols }];
        let mx = (0..COPIES).map(|i| self.mx(i, 4096, 7168)).collect();
        vec![
            ("bf16 64x64 (fixed cost)", bf(&self.tiny, 64, 64), 1, 1),
            ("bf16 7168x7168", bf(&self.sq, 7168, 7168), 1, 1),
            ("bf16 7168x7168, T=8", bf(&self.sq, 7168, 7168), 1, 8),
            (
                "bf16 163840x7168 (head)",
                bf(&self.head, 163_840, 7168),
                1,
                1,
            ),
            (
                "bf16 96 heads x 512x128, grouped",
                bf(&self.heads, 96 * 512, 128),
                96,
                1,
            ),
            ("mxfp4 4096x7168 (expert)", mx, 1, 1),
        ]
    }
}

/// A MoE layer's routed experts at K3's shapes as the model hands them over:
/// the gate and up products of four experts in one batch, then their downs
/// (each batch's matrices distinct, the batches taking turns over 16
/// matrices, 88 MB).
fn batch_cases(b: &CudaBackend, w: &Weights) {
    use fathom_kernels::backend::Product;
    let (f, l) = (3072, 3584);
    // Two matrices of a K3 expert's shape fit in each copy: 16 of 5.5 MB.
    let per = 4096 * 7168 / (f * l);
    let all = |rows, cols| -> Vec<MatRef<'_>> {
        (0..COPIES * per).map(|i| w.mx(i, rows, cols)).collect()
    };
    let (ups, downs) = (all(f, l), all(l, f));
    for (what, ms, n) in [
        ("4 experts' gate+up (8 x 3072x3584), one batch", ups, 8),
        ("4 experts' down (4 x 3584x3072), one batch", downs, 4),
    ] {
        let m = ms[0];
        let x = vec![0.25f32; m.cols()];
        let mut ys: Vec<Vec<f32>> = (0..n).map(|_| vec![0f32; m.rows()]).collect();
        let mut turn = 0;
        let mut go = || {
            turn += 1;
            let at = turn * n % ms.len();
            let mut ps: Vec<Product<'_, '_>> = ys
                .iter_mut()
                .zip(&ms[at..at + n])
                .map(|(y, &m)| Product {
                    w: m,
                    role: Role::Expert,
                    x: &x,
                    t: 1,
                    y,
                })
                .collect();
            assert!(b.matmul_batch(&mut ps, &Default::default()), "declined");
        };
        for _ in 0..ms.len() / n {
            go();
        }
        let k0 = b.stats().kernel_ms;
        let start = Instant::now();
        for _ in 0..20 {
            go();
        }
        let s = start.elapsed().as_secs_f64() / 20.0;
        let k = (b.stats().kernel_ms - k0) / 1e3 / 20.0;
        let bytes: usize = fathom_kernels::backend::segments(&m)
            .iter()
            .map(|s| s.len())
            .sum::<usize>()
            * n;
        println!(
            "{what:<48} {:>9.1} µs  {:>7.0} GB/s of weights; kernels {:>8.1} µs  {:>7.0} GB/s",
            s * 1e6,
            bytes as f64 / s / 1e9,
            k * 1e6,
            bytes as f64 / k / 1e9
        );
    }
}
