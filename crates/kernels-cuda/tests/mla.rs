//! An MLA layer's absorbed attention on the device (`Backend::mla_attend`:
//! `uk_t`'s grouped product, the attention over each sequence's cache,
//! `uv`'s grouped product, in one call) against the CPU kernels step by
//! step, bit for bit: two sequences (their kept and sent blocks
//! interleaved in one table), queries seeing one row to every row of a
//! cache of full blocks and a partial one; the full blocks kept on the
//! device between calls (only partial blocks and queries go up again); a
//! block changed after `forget` copied anew; a prefill run in chunks of
//! queries; full blocks beyond the budget declined with nothing written.
//! Without a CUDA device (real or emulated) the test prints why it skipped.

use fathom_kernels::attention::{MlaShape, SPLIT};
use fathom_kernels::backend::{Backend, MatRef, MlaSeqWork, MlaWork, mla_work_cpu};

mod common;

use common::{Lcg, open};

impl Lcg {
    fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() as f32 / u32::MAX as f32 - 0.5) * 2.0 * amp)
            .collect()
    }
    fn bf16(&mut self, n: usize) -> Vec<u16> {
        self.vec(n, 0.4)
            .iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect()
    }
}

const SH: MlaShape = MlaShape {
    heads: 5,
    lora: 36,
    rope: 12,
    scale: 0.17,
};
const DN: usize = 20;
const DV: usize = 24;

#[test]
fn mla_attention_on_the_device_gives_the_cpus_bits() {
    let Some(dev) = open(Some(64 << 20)) else {
        return;
    };
    let (h, w) = (SH.heads, SH.width());
    let mut g = Lcg(7);
    let (rows_a, rows_b) = (3 * SPLIT + 41, SPLIT + 100);
    let mut cache_a = g.vec(rows_a * w, 2.0);
    let cache_b = g.vec(rows_b * w, 2.0);
    let ns = [
        1usize,
        SPLIT - 1,
        SPLIT,
        SPLIT + 1,
        2 * SPLIT + 3,
        rows_a,
        7,
        rows_b,
    ];
    let t = ns.len();
    let q_nope = g.vec(h * t * DN, 1.5);
    let q_rope = g.vec(t * h * SH.rope, 1.5);
    let (uk, uv) = (g.bf16(h * SH.lora * DN), g.bf16(h * DV * SH.lora));
    let block_bytes = (4 * SPLIT * w) as u64;
    // The device's values and the CPU's as bits; `None` when declined.
    let both = |b: &dyn Backend, cache_a: &[f32], stable: usize| {
        let seqs = [
            MlaSeqWork {
                blocks: cache_a.chunks(SPLIT * w).collect(),
                stable,
                queries: 0..6,
            },
            MlaSeqWork {
                blocks: cache_b.chunks(SPLIT * w).collect(),
                stable: stable.min(1),
                queries: 6..8,
            },
        ];
        let mut out = vec![f32::NAN; h * t * DV];
        let mut work = MlaWork {
            shape: SH,
            seqs: &seqs,
            ns: &ns,
            q_nope: &q_nope,
            q_rope: &q_rope,
            uk_t: MatRef::Bf16 {
                w: &uk,
                rows: h * SH.lora,
                cols: DN,
            },
            uv: MatRef::Bf16 {
                w: &uv,
                rows: h * DV,
                cols: SH.lora,
            },
            out: &mut out,
        };
        assert!(work.fits_device_kernel());
        let mut want = vec![0f32; h * t * DV];
        mla_work_cpu(&mut MlaWork {
            out: &mut want,
            ..work
        });
        if !b.mla_attend(&mut work) {
            assert!(
                out.iter().all(|v| v.is_nan()),
                "declined work wrote its output"
            );
            return None;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        Some((bits(&out), bits(&want)))
    };
    let run = |cache_a: &[f32], stable: usize| {
        let before = dev.stats();
        let (d, c) = both(dev.as_ref(), cache_a, stable).expect("taken");
        assert_eq!(d, c, "stable {stable}");
        dev.stats().since(&before)
    };
    // First call: the three full blocks go up and stay.
    let first = run(&cache_a, 3);
    assert_eq!((first.device_attention, first.device_calls), (1, 1));
    assert!(first.h2d_bytes >= 3 * block_bytes, "{first:?}");
    // Second call: only the partial blocks, the queries and the table.
    let again = run(&cache_a, 3);
    assert!(again.h2d_bytes < block_bytes, "{again:?}");
    // Nothing kept: every block goes up each call, same bits.
    let none = run(&cache_a, 0);
    assert!(none.h2d_bytes >= 3 * block_bytes, "{none:?}");
    // A full block changes after its owner forgets it: copied anew.
    let b1 = SPLIT * w..2 * SPLIT * w;
    let start = cache_a[b1.clone()].as_ptr() as usize;
    dev.forget(start..start + 4 * b1.len());
    for v in &mut cache_a[b1] {
        *v = -*v * 0.5;
    }
    let changed = run(&cache_a, 3);
    assert!(changed.h2d_bytes >= block_bytes, "{changed:?}");
    // A prefill in chunks of three queries.
    dev.limit_mla_scratch(3 * 4 * h * (SPLIT + SH.lora + 2));
    run(&cache_a, 3);
    dev.limit_mla_scratch(usize::MAX);
    // Full blocks beyond the budget: declined, nothing written.
    let Some(small) = open(Some(block_bytes)) else {
        return;
    };
    assert!(both(small.as_ref(), &cache_a, 3).is_none());
    // Without kept blocks the small device takes it.
    let (d, c) = both(small.as_ref(), &cache_a, 0).expect("taken");
    assert_eq!(d, c);
}
