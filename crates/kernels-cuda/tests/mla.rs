//! MLA attention on the device (`Backend::mla_attend`) against the CPU
//! kernel (`attention::mla_attend`) bit for bit: queries seeing one row to
//! every row of a cache of full blocks and a partial one; the full blocks
//! kept on the device between calls (only the partial block and the
//! queries go up again); a block changed after `forget` is copied anew; a
//! prefill run in chunks of queries; a cache whose full blocks do not fit
//! the budget declined with nothing written. Without a CUDA device (real
//! or emulated) the test prints why it skipped.

use fathom_kernels::attention::{MlaQuery, MlaShape, SPLIT, mla_attend};
use fathom_kernels::backend::{Backend, MlaWork};

mod common;

use common::{Lcg, open};

impl Lcg {
    fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() as f32 / u32::MAX as f32 - 0.5) * 2.0 * amp)
            .collect()
    }
}

/// The device's and the CPU's context for `queries` over `blocks`, as bits;
/// `None` when the device declined (its output then untouched).
fn both(
    b: &dyn Backend,
    sh: MlaShape,
    blocks: &[&[f32]],
    stable: usize,
    queries: &[MlaQuery<'_>],
) -> Option<(Vec<u32>, Vec<u32>)> {
    let n = queries.len() * sh.heads * sh.lora;
    let mut cpu = vec![0f32; n];
    mla_attend(&sh, blocks, queries, &mut cpu);
    let mut dev = vec![f32::NAN; n];
    let mut work = MlaWork {
        shape: sh,
        blocks,
        stable,
        queries,
        out: &mut dev,
    };
    if !b.mla_attend(&mut work) {
        assert!(
            dev.iter().all(|v| v.is_nan()),
            "declined work wrote its output"
        );
        return None;
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect();
    Some((bits(&dev), bits(&cpu)))
}

#[test]
fn mla_attention_on_the_device_gives_the_cpus_bits() {
    let Some(dev) = open(Some(64 << 20)) else {
        return;
    };
    let sh = MlaShape {
        heads: 5,
        lora: 36,
        rope: 12,
        scale: 0.17,
    };
    let w = sh.width();
    let mut g = Lcg(7);
    let rows = 3 * SPLIT + 41;
    let mut cache = g.vec(rows * w, 2.0);
    let q_lat = g.vec(6 * sh.heads * sh.lora, 1.5);
    let q_rope = g.vec(6 * sh.heads * sh.rope, 1.5);
    let ns = [1usize, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT + 3, rows];
    let queries: Vec<MlaQuery<'_>> = ns
        .iter()
        .enumerate()
        .map(|(i, &n)| MlaQuery {
            q_lat: &q_lat[i * sh.heads * sh.lora..][..sh.heads * sh.lora],
            q_rope: &q_rope[i * sh.heads * sh.rope..][..sh.heads * sh.rope],
            n,
        })
        .collect();
    let block_bytes = (4 * SPLIT * w) as u64;
    let run = |cache: &[f32], stable: usize| {
        let blocks: Vec<&[f32]> = cache.chunks(SPLIT * w).collect();
        let before = dev.stats();
        let (d, c) = both(dev.as_ref(), sh, &blocks, stable, &queries).expect("taken");
        assert_eq!(d, c, "stable {stable}");
        dev.stats().since(&before)
    };
    // First call: the three full blocks go up and stay.
    let first = run(&cache, 3);
    assert_eq!(first.device_attention, 1);
    assert!(first.h2d_bytes >= 3 * block_bytes, "{first:?}");
    // Second call: only the partial block, the queries and the table.
    let again = run(&cache, 3);
    assert!(again.h2d_bytes < block_bytes, "{again:?}");
    // Nothing kept: every block goes up each call, same bits.
    let none = run(&cache, 0);
    assert!(none.h2d_bytes >= 3 * block_bytes, "{none:?}");
    // A full block changes after its owner forgets it: copied anew.
    let b1 = SPLIT * w..2 * SPLIT * w;
    dev.forget({
        let s = cache[b1.clone()].as_ptr() as usize;
        s..s + 4 * b1.len()
    });
    for v in &mut cache[b1] {
        *v = -*v * 0.5;
    }
    let changed = run(&cache, 3);
    assert!(changed.h2d_bytes >= block_bytes, "{changed:?}");
    // A prefill in chunks of two queries.
    dev.limit_mla_scratch(2 * 4 * sh.heads * (SPLIT + sh.lora + 2));
    run(&cache, 3);
    dev.limit_mla_scratch(usize::MAX);
    // Full blocks beyond the budget: declined, nothing written.
    let Some(small) = open(Some(block_bytes)) else {
        return;
    };
    let blocks: Vec<&[f32]> = cache.chunks(SPLIT * w).collect();
    assert!(both(small.as_ref(), sh, &blocks, 3, &queries).is_none());
    // Without kept blocks the small device takes it.
    let (d, c) = both(small.as_ref(), sh, &blocks, 0, &queries).expect("taken");
    assert_eq!(d, c);
}
