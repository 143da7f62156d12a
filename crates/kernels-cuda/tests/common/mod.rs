//! What the GPU tests share: opening the device (or saying why a test
//! skips) and a deterministic generator; each test adds the value
//! distributions it needs as methods of [`Lcg`].

#![allow(dead_code)]

use std::sync::Arc;

use fathom_kernels::backend::{Backend, MatRef, Then, ThenGlu, ThenProduct};

use fathom_kernels::ops::GluAct;
use fathom_kernels_cuda::{CudaBackend, CudaError};

/// Device 0 with `budget` bytes for weights: a real one where the NVIDIA
/// driver is installed, else the emulated driver (`fathom-cuda-emu`: the
/// whole backend on the host emulator, with its checks of copies and
/// launch arguments); `None`, saying why, when neither is here.
pub fn open(budget: Option<u64>) -> Option<Arc<CudaBackend>> {
    let first = match CudaBackend::open(0, budget) {
        Ok(b) => return Some(b),
        Err(e) => e,
    };
    if !matches!(first, CudaError::NoDriver) {
        eprintln!("skipped: no CUDA backend here ({first})");
        return None;
    }
    if let Err(why) = fathom_cuda_emu::install_driver() {
        eprintln!("skipped: no CUDA driver here ({first}) and {why}");
        return None;
    }
    match CudaBackend::open(0, budget) {
        Ok(b) => {
            eprintln!("no CUDA driver here: running on the emulated driver (fathom-cuda-emu)");
            Some(b)
        }
        Err(e) => panic!("the emulated CUDA driver did not open: {e}"),
    }
}

/// A 64-bit linear congruential generator.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
}

impl Lcg {
    /// `n` values uniform in `[-amp, amp)`.
    pub fn uniform(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() as f32 / u32::MAX as f32 - 0.5) * 2.0 * amp)
            .collect()
    }

    /// `n` bf16 values (as bits) uniform in `[-amp, amp)`.
    pub fn bf16_bits(&mut self, n: usize, amp: f32) -> Vec<u16> {
        self.uniform(n, amp)
            .iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect()
    }
}

/// The buffers of a [`Then`] over `n` rows of width `d`: a gated MLP
/// and two plain products (bf16) of the normed rows; the weights
/// forgotten on drop.
pub struct Rest {
    /// The backend that keeps device copies of the weights (by address).
    dev: Arc<CudaBackend>,
    d: usize,
    partial: Vec<f32>,
    blocks: Vec<Vec<f32>>,
    query: Option<Vec<f32>>,
    norm: Vec<f32>,
    w: [Vec<u16>; 5],
    x: Vec<f32>,
    ys: [Vec<f32>; 3],
}

/// The rest's products' rows: plain 24 and 8, gate and up 264 (all `d`
/// wide), then the down (`d` rows, 264 wide: one full chunk of 256
/// columns, which VRAM holds rearranged, and a tail).
const REST_ROWS: [usize; 4] = [24, 8, 264, 264];

impl Rest {
    pub fn new(
        dev: &Arc<CudaBackend>,
        rng: &mut Lcg,
        n: usize,
        d: usize,
        nb: usize,
        query: bool,
    ) -> Self {
        let w = std::array::from_fn(|i| {
            let size = if i == 4 {
                d * REST_ROWS[2]
            } else {
                REST_ROWS[i] * d
            };
            rng.bf16_bits(size, 0.3)
        });
        Rest {
            dev: dev.clone(),
            d,
            partial: rng.uniform(n * d, 2.0),
            blocks: (0..nb).map(|_| rng.uniform(n * d, 2.0)).collect(),
            query: query.then(|| rng.uniform(d, 1.0)),
            norm: rng.uniform(d, 1.5),
            w,
            x: vec![0f32; n * d],
            ys: [n * 24, n * 8, n * d].map(|len| vec![f32::NAN; len]),
        }
    }

    pub fn then(&mut self) -> Then<'_> {
        let d = self.d;
        let m = |w, i: usize| {
            let (rows, cols) = if i == 4 {
                (d, REST_ROWS[2])
            } else {
                (REST_ROWS[i], d)
            };
            MatRef::Bf16 { w, rows, cols }
        };
        let [y0, y1, y2] = &mut self.ys;
        Then {
            d,
            partial: &self.partial,
            blocks: &self.blocks,
            query: self.query.as_deref(),
            eps: 1e-5,
            norm: &self.norm,
            x: &mut self.x,
            plain: vec![
                ThenProduct {
                    w: m(&self.w[0], 0),
                    y: y0,
                },
                ThenProduct {
                    w: m(&self.w[1], 1),
                    y: y1,
                },
            ],
            glu: vec![ThenGlu {
                gate: m(&self.w[2], 2),
                up: m(&self.w[3], 3),
                down: m(&self.w[4], 4),
                y: y2,
            }],
            act: GluAct::Situ {
                beta: 4.0,
                beta_lin: Some(25.0),
            },
            done: false,
        }
    }

    pub fn bits(&self) -> impl Iterator<Item = u32> + '_ {
        self.x
            .iter()
            .chain(self.ys.iter().flatten())
            .map(|v| v.to_bits())
    }
}

impl Drop for Rest {
    /// The weights' device copies go with them.
    fn drop(&mut self) {
        use fathom_kernels::backend::Backend;
        let forget = |p: *const u8, bytes: usize| self.dev.forget(p as usize..p as usize + bytes);
        for w in &self.w {
            forget(w.as_ptr().cast(), 2 * w.len());
        }
        forget(self.norm.as_ptr().cast(), 4 * self.norm.len());
        if let Some(q) = &self.query {
            forget(q.as_ptr().cast(), 4 * q.len());
        }
    }
}

/// `y[T, rows]` from the scalar twin.
#[allow(unused_imports)]
pub use fathom_kernels::formats::scalar_product as twin;

/// `a` and `b` bit for bit (any NaN equal to any NaN), naming the first
/// element that differs.
pub fn same(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    for (i, (p, q)) in a.iter().zip(b).enumerate() {
        assert!(
            p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()),
            "{what}: element {i}: device {p:e} ({:#x}) vs CPU {q:e} ({:#x})",
            p.to_bits(),
            q.to_bits()
        );
    }
}

/// Tells the backend a test buffer is going away, as every owner of
/// weights does on drop (the residency contract of `matmul_stable`).
pub fn drop_all(b: &CudaBackend, m: &MatRef<'_>) {
    for s in fathom_kernels::backend::segments(m) {
        let a = s.as_ptr() as usize;
        b.forget(a..a + s.len());
    }
}

/// MXFP4 views of `(packed, scales)` pairs, each `rows × cols`.
pub fn mxfp4_refs(
    bytes: &[(Vec<u8>, Vec<u8>)],
    rows: usize,
    cols: usize,
) -> Vec<fathom_weights::mxfp4::Mxfp4Ref<'_>> {
    bytes
        .iter()
        .map(|(p, s)| fathom_weights::mxfp4::Mxfp4Ref {
            rows,
            cols,
            packed: p,
            scales: s,
        })
        .collect()
}
