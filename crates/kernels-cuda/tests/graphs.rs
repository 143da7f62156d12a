//! CUDA graphs (`device/tape.rs`): a call that repeats exactly is captured
//! the second time and replayed after, reading each call's own inputs and
//! address tables, with the bits of the calls issued one by one and of the
//! CPU's scalar twin; graphs off, nothing is replayed. Without a CUDA
//! device (real or emulated) every test prints why it skipped.

use fathom_kernels::backend::{Backend, BackendStats, Hints, MatRef, Product, Role};
use fathom_kernels::formats::Bf16Rows;

mod common;

use common::{Lcg, open};

impl Lcg {
    fn f32(&mut self) -> f32 {
        (self.next() as f32 / u32::MAX as f32 - 0.5) * 4.0
    }
    fn bf16s(&mut self, n: usize) -> Vec<u16> {
        (0..n)
            .map(|_| (self.f32().to_bits() >> 16) as u16)
            .collect()
    }
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

/// `y[T, rows]` from the scalar twin.
fn twin(w: &[u16], cols: usize, x: &[f32], t: usize) -> Vec<f32> {
    common::twin(&Bf16Rows { w, cols }, x, t)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn graphs(s: &BackendStats) -> (u64, u64, u64) {
    (s.graph_launches, s.graph_builds, s.graph_failures)
}

#[test]
fn a_repeated_product_replays_its_graph_with_each_calls_input() {
    let Some(b) = open(None) else {
        return;
    };
    let (rows, cols, t) = (72, 96, 3);
    let mut g = Lcg(7);
    let w = g.bf16s(rows * cols);
    let m = MatRef::Bf16 { w: &w, rows, cols };
    for call in 0..5 {
        // New values in the same staging each call: a replay that read a
        // stale input would give the last call's answer.
        let x = g.f32s(t * cols);
        let mut y = vec![0f32; t * rows];
        assert!(b.matmul(&m, Role::Spine, &x, t, &mut y), "call {call}");
        assert_eq!(bits(&y), bits(&twin(&w, cols, &x, t)), "call {call}");
    }
    // Seen once, captured the second time, replayed from then on (on a
    // device the first call also waits for its weights' copy, so it is
    // issued one by one and not counted as seen).
    let (launches, builds, failures) = graphs(&b.stats());
    assert!(
        launches >= 3 && builds == 1 && failures == 0,
        "{:?}",
        b.stats()
    );
    b.set_graphs(false);
    let x = g.f32s(t * cols);
    let mut y = vec![0f32; t * rows];
    assert!(b.matmul(&m, Role::Spine, &x, t, &mut y));
    assert_eq!(bits(&y), bits(&twin(&w, cols, &x, t)));
    let off = graphs(&b.stats());
    assert_eq!(off, (launches, builds, 0), "graphs off: nothing replayed");
    b.forget(w.as_ptr() as usize..w.as_ptr() as usize + 2 * w.len());
}

#[test]
fn a_batch_of_other_experts_of_one_shape_replays_with_their_table() {
    let Some(b) = open(None) else {
        return;
    };
    let (rows, cols, t, n) = (40, 64, 1, 6);
    let mut g = Lcg(11);
    let experts: Vec<Vec<u16>> = (0..n).map(|_| g.bf16s(rows * cols)).collect();
    // Each call multiplies a different pair of experts: one grouped launch
    // whose address table changes while the launch itself does not.
    let picks = [[0, 1], [2, 3], [4, 5], [1, 4], [5, 0]];
    for (call, pick) in picks.iter().enumerate() {
        let xs: Vec<Vec<f32>> = pick.iter().map(|_| g.f32s(t * cols)).collect();
        let mut ys: Vec<Vec<f32>> = pick.iter().map(|_| vec![0f32; t * rows]).collect();
        let mut products: Vec<Product<'_, '_>> = pick
            .iter()
            .zip(&xs)
            .zip(ys.iter_mut())
            .map(|((&e, x), y)| Product {
                w: MatRef::Bf16 {
                    w: &experts[e],
                    rows,
                    cols,
                },
                role: Role::Expert,
                x,
                t,
                y,
            })
            .collect();
        assert!(
            b.matmul_batch(&mut products, &Hints::default()),
            "call {call}"
        );
        drop(products);
        for ((&e, x), y) in pick.iter().zip(&xs).zip(&ys) {
            let want = twin(&experts[e], cols, x, t);
            assert_eq!(bits(y), bits(&want), "call {call}, expert {e}");
        }
    }
    let s = b.stats();
    // The first three calls copy their experts up first (their launches
    // may wait for those copies on a device, so they are issued one by
    // one there); the last two find theirs and repeat the third's launch.
    assert!(s.graph_launches >= 1 && s.graph_failures == 0, "{s:?}");
    for e in &experts {
        b.forget(e.as_ptr() as usize..e.as_ptr() as usize + 2 * e.len());
    }
}
