//! Gated MLPs in one device call (`Backend::glu_batch`: gate and up
//! products, the activation on the device, the downs) against the seam's
//! host path (the CPU kernels with the activation between them), bit for
//! bit, for every activation, bf16 and MXFP4 weights, several position
//! counts in one call and an activation wider than one launch's grid;
//! plain products beside the MLPs in the same call (`Backend::glu_mixed`);
//! a MoE layer's experts through their combine (`Backend::moe_tail`)
//! against its twin.
//! Without a CUDA device the test prints why it skipped.

use fathom_kernels::backend::{
    Backend, GluProduct, Hints, MatRef, MoeTail, Product, Role, TailExpert, glu_batch_stable,
    moe_tail_cpu,
};
use fathom_kernels::ops::GluAct;
use fathom_weights::mxfp4::Mxfp4Ref;

mod common;

use common::{Lcg, open};

/// Every activation: SwiGLU, SiTU-GLU with and without β_lin.
const ACTS: [GluAct; 3] = [
    GluAct::Swiglu,
    GluAct::Situ {
        beta: 4.0,
        beta_lin: Some(25.0),
    },
    GluAct::Situ {
        beta: 4.0,
        beta_lin: None,
    },
];

impl Lcg {
    /// Deterministic values in ±`scale`, with zeros and subnormals.
    fn f32(&mut self, scale: f32) -> f32 {
        match self.next() % 16 {
            0 => 0.0,
            1 => f32::from_bits(self.next() % 0x007F_FFFF + 1),
            _ => (self.next() as f32 / u32::MAX as f32 - 0.5) * 2.0 * scale,
        }
    }
    fn bf16(&mut self, n: usize, scale: f32) -> Vec<u16> {
        (0..n)
            .map(|_| (self.f32(scale).to_bits() >> 16) as u16)
            .collect()
    }
}

/// One gated MLP's weights: bf16 or MXFP4 (codes, scales) per matrix.
enum Weights {
    Bf16([Vec<u16>; 3]),
    Mxfp4([(Vec<u8>, Vec<u8>); 3]),
}

/// A test MLP: `gate`/`up` `[f, cols]`, `down` `[out, f]`, `t` positions.
struct Mlp {
    w: Weights,
    f: usize,
    cols: usize,
    out: usize,
    t: usize,
    x: Vec<f32>,
}

impl Mlp {
    fn new(g: &mut Lcg, mxfp4: bool, (f, cols, out, t): (usize, usize, usize, usize)) -> Mlp {
        let shapes = [(f, cols), (f, cols), (out, f)];
        let w = if mxfp4 {
            Weights::Mxfp4(shapes.map(|(r, c)| {
                let packed = (0..r * c / 2).map(|_| g.next() as u8).collect();
                let scales = (0..r * c / 32)
                    .map(|_| 118 + (g.next() % 10) as u8)
                    .collect();
                (packed, scales)
            }))
        } else {
            Weights::Bf16(shapes.map(|(r, c)| g.bf16(r * c, 1.0 / (c as f32).sqrt() * 3.0)))
        };
        let x = (0..t * cols).map(|_| g.f32(2.0)).collect();
        Mlp {
            w,
            f,
            cols,
            out,
            t,
            x,
        }
    }

    fn mats(&self) -> [MatRef<'_>; 3] {
        let shapes = [(self.f, self.cols), (self.f, self.cols), (self.out, self.f)];
        match &self.w {
            Weights::Bf16(ws) => std::array::from_fn(|i| MatRef::Bf16 {
                w: &ws[i],
                rows: shapes[i].0,
                cols: shapes[i].1,
            }),
            Weights::Mxfp4(ws) => std::array::from_fn(|i| {
                MatRef::Mxfp4(Mxfp4Ref {
                    rows: shapes[i].0,
                    cols: shapes[i].1,
                    packed: &ws[i].0,
                    scales: &ws[i].1,
                })
            }),
        }
    }
}

/// The MLPs' outputs through `run` (a device call, or the host path).
fn outputs(mlps: &[Mlp], role: Role, run: impl FnOnce(&mut [GluProduct<'_, '_>])) -> Vec<Vec<f32>> {
    let mut ys: Vec<Vec<f32>> = mlps.iter().map(|m| vec![f32::NAN; m.t * m.out]).collect();
    let mut jobs: Vec<GluProduct<'_, '_>> = mlps
        .iter()
        .zip(ys.iter_mut())
        .map(|(m, y)| {
            let [gate, up, down] = m.mats();
            GluProduct {
                gate,
                up,
                down,
                role,
                x: &m.x,
                t: m.t,
                y,
            }
        })
        .collect();
    run(&mut jobs);
    drop(jobs);
    ys
}

#[test]
fn gated_mlps_in_one_call_give_the_host_paths_bits() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(7);
    // (f, cols, out, t): widths off the warp's 32 and 256-column chunks.
    let spine = vec![Mlp::new(&mut g, false, (300, 96, 80, 1))];
    let spine_t = vec![
        Mlp::new(&mut g, false, (300, 96, 80, 3)),
        Mlp::new(&mut g, false, (4100, 64, 40, 260)),
    ];
    let experts: Vec<Mlp> = [1, 1, 2, 1]
        .iter()
        .map(|&t| Mlp::new(&mut g, true, (96, 128, 128, t)))
        .collect();
    for (mlps, role) in [
        (&spine, Role::Spine),
        (&spine_t, Role::Spine),
        (&experts, Role::Expert),
    ] {
        for act in ACTS {
            let host = outputs(mlps, role, |j| glu_batch_stable(j, act, &Hints::default()));
            let before = b.stats();
            let dev = outputs(mlps, role, |j| {
                assert!(
                    b.glu_batch(j, act, &Hints::default()),
                    "declined: {:?}",
                    b.stats().last_error
                )
            });
            let after = b.stats();
            assert_eq!(
                after.device_calls - before.device_calls,
                1,
                "one round trip"
            );
            assert_eq!(
                after.device_products - before.device_products,
                3 * mlps.len() as u64
            );
            for (i, (d, h)) in dev.iter().zip(&host).enumerate() {
                for (k, (p, q)) in d.iter().zip(h).enumerate() {
                    assert!(
                        p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()),
                        "{act:?} {role:?} MLP {i} element {k}: device {p:e} vs host {q:e}"
                    );
                }
            }
        }
    }
    // Shapes the kernels do not take are declined, nothing written.
    let m = &spine[0];
    let [gate, _, down] = m.mats();
    let mut y = vec![1.5f32; m.t * m.out];
    let mut bad = [GluProduct {
        gate,
        up: down,
        down,
        role: Role::Spine,
        x: &m.x,
        t: m.t,
        y: &mut y,
    }];
    assert!(!b.glu_batch(&mut bad, GluAct::Swiglu, &Hints::default()));
    assert!(y.iter().all(|&v| v == 1.5));
    for m in spine.iter().chain(&spine_t).chain(&experts) {
        for w in m.mats() {
            for s in fathom_kernels::backend::segments(&w) {
                let a = s.as_ptr() as usize;
                b.forget(a..a + s.len());
            }
        }
    }
}

/// Plain products beside gated MLPs (`Backend::glu_mixed`: a MoE layer's
/// router and latent projection with its shared experts) in one round
/// trip: each output the host path's bits.
#[test]
fn plain_products_beside_mlps_in_one_call_keep_their_bits() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(11);
    let mlps = vec![Mlp::new(&mut g, false, (300, 96, 80, 3))];
    let (router, latent) = (g.bf16(37 * 96, 0.3), g.bf16(64 * 96, 0.3));
    let ws = [
        MatRef::Bf16 {
            w: &router,
            rows: 37,
            cols: 96,
        },
        MatRef::Bf16 {
            w: &latent,
            rows: 64,
            cols: 96,
        },
    ];
    let x = &mlps[0].x;
    let act = ACTS[1];
    let host = outputs(&mlps, Role::Spine, |j| {
        glu_batch_stable(j, act, &Hints::default())
    });
    let host_plain: Vec<Vec<f32>> = ws
        .iter()
        .map(|w| {
            let mut y = vec![0f32; 3 * w.rows()];
            w.cpu(x, 3, &mut y);
            y
        })
        .collect();
    let mut dev_plain: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; 3 * w.rows()]).collect();
    let before = b.stats();
    let dev = outputs(&mlps, Role::Spine, |j| {
        let mut plain: Vec<Product<'_, '_>> = ws
            .iter()
            .zip(dev_plain.iter_mut())
            .map(|(&w, y)| Product {
                w,
                role: Role::Spine,
                x,
                t: 3,
                y,
            })
            .collect();
        assert!(
            b.glu_mixed(&mut plain, j, act, &Hints::default()),
            "declined: {:?}",
            b.stats().last_error
        );
    });
    let after = b.stats();
    assert_eq!(
        after.device_calls - before.device_calls,
        1,
        "one round trip"
    );
    assert_eq!(after.device_products - before.device_products, 5);
    let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
        v.iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    assert!(bits(&dev) == bits(&host), "the MLP's outputs");
    assert!(
        bits(&dev_plain) == bits(&host_plain),
        "the plain products' outputs"
    );
    for w in mlps[0].mats().iter().chain(&ws) {
        for s in fathom_kernels::backend::segments(w) {
            let a = s.as_ptr() as usize;
            b.forget(a..a + s.len());
        }
    }
}

/// `glu.cu` spells the CPU's tanh series in hex: the same bits, in order
/// (runs without a device).
#[test]
fn the_kernels_tanh_constants_are_the_cpus() {
    let src = fathom_kernels_cuda::SOURCE;
    let body = &src[src
        .find("float tanh_fixed(float x)")
        .expect("tanh_fixed in glu.cu")..];
    let body = &body[..body.find("\n}\n").expect("its end")];
    let spelled: Vec<u32> = body
        .split("__uint_as_float(0x")
        .skip(1)
        .map(|s| u32::from_str_radix(&s[..8], 16).expect("eight hex digits"))
        .collect();
    let cpu: Vec<u32> = fathom_kernels::ops::TANH_SERIES
        .iter()
        .map(|c| c.to_bits())
        .collect();
    assert_eq!(spelled, cpu);
}

/// Special values through the activation on both sides: 1×1 matrices of
/// ones pass each position's input straight to the gate and up (g = u =
/// x), so the activation meets ±0, subnormals, values at and beside the
/// series' cut (|x| = 0.5 for the gate's tanh(g/β) at g = ±2, for the up's
/// at u = ±12.5), saturating values, ±∞ and NaN.
#[test]
fn special_values_take_the_same_paths_on_both_devices() {
    let Some(b) = open(None) else { return };
    let below = |v: f32| f32::from_bits(v.to_bits() - 1);
    let above = |v: f32| f32::from_bits(v.to_bits() + 1);
    let mut xs = vec![
        0.0, 1e-30, 1e-40, 0.5, 2.0, 12.5, 3.0, 20.0, 88.0, 100.0, 1e30,
    ];
    xs.extend(
        [0.5f32, 2.0, 12.5]
            .iter()
            .flat_map(|&v| [below(v), above(v)]),
    );
    let neg: Vec<f32> = xs.iter().map(|v| -v).collect();
    xs.extend(neg);
    xs.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
    let one = [1.0f32];
    let m = MatRef::F32 {
        w: &one,
        rows: 1,
        cols: 1,
    };
    let t = xs.len();
    for act in ACTS {
        let run = |on_device: bool| {
            let mut y = vec![0f32; t];
            let mut job = [GluProduct {
                gate: m,
                up: m,
                down: m,
                role: Role::Spine,
                x: &xs,
                t,
                y: &mut y,
            }];
            if on_device {
                assert!(b.glu_batch(&mut job, act, &Hints::default()), "declined");
            } else {
                glu_batch_stable(&mut job, act, &Hints::default());
            }
            y
        };
        let (host, dev) = (run(false), run(true));
        for ((x, h), d) in xs.iter().zip(&host).zip(&dev) {
            assert!(
                h.to_bits() == d.to_bits() || (h.is_nan() && d.is_nan()),
                "{act:?} at {x:e}: device {d:e} vs host {h:e}"
            );
        }
    }
    b.forget(one.as_ptr() as usize..one.as_ptr() as usize + 4);
}

/// The activations at other β than K3's — SiTU-GLU with β 3 and a linear
/// branch of β_lin 0.7, and with β 0.4 alone — and SwiGLU, over a spread
/// of gate and up values each on its own (1,024 positions, past one
/// 256-thread block): `x = [a, b]` through a gate row `[1, 0]` and an up
/// row `[0, 1]`, a down of one `1`.
#[test]
fn gated_activations_at_other_betas_over_a_spread_keep_their_bits() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(3);
    let t = 1024;
    let xs: Vec<f32> = (0..2 * t).map(|_| g.f32(16.0)).collect();
    let ws: [&[f32]; 3] = [&[1.0, 0.0], &[0.0, 1.0], &[1.0]];
    let [gate, up, down] = ws.map(|w| MatRef::F32 {
        w,
        rows: 1,
        cols: w.len(),
    });
    let acts = [
        GluAct::Swiglu,
        GluAct::Situ {
            beta: 3.0,
            beta_lin: Some(0.7),
        },
        GluAct::Situ {
            beta: 0.4,
            beta_lin: None,
        },
    ];
    for act in acts {
        let run = |on_device: bool| {
            let mut y = vec![f32::NAN; t];
            let mut job = [GluProduct {
                gate,
                up,
                down,
                role: Role::Spine,
                x: &xs,
                t,
                y: &mut y,
            }];
            if on_device {
                assert!(b.glu_batch(&mut job, act, &Hints::default()), "declined");
            } else {
                glu_batch_stable(&mut job, act, &Hints::default());
            }
            y
        };
        let (host, dev) = (run(false), run(true));
        for (i, (h, d)) in host.iter().zip(&dev).enumerate() {
            assert!(
                h.to_bits() == d.to_bits(),
                "{act:?} at position {i} ({:e}, {:e}): device {d:e} vs host {h:e}",
                xs[2 * i],
                xs[2 * i + 1]
            );
        }
    }
    for w in ws {
        b.forget(w.as_ptr() as usize..w.as_ptr() as usize + 4 * w.len());
    }
}

/// A MoE layer's routed experts for `Backend::moe_tail`: the experts
/// (`t` rows each), each output row's picks and weights, a norm weight and
/// a bf16 up-projection `[80, width]`.
struct TailCase {
    experts: Vec<Mlp>,
    k: usize,
    picks: Vec<(u32, u32)>,
    weights: Vec<f32>,
    norm: Vec<f32>,
    up_w: Vec<u16>,
    width: usize,
}

impl TailCase {
    /// Experts of `f` hidden, `cols` in and `width` out, MXFP4 or bf16.
    fn new(
        g: &mut Lcg,
        mxfp4: bool,
        (f, cols, width): (usize, usize, usize),
        ts: &[usize],
    ) -> Self {
        let experts: Vec<Mlp> = ts
            .iter()
            .map(|&t| Mlp::new(g, mxfp4, (f, cols, width, t)))
            .collect();
        // Three rows of three picks (the order of three sums shows in the
        // bits; two would not, addition being commutative); row 1 picks
        // expert 1 twice.
        let picks = vec![
            (1, 0),
            (3, 1),
            (4, 0),
            (0, 0),
            (1, 1),
            (1, 0),
            (3, 0),
            (0, 1),
            (4, 1),
        ];
        TailCase {
            experts,
            k: 3,
            weights: (0..picks.len()).map(|_| g.f32(1.5)).collect(),
            picks,
            norm: (0..width).map(|_| g.f32(2.0)).collect(),
            up_w: g.bf16(80 * width, 0.2),
            width,
        }
    }

    /// As [`TailCase::new`] with `k` picks a row (the device's combine
    /// loads a column's picks four at a time: k = 6 takes a group of four
    /// and a remainder of two).
    fn with_k(
        g: &mut Lcg,
        mxfp4: bool,
        dims: (usize, usize, usize),
        ts: &[usize],
        k: usize,
    ) -> Self {
        let mut case = Self::new(g, mxfp4, dims, ts);
        case.picks = (0..3 * k)
            .map(|i| {
                let e = (3 * i + 1) % ts.len();
                (e as u32, (i % ts[e]) as u32)
            })
            .collect();
        case.weights = (0..3 * k).map(|_| g.f32(1.5)).collect();
        case.k = k;
        case
    }

    fn tails(&self) -> Vec<TailExpert<'_, '_>> {
        self.experts
            .iter()
            .map(|m| {
                let [gate, up, down] = m.mats();
                TailExpert {
                    gate,
                    up,
                    down,
                    x: &m.x,
                    t: m.t,
                }
            })
            .collect()
    }

    fn up(&self) -> MatRef<'_> {
        MatRef::Bf16 {
            w: &self.up_w,
            rows: 80,
            cols: self.width,
        }
    }

    /// The tail on `b`'s device (asserting it took it), or on its twin.
    fn run(&self, b: Option<&dyn Backend>, act: GluAct, norm: bool, up: bool) -> Vec<f32> {
        let tails = self.tails();
        let up = up.then(|| self.up());
        let mut y = vec![f32::NAN; 3 * up.map_or(self.width, |u| u.rows())];
        let mut job = MoeTail {
            experts: &tails,
            act,
            k: self.k,
            picks: &self.picks,
            weights: &self.weights,
            norm: norm.then_some((&self.norm[..], 1e-6)),
            up,
            y: &mut y,
        };
        match b {
            Some(b) => assert!(b.moe_tail(&mut job, &Hints::default()), "declined"),
            None => moe_tail_cpu(&mut job),
        }
        y
    }

    /// The tail (first activation, projection, no norm) offered to `b`:
    /// whether it took it, and the output, filled with 1.5 beforehand.
    fn offer(&self, b: &dyn Backend) -> (bool, Vec<f32>) {
        let tails = self.tails();
        let mut y = vec![1.5f32; 3 * 80];
        let mut job = MoeTail {
            experts: &tails,
            act: ACTS[0],
            k: self.k,
            picks: &self.picks,
            weights: &self.weights,
            norm: None,
            up: Some(self.up()),
            y: &mut y,
        };
        let taken = b.moe_tail(&mut job, &Hints::default());
        (taken, y)
    }

    fn forget(&self, b: &dyn Backend) {
        let mats = self.experts.iter().flat_map(|m| m.mats());
        for w in mats.chain([self.up()]) {
            for s in fathom_kernels::backend::segments(&w) {
                let a = s.as_ptr() as usize;
                b.forget(a..a + s.len());
            }
        }
    }
}

/// A MoE layer's routed experts through their combine in one call
/// (`Backend::moe_tail`: the experts, each row's rank-order sum, the
/// latent norm, the up-projection) against its twin `moe_tail_cpu`, bit
/// for bit: MXFP4 experts on a 128-wide latent and bf16 ones on a 300-wide
/// one (past a block's 256 threads, not a multiple of the norm's 8
/// lanes), eight picks a row (two groups of the device's four loads), and bf16 experts with six picks a row on a
/// 4100-wide latent (wider than the combine keeps in shared memory), every activation, with and
/// without the norm and the projection.
#[test]
fn a_moe_tail_in_one_call_gives_the_twins_bits() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(23);
    let cases = [
        TailCase::new(&mut g, true, (96, 128, 128), &[2, 2, 1, 2, 2]),
        TailCase::new(&mut g, false, (40, 64, 300), &[2, 2, 1, 2, 2]),
        TailCase::with_k(&mut g, true, (96, 128, 128), &[2, 2, 1, 2, 2], 8),
        TailCase::with_k(&mut g, false, (8, 64, 4100), &[2, 2, 1, 2, 2], 6),
    ];
    for (c, case) in cases.iter().enumerate() {
        for act in ACTS {
            for (norm, up) in [(true, true), (false, true), (false, false), (true, false)] {
                let host = case.run(None, act, norm, up);
                let before = b.stats();
                let dev = case.run(Some(&*b), act, norm, up);
                let after = b.stats();
                assert_eq!(
                    after.device_calls - before.device_calls,
                    1,
                    "one round trip"
                );
                assert_eq!(after.device_moe_tails - before.device_moe_tails, 1);
                assert_eq!(
                    after.device_products - before.device_products,
                    15 + u64::from(up)
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(&dev) == bits(&host),
                    "case {c} {act:?}, norm {norm}, up {up}: device {dev:?} vs twin {host:?}"
                );
                assert!(host.iter().all(|v| v.is_finite()), "a real test: {host:?}");
            }
        }
        case.forget(&*b);
    }
}

/// Only the experts of a tail count as expert products (15 hits a call
/// once they are held, the projection not among them); a pick of a row
/// that does not exist is declined with nothing written.
#[test]
fn a_moe_tail_counts_its_experts_and_declines_bad_picks() {
    let Some(b) = open(None) else { return };
    let mut g = Lcg(29);
    let case = TailCase::new(&mut g, true, (96, 128, 128), &[2, 2, 1, 2, 2]);
    case.run(Some(&*b), ACTS[0], true, true);
    let before = b.stats();
    case.run(Some(&*b), ACTS[0], true, true);
    let after = b.stats();
    assert_eq!(after.vram_expert_hits - before.vram_expert_hits, 15);
    assert_eq!(after.vram_expert_misses, before.vram_expert_misses);
    let bad = TailCase {
        picks: {
            let mut p = case.picks.clone();
            p[4] = (2, 1);
            p
        },
        ..TailCase::new(&mut g, true, (96, 128, 128), &[2, 2, 1, 2, 2])
    };
    let (taken, y) = bad.offer(&*b);
    assert!(!taken, "expert 2 has no row 1");
    assert!(y.iter().all(|&v| v == 1.5));
    case.forget(&*b);
}

/// Room for a tail is made class by class: its experts may not push out a
/// spine matrix (declined, the spine still held), while with room for both
/// the same tail is taken.
#[test]
fn a_moe_tails_experts_never_push_out_the_spine() {
    let mut g = Lcg(31);
    // Five MXFP4 experts of 3 × 6.5 kB and a 20 kB projection; a 64 kB spine matrix.
    let case = TailCase::new(&mut g, true, (96, 128, 128), &[2, 2, 1, 2, 2]);
    let spine_w = g.bf16(256 * 128, 0.2);
    let spine = MatRef::Bf16 {
        w: &spine_w,
        rows: 256,
        cols: 128,
    };
    let x: Vec<f32> = (0..128).map(|_| g.f32(1.0)).collect();
    for (budget, taken) in [(150_000u64, false), (200_000, true)] {
        let Some(b) = open(Some(budget)) else { return };
        let mut y = vec![0f32; 256];
        assert!(
            b.matmul(&spine, Role::Spine, &x, 1, &mut y),
            "the spine fits"
        );
        assert_eq!(b.missing_bytes(&[spine]), [0]);
        let (took, out) = case.offer(&*b);
        assert_eq!(took, taken, "budget {budget}");
        assert_eq!(b.missing_bytes(&[spine]), [0], "the spine is still held");
        if !taken {
            assert!(out.iter().all(|&v| v == 1.5), "declined: nothing written");
        }
    }
}
