//! Gated experts without biases, `down(act(gate z, up z))`: one at a time
//! ([`GluExpert::forward`]) or a layer's experts together through the
//! backend seam ([`GluExpert::grouped`]), where the experts whose weights
//! the device lacks may run on the CPU while the device copies and
//! computes the others. Every product is the same on either side (the
//! device kernels reproduce the CPU kernels' order), so where an expert
//! runs never shows in the bits.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use fathom_kernels::backend::{self, GluProduct, Hints, MatRef, MoeTail, Role, TailExpert};
use fathom_kernels::ops::GluAct;
use rayon::prelude::*;

use crate::experts::ExpertWeights;

/// A gated expert without biases: its matrices' indices in the expert
/// table, its hidden width and its activation.
pub struct GluExpert {
    pub gate: usize,
    pub up: usize,
    pub down: usize,
    pub inter: usize,
    pub act: GluAct,
}

/// What follows a layer's experts, for [`GluExpert::grouped`] to hand a
/// device in the same call ([`MoeTail`]): each output row's `k` picks
/// (expert index, row of its output) with their combine weights, summed in
/// rank order, then the norm and the projection, if any.
pub struct TailAsk<'a> {
    pub k: usize,
    pub picks: Vec<(u32, u32)>,
    pub weights: Vec<f32>,
    pub norm: Option<(&'a [f32], f32)>,
    pub up: Option<MatRef<'a>>,
}

/// What [`GluExpert::grouped`] computed: every expert's output, or (a
/// device took the [`TailAsk`] too) the tail's output.
pub enum Grouped {
    Each(Vec<Vec<f32>>),
    Tail(Vec<f32>),
}

/// One expert's three matrices as stable views.
#[derive(Clone, Copy)]
struct Mats<'w> {
    gate: MatRef<'w>,
    up: MatRef<'w>,
    down: MatRef<'w>,
}

impl<'w> Mats<'w> {
    fn all(&self) -> [MatRef<'w>; 3] {
        [self.gate, self.up, self.down]
    }

    /// Weight bytes of the three matrices.
    fn bytes(&self) -> f64 {
        let len = |w: &MatRef<'_>| -> usize { backend::segments(w).iter().map(|s| s.len()).sum() };
        self.all().iter().map(len).sum::<usize>() as f64
    }
}

/// A layer's experts as [`GluExpert::grouped`] runs them: their matrices,
/// their inputs (`[n_i, in]`), row counts and output width.
#[derive(Clone, Copy)]
struct Layer<'a, 'w> {
    mats: &'a [Mats<'w>],
    inputs: &'a [Vec<f32>],
    ns: &'a [usize],
    out_w: usize,
}

/// Weight bytes per second at which the CPU last computed cold experts
/// (an `f64`'s bits; 0 before any).
static CPU_BYTES_PER_S: AtomicU64 = AtomicU64::new(0);

/// Experts with more rows than this always run on the device: with several
/// rows its compute beats the CPU's whatever the copy costs.
const CPU_MAX_ROWS: usize = 4;

/// Layers with cold experts but none sent to the CPU, counted to send it
/// one every [`PROBE_EVERY`]th time.
static PROBES: AtomicU64 = AtomicU64::new(0);
const PROBE_EVERY: u64 = 64;

impl GluExpert {
    /// One expert on `z [n, in]` → `[n, out_w]`.
    pub fn forward(&self, e: &ExpertWeights, z: &[f32], n: usize, out_w: usize) -> Vec<f32> {
        let index = [self.gate, self.up, self.down];
        self.apply(z, n, out_w, |m, x, y| e.matmul(index[m], x, n, y))
    }

    /// `down(act(gate z, up z))` on `z [n, in]` → `[n, out_w]`, with
    /// `mm(m, x, y)` computing matrix `m` (0 gate, 1 up, 2 down) of `x`.
    fn apply(
        &self,
        z: &[f32],
        n: usize,
        out_w: usize,
        mm: impl Fn(usize, &[f32], &mut [f32]),
    ) -> Vec<f32> {
        let mut g = vec![0f32; n * self.inter];
        let mut u = vec![0f32; n * self.inter];
        mm(0, z, &mut g);
        mm(1, z, &mut u);
        self.act.apply(&mut g, &u);
        let mut y = vec![0f32; n * out_w];
        mm(2, &g, &mut y);
        y
    }

    /// Every expert on its own rows (`inputs[i]`, `[n_i, in]`), each output
    /// the one [`GluExpert::forward`] computes. The experts whose weights
    /// the device lacks are split by the measured rates (see
    /// [`split_cold`]): some run on the CPU kernels while the rest go
    /// through the backend seam as one gated batch (on a device that takes
    /// it, one call; else the gate and up products of all, then the downs
    /// of all, the downs copied ahead of the first), and as guesses the
    /// gate and up matrices of `next` (the next layer's guessed experts, surest
    /// first). With `tail` and no expert for the CPU, the device may take
    /// the experts and the tail in one call ([`Grouped::Tail`]). `None`
    /// (nothing computed) when some matrix is not a stable plain view.
    pub fn grouped(
        &self,
        experts: &[Arc<ExpertWeights>],
        inputs: &[Vec<f32>],
        out_w: usize,
        next: &[Arc<ExpertWeights>],
        tail: Option<TailAsk<'_>>,
    ) -> Option<Grouped> {
        let mats: Vec<Mats<'_>> = experts
            .iter()
            .map(|e| {
                Some(Mats {
                    gate: e.stable_mat(self.gate)?,
                    up: e.stable_mat(self.up)?,
                    down: e.stable_mat(self.down)?,
                })
            })
            .collect::<Option<_>>()?;
        let cols = mats.first().map_or(1, |m| m.gate.cols().max(1));
        let ns: Vec<usize> = inputs.iter().map(|x| x.len() / cols).collect();
        let on_cpu = split_cold(&mats, &ns);
        let (cpu, dev): (Vec<usize>, Vec<usize>) = (0..mats.len()).partition(|&i| on_cpu[i]);
        let guessed: Vec<MatRef<'_>> = next
            .iter()
            .flat_map(|e| [e.stable_mat(self.gate), e.stable_mat(self.up)])
            .flatten()
            .collect();
        // The device is told which experts the CPU computes (they count as
        // used; while it has room to spare it copies them up to hold them).
        let elsewhere: Vec<MatRef<'_>> = cpu.iter().flat_map(|&i| mats[i].all()).collect();
        let layer = Layer {
            mats: &mats,
            inputs,
            ns: &ns,
            out_w,
        };
        if let Some(t) = tail.filter(|_| cpu.is_empty())
            && let Some(y) = self.tail_on_device(&layer, &t, &guessed)
        {
            return Some(Grouped::Tail(y));
        }
        let (dev_out, cpu_out) = rayon::join(
            || self.on_device(&layer, &dev, (&elsewhere, &guessed)),
            || self.on_cpu(&layer, &cpu),
        );
        let mut out = vec![Vec::new(); mats.len()];
        for (i, y) in dev
            .into_iter()
            .zip(dev_out)
            .chain(cpu.into_iter().zip(cpu_out))
        {
            out[i] = y;
        }
        Some(Grouped::Each(out))
    }

    /// Every expert of `layer` and `tail` through the seam in one call
    /// ([`backend::moe_tail_taken`]); `None` (nothing computed) when the
    /// device declines.
    fn tail_on_device(
        &self,
        layer: &Layer<'_, '_>,
        tail: &TailAsk<'_>,
        guessed: &[MatRef<'_>],
    ) -> Option<Vec<f32>> {
        let experts: Vec<TailExpert<'_, '_>> = (layer.mats.iter().zip(layer.inputs))
            .zip(layer.ns)
            .map(|((m, x), &t)| TailExpert {
                gate: m.gate,
                up: m.up,
                down: m.down,
                x,
                t,
            })
            .collect();
        let rows = tail.picks.len() / tail.k.max(1);
        let mut y = vec![0f32; rows * tail.up.map_or(layer.out_w, |u| u.rows())];
        let mut job = MoeTail {
            experts: &experts,
            act: self.act,
            k: tail.k,
            picks: &tail.picks,
            weights: &tail.weights,
            norm: tail.norm,
            up: tail.up,
            y: &mut y,
        };
        let hints = Hints {
            guessed,
            ..Hints::default()
        };
        backend::moe_tail_taken(&mut job, &hints).then_some(y)
    }

    /// Experts `which` through the seam as one gated batch
    /// ([`backend::glu_batch_stable`]: on a device that takes it the
    /// activation stays there; else gate and up of all, the activation on
    /// the host, the downs of all), with the hints (the CPU's matrices
    /// `elsewhere`, `guessed`). With no expert on the device the hints go
    /// alone.
    fn on_device(
        &self,
        layer: &Layer<'_, '_>,
        which: &[usize],
        (elsewhere, guessed): (&[MatRef<'_>], &[MatRef<'_>]),
    ) -> Vec<Vec<f32>> {
        let Layer {
            mats,
            inputs,
            ns,
            out_w,
        } = *layer;
        let hints = Hints {
            next: &[],
            elsewhere,
            guessed,
        };
        let mut y: Vec<Vec<f32>> = which.iter().map(|&i| vec![0f32; ns[i] * out_w]).collect();
        let mut jobs: Vec<GluProduct<'_, '_>> = which
            .iter()
            .zip(y.iter_mut())
            .map(|(&i, y)| GluProduct {
                gate: mats[i].gate,
                up: mats[i].up,
                down: mats[i].down,
                role: Role::Expert,
                x: &inputs[i],
                t: ns[i],
                y,
            })
            .collect();
        backend::glu_batch_stable(&mut jobs, self.act, &hints);
        drop(jobs);
        y
    }

    /// Experts `which` on the CPU kernels (one task each, its products
    /// split further over the pool's threads when large), noting the
    /// weight bytes per second they ran at.
    fn on_cpu(&self, layer: &Layer<'_, '_>, which: &[usize]) -> Vec<Vec<f32>> {
        let Layer {
            mats,
            inputs,
            ns,
            out_w,
        } = *layer;
        if which.is_empty() {
            return Vec::new();
        }
        let start = Instant::now();
        let out = which
            .par_iter()
            .map(|&i| {
                let (all, n) = (mats[i].all(), ns[i]);
                self.apply(&inputs[i], n, out_w, |m, x, y| all[m].cpu(x, n, y))
            })
            .collect();
        let bytes: f64 = which.iter().map(|&i| mats[i].bytes()).sum();
        let rate = bytes / start.elapsed().as_secs_f64().max(1e-9);
        let old = f64::from_bits(CPU_BYTES_PER_S.load(Ordering::Relaxed));
        let new = if old > 0.0 {
            0.7 * old + 0.3 * rate
        } else {
            rate
        };
        CPU_BYTES_PER_S.store(new.to_bits(), Ordering::Relaxed);
        out
    }
}

/// Which experts run on the CPU: of those with at most [`CPU_MAX_ROWS`]
/// rows whose weights the device lacks in part, each in turn goes where it
/// would finish first — on the CPU (all its bytes at the CPU's last
/// measured rate; the host→device rate before any) or on the device (its
/// missing bytes at the measured host→device rate). Every
/// [`PROBE_EVERY`]th layer with cold experts of which none went to the
/// CPU sends it the smallest, so a rate once measured badly is measured
/// again. No expert goes to the CPU when the device reports no
/// host→device rate. Only speed depends on this choice.
fn split_cold(mats: &[Mats<'_>], ns: &[usize]) -> Vec<bool> {
    let mut on_cpu = vec![false; mats.len()];
    let h2d = backend::snapshot().h2d_bytes_per_s;
    if h2d <= 0.0 {
        return on_cpu;
    }
    let cpu = match f64::from_bits(CPU_BYTES_PER_S.load(Ordering::Relaxed)) {
        r if r > 0.0 => r,
        _ => h2d,
    };
    let all: Vec<MatRef<'_>> = mats.iter().flat_map(Mats::all).collect();
    let missing = backend::missing_bytes(&all);
    if missing.len() != all.len() {
        return on_cpu;
    }
    let (mut t_dev, mut t_cpu) = (0.0, 0.0);
    let mut smallest: Option<(f64, usize)> = None;
    for (i, m) in mats.iter().enumerate() {
        let lack = missing[3 * i..3 * i + 3].iter().sum::<usize>() as f64;
        if ns[i] > CPU_MAX_ROWS || lack == 0.0 {
            continue;
        }
        let bytes = m.bytes();
        smallest = smallest.filter(|s| s.0 <= bytes).or(Some((bytes, i)));
        let (c, d) = (bytes / cpu, lack / h2d);
        if t_cpu + c < t_dev + d {
            t_cpu += c;
            on_cpu[i] = true;
        } else {
            t_dev += d;
        }
    }
    if let Some((_, i)) = smallest.filter(|_| t_cpu == 0.0)
        && PROBES.fetch_add(1, Ordering::Relaxed) % PROBE_EVERY == PROBE_EVERY - 1
    {
        on_cpu[i] = true;
    }
    on_cpu
}
