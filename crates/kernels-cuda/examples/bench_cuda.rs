//! Times single products on the device with their weights already in VRAM:
//! the fixed cost of one product (a tiny matrix) and the weight bandwidth
//! of decode-sized ones, beside the device-memory bandwidth measured when
//! the backend opened. `cargo run --release -p fathom-kernels-cuda --example bench_cuda`
//! (prints why and exits 0 without a device).

use std::time::Instant;

use fathom_kernels::backend::{Backend, MatRef, Role};
use fathom_kernels_cuda::CudaBackend;
use fathom_weights::mxfp4::Mxfp4Ref;

/// Seconds a call takes (wall) and its kernels take (device time, from
/// the backend's `kernel_ms`), each the mean over `reps`.
fn time(b: &CudaBackend, m: &MatRef<'_>, groups: usize, t: usize, reps: usize) -> (f64, f64) {
    let x = vec![0.25f32; groups * t * m.cols()];
    let mut y = vec![0f32; t * m.rows()];
    let go = |y: &mut [f32]| {
        if groups == 1 {
            b.matmul(m, Role::Spine, &x, t, y)
        } else {
            b.matmul_groups(m, Role::Spine, groups, &x, t, y)
        }
    };
    assert!(go(&mut y), "declined");
    let k0 = b.stats().kernel_ms;
    let start = Instant::now();
    for _ in 0..reps {
        go(&mut y);
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
    for (what, m, groups, t) in w.cases() {
        let bytes: usize = fathom_kernels::backend::segments(&m)
            .iter()
            .map(|s| s.len())
            .sum();
        let (s, k) = time(&b, &m, groups, t, 20);
        println!(
            "{what:<36} {:>9.1} µs  {:>7.0} GB/s of weights; kernels {:>8.1} µs  {:>7.0} GB/s",
            s * 1e6,
            bytes as f64 / s / 1e9,
            k * 1e6,
            bytes as f64 / k / 1e9
        );
    }
}

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
            packed: vec![0x21u8; 4096 * 7168 / 2],
            scales: vec![127u8; 4096 * 7168 / 32],
        }
    }

    /// (label, matrix, groups, positions).
    fn cases(&self) -> Vec<(&'static str, MatRef<'_>, usize, usize)> {
        let bf = |w, rows, cols| MatRef::Bf16 { w, rows, cols };
        let mx = MatRef::Mxfp4(Mxfp4Ref::new(4096, 7168, &self.packed, &self.scales).unwrap());
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
/// the gate and up products of four experts in one batch, then their downs.
fn batch_cases(b: &CudaBackend, w: &Weights) {
    use fathom_kernels::backend::Product;
    let (f, l) = (3072, 3584);
    let up = MatRef::Mxfp4(
        Mxfp4Ref::new(f, l, &w.packed[..f * l / 2], &w.scales[..f * l / 32]).unwrap(),
    );
    let down = MatRef::Mxfp4(
        Mxfp4Ref::new(l, f, &w.packed[..f * l / 2], &w.scales[..f * l / 32]).unwrap(),
    );
    for (what, m, n) in [
        ("4 experts' gate+up (8 x 3072x3584), one batch", up, 8),
        ("4 experts' down (4 x 3584x3072), one batch", down, 4),
    ] {
        let x = vec![0.25f32; m.cols()];
        let mut ys: Vec<Vec<f32>> = (0..n).map(|_| vec![0f32; m.rows()]).collect();
        let mut go = || {
            let mut ps: Vec<Product<'_, '_>> = ys
                .iter_mut()
                .map(|y| Product {
                    w: m,
                    role: Role::Expert,
                    x: &x,
                    t: 1,
                    y,
                })
                .collect();
            assert!(b.matmul_batch(&mut ps, &Default::default()), "declined");
        };
        go();
        let start = Instant::now();
        for _ in 0..20 {
            go();
        }
        let s = start.elapsed().as_secs_f64() / 20.0;
        let bytes: usize = fathom_kernels::backend::segments(&m)
            .iter()
            .map(|s| s.len())
            .sum::<usize>()
            * n;
        println!(
            "{what:<48} {:>9.1} µs  {:>7.0} GB/s of weights",
            s * 1e6,
            bytes as f64 / s / 1e9
        );
    }
}
