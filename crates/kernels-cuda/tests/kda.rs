//! The KDA core on the GPU against its CPU twin (`kda_step_cpu`), bit for
//! bit: outputs and the states left behind, over batched steps of several
//! sequences with 1..3 positions each, head widths that are and are not a
//! multiple of 32, inputs that drive the exponentials past both ends, the
//! decay with a lower bound (K3) and with softplus (Kimi-Linear), a
//! state copied on the device (an undo mark) and stepped from, and a state
//! copied back to the host and stepped again from there, with and without
//! the forget gate's up-projection and o_proj in the call. Without a CUDA
//! device the test prints why it skipped.

use std::sync::Arc;

use fathom_kernels::backend::{self, Backend, DEVICE_MAX_SOURCES, MatRef, then_cpu};
use fathom_kernels::kda::{KdaDims, KdaInputs, KdaJob, KdaParams, KdaProj, KdaSeq, kda_step_cpu};
use fathom_kernels::state_buf::StateBuf;

use fathom_kernels_cuda::CudaBackend;

mod common;

use common::{Lcg, Rest, open};

impl Lcg {
    /// Mostly moderate values, some large enough to saturate a sigmoid or
    /// overflow an exponential, some zero.
    fn f32(&mut self, amp: f32) -> f32 {
        match self.next() % 32 {
            0 => 0.0,
            1 => 120.0,
            2 => -120.0,
            _ => (self.next() as f32 / u32::MAX as f32 - 0.5) * 2.0 * amp,
        }
    }
    fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32(amp)).collect()
    }
}

struct Layer {
    dims: KdaDims,
    conv: [Vec<f32>; 3],
    a: Vec<f32>,
    dt: Vec<f32>,
    o_norm: Vec<f32>,
    /// The forget gate's up-projection `[P, R]` and `o_proj` `[D, P]`
    /// (bf16), used when `products` is set.
    f_up: Vec<u16>,
    o_proj: Vec<u16>,
    products: bool,
    /// A low-rank output gate (Kimi-Linear's): its up-projection `[P, RG]`
    /// (bf16), used when `low_g` is set.
    g_up: Vec<u16>,
    low_g: bool,
    /// The six input projections `[rows, DM]` (q, k, v, f_a, b, g) when the
    /// step carries them (`KdaJob::proj`); empty otherwise.
    proj: Vec<Vec<u16>>,
}

/// The projections' input width.
const DM: usize = 80;

/// Low-rank widths of the forget gate and of a low-rank output gate, and
/// the model width in the products' cases.
const R: usize = 16;
const RG: usize = 12;
const D: usize = 96;

impl Layer {
    fn new(rng: &mut Lcg, heads: usize, kd: usize, kernel: usize) -> Self {
        let p = heads * kd;
        Layer {
            dims: KdaDims {
                heads,
                head_dim: kd,
                conv_kernel: kernel,
                gate_lower_bound: Some(-5.0),
                norm_eps: 1e-5,
            },
            conv: std::array::from_fn(|_| rng.vec(p * kernel, 0.8)),
            a: (0..p).map(|_| rng.f32(1.0).abs() + 0.01).collect(),
            dt: rng.vec(p, 1.0),
            o_norm: rng.vec(kd, 1.5),
            f_up: bf16(rng, p * R, 0.5),
            o_proj: bf16(rng, D * p, 0.1),
            products: false,
            g_up: bf16(rng, p * RG, 0.5),
            low_g: false,
            proj: Vec::new(),
        }
    }
    /// The rows of the six projections.
    fn proj_rows(&self) -> [usize; 6] {
        let (p, h) = (self.dims.width(), self.dims.heads);
        [
            p,
            p,
            p,
            if self.products { R } else { p },
            h,
            self.g_width(),
        ]
    }
    /// The output gate's input width (its low rank, else P).
    fn g_width(&self) -> usize {
        if self.low_g { RG } else { self.dims.width() }
    }
    /// The output gate's up-projection `[P, RG]`, when the case has one.
    fn g_up(&self) -> Option<MatRef<'_>> {
        let (w, rows, cols) = (&self.g_up[..], self.dims.width(), RG);
        self.low_g.then_some(MatRef::Bf16 { w, rows, cols })
    }
    /// The forget gate's up-projection `[P, R]` and `o_proj` `[D, P]`, when
    /// the case runs them in the step.
    fn products(&self) -> [Option<MatRef<'_>>; 2] {
        let p = self.dims.width();
        let bf16 = |w, rows, cols| self.products.then_some(MatRef::Bf16 { w, rows, cols });
        [bf16(&self.f_up[..], p, R), bf16(&self.o_proj[..], D, p)]
    }
    fn params(&self) -> KdaParams<'_> {
        // (The backend keeps these in its weight cache: `Drop` forgets them.)
        KdaParams {
            conv: [&self.conv[0], &self.conv[1], &self.conv[2]],
            a: &self.a,
            dt_bias: &self.dt,
            o_norm: &self.o_norm,
        }
    }
}

impl Drop for Layer {
    fn drop(&mut self) {
        self.params().forget();
        backend::forget(&self.f_up);
        backend::forget(&self.g_up);
        backend::forget(&self.o_proj);
        for m in &self.proj {
            backend::forget(m);
        }
    }
}

/// `n` bf16 values in ±`amp`.
fn bf16(rng: &mut Lcg, n: usize, amp: f32) -> Vec<u16> {
    rng.vec(n, amp)
        .iter()
        .map(|v| (v.to_bits() >> 16) as u16)
        .collect()
}

/// One sequence's carried buffers.
struct Seq {
    s: StateBuf,
    conv: [StateBuf; 3],
}

impl Seq {
    fn new(rng: &mut Lcg, l: &Layer) -> Self {
        let (p, kd) = (l.dims.width(), l.dims.head_dim);
        Seq {
            s: StateBuf::new(rng.vec(l.dims.heads * kd * kd, 0.05)),
            conv: std::array::from_fn(|_| {
                StateBuf::new(rng.vec((l.dims.conv_kernel - 1) * p, 1.0))
            }),
        }
    }
    fn bits(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.s.read().unwrap().iter().map(|x| x.to_bits()).collect();
        for c in &self.conv {
            v.extend(c.read().unwrap().iter().map(|x| x.to_bits()));
        }
        v
    }
}

/// One step of `seqs` with `lens[i]` positions each; on the installed
/// backend when `device`, else the twin. Returns the bits of the outputs
/// and of the delta-rule inputs handed back for a journal.
fn step(l: &Layer, seqs: &mut [Seq], lens: &[usize], rng: &mut Lcg, device: bool) -> Vec<u32> {
    step_then(l, seqs, lens, rng, device, None)
}

/// [`step`] with a [`Then`] of `blocks` earlier blocks (and a query when
/// `Some((_, blocks, true))`) behind the step's output, whose rows and
/// products' bits follow the step's.
fn step_then(
    l: &Layer,
    seqs: &mut [Seq],
    lens: &[usize],
    rng: &mut Lcg,
    device: bool,
    then: Option<(&Arc<CudaBackend>, usize, bool)>,
) -> Vec<u32> {
    let (p, h) = (l.dims.width(), l.dims.heads);
    let n: usize = lens.iter().sum();
    let pre: [Vec<f32>; 3] = std::array::from_fn(|_| rng.vec(n * p, 2.0));
    let r = if l.products { R } else { p };
    let (f, b, g) = (
        rng.vec(n * r, 3.0),
        rng.vec(n * h, 3.0),
        rng.vec(n * l.g_width(), 3.0),
    );
    let mut out = vec![0f32; n * if l.products { D } else { p }];
    let mut inputs = vec![0f32; KdaJob::inputs_len(&l.dims, n)];
    let xs = rng.vec(n * DM, 1.0);
    let proj = (!l.proj.is_empty()).then(|| KdaProj {
        x: &xs,
        mats: std::array::from_fn(|i| MatRef::Bf16 {
            w: &l.proj[i],
            rows: l.proj_rows()[i],
            cols: DM,
        }),
    });
    let mut at = 0;
    let job_seqs = seqs
        .iter_mut()
        .zip(lens)
        .map(|(s, &len)| {
            at += len;
            let [q, k, v] = &mut s.conv;
            KdaSeq {
                rows: at - len..at,
                s: &mut s.s,
                conv: [q, k, v],
            }
        })
        .collect();
    let mut job = KdaJob {
        dims: &l.dims,
        w: l.params(),
        // With `proj` the inputs come from its products (these are unread).
        x: KdaInputs {
            pre: [&pre[0], &pre[1], &pre[2]],
            f: &f,
            b: &b,
            g: &g,
        },
        proj,
        seqs: job_seqs,
        out: &mut out,
        f_up: l.products()[0],
        g_up: l.g_up(),
        o_proj: l.products()[1],
        inputs_out: Some(&mut inputs),
        then: None,
    };
    let mut rest = then.map(|(dev, nb, q)| Rest::new(dev, rng, n, D, nb, q));
    job.then = rest.as_mut().map(Rest::then);
    if device {
        assert!(
            backend::kda_step(&mut job).unwrap(),
            "the device took the step"
        );
    } else {
        kda_step_cpu(&mut job).unwrap();
    }
    let a = job.out.to_vec();
    if let Some(t) = job.then.as_mut() {
        // More sources than the device's kernels take: declined, and
        // the caller does the rest.
        let declined = t.blocks.len() >= DEVICE_MAX_SOURCES;
        if device {
            assert_eq!(t.done, !declined, "the device took the step's rest");
        }
        if !t.done {
            then_cpu(t, &a);
        }
    }
    drop(job);
    let mut bits: Vec<u32> = out.iter().chain(&inputs).map(|x| x.to_bits()).collect();
    if let Some(r) = &rest {
        bits.extend(r.bits());
    }
    bits
}

/// The tests here install their backend for the process (a state's own
/// methods call the installed one): one at a time.
static INSTALLED: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_step_with_its_layers_rest_gives_the_twins_bits() {
    let _one = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
    let Some(b) = open(None) else { return };
    backend::install(b.clone() as Arc<dyn Backend>);
    let calls0 = b.stats().device_calls;
    for (nb, query) in [(0, false), (0, true), (1, true), (3, true), (64, true)] {
        let mut rng = Lcg(31 + nb as u64);
        let mut l = Layer::new(&mut rng, 2, 64, 4);
        l.products = true;
        let rows = l.proj_rows();
        l.proj = rows.iter().map(|&r| bf16(&mut rng, r * DM, 0.4)).collect();
        let mut dev: Vec<Seq> = (0..2).map(|_| Seq::new(&mut rng, &l)).collect();
        let mut cpu: Vec<Seq> = dev
            .iter()
            .map(|s| Seq {
                s: s.s.clone(),
                conv: s.conv.clone(),
            })
            .collect();
        for (i, lens) in [[1, 2], [1, 1], [1, 1]].iter().enumerate() {
            let seed = rng.0;
            let then = Some((&b, nb, query));
            let got = step_then(&l, &mut dev, lens, &mut Lcg(seed), true, then);
            let want = step_then(&l, &mut cpu, lens, &mut Lcg(seed), false, then);
            rng.next();
            assert!(
                got == want,
                "{nb} blocks, query {query}: outputs of step {i} differ"
            );
        }
    }
    // One round trip a step, the rest included (or declined).
    assert_eq!(b.stats().device_calls - calls0, 15);
    backend::uninstall();
}

#[test]
fn kda_core_matches_its_twin_bit_for_bit() {
    let _one = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
    let Some(b) = open(None) else { return };
    backend::install(b.clone() as Arc<dyn Backend>);
    // The last two cases also run the forget gate's up-projection and
    // o_proj in the step's call.
    // The fourth case has Kimi-Linear's decay (−a·softplus, no lower
    // bound) and low-rank output gate; the last three carry the layer's
    // six input projections (with and without the forget gate's
    // up-projection and o_proj; the last with Kimi-Linear's gate).
    for (heads, kd, kernel, products, lb, projected, low_g) in [
        (4, 128, 4, false, Some(-5.0), false, false),
        (3, 48, 3, true, Some(-5.0), false, false),
        (2, 64, 2, true, Some(-5.0), false, false),
        (2, 40, 4, true, None, false, true),
        (2, 64, 4, true, Some(-5.0), true, false),
        (1, 40, 3, false, None, true, false),
        (2, 48, 4, true, None, true, true),
    ] {
        let mut rng = Lcg(heads as u64 * 1000 + kd as u64 + u64::from(low_g));
        let mut l = Layer::new(&mut rng, heads, kd, kernel);
        l.products = products;
        l.low_g = low_g;
        l.dims.gate_lower_bound = lb;
        if projected {
            let rows = l.proj_rows();
            l.proj = rows.iter().map(|&r| bf16(&mut rng, r * DM, 0.4)).collect();
        }
        let mut dev: Vec<Seq> = (0..3).map(|_| Seq::new(&mut rng, &l)).collect();
        let mut cpu: Vec<Seq> = dev
            .iter()
            .map(|s| Seq {
                s: s.s.clone(),
                conv: s.conv.clone(),
            })
            .collect();
        let case = format!(
            "heads {heads}, kd {kd}, kernel {kernel}, products {products}, bound {lb:?}, \
             projected {projected}"
        );
        for (i, lens) in [[1, 3, 2], [1, 1, 1], [2, 1, 1]].iter().enumerate() {
            let seed = rng.0;
            let got = step(&l, &mut dev, lens, &mut Lcg(seed), true);
            let want = step(&l, &mut cpu, lens, &mut Lcg(seed), false);
            rng.next();
            assert!(got == want, "{case}: outputs of step {i} differ");
            for (s, (d, c)) in dev.iter().zip(&cpu).enumerate() {
                assert!(
                    d.s.on_device(),
                    "{case}: sequence {s}'s state stays on the device"
                );
                assert!(
                    d.bits() == c.bits(),
                    "{case}: sequence {s}'s state after step {i}"
                );
            }
        }
        // An undo mark copied on the device, stepped from, and put back.
        let mut mark = StateBuf::zeros(dev[0].s.len());
        mark.copy_from(&dev[0].s).unwrap();
        assert!(mark.on_device(), "a device state's copy stays there");
        let before = dev[0].s.read().unwrap().into_owned();
        step(&l, &mut dev, &[1, 1, 1], &mut Lcg(7), true);
        step(&l, &mut cpu, &[1, 1, 1], &mut Lcg(7), false);
        dev[0].s.copy_from(&mark).unwrap();
        cpu[0].s = StateBuf::new(before);
        // One state brought back to the host, then a step from there.
        dev[1].s.host_mut().unwrap();
        assert!(!dev[1].s.on_device());
        let got = step(&l, &mut dev, &[1, 2, 1], &mut Lcg(9), true);
        let want = step(&l, &mut cpu, &[1, 2, 1], &mut Lcg(9), false);
        assert!(
            got == want,
            "{case}: outputs after the undo and the pull differ"
        );
        for (d, c) in dev.iter().zip(&cpu) {
            assert!(
                d.bits() == c.bits(),
                "{case}: states after the undo and the pull"
            );
        }
        drop(dev);
        drop(mark);
        assert_eq!(
            b.stats().vram_state_bytes,
            0,
            "{case}: dropped states leave the device"
        );
    }
    // Declined, nothing changed: sequences whose rows do not tile the
    // step's rows in order.
    let mut rng = Lcg(1);
    let l = Layer::new(&mut rng, 2, 32, 4);
    let p = l.dims.width();
    let x = rng.vec(2 * p, 1.0);
    let bb = rng.vec(2 * 2, 1.0);
    for rows in [[1..2, 0..1], [0..2, 1..2]] {
        let mut seqs: Vec<Seq> = (0..2).map(|_| Seq::new(&mut rng, &l)).collect();
        let before: Vec<Vec<u32>> = seqs.iter().map(Seq::bits).collect();
        let mut out = vec![0f32; 2 * p];
        let job_seqs = seqs
            .iter_mut()
            .zip(rows.clone())
            .map(|(Seq { s, conv }, rows)| {
                let [q, k, v] = conv;
                KdaSeq {
                    rows,
                    s,
                    conv: [q, k, v],
                }
            })
            .collect();
        let mut job = KdaJob {
            dims: &l.dims,
            w: l.params(),
            x: KdaInputs {
                pre: [&x, &x, &x],
                f: &x,
                b: &bb,
                g: &x,
            },
            proj: None,
            seqs: job_seqs,
            out: &mut out,
            f_up: None,
            g_up: None,
            o_proj: None,
            inputs_out: None,
            then: None,
        };
        assert!(!backend::kda_step(&mut job).unwrap(), "declined: {rows:?}");
        let after: Vec<Vec<u32>> = seqs.iter().map(Seq::bits).collect();
        assert!(before == after && seqs.iter().all(|s| !s.s.on_device()));
    }
    backend::uninstall();
}
