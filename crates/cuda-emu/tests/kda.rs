//! `kda.cu`'s KDA core, run on the host emulator, against its CPU twin
//! (`kda_step_cpu`) bit for bit: outputs, the journal's inputs and the
//! states left behind, over steps of three sequences with 1..3 positions,
//! head widths that are and are not a multiple of 32, inputs that drive
//! the exponentials past both ends, the decay with a lower bound (K3) and
//! with softplus (Kimi-Linear), with and without the forget gate's
//! up-projection and o_proj in the call, and with the layer's six input
//! projections in it (`KdaJob::proj`). Where the emulator was not built
//! the test prints why it skips.

use fathom_cuda_emu::{EmuBackend, available};
use fathom_kernels::backend::{Backend, MatRef};
use fathom_kernels::kda::{KdaDims, KdaInputs, KdaJob, KdaParams, KdaProj, KdaSeq, kda_step_cpu};
use fathom_kernels::state_buf::StateBuf;

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    /// Mostly moderate values, some that saturate a sigmoid or overflow an
    /// exponential, some zero.
    fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|_| match self.next() % 32 {
                0 => 0.0,
                1 => 120.0,
                2 => -120.0,
                _ => (self.next() as f32 / u32::MAX as f32 - 0.5) * 2.0 * amp,
            })
            .collect()
    }
    fn bf16(&mut self, n: usize, amp: f32) -> Vec<u16> {
        self.vec(n, amp)
            .iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect()
    }
}

/// Low-rank width of the forget gate and the model width.
const R: usize = 16;
const D: usize = 40;

struct Layer {
    dims: KdaDims,
    conv: [Vec<f32>; 3],
    a: Vec<f32>,
    dt: Vec<f32>,
    o_norm: Vec<f32>,
    f_up: Vec<u16>,
    o_proj: Vec<u16>,
    products: bool,
    /// The six input projections `[rows, DM]` (q, k, v, f_a, b, g) when the
    /// step carries them (`KdaJob::proj`); empty otherwise.
    proj: Vec<Vec<u16>>,
}

/// The projections' input width.
const DM: usize = 24;

impl Layer {
    /// The step carries its six projections of `x [N, DM]`.
    fn projected(mut self, g: &mut Lcg) -> Self {
        let (p, h) = (self.dims.width(), self.dims.heads);
        let r = if self.products { R } else { p };
        self.proj = [p, p, p, r, h, p]
            .iter()
            .map(|&rows| g.bf16(rows * DM, 0.4))
            .collect();
        self
    }
    fn proj_rows(&self) -> [usize; 6] {
        let (p, h) = (self.dims.width(), self.dims.heads);
        [p, p, p, if self.products { R } else { p }, h, p]
    }
}

impl Layer {
    fn new(
        g: &mut Lcg,
        heads: usize,
        kd: usize,
        kernel: usize,
        products: bool,
        lb: Option<f32>,
    ) -> Self {
        let p = heads * kd;
        Layer {
            dims: KdaDims {
                heads,
                head_dim: kd,
                conv_kernel: kernel,
                gate_lower_bound: lb,
                norm_eps: 1e-5,
            },
            conv: std::array::from_fn(|_| g.vec(p * kernel, 0.8)),
            a: g.vec(p, 1.0).iter().map(|v| v.abs() + 0.01).collect(),
            dt: g.vec(p, 1.0),
            o_norm: g.vec(kd, 1.5),
            f_up: g.bf16(p * R, 0.5),
            o_proj: g.bf16(D * p, 0.1),
            products,
            proj: Vec::new(),
        }
    }
}

/// One step of `states` (per sequence: S, then the q, k, v windows) with
/// `lens[i]` positions each, on `b` or (none) the twin; the bits of the
/// outputs and of the journal's inputs.
fn step(
    l: &Layer,
    states: &mut [[StateBuf; 4]],
    lens: &[usize],
    g: &mut Lcg,
    b: Option<&EmuBackend>,
) -> Vec<u32> {
    let (p, h) = (l.dims.width(), l.dims.heads);
    let n: usize = lens.iter().sum();
    let pre: [Vec<f32>; 3] = std::array::from_fn(|_| g.vec(n * p, 2.0));
    let r = if l.products { R } else { p };
    let (f, bb, gg) = (g.vec(n * r, 3.0), g.vec(n * h, 3.0), g.vec(n * p, 3.0));
    let mut out = vec![0f32; n * if l.products { D } else { p }];
    let mut inputs = vec![0f32; KdaJob::inputs_len(&l.dims, n)];
    let mut at = 0;
    let seqs = states
        .iter_mut()
        .zip(lens)
        .map(|([s, q, k, v], &len)| {
            at += len;
            KdaSeq {
                rows: at - len..at,
                s,
                conv: [q, k, v],
            }
        })
        .collect();
    let bf16 = |w, rows, cols| l.products.then_some(MatRef::Bf16 { w, rows, cols });
    let xs = g.vec(n * DM, 1.0);
    let proj = (!l.proj.is_empty()).then(|| KdaProj {
        x: &xs,
        mats: std::array::from_fn(|i| MatRef::Bf16 {
            w: &l.proj[i],
            rows: l.proj_rows()[i],
            cols: DM,
        }),
    });
    let none: &[f32] = &[];
    let inputs_x = match proj {
        Some(_) => KdaInputs {
            pre: [none; 3],
            f: none,
            b: none,
            g: none,
        },
        None => KdaInputs {
            pre: [&pre[0], &pre[1], &pre[2]],
            f: &f,
            b: &bb,
            g: &gg,
        },
    };
    let mut job = KdaJob {
        dims: &l.dims,
        w: KdaParams {
            conv: [&l.conv[0], &l.conv[1], &l.conv[2]],
            a: &l.a,
            dt_bias: &l.dt,
            o_norm: &l.o_norm,
        },
        x: inputs_x,
        proj,
        seqs,
        out: &mut out,
        f_up: bf16(&l.f_up[..], p, R),
        g_up: None,
        o_proj: bf16(&l.o_proj[..], D, p),
        inputs_out: Some(&mut inputs),
        then: None,
    };
    match b {
        Some(b) => assert!(b.kda_step(&mut job).unwrap(), "the emulator took the step"),
        None => kda_step_cpu(&mut job).unwrap(),
    }
    out.iter().chain(&inputs).map(|x| x.to_bits()).collect()
}

fn bits(states: &[[StateBuf; 4]]) -> Vec<u32> {
    states
        .iter()
        .flatten()
        .flat_map(|s| {
            s.read()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn kda_core_matches_its_twin_bit_for_bit() {
    if !available() {
        eprintln!("skipped: {}", fathom_cuda_emu::ABSENT);
        return;
    }
    let b = EmuBackend::new();
    // The decay as K3's (a lower bound: lb·σ) and as Kimi-Linear's (−a·softplus).
    // The last two also carry their six input projections in the call.
    for (heads, kd, kernel, products, lb, projected) in [
        (2, 64, 4, false, Some(-5.0), false),
        (3, 48, 3, true, Some(-5.0), false),
        (2, 32, 2, true, None, false),
        (1, 40, 4, false, None, false),
        (2, 32, 4, true, Some(-5.0), true),
        (1, 40, 3, false, None, true),
    ] {
        let mut g = Lcg(heads as u64 * 1000 + kd as u64);
        let mut l = Layer::new(&mut g, heads, kd, kernel, products, lb);
        if projected {
            l = l.projected(&mut g);
        }
        let (p, kk) = (l.dims.width(), kernel - 1);
        let mut emu: Vec<[StateBuf; 4]> = (0..3)
            .map(|_| {
                let s = StateBuf::new(g.vec(heads * kd * kd, 0.05));
                [
                    s,
                    StateBuf::new(g.vec(kk * p, 1.0)),
                    StateBuf::new(g.vec(kk * p, 1.0)),
                    StateBuf::new(g.vec(kk * p, 1.0)),
                ]
            })
            .collect();
        let mut cpu = emu.clone();
        let case = format!(
            "heads {heads}, kd {kd}, kernel {kernel}, products {products}, bound {lb:?}, \
             projected {projected}"
        );
        for (i, lens) in [[1, 3, 2], [1, 1, 1], [2, 1, 1]].iter().enumerate() {
            let seed = g.0;
            let got = step(&l, &mut emu, lens, &mut Lcg(seed), Some(&b));
            let want = step(&l, &mut cpu, lens, &mut Lcg(seed), None);
            g.next();
            assert!(got == want, "{case}: outputs of step {i} differ");
            assert!(
                bits(&emu) == bits(&cpu),
                "{case}: states after step {i} differ"
            );
        }
    }
    // Sequences whose rows do not tile the step's rows in order are declined.
    let mut g = Lcg(5);
    let l = Layer::new(&mut g, 1, 32, 2, false, None);
    let mut s: Vec<[StateBuf; 4]> = (0..2)
        .map(|_| std::array::from_fn(|i| StateBuf::zeros(if i == 0 { 1024 } else { 32 })))
        .collect();
    let (pre, bb) = (g.vec(64, 1.0), g.vec(2, 1.0));
    let mut out = vec![0f32; 64];
    let seqs = s
        .iter_mut()
        .zip([1..2, 0..1])
        .map(|([a, q, k, v], rows)| KdaSeq {
            rows,
            s: a,
            conv: [q, k, v],
        })
        .collect();
    let mut job = KdaJob {
        dims: &l.dims,
        w: KdaParams {
            conv: [&l.conv[0], &l.conv[1], &l.conv[2]],
            a: &l.a,
            dt_bias: &l.dt,
            o_norm: &l.o_norm,
        },
        x: KdaInputs {
            pre: [&pre, &pre, &pre],
            f: &pre,
            b: &bb,
            g: &pre,
        },
        proj: None,
        seqs,
        out: &mut out,
        f_up: None,
        g_up: None,
        o_proj: None,
        inputs_out: None,
        then: None,
    };
    assert!(
        !b.kda_step(&mut job).unwrap(),
        "rows out of order are declined"
    );
}
