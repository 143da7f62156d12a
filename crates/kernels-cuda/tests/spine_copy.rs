//! A spine larger than the device's budget: spine products of many
//! positions are copied up by pushing other spine out, with the CPU
//! twin's bits; products of few positions are left to the CPU. Without a
//! CUDA device (or the emulator) every test prints why it skipped.

use fathom_kernels::backend::{Backend, MatRef, Role};

mod common;

use common::{Lcg, drop_all, open, same};

/// A spine larger than the budget: a product of at least
/// `spine_copy_min_t` positions is copied up, pushing other spine out,
/// and gives the twin's bits; one of fewer positions is still left to the
/// CPU, and with the threshold out of reach nothing is pushed out.
#[test]
fn spine_products_of_many_positions_push_other_spine_out() {
    let Some(b) = open(Some(20 << 10)) else {
        return;
    };
    let mut g = Lcg(11);
    let (rows, cols, t) = (64, 128, 4); // 16 KiB each
    let (w1, w2) = (g.bf16_bits(rows * cols, 2.0), g.bf16_bits(rows * cols, 2.0));
    let m1 = MatRef::Bf16 { w: &w1, rows, cols };
    let m2 = MatRef::Bf16 { w: &w2, rows, cols };
    let x = g.uniform(t * cols, 1.0);
    let want = |m: &MatRef<'_>, t: usize| {
        let mut y = vec![0f32; t * rows];
        m.cpu(&x[..t * cols], t, &mut y);
        y
    };
    let run = |m: &MatRef<'_>, t: usize| {
        let mut y = vec![0f32; t * rows];
        b.matmul(m, Role::Spine, &x[..t * cols], t, &mut y)
            .then_some(y)
    };
    b.set_spine_copy_min_t(Some(t));
    same(&run(&m1, 1).expect("m1 fits"), &want(&m1, 1), "m1");
    assert!(run(&m2, 1).is_none(), "one position: m1 keeps its room");
    assert!(
        run(&m2, t - 1).is_none(),
        "fewer positions than the threshold"
    );
    let got = run(&m2, t).expect("four positions: m2 copied up over m1");
    same(&got, &want(&m2, t), "m2 at four positions");
    let st = b.stats();
    assert_eq!(st.h2d_spine_displacing_bytes, 16 << 10);
    assert_eq!(st.vram_weight_bytes, 16 << 10, "m1 went, m2 came");
    assert!(run(&m1, 1).is_none(), "m2 holds the room now");
    b.set_spine_copy_min_t(Some(usize::MAX));
    assert!(
        run(&m1, t).is_none(),
        "never, with the threshold out of reach"
    );
    assert_eq!(b.stats().h2d_spine_displacing_bytes, 16 << 10);
    assert_eq!(b.stats().device_errors, 0, "{:?}", b.stats().last_error);
    drop_all(&b, &m2);
}

#[test]
fn the_copy_threshold_is_where_the_cpu_product_costs_the_pageable_copy() {
    use fathom_kernels_cuda::spine_copy_min_t;
    // 360 GFLOP/s on the CPU against 53.7 GB/s page-locked (17.9 GB/s
    // pageable): 20.1 positions.
    assert_eq!(spine_copy_min_t(360e9, 53.7e9), 21);
    assert_eq!(spine_copy_min_t(1e9, 50e9), 2, "never below two");
    assert_eq!(spine_copy_min_t(0.0, 50e9), usize::MAX);
    assert_eq!(spine_copy_min_t(1e11, 0.0), usize::MAX);
}
