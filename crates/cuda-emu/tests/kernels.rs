//! The CUDA kernels, run on the host emulator, against the CPU kernels'
//! scalar twins bit for bit: every product format with awkward shapes and
//! 1..9 positions, grouped and many-product launches, the gated
//! activations over special values. Where the emulator was not built the
//! tests print why they skip.

use fathom_cuda_emu::{EmuBackend, available, glu_act};
use fathom_kernels::backend::{Backend, GluProduct, Hints, MatRef, Product, Role};
use fathom_kernels::formats::{Bf16Rows, F32Rows, Fp8Rows, Int4Rows, Int8Rows, Mxfp4Rows};
use fathom_kernels::ops::GluAct;
use fathom_weights::mxfp4::Mxfp4Ref;

fn built() -> bool {
    if !available() {
        eprintln!("skipped: {}", fathom_cuda_emu::ABSENT);
    }
    available()
}

/// A 64-bit linear congruential generator.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    /// A spread of magnitudes and signs, zeros and subnormals.
    fn f32(&mut self) -> f32 {
        match self.next() % 16 {
            0 => 0.0,
            1 => -0.0,
            2 => f32::from_bits(self.next() % 0x007F_FFFF + 1),
            _ => (self.next() as f32 / u32::MAX as f32 - 0.5) * 4.0,
        }
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// `y[T, rows]` from the scalar twin.
use fathom_kernels::formats::scalar_product as twin;

fn same(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (p, q)) in a.iter().zip(b).enumerate() {
        assert!(
            p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()),
            "{what}: element {i}: emulated kernel {p:e} ({:#x}) vs CPU {q:e} ({:#x})",
            p.to_bits(),
            q.to_bits()
        );
    }
}

/// `m` on the emulated kernel for 1, 3 and 9 positions (one and two passes
/// of the kernel's 8 positions) against `want`.
fn check(m: &MatRef<'_>, want: impl Fn(&[f32], usize) -> Vec<f32>, what: &str) {
    let b = EmuBackend::new();
    let mut g = Lcg(7);
    for t in [1usize, 3, 9] {
        let x = g.vec(t * m.cols());
        let mut y = vec![f32::NAN; t * m.rows()];
        assert!(b.matmul(m, Role::Expert, &x, t, &mut y), "{what}: declined");
        same(&y, &want(&x, t), &format!("{what}, T = {t}"));
    }
}

#[test]
fn every_format_matches_the_scalar_twin() {
    if !built() {
        return;
    }
    let mut g = Lcg(1);
    // Columns below, at and past a full chunk (256) and with a tail.
    for (rows, cols) in [(1usize, 32usize), (37, 100), (9, 7), (12, 600)] {
        let w = g.vec(rows * cols);
        let m = MatRef::F32 { w: &w, rows, cols };
        check(
            &m,
            |x, t| twin(&F32Rows { w: &w, cols }, x, t),
            &format!("f32 {rows}x{cols}"),
        );
        let h: Vec<u16> = (0..rows * cols).map(|_| g.next() as u16).collect();
        let m = MatRef::Bf16 { w: &h, rows, cols };
        check(
            &m,
            |x, t| twin(&Bf16Rows { w: &h, cols }, x, t),
            &format!("bf16 {rows}x{cols}"),
        );
        let q: Vec<i8> = (0..rows * cols).map(|_| g.next() as i8).collect();
        let s = g.vec(rows);
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
        check(&m, |x, t| twin(&tw, x, t), &format!("int8 {rows}x{cols}"));
    }
    for (rows, cols) in [(1usize, 32usize), (37, 96), (12, 288), (8, 544)] {
        let packed = g.bytes(rows * cols / 2);
        // Scales near 2^0 with the extremes 0 (2^-127) and 254.
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
            &MatRef::Mxfp4(r),
            |x, t| twin(&Mxfp4Rows(r), x, t),
            &format!("mxfp4 {rows}x{cols}"),
        );
        let scale: Vec<u16> = (0..rows * cols / 32)
            .map(|_| 0x3C00 + (g.next() % 0x200) as u16)
            .collect();
        let w = Int4Rows::new(&packed, &scale, rows, cols, 32).unwrap();
        check(
            &MatRef::Int4(w),
            |x, t| twin(&w, x, t),
            &format!("int4 {rows}x{cols}"),
        );
    }
    for (rows, cols, block, row0) in [
        (40usize, 200usize, [16usize, 64usize], 0usize),
        (5, 128, [1, 32], 3),
        (8, 64, [2, 32], 1),
    ] {
        // NaN codes (0x7F, 0xFF) are refused at load: leave them out.
        let q: Vec<u8> = g
            .bytes(rows * cols)
            .into_iter()
            .map(|c| if c & 0x7F == 0x7F { 0 } else { c })
            .collect();
        let grid = (row0 + rows).div_ceil(block[0]) * cols.div_ceil(block[1]);
        let scale = g.vec(grid);
        let w = Fp8Rows::new(&q, &scale, cols, block, row0).unwrap();
        check(
            &MatRef::Fp8(w),
            |x, t| twin(&w, x, t),
            &format!("fp8 {rows}x{cols} {block:?}+{row0}"),
        );
    }
}

#[test]
fn grouped_and_many_product_launches_give_each_products_bits() {
    if !built() {
        return;
    }
    let b = EmuBackend::new();
    let mut g = Lcg(2);
    let (rows, cols, t) = (24usize, 96usize, 3usize);
    // Three groups of 8 rows, each on its own input (MLA's per-head products).
    let h: Vec<u16> = (0..rows * cols).map(|_| g.next() as u16).collect();
    let m = MatRef::Bf16 { w: &h, rows, cols };
    let x = g.vec(3 * t * cols);
    let mut y = vec![0f32; t * rows];
    assert!(b.matmul_groups(&m, Role::Spine, 3, &x, t, &mut y));
    for k in 0..3 {
        let part = &h[k * 8 * cols..(k + 1) * 8 * cols];
        let want = twin(
            &Bf16Rows { w: part, cols },
            &x[k * t * cols..(k + 1) * t * cols],
            t,
        );
        same(&y[k * t * 8..(k + 1) * t * 8], &want, &format!("group {k}"));
    }
    // A batch: four MXFP4 experts of one shape (one launch), a bf16 and an
    // f32 product of their own.
    let packed: Vec<Vec<u8>> = (0..4).map(|_| g.bytes(rows * cols / 2)).collect();
    let scales: Vec<Vec<u8>> = (0..4)
        .map(|_| {
            (0..rows * cols / 32)
                .map(|_| 118 + (g.next() % 16) as u8)
                .collect()
        })
        .collect();
    let refs: Vec<Mxfp4Ref<'_>> = (0..4)
        .map(|i| Mxfp4Ref {
            rows,
            cols,
            packed: &packed[i],
            scales: &scales[i],
        })
        .collect();
    let f = g.vec(5 * cols);
    let xs: Vec<Vec<f32>> = (0..6).map(|_| g.vec(t * cols)).collect();
    let mut ys: Vec<Vec<f32>> = (0..6)
        .map(|i| vec![0f32; t * if i == 5 { 5 } else { rows }])
        .collect();
    let mut ws: Vec<MatRef<'_>> = refs.iter().map(|&r| MatRef::Mxfp4(r)).collect();
    ws.push(MatRef::Bf16 { w: &h, rows, cols });
    ws.push(MatRef::F32 {
        w: &f,
        rows: 5,
        cols,
    });
    let before = b.stats().device_calls;
    let mut ps: Vec<Product<'_, '_>> = ws
        .iter()
        .zip(&xs)
        .zip(ys.iter_mut())
        .map(|((&w, x), y)| Product {
            w,
            role: Role::Expert,
            x,
            t,
            y,
        })
        .collect();
    assert!(b.matmul_batch(&mut ps, &Hints::default()));
    drop(ps);
    assert_eq!(b.stats().device_calls, before + 1, "one call for the batch");
    for i in 0..4 {
        same(
            &ys[i],
            &twin(&Mxfp4Rows(refs[i]), &xs[i], t),
            &format!("expert {i} of the batch"),
        );
    }
    same(
        &ys[4],
        &twin(&Bf16Rows { w: &h, cols }, &xs[4], t),
        "bf16 of the batch",
    );
    same(
        &ys[5],
        &twin(&F32Rows { w: &f, cols }, &xs[5], t),
        "f32 of the batch",
    );
}

#[test]
fn gated_activations_match_the_cpu_on_special_values() {
    if !built() {
        return;
    }
    let mut g = Lcg(3);
    // Each side of the tanh series' cut (±0.5), saturating values, zeros,
    // subnormals, infinities, NaN, and a spread (past one 256-thread block).
    let mut v: Vec<f32> = vec![
        0.0,
        -0.0,
        0.5,
        -0.5,
        0.49999997,
        -0.49999997,
        0.50000006,
        1e-40,
        -1e-40,
        30.0,
        -30.0,
        88.0,
        -88.0,
        200.0,
        -200.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MIN_POSITIVE,
    ];
    v.extend((0..1000).map(|_| g.f32() * 4.0));
    let n = v.len();
    let gate: Vec<f32> = (0..n * n.min(24)).map(|i| v[i % n]).collect();
    let up: Vec<f32> = (0..gate.len()).map(|i| v[(i / n + 7 * i) % n]).collect();
    for act in [
        GluAct::Swiglu,
        GluAct::Situ {
            beta: 3.0,
            beta_lin: Some(0.7),
        },
        GluAct::Situ {
            beta: 0.4,
            beta_lin: None,
        },
    ] {
        let mut want = gate.clone();
        act.apply(&mut want, &up);
        let mut got = gate.clone();
        glu_act(act, &mut got, &up);
        same(&got, &want, &format!("{act:?}"));
    }
}

/// Plain products beside a gated MLP in one call (`Backend::glu_mixed`, a
/// MoE layer's router and latent projection with its shared experts):
/// each output the CPU's bits.
#[test]
fn plain_products_beside_a_gated_mlp_keep_their_bits() {
    if !built() {
        return;
    }
    let b = EmuBackend::new();
    let mut g = Lcg(4);
    let (f, cols, out, t) = (72usize, 96usize, 40usize, 3usize);
    let h: Vec<Vec<u16>> = [(f, cols), (f, cols), (out, f), (37, cols), (64, cols)]
        .iter()
        .map(|&(r, c)| {
            (0..r * c)
                .map(|_| (g.f32().to_bits() >> 16) as u16)
                .collect()
        })
        .collect();
    let m = |i: usize, rows, cols| MatRef::Bf16 {
        w: &h[i],
        rows,
        cols,
    };
    let x = g.vec(t * cols);
    let act = GluAct::Situ {
        beta: 4.0,
        beta_lin: Some(25.0),
    };
    // The CPU: products one by one, the activation between.
    let (mut gate, mut up) = (vec![0f32; t * f], vec![0f32; t * f]);
    m(0, f, cols).cpu(&x, t, &mut gate);
    m(1, f, cols).cpu(&x, t, &mut up);
    act.apply(&mut gate, &up);
    let mut want_y = vec![0f32; t * out];
    m(2, out, f).cpu(&gate, t, &mut want_y);
    let want_plain: Vec<Vec<f32>> = [(3, 37), (4, 64)]
        .iter()
        .map(|&(i, r)| {
            let mut y = vec![0f32; t * r];
            m(i, r, cols).cpu(&x, t, &mut y);
            y
        })
        .collect();
    let mut y = vec![f32::NAN; t * out];
    let mut ys: Vec<Vec<f32>> = [37, 64].iter().map(|r| vec![f32::NAN; t * r]).collect();
    let mut plain: Vec<Product<'_, '_>> = [(3, 37), (4, 64)]
        .iter()
        .zip(ys.iter_mut())
        .map(|(&(i, r), y)| Product {
            w: m(i, r, cols),
            role: Role::Spine,
            x: &x,
            t,
            y,
        })
        .collect();
    let mut jobs = [GluProduct {
        gate: m(0, f, cols),
        up: m(1, f, cols),
        down: m(2, out, f),
        role: Role::Spine,
        x: &x,
        t,
        y: &mut y,
    }];
    assert!(b.glu_mixed(&mut plain, &mut jobs, act, &Hints::default()));
    drop((plain, jobs));
    assert_eq!(b.stats().device_calls, 1, "one call");
    same(&y, &want_y, "the MLP");
    same(&ys[0], &want_plain[0], "the router");
    same(&ys[1], &want_plain[1], "the latent projection");
}
