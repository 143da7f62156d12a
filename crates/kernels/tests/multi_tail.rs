//! A MoE layer's tail (`Backend::moe_tail`) over several devices
//! (`MultiBackend`), with stand-in devices that compute on the CPU kernels
//! and record what they are handed: a tail whose experts all belong to
//! one device goes there whole — its up-projection, a spine matrix, on
//! the first device from the sums the owner sends back — and gives the
//! bits of `moe_tail_cpu`; a tail whose experts lie on several devices is
//! declined with nothing written; both are counted, the split ones in the
//! stats too. New experts are placed as a batch's are, one at a time on
//! the least loaded device, so a tail of two new experts is split.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use fathom_kernels::backend::{
    self, Backend, BackendStats, DeviceBackend, Hints, MatRef, MoeTail, Role, TailExpert,
    moe_tail_cpu,
};
use fathom_kernels::multi::MultiBackend;
use fathom_kernels::ops::GluAct;
use std::sync::Arc;

/// A matrix's first byte's address (how the stand-ins name matrices).
fn addr(w: &MatRef<'_>) -> usize {
    backend::segments(w)[0].as_ptr() as usize
}

/// Computes on the CPU kernels; takes tails unless told not to.
#[derive(Default)]
struct Dev {
    declines_tails: bool,
    /// Each tail taken: its experts' gates and whether it had `up`.
    tails: Mutex<Vec<(Vec<usize>, bool)>>,
    /// Single products: matrix and role.
    products: Mutex<Vec<(usize, Role)>>,
    /// Matrices handed over as hints (`next` and `guessed`), in tails too.
    hinted: Mutex<Vec<usize>>,
    taken: AtomicU64,
}

impl Dev {
    fn note(&self, h: &Hints<'_, '_>) {
        let mut v = self.hinted.lock().unwrap();
        v.extend(h.next.iter().chain(h.guessed).map(addr));
    }
    fn clear(&self) {
        self.tails.lock().unwrap().clear();
        self.products.lock().unwrap().clear();
        self.hinted.lock().unwrap().clear();
    }
}

impl DeviceBackend for Dev {
    fn name(&self) -> String {
        "stand-in".into()
    }
    fn matmul(&self, w: &MatRef<'_>, role: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool {
        self.products.lock().unwrap().push((addr(w), role));
        w.cpu(x, t, y);
        true
    }
    fn hint(&self, h: &Hints<'_, '_>) {
        self.note(h);
    }
    fn moe_tail(&self, tail: &mut MoeTail<'_, '_>, h: &Hints<'_, '_>) -> bool {
        if self.declines_tails {
            return false;
        }
        self.note(h);
        let gates = tail.experts.iter().map(|e| addr(&e.gate)).collect();
        self.tails.lock().unwrap().push((gates, tail.up.is_some()));
        moe_tail_cpu(tail);
        self.taken.fetch_add(1, Ordering::Relaxed);
        true
    }
    fn forget(&self, _: Range<usize>) {}
    fn stats(&self) -> BackendStats {
        BackendStats {
            device_moe_tails: self.taken.load(Ordering::Relaxed),
            ..BackendStats::default()
        }
    }
}

/// A deterministic spread of values in ±`amp`.
fn data(seed: u64, n: usize, amp: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

fn bf16(seed: u64, n: usize, amp: f32) -> Vec<u16> {
    data(seed, n, amp)
        .iter()
        .map(|v| (v.to_bits() >> 16) as u16)
        .collect()
}

/// Experts' gate and up `[F, COLS]`, down `[WIDTH, F]`; `up` `[OUT, WIDTH]`.
const F: usize = 16;
const COLS: usize = 32;
const WIDTH: usize = 24;
const OUT: usize = 40;
/// Rows each expert computes.
const T: usize = 2;

/// Eight experts' weights and inputs, a norm and an up-projection.
struct Layer {
    w: Vec<[Vec<u16>; 3]>,
    x: Vec<Vec<f32>>,
    norm: Vec<f32>,
    up: Vec<u16>,
}

impl Layer {
    fn new() -> Layer {
        let s = |e: u64, i: u64| 10 * e + i;
        Layer {
            w: (0..8)
                .map(|e| {
                    [
                        bf16(s(e, 1), F * COLS, 0.4),
                        bf16(s(e, 2), F * COLS, 0.4),
                        bf16(s(e, 3), WIDTH * F, 0.4),
                    ]
                })
                .collect(),
            x: (0..8).map(|e| data(s(e, 4), T * COLS, 1.5)).collect(),
            norm: data(5, WIDTH, 1.2),
            up: bf16(6, OUT * WIDTH, 0.3),
        }
    }

    fn mats(&self, e: usize) -> [MatRef<'_>; 3] {
        let [g, u, d] = &self.w[e];
        [
            MatRef::Bf16 {
                w: g,
                rows: F,
                cols: COLS,
            },
            MatRef::Bf16 {
                w: u,
                rows: F,
                cols: COLS,
            },
            MatRef::Bf16 {
                w: d,
                rows: WIDTH,
                cols: F,
            },
        ]
    }

    fn experts(&self, which: &[usize]) -> Vec<TailExpert<'_, '_>> {
        which
            .iter()
            .map(|&e| {
                let [gate, up, down] = self.mats(e);
                TailExpert {
                    gate,
                    up,
                    down,
                    x: &self.x[e],
                    t: T,
                }
            })
            .collect()
    }
}

/// Three output rows of three picks each over two experts (rows of
/// their outputs), with their weights.
const PICKS: [(u32, u32); 9] = [
    (0, 0),
    (1, 1),
    (1, 0),
    (1, 0),
    (0, 1),
    (0, 0),
    (0, 1),
    (1, 1),
    (0, 1),
];

/// `tail` of experts `which` (with the norm, and `up` when `with_up`) on
/// `b`: whether it was taken, and `y`'s bits; with `b` `None`, the twin's.
fn run(
    layer: &Layer,
    which: &[usize],
    with_up: bool,
    b: Option<&dyn Backend>,
    hints: &Hints<'_, '_>,
) -> (bool, Vec<u32>) {
    let experts = layer.experts(which);
    let weights = data(7, PICKS.len(), 1.0);
    let out = if with_up { OUT } else { WIDTH };
    let mut y = vec![f32::NAN; 3 * out];
    let mut tail = MoeTail {
        experts: &experts,
        act: GluAct::Situ {
            beta: 4.0,
            beta_lin: Some(25.0),
        },
        k: 3,
        picks: &PICKS,
        weights: &weights,
        norm: Some((&layer.norm, 1e-6)),
        up: with_up.then(|| MatRef::Bf16 {
            w: &layer.up,
            rows: OUT,
            cols: WIDTH,
        }),
        y: &mut y,
    };
    assert!(tail.is_consistent());
    let taken = match b {
        Some(b) => b.moe_tail(&mut tail, hints),
        None => {
            moe_tail_cpu(&mut tail);
            true
        }
    };
    (taken, y.iter().map(|v| v.to_bits()).collect())
}

#[test]
fn a_tail_goes_whole_to_the_device_owning_its_experts_with_the_twins_bits() {
    let devs: Vec<Arc<Dev>> = (0..3)
        .map(|d| {
            Arc::new(Dev {
                declines_tails: d == 2,
                ..Dev::default()
            })
        })
        .collect();
    let multi = MultiBackend::new(devs.iter().map(|d| d.clone() as Arc<dyn Backend>).collect())
        .expect("three devices");
    let layer = Layer::new();
    // Experts 0..6 handed over at load: expert e to device e % 3 (each
    // the least loaded in turn), its three matrices together.
    let groups: Vec<Vec<MatRef<'_>>> = (0..6).map(|e| layer.mats(e).to_vec()).collect();
    multi.preload(&groups);
    assert_eq!(multi.owned(), vec![6, 6, 6]);
    for (e, g) in groups.iter().enumerate() {
        let holds = devs[e % 3].hinted.lock().unwrap().contains(&addr(&g[0]));
        assert!(holds, "expert {e} on device {}", e % 3);
    }
    devs.iter().for_each(|d| d.clear());
    let up_addr = addr(&MatRef::Bf16 {
        w: &layer.up,
        rows: OUT,
        cols: WIDTH,
    });
    let gates = |which: &[usize]| -> Vec<usize> {
        which.iter().map(|&e| addr(&layer.mats(e)[0])).collect()
    };

    // Experts 1 and 4 on device 1: the experts, sums and norm there, the
    // up-projection on the first device; expert 2's gate, guessed, goes
    // to device 2 as a hint.
    let guess = [layer.mats(2)[0]];
    let hints = Hints {
        guessed: &guess,
        ..Hints::default()
    };
    let want = run(&layer, &[1, 4], true, None, &Hints::default());
    let got = run(&layer, &[1, 4], true, Some(&multi), &hints);
    assert!(got.0, "taken");
    assert!(
        got.1 == want.1,
        "device 1's tail and the first's up-projection"
    );
    assert_eq!(
        *devs[1].tails.lock().unwrap(),
        vec![(gates(&[1, 4]), false)]
    );
    assert_eq!(
        *devs[0].products.lock().unwrap(),
        vec![(up_addr, Role::Spine)]
    );
    assert!(devs[0].tails.lock().unwrap().is_empty());
    assert_eq!(*devs[2].hinted.lock().unwrap(), vec![addr(&guess[0])]);
    assert_eq!(multi.tails(), (1, 0));
    devs.iter().for_each(|d| d.clear());

    // Experts 0 and 3 on the first device: whole there, up-projection too.
    let want = run(&layer, &[0, 3], true, None, &Hints::default());
    let got = run(&layer, &[0, 3], true, Some(&multi), &Hints::default());
    assert!(got.0 && got.1 == want.1, "the first device's tail");
    assert_eq!(*devs[0].tails.lock().unwrap(), vec![(gates(&[0, 3]), true)]);
    assert!(devs[0].products.lock().unwrap().is_empty());

    // Without an up-projection on device 1: whole there.
    let want = run(&layer, &[4, 1], false, None, &Hints::default());
    let got = run(&layer, &[4, 1], false, Some(&multi), &Hints::default());
    assert!(got.0 && got.1 == want.1, "device 1's tail without up");
    assert_eq!(devs[1].tails.lock().unwrap()[0], (gates(&[4, 1]), false));
    assert_eq!(multi.tails(), (3, 0));
    devs.iter().for_each(|d| d.clear());

    // Experts on devices 0 and 1: declined, nothing written, counted.
    let got = run(&layer, &[0, 1], true, Some(&multi), &Hints::default());
    assert!(!got.0, "a split tail is declined");
    assert!(got.1.iter().all(|&b| f32::from_bits(b).is_nan()));
    assert_eq!(multi.tails(), (3, 1));
    assert_eq!(multi.stats().moe_tails_split, 1);
    assert_eq!(multi.stats().device_moe_tails, 3);
    // Whole to device 2, which declines it as a lone device may.
    let got = run(&layer, &[2, 5], true, Some(&multi), &Hints::default());
    assert!(!got.0 && got.1.iter().all(|&b| f32::from_bits(b).is_nan()));
    assert_eq!(multi.tails(), (4, 1));
    assert!(devs.iter().all(|d| d.tails.lock().unwrap().is_empty()));

    // Two new experts: placed one at a time on the least loaded devices
    // (apart), so the tail is split.
    let got = run(&layer, &[6, 7], true, Some(&multi), &Hints::default());
    assert!(!got.0);
    assert_eq!(multi.tails(), (4, 2));
    assert_eq!(
        multi.owned().iter().sum::<usize>(),
        20,
        "their gates placed"
    );
}
