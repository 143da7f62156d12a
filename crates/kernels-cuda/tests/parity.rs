//! The GPU products against the CPU kernels' scalar twin, bit for bit, for
//! every format, awkward shapes, 1..17 positions, cache hits and misses,
//! and a budget too small to hold the weights. Without a CUDA device every
//! test prints why it skipped.

use fathom_kernels::backend::{Backend, BackendStats, Hints, MatRef, Product, Role};
use fathom_kernels::formats::{Bf16Rows, F32Rows, Fp8Rows, Int4Rows, Int8Rows, Mxfp4Rows};
use fathom_kernels_cuda::CudaBackend;
use fathom_weights::mxfp4::Mxfp4Ref;

mod common;

use common::{Lcg, drop_all, mxfp4_refs, open, same, twin};

impl Lcg {
    /// Deterministic values with a spread of magnitudes, signs, zeros and subnormals.
    fn f32(&mut self) -> f32 {
        match self.next() % 16 {
            0 => 0.0,
            1 => -0.0,
            2 => f32::from_bits(self.next() % 0x007F_FFFF + 1), // subnormal
            _ => (self.next() as f32 / u32::MAX as f32 - 0.5) * 4.0,
        }
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Runs `m` on the device for several position counts and checks each
/// against `want(x, t)`; then the same call again (a cache hit).
fn check(b: &CudaBackend, m: &MatRef<'_>, want: impl Fn(&[f32], usize) -> Vec<f32>, what: &str) {
    let mut g = Lcg(7);
    for t in [1usize, 3, 8, 9, 17] {
        let x: Vec<f32> = (0..t * m.cols()).map(|_| g.f32()).collect();
        let mut y = vec![f32::NAN; t * m.rows()];
        assert!(b.matmul(m, Role::Expert, &x, t, &mut y), "{what}: declined");
        same(&y, &want(&x, t), &format!("{what}, T = {t}"));
        let mut again = vec![0f32; y.len()];
        assert!(b.matmul(m, Role::Expert, &x, t, &mut again));
        same(&again, &y, &format!("{what}, T = {t}, from the cache"));
        // Batch invariance: each position alone gives its row of the batch.
        let c = m.cols();
        let mut one = vec![0f32; m.rows()];
        assert!(b.matmul(m, Role::Expert, &x[(t - 1) * c..], 1, &mut one));
        same(
            &one,
            &y[(t - 1) * m.rows()..],
            &format!("{what}: last of {t} alone"),
        );
    }
    // The test's buffers are freed after this: a later one could reuse
    // the address and length (the residency contract of `matmul_stable`).
    drop_all(b, m);
}

/// The same bytes read as two matrices — an MXFP4 matrix's codes, then an
/// INT4 matrix's, then the MXFP4 one again, with no `forget` between —:
/// VRAM holds MXFP4 codes in lane order, so each time the bytes are copied
/// again in the layout the matrix at hand reads, and every product gives
/// its twin's bits. Both in one batch are declined.
#[test]
fn bytes_seen_as_another_matrix_are_copied_again_in_its_layout() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(77);
    let (rows, cols) = (6usize, 512usize);
    let packed = g.bytes(rows * cols / 2);
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| 120 + (g.next() % 14) as u8)
        .collect();
    let mx = Mxfp4Ref {
        rows,
        cols,
        packed: &packed,
        scales: &scales,
    };
    let scale: Vec<u16> = (0..rows * cols / 32)
        .map(|_| 0x3C00 + (g.next() % 0x200) as u16)
        .collect();
    let i4 = Int4Rows::new(&packed, &scale, rows, cols, 32).unwrap();
    let x: Vec<f32> = (0..cols).map(|_| g.f32()).collect();
    for (k, m) in [MatRef::Mxfp4(mx), MatRef::Int4(i4), MatRef::Mxfp4(mx)]
        .iter()
        .enumerate()
    {
        let mut y = vec![f32::NAN; rows];
        assert!(b.matmul(m, Role::Expert, &x, 1, &mut y), "declined");
        let want = match m {
            MatRef::Mxfp4(r) => twin(&Mxfp4Rows(*r), &x, 1),
            _ => twin(&i4, &x, 1),
        };
        same(&y, &want, &format!("product {k} over the same bytes"));
    }
    // Both in one call: one copy cannot serve two layouts, so it is declined.
    let (mut y1, mut y2) = (vec![0f32; rows], vec![0f32; rows]);
    let mut ps = [
        Product {
            w: MatRef::Mxfp4(mx),
            role: Role::Expert,
            x: &x,
            t: 1,
            y: &mut y1,
        },
        Product {
            w: MatRef::Int4(i4),
            role: Role::Expert,
            x: &x,
            t: 1,
            y: &mut y2,
        },
    ];
    assert!(
        !b.matmul_batch(&mut ps, &Hints::default()),
        "one batch reading the same bytes in two layouts"
    );
    drop_all(&b, &MatRef::Mxfp4(mx));
    drop_all(&b, &MatRef::Int4(i4));
}

#[test]
fn every_format_matches_the_scalar_twin() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(1);
    let mut failures = Vec::new();
    for (rows, cols) in [
        (1usize, 32usize),
        (37, 100),
        (300, 4096),
        (40, 2400),
        (9, 7),
        (5, 300),
        (8, 300),
    ] {
        let w: Vec<f32> = (0..rows * cols).map(|_| g.f32()).collect();
        let m = MatRef::F32 { w: &w, rows, cols };
        check(
            &b,
            &m,
            |x, t| twin(&F32Rows { w: &w, cols }, x, t),
            &format!("f32 {rows}x{cols}"),
        );

        let h: Vec<u16> = (0..rows * cols).map(|_| g.next() as u16).collect();
        let m = MatRef::Bf16 { w: &h, rows, cols };
        check(
            &b,
            &m,
            |x, t| twin(&Bf16Rows { w: &h, cols }, x, t),
            &format!("bf16 {rows}x{cols}"),
        );

        let q: Vec<i8> = (0..rows * cols).map(|_| g.next() as i8).collect();
        let s: Vec<f32> = (0..rows).map(|_| g.f32()).collect();
        let m = MatRef::Int8 {
            q: &q,
            scale: &s,
            cols,
        };
        let tw = Int8Rows {
            q: &q,
            scale: &s,
            cols,
        };
        check(
            &b,
            &m,
            |x, t| twin(&tw, x, t),
            &format!("int8 {rows}x{cols}"),
        );
    }
    for (rows, cols) in [
        (1usize, 32usize),
        (37, 96),
        (300, 2048),
        (12, 288),
        (8, 2080),
        (9, 3584),
        (3, 3616),
    ] {
        let packed = g.bytes(rows * cols / 2);
        // Scales near 127 (2^0) with the extremes 0 (subnormal 2^-127) and 254.
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|i| match i % 11 {
                0 => 0,
                1 => 254,
                _ => 120 + (g.next() % 14) as u8,
            })
            .collect();
        let r = Mxfp4Ref {
            rows,
            cols,
            packed: &packed,
            scales: &scales,
        };
        check(
            &b,
            &MatRef::Mxfp4(r),
            |x, t| twin(&Mxfp4Rows(r), x, t),
            &format!("mxfp4 {rows}x{cols}"),
        );

        let scale: Vec<u16> = (0..rows * cols / 32)
            .map(|_| 0x3C00 + (g.next() % 0x200) as u16)
            .collect();
        let w = Int4Rows::new(&packed, &scale, rows, cols, 32).unwrap();
        check(
            &b,
            &MatRef::Int4(w),
            |x, t| twin(&w, x, t),
            &format!("int4 {rows}x{cols}"),
        );
    }
    for (rows, cols, block, row0) in [
        (40usize, 200usize, [16usize, 64usize], 0usize),
        (300, 256, [128, 128], 0),
        (5, 128, [1, 32], 0),
        (40, 200, [16, 64], 16),
        (8, 64, [2, 32], 1),
        (5, 128, [1, 32], 3),
    ] {
        // NaN codes (0x7F, 0xFF) are refused at load: leave them out.
        let q: Vec<u8> = g
            .bytes(rows * cols)
            .into_iter()
            .map(|c| if c & 0x7F == 0x7F { 0 } else { c })
            .collect();
        let grid = (row0 + rows).div_ceil(block[0]) * cols.div_ceil(block[1]);
        let scale: Vec<f32> = (0..grid).map(|_| g.f32()).collect();
        let w = Fp8Rows::new(&q, &scale, cols, block, row0).unwrap();
        let what = format!("fp8 {rows}x{cols} {block:?}+{row0}");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            check(&b, &MatRef::Fp8(w), |x, t| twin(&w, x, t), &what)
        }));
        if r.is_err() {
            failures.push(what);
            drop_all(&b, &MatRef::Fp8(w));
        }
    }
    assert!(failures.is_empty(), "failed: {failures:?}");
    let st = b.stats();
    assert_eq!(st.device_errors, 0, "{:?}", st.last_error);
    assert!(st.vram_expert_hits > 0 && st.vram_expert_misses > 0);
}

#[test]
fn too_small_a_budget_declines_and_forget_drops_copies() {
    let Some(b) = open(Some(4096)) else { return };
    let w = vec![1u16; 64 * 128];
    let x = vec![0.5f32; 128];
    let mut y = vec![0f32; 64];
    let m = MatRef::Bf16 {
        w: &w,
        rows: 64,
        cols: 128,
    };
    assert!(
        !b.matmul(&m, Role::Spine, &x, 1, &mut y),
        "16 KiB does not fit in 4 KiB"
    );
    let small = &w[..8 * 128];
    let m = MatRef::Bf16 {
        w: small,
        rows: 8,
        cols: 128,
    };
    assert!(b.matmul(&m, Role::Spine, &x, 1, &mut y[..8]));
    assert_eq!(b.stats().vram_weight_bytes, 2048);
    b.forget(small.as_ptr() as usize..small.as_ptr() as usize + 2048);
    assert_eq!(b.stats().vram_weight_bytes, 0);
}

#[test]
fn a_forgotten_buffer_rewritten_in_place_is_copied_again() {
    let Some(b) = open(None) else { return };
    let (rows, cols) = (16, 64);
    let mut w = vec![0x3F80u16; rows * cols]; // 1.0
    let x = vec![1.0f32; cols];
    let mut y = vec![0f32; rows];
    let run = |w: &[u16], y: &mut [f32]| {
        let m = MatRef::Bf16 { w, rows, cols };
        assert!(b.matmul(&m, Role::Spine, &x, 1, y));
    };
    run(&w, &mut y);
    assert!(y.iter().all(|&v| v == 64.0));
    let a = w.as_ptr() as usize;
    b.forget(a..a + 2 * w.len());
    w.fill(0x4000); // 2.0, same address and length
    run(&w, &mut y);
    assert!(y.iter().all(|&v| v == 128.0), "{y:?}");
}

/// A grouped call (one block of rows per head, each with its own input)
/// gives each block the bits of the scalar twin over that block alone,
/// for one and several positions.
#[test]
fn grouped_products_give_each_blocks_bits() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(5);
    for (groups, rg, cols) in [
        (1usize, 40usize, 300usize),
        (3, 7, 100),
        (8, 64, 512),
        (3, 40, 512),
    ] {
        let rows = groups * rg;
        let h: Vec<u16> = (0..rows * cols).map(|_| g.next() as u16).collect();
        let m = MatRef::Bf16 { w: &h, rows, cols };
        bf16_groups_match_the_twin(&b, &mut g, &h, groups, cols, false);
        // Inputs that do not match the blocks are declined, not guessed.
        let mut y = vec![0f32; rows];
        let x = vec![0f32; groups * cols + 1];
        assert!(!b.matmul_groups(&m, Role::Spine, groups, &x, 1, &mut y));
        assert!(!b.matmul_groups(&m, Role::Spine, rows + 1, &x, 1, &mut y));
        drop_all(&b, &m);
    }
}

/// The bf16 matrix `h` (`cols` wide) split into `groups` equal blocks, at
/// one position (the decode kernels) and at 3 and 9 (the staged ones): each
/// block's results against the scalar twin over that block alone, bit for
/// bit (`finite`: and every expected value finite, so the order shows).
fn bf16_groups_match_the_twin(
    b: &CudaBackend,
    g: &mut Lcg,
    h: &[u16],
    groups: usize,
    cols: usize,
    finite: bool,
) {
    let rows = h.len() / cols;
    let rg = rows / groups;
    let m = MatRef::Bf16 { w: h, rows, cols };
    for t in [1usize, 3, 9] {
        let x: Vec<f32> = (0..groups * t * cols).map(|_| g.f32()).collect();
        let mut y = vec![f32::NAN; t * rows];
        assert!(b.matmul_groups(&m, Role::Spine, groups, &x, t, &mut y));
        for k in 0..groups {
            let block = Bf16Rows {
                w: &h[k * rg * cols..(k + 1) * rg * cols],
                cols,
            };
            let want = twin(&block, &x[k * t * cols..(k + 1) * t * cols], t);
            assert!(!finite || want.iter().all(|v| v.is_finite()), "a real test");
            same(
                &y[k * t * rg..(k + 1) * t * rg],
                &want,
                &format!("bf16 {groups}×{rg}x{cols}, block {k}, T = {t}"),
            );
        }
    }
}

/// bf16 products with finite weights, so every row's sum shows its order
/// (random bf16 bits are mostly NaN or infinite), at one position (the
/// decode kernels) and at 3 and 9 (the staged ones): two rows a warp over
/// several two-chunk passes, an odd row count (a warp's lone last row), a
/// single block of rows, grouped blocks whose rows split across a warp or
/// straddle a block of 16, against the scalar twin bit for bit.
#[test]
fn bf16_products_keep_the_twins_order() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(41);
    for (groups, rg, cols) in [
        (1usize, 2051usize, 1100usize),
        (1, 2048, 1100),
        (1, 33, 7168),
        (3, 683, 600),
        (3, 40, 512),
    ] {
        let rows = groups * rg;
        let h: Vec<u16> = (0..rows * cols)
            .map(|_| (g.f32().to_bits() >> 16) as u16)
            .collect();
        let m = MatRef::Bf16 { w: &h, rows, cols };
        bf16_groups_match_the_twin(&b, &mut g, &h, groups, cols, true);
        drop_all(&b, &m);
    }
}

/// Grouped FP8 (block scales indexed by the row in the whole matrix) and
/// int8 (a scale per row): each block against the scalar twin over that
/// block's own row selection.
#[test]
fn grouped_fp8_and_int8_blocks_keep_their_rows_scales() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(9);
    let (groups, rg, cols, t) = (4usize, 24usize, 256usize, 3usize);
    let rows = groups * rg;
    let x: Vec<f32> = (0..groups * t * cols).map(|_| g.f32()).collect();
    let xb = |k: usize| &x[k * t * cols..(k + 1) * t * cols];
    let q: Vec<u8> = g
        .bytes(rows * cols)
        .into_iter()
        .map(|c| if c & 0x7F == 0x7F { 0 } else { c })
        .collect();
    let block = [16usize, 128usize];
    let scale: Vec<f32> = (0..rows.div_ceil(16) * 2).map(|_| g.f32()).collect();
    let whole = Fp8Rows::new(&q, &scale, cols, block, 0).unwrap();
    let mut y = vec![f32::NAN; t * rows];
    assert!(b.matmul_groups(&MatRef::Fp8(whole), Role::Spine, groups, &x, t, &mut y));
    for k in 0..groups {
        let part = Fp8Rows::new(
            &q[k * rg * cols..(k + 1) * rg * cols],
            &scale,
            cols,
            block,
            k * rg,
        )
        .unwrap();
        let got = &y[k * t * rg..(k + 1) * t * rg];
        same(got, &twin(&part, xb(k), t), &format!("fp8 block {k}"));
    }
    drop_all(&b, &MatRef::Fp8(whole));

    let qi: Vec<i8> = (0..rows * cols).map(|_| g.next() as i8).collect();
    let si: Vec<f32> = (0..rows).map(|_| g.f32()).collect();
    let m = MatRef::Int8 {
        q: &qi,
        scale: &si,
        cols,
    };
    let mut y = vec![f32::NAN; t * rows];
    assert!(b.matmul_groups(&m, Role::Spine, groups, &x, t, &mut y));
    for k in 0..groups {
        let part = Int8Rows {
            q: &qi[k * rg * cols..(k + 1) * rg * cols],
            scale: &si[k * rg..(k + 1) * rg],
            cols,
        };
        let got = &y[k * t * rg..(k + 1) * t * rg];
        same(got, &twin(&part, xb(k), t), &format!("int8 block {k}"));
    }
    drop_all(&b, &m);
}

/// MXFP4 test weights: random codes, scales around 2^0.
fn mxfp4_bytes(g: &mut Lcg, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let scales = (0..rows * cols / 32)
        .map(|_| 120 + (g.next() % 14) as u8)
        .collect();
    (g.bytes(rows * cols / 2), scales)
}

/// A batch of expert products — some already in device memory, some
/// copied up within the call on the copy stream, different position
/// counts — gives each product the scalar twin's bits, and counts the hits
/// and misses.
#[test]
fn a_batch_gives_each_products_bits() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(11);
    let (rows, cols) = (64, 288);
    let bytes: Vec<(Vec<u8>, Vec<u8>)> = (0..6).map(|_| mxfp4_bytes(&mut g, rows, cols)).collect();
    let refs = mxfp4_refs(&bytes, rows, cols);
    let x1: Vec<f32> = (0..cols).map(|_| g.f32()).collect();
    let mut y1 = vec![0f32; rows];
    for r in refs.iter().step_by(2) {
        assert!(b.matmul(&MatRef::Mxfp4(*r), Role::Expert, &x1, 1, &mut y1));
    }
    let before = b.stats();
    let ts: Vec<usize> = (0..6).map(|i| 1 + i % 3).collect();
    let xs: Vec<Vec<f32>> = ts
        .iter()
        .map(|&t| (0..t * cols).map(|_| g.f32()).collect())
        .collect();
    let mut ys: Vec<Vec<f32>> = ts.iter().map(|&t| vec![f32::NAN; t * rows]).collect();
    let mut ps: Vec<Product<'_, '_>> = ys
        .iter_mut()
        .enumerate()
        .map(|(i, y)| Product {
            w: MatRef::Mxfp4(refs[i]),
            role: Role::Expert,
            x: &xs[i],
            t: ts[i],
            y,
        })
        .collect();
    assert!(b.matmul_batch(&mut ps, &Hints::default()), "declined");
    drop(ps);
    for i in 0..6 {
        same(
            &ys[i],
            &twin(&Mxfp4Rows(refs[i]), &xs[i], ts[i]),
            &format!("product {i} of the batch"),
        );
    }
    let st = b.stats().since(&before);
    assert_eq!((st.vram_expert_hits, st.vram_expert_misses), (3, 3));
    assert_eq!(
        (st.device_products, st.device_errors),
        (6, 0),
        "{:?}",
        st.last_error
    );
    // All in device memory now: products of one format and shape share a
    // launch (two MXFP4 shapes and two bf16 shapes here, interleaved).
    let bf: Vec<Vec<u16>> = (0..4)
        .map(|i| {
            (0..(40 - 16 * (i % 2)) * 300)
                .map(|_| g.next() as u16)
                .collect()
        })
        .collect();
    let mut mats: Vec<MatRef<'_>> = refs.iter().map(|r| MatRef::Mxfp4(*r)).collect();
    let short = Mxfp4Ref {
        rows: 32,
        cols,
        packed: &bytes[0].0[..32 * cols / 2],
        scales: &bytes[0].1[..32 * cols / 32],
    };
    mats.insert(3, MatRef::Mxfp4(short));
    for (i, w) in bf.iter().enumerate() {
        mats.insert(
            2 * i,
            MatRef::Bf16 {
                w,
                rows: w.len() / 300,
                cols: 300,
            },
        );
    }
    for t in [1usize, 2] {
        let xs: Vec<Vec<f32>> = mats
            .iter()
            .map(|m| (0..t * m.cols()).map(|_| g.f32()).collect())
            .collect();
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; t * m.rows()]).collect();
        let mut ps: Vec<Product<'_, '_>> = ys
            .iter_mut()
            .enumerate()
            .map(|(i, y)| Product {
                w: mats[i],
                role: Role::Expert,
                x: &xs[i],
                t,
                y,
            })
            .collect();
        assert!(b.matmul_batch(&mut ps, &Hints::default()), "declined");
        drop(ps);
        for (i, m) in mats.iter().enumerate() {
            let want = match m {
                MatRef::Mxfp4(r) => twin(&Mxfp4Rows(*r), &xs[i], t),
                MatRef::Bf16 { w, cols, .. } => twin(&Bf16Rows { w, cols: *cols }, &xs[i], t),
                _ => unreachable!(),
            };
            same(
                &ys[i],
                &want,
                &format!("product {i} of a grouped batch, T = {t}"),
            );
        }
    }
    assert_eq!(b.stats().device_errors, 0, "{:?}", b.stats().last_error);
    for m in &mats {
        drop_all(&b, m);
    }
}

/// A batch whose weights cannot all be in the budget at once is declined
/// as a whole (the seam then offers its products one by one) and evicts
/// nothing; a product that fits alone comes in once the spine holding the
/// room has gone.
#[test]
fn a_batch_larger_than_the_budget_is_declined_whole() {
    let Some(b) = open(Some(20 << 10)) else {
        return;
    };
    let (rows, cols) = (64, 128); // 16 KiB each
    let (w1, w2) = (vec![0x3F80u16; rows * cols], vec![0x4000u16; rows * cols]);
    let x = vec![0.5f32; cols];
    let m1 = MatRef::Bf16 { w: &w1, rows, cols };
    let m2 = MatRef::Bf16 { w: &w2, rows, cols };
    let (mut y1, mut y2) = (vec![0f32; rows], vec![0f32; rows]);
    assert!(b.matmul(&m1, Role::Spine, &x, 1, &mut y1));
    let held = b.stats().vram_weight_bytes;
    let mut ps = [
        Product {
            w: m1,
            role: Role::Spine,
            x: &x,
            t: 1,
            y: &mut y1,
        },
        Product {
            w: m2,
            role: Role::Spine,
            x: &x,
            t: 1,
            y: &mut y2,
        },
    ];
    assert!(
        !b.matmul_batch(&mut ps, &Hints::default()),
        "32 KiB at once in a 20 KiB budget"
    );
    assert_eq!(b.stats().cpu_products, 0, "the seam counts what it retries");
    assert_eq!(
        b.stats().vram_weight_bytes,
        held,
        "a declined batch evicts nothing"
    );
    // Alone it would fit, but only by pushing out the spine matrix held:
    // spine never displaces spine (the caller computes it on the CPU).
    assert!(
        !b.matmul(&m2, Role::Spine, &x, 1, &mut y2),
        "m1 keeps its room"
    );
    assert_eq!(b.stats().vram_weight_bytes, held);
    drop_all(&b, &m1);
    assert!(b.matmul(&m2, Role::Spine, &x, 1, &mut y2), "alone it fits");
    assert!(y2.iter().all(|&v| v == 128.0), "{y2:?}");
    drop_all(&b, &m2);
}

/// MXFP4 matrices of `(packed, scales)` pairs, each `rows × cols`.
fn mxfp4_mats(bytes: &[(Vec<u8>, Vec<u8>)], rows: usize, cols: usize) -> Vec<MatRef<'_>> {
    mxfp4_refs(bytes, rows, cols)
        .into_iter()
        .map(MatRef::Mxfp4)
        .collect()
}

/// One expert product per MXFP4 matrix of `mats` on `x` (one position) as
/// a batch with `hints`, each checked against the scalar twin; the stats
/// of the call.
fn expert_batch(
    b: &CudaBackend,
    mats: &[MatRef<'_>],
    x: &[f32],
    hints: &Hints<'_, '_>,
    what: &str,
) -> BackendStats {
    let before = b.stats();
    let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; m.rows()]).collect();
    let mut ps: Vec<Product<'_, '_>> = ys
        .iter_mut()
        .zip(mats)
        .map(|(y, &w)| Product {
            w,
            role: Role::Expert,
            x,
            t: 1,
            y,
        })
        .collect();
    assert!(b.matmul_batch(&mut ps, hints), "{what}: declined");
    drop(ps);
    for (n, (y, m)) in ys.iter().zip(mats).enumerate() {
        let MatRef::Mxfp4(r) = *m else { unreachable!() };
        same(
            y,
            &twin(&Mxfp4Rows(r), x, 1),
            &format!("{what}: product {n}"),
        );
    }
    b.stats().since(&before)
}

/// Matrices handed `ahead` of a batch are copied up behind it and serve
/// the next batch from device memory with the scalar twin's bits; one
/// forgotten while its copy may still run is waited for, not raced; under
/// a budget with no room left they are skipped, never displacing the
/// batch's own weights.
#[test]
fn matrices_handed_ahead_arrive_for_the_next_batch() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(17);
    let (rows, cols) = (96, 544);
    let bytes: Vec<(Vec<u8>, Vec<u8>)> = (0..5).map(|_| mxfp4_bytes(&mut g, rows, cols)).collect();
    let mats = mxfp4_mats(&bytes, rows, cols);
    let x: Vec<f32> = (0..cols).map(|_| g.f32()).collect();
    let one = (bytes[0].0.len() + bytes[0].1.len()) as u64;
    // Two handed ahead, two guessed (copied: no guess has proved wrong yet).
    let hints = Hints {
        next: &mats[1..3],
        guessed: &mats[3..],
        ..Hints::default()
    };
    let st = expert_batch(&b, &mats[..1], &x, &hints, "the first batch");
    assert_eq!(st.h2d_ahead_bytes, 4 * one);
    drop_all(&b, &mats[4]); // forgotten while its copy may still be running
    let st = expert_batch(&b, &mats[1..4], &x, &Hints::default(), "handed ahead");
    assert_eq!(
        (st.vram_expert_hits, st.vram_expert_misses),
        (3, 0),
        "copied ahead"
    );
    assert_eq!(b.stats().device_errors, 0, "{:?}", b.stats().last_error);
    for m in &mats {
        drop_all(&b, m);
    }
    // No room: a budget of one matrix keeps the batch's and skips the rest.
    let Some(small) = open(Some(one)) else { return };
    let hints = Hints {
        next: &mats[1..2],
        ..Hints::default()
    };
    expert_batch(
        &small,
        &mats[..1],
        &x,
        &hints,
        "the batch under a full budget",
    );
    let st = small.stats();
    assert_eq!((st.h2d_ahead_bytes, st.vram_weight_bytes), (0, one));
    drop_all(&small, &mats[0]);
}

/// Hints are copied in order — next, the caller's CPU products while no
/// expert has been turned away, guesses — as far as they fit without
/// displacing the batch's or another listed matrix; hints without products
/// still copy; the copies serve the next batch with the twin's bits.
#[test]
fn hints_are_copied_in_order_as_far_as_they_fit() {
    let mut g = Lcg(19);
    let (rows, cols) = (96, 544);
    let bytes: Vec<(Vec<u8>, Vec<u8>)> = (0..5).map(|_| mxfp4_bytes(&mut g, rows, cols)).collect();
    let one = (bytes[0].0.len() + bytes[0].1.len()) as u64;
    let Some(b) = open(Some(3 * one)) else {
        return;
    };
    let mats = mxfp4_mats(&bytes, rows, cols);
    let x: Vec<f32> = (0..cols).map(|_| g.f32()).collect();
    // Computed elsewhere, with room: copied, and counted.
    b.hint(&Hints {
        elsewhere: &mats[1..2],
        ..Hints::default()
    });
    let st = b.stats();
    assert_eq!((st.h2d_ahead_bytes, st.cpu_expert_products), (one, 1));
    assert!(!b.experts_crowded());
    // A batch on 0, then 2 next and 3, 4 guessed: 1 (unlisted) makes way
    // for 3, and 4 finds no room.
    let hints = Hints {
        next: &mats[2..3],
        guessed: &mats[3..],
        ..Hints::default()
    };
    expert_batch(&b, &mats[..1], &x, &hints, "the batch with hints");
    let st = b.stats();
    assert_eq!((st.h2d_ahead_bytes, st.h2d_guessed_bytes), (3 * one, one));
    assert!(b.experts_crowded(), "an expert left, another found no room");
    let held = [mats[0], mats[2], mats[3]];
    let st = expert_batch(&b, &held, &x, &Hints::default(), "matrices 0, 2, 3");
    assert_eq!((st.vram_expert_hits, st.vram_expert_misses), (3, 0));
    // Crowded now: computed elsewhere is counted, not copied.
    let before = b.stats();
    b.hint(&Hints {
        elsewhere: &mats[4..],
        ..Hints::default()
    });
    let st = b.stats().since(&before);
    assert_eq!((st.h2d_ahead_bytes, st.cpu_expert_products), (0, 1));
    assert_eq!(b.stats().device_errors, 0, "{:?}", b.stats().last_error);
    for m in &mats {
        drop_all(&b, m);
    }
}
