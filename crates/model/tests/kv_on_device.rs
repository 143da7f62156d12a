//! A latent cache's full blocks kept on the CUDA backend (the real driver,
//! else the emulated one from `fathom-cuda-emu`) never go stale: MLA work
//! over a `PagedRows` cache gives the CPU twin's bits after the cache is
//! truncated into a full block and refilled with other rows, and after it
//! is dropped and a new cache (perhaps at the same addresses) filled.
//! Without either driver the test prints why it skips.

use std::sync::Arc;

use fathom_kernels::attention::MlaShape;
use fathom_kernels::backend::{self, Backend, MatRef, MlaSeqWork, MlaWork, mla_work_cpu};
use fathom_kernels_cuda::{CudaBackend, CudaError};
use fathom_model::kv::{KvPool, PagedRows};

const SH: MlaShape = MlaShape {
    heads: 3,
    lora: 24,
    rope: 8,
    scale: 0.2,
};
const DN: usize = 16;
const DV: usize = 12;

fn open() -> Option<Arc<CudaBackend>> {
    match CudaBackend::open(0, Some(64 << 20)) {
        Ok(b) => return Some(b),
        Err(CudaError::NoDriver) => {}
        Err(e) => {
            eprintln!("skipped: no CUDA backend here ({e})");
            return None;
        }
    }
    if let Err(why) = fathom_cuda_emu::install_driver() {
        eprintln!("skipped: no CUDA driver here and {why}");
        return None;
    }
    Some(CudaBackend::open(0, Some(64 << 20)).expect("the emulated driver opens"))
}

struct Rng(u64);

impl Rng {
    fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * amp
            })
            .collect()
    }
}

/// The device's values over `cache`'s first `rows` rows (queries seeing
/// `rows` and half of them) equal the CPU twin's.
fn check(b: &dyn Backend, cache: &PagedRows, rows: usize, g: &mut Rng, w: (&[u16], &[u16])) {
    let h = SH.heads;
    let (blocks, stable) = cache.ram_blocks(rows).expect("fp32 in RAM");
    let seqs = [MlaSeqWork {
        blocks,
        stable,
        queries: 0..2,
        first: 0,
    }];
    let ns = [rows, rows / 2];
    let (q_nope, q_rope) = (g.vec(h * 2 * DN, 1.0), g.vec(2 * h * SH.rope, 1.0));
    let mut want = vec![0f32; h * 2 * DV];
    let mut got = vec![f32::NAN; h * 2 * DV];
    let mut work = MlaWork {
        shape: SH,
        seqs: &seqs,
        ns: &ns,
        q_nope: &q_nope,
        q_rope: &q_rope,
        uk_t: MatRef::Bf16 {
            w: w.0,
            rows: h * SH.lora,
            cols: DN,
        },
        uv: MatRef::Bf16 {
            w: w.1,
            rows: h * DV,
            cols: SH.lora,
        },
        o: None,
        out: &mut got,
        then: None,
        proj: None,
    };
    mla_work_cpu(&mut MlaWork {
        out: &mut want,
        then: None,
        proj: None,
        ..work
    });
    assert!(b.mla_attend(&mut work), "the device takes it");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want), "{rows} rows, {stable} kept");
}

#[test]
fn cache_blocks_on_the_device_follow_truncation_and_reuse() {
    let Some(dev) = open() else {
        return;
    };
    // The cache forgets through the installed backend.
    backend::install(dev.clone());
    let mut g = Rng(11);
    let bf16 = |v: Vec<f32>| -> Vec<u16> { v.iter().map(|x| (x.to_bits() >> 16) as u16).collect() };
    let uk = bf16(g.vec(SH.heads * SH.lora * DN, 0.5));
    let uv = bf16(g.vec(SH.heads * DV * SH.lora, 0.5));
    let w = SH.width();
    let pool = KvPool::unlimited();
    let mut cache = PagedRows::new(w, &pool);
    cache.push_rows(&g.vec(300 * w, 2.0)).unwrap();
    check(dev.as_ref(), &cache, 300, &mut g, (&uk, &uv));
    // Into the full first block, then other rows over it.
    cache.truncate(200);
    cache.push_rows(&g.vec(100 * w, 2.0)).unwrap();
    check(dev.as_ref(), &cache, 300, &mut g, (&uk, &uv));
    // A new cache in place of a dropped one.
    drop(cache);
    let mut again = PagedRows::new(w, &pool);
    again.push_rows(&g.vec(280 * w, 2.0)).unwrap();
    check(dev.as_ref(), &again, 280, &mut g, (&uk, &uv));
    backend::uninstall();
}
