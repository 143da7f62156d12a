//! [`EmuBackend`]: the emulated kernels behind the backend seam, taking
//! what the CUDA backend takes (products of every format, batches, gated
//! MLPs, KDA steps, MLA attention, MoE tails) and computing it the way the CUDA backend's launches
//! do, with host memory standing in for VRAM.

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use fathom_kernels::backend::{
    BackendStats, DeviceBackend, GluProduct, Hints, MatRef, MlaWork, MoeTail, Product, Role,
};
use fathom_kernels::kda::{KDA_L2_EPS, KdaJob};
use fathom_kernels::ops::GluAct;

use crate::{
    KdaLaunch, MlaLaunch, glu_act, kda_launch, matmul, matmul_many, mla_launch, takes, takes_many,
};

/// The CUDA kernels on the host; counts what it computed in
/// [`BackendStats`] (`device_products`, `device_calls`).
#[derive(Default)]
pub struct EmuBackend {
    stats: Mutex<BackendStats>,
    glu_calls: AtomicU64,
    kda_steps: AtomicU64,
}

impl EmuBackend {
    pub fn new() -> Self {
        Self::default()
    }

    /// Gated-MLP calls taken ([`Backend::glu_batch`], [`Backend::glu_mixed`])
    /// and KDA steps taken.
    pub fn glu_and_kda_calls(&self) -> (u64, u64) {
        (
            self.glu_calls.load(Ordering::Relaxed),
            self.kda_steps.load(Ordering::Relaxed),
        )
    }

    fn count(&self, products: usize) {
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.device_products += products as u64;
        s.device_calls += 1;
    }

    /// The products of a batch in launches as the CUDA backend groups them:
    /// bf16 and MXFP4 products of one shape and position count together,
    /// the rest one launch each.
    fn run_batch(ps: &mut [Product<'_, '_>]) {
        let mut done = vec![false; ps.len()];
        for i in 0..ps.len() {
            if done[i] {
                continue;
            }
            let same: Vec<usize> = (i..ps.len())
                .filter(|&j| {
                    !done[j] && ps[j].t == ps[i].t && takes_many(&[ps[i].w, ps[j].w], ps[i].t)
                })
                .collect();
            if same.len() > 1 {
                let ws: Vec<MatRef<'_>> = same.iter().map(|&j| ps[j].w).collect();
                let xs: Vec<&[f32]> = same.iter().map(|&j| ps[j].x).collect();
                let mut outs: Vec<Vec<f32>> =
                    same.iter().map(|&j| vec![0f32; ps[j].y.len()]).collect();
                let mut ys: Vec<&mut [f32]> = outs.iter_mut().map(|v| &mut v[..]).collect();
                matmul_many(&ws, &xs, ps[i].t, &mut ys);
                for (&j, o) in same.iter().zip(&outs) {
                    ps[j].y.copy_from_slice(o);
                    done[j] = true;
                }
            } else {
                matmul(&ps[i].w, ps[i].x, ps[i].t, 1, ps[i].y);
                done[i] = true;
            }
        }
    }
}

impl EmuBackend {
    /// The CUDA backend's phases: gates, ups and `plain` in one batch, the
    /// activation over all gates, the downs in a second batch.
    fn run_glu(plain: &mut [Product<'_, '_>], jobs: &mut [GluProduct<'_, '_>], act: GluAct) {
        let mut g: Vec<Vec<f32>> = jobs
            .iter()
            .map(|j| vec![0f32; j.t * j.gate.rows()])
            .collect();
        let mut u = g.clone();
        let mut ps: Vec<Product<'_, '_>> = Vec::with_capacity(2 * jobs.len() + plain.len());
        for ((j, g), u) in jobs.iter().zip(&mut g).zip(&mut u) {
            for (w, y) in [(j.gate, g), (j.up, u)] {
                ps.push(Product {
                    w,
                    role: j.role,
                    x: j.x,
                    t: j.t,
                    y,
                });
            }
        }
        ps.extend(plain.iter_mut().map(|p| Product {
            w: p.w,
            role: p.role,
            x: p.x,
            t: p.t,
            y: &mut *p.y,
        }));
        Self::run_batch(&mut ps);
        drop(ps);
        let (mut ga, ua): (Vec<f32>, Vec<f32>) = (g.concat(), u.concat());
        glu_act(act, &mut ga, &ua);
        let mut off = 0;
        let mut downs: Vec<Product<'_, '_>> = Vec::with_capacity(jobs.len());
        for j in jobs.iter_mut() {
            let len = j.t * j.gate.rows();
            downs.push(Product {
                w: j.down,
                role: j.role,
                x: &ga[off..off + len],
                t: j.t,
                y: &mut *j.y,
            });
            off += len;
        }
        Self::run_batch(&mut downs);
    }
}

impl EmuBackend {
    /// The rest of [`Backend::moe_tail`] after the experts (`outs`, their
    /// outputs one after another): `moe_combine`, then the projection.
    fn combine_and_project(&self, tail: &mut MoeTail<'_, '_>, outs: &[f32]) {
        let (rows, width) = (tail.rows(), tail.width());
        let mut starts = Vec::with_capacity(tail.experts.len());
        let mut at = 0usize;
        for e in tail.experts {
            starts.push(at);
            at += e.t * width;
        }
        let off: Vec<u32> = tail
            .picks
            .iter()
            .map(|&(e, r)| (starts[e as usize] + r as usize * width) as u32)
            .collect();
        let mut sums = vec![0f32; rows * width];
        let picks = (&off[..], tail.weights, tail.k);
        crate::moe_combine(outs, picks, tail.norm, width, &mut sums);
        match tail.up {
            Some(up) => Self::run_batch(&mut [Product {
                w: up,
                role: Role::Spine,
                x: &sums,
                t: rows,
                y: &mut *tail.y,
            }]),
            None => tail.y.copy_from_slice(&sums),
        }
        self.count(3 * tail.experts.len() + usize::from(tail.up.is_some()));
        self.stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .device_moe_tails += 1;
    }
}

/// A KDA step's inputs (pre q, k, v, f, b, g): the job's own, or its
/// projections' products first when it carries them (one batch, as the
/// CUDA backend launches them in the step's call).
fn inputs(job: &KdaJob<'_>, n: usize) -> [Vec<f32>; 6] {
    let Some(pj) = job.proj else {
        let x = &job.x;
        return [x.pre[0], x.pre[1], x.pre[2], x.f, x.b, x.g].map(<[f32]>::to_vec);
    };
    let mut outs = pj.mats.map(|m| vec![0f32; n * m.rows()]);
    let mut ps: Vec<Product<'_, '_>> = pj
        .mats
        .iter()
        .zip(outs.iter_mut())
        .map(|(&w, y)| Product {
            w,
            role: Role::Spine,
            x: pj.x,
            t: n,
            y,
        })
        .collect();
    EmuBackend::run_batch(&mut ps);
    drop(ps);
    outs
}

/// `work` in the CUDA backend's launches: the latent queries `[H, T,
/// lora]` by `uk_t`'s grouped product, the attention over every
/// sequence's cache in one launch pair (strided to read and write `[H, T,
/// lora]`), the values by `uv`'s grouped product.
fn mla_work(work: &mut MlaWork<'_>) {
    let sh = work.shape;
    let (h, lora, t) = (sh.heads, sh.lora, work.ns.len());
    let mut q_lat = vec![0f32; h * t * lora];
    matmul(&work.uk_t, work.q_nope, t, h, &mut q_lat);
    let mut table = Vec::new();
    let mut boff = vec![0i32; t];
    for s in work.seqs {
        boff[s.queries.clone()].fill(table.len() as i32);
        table.extend(s.blocks.iter().map(|b| b.as_ptr() as u64));
    }
    let ns: Vec<i32> = work.ns.iter().map(|&n| n as i32).collect();
    let mut ctx = vec![0f32; h * t * lora];
    let (qs, hs) = (lora as i64, (t * lora) as i64);
    mla_launch(MlaLaunch {
        shape: sh,
        table: &table,
        boff: &boff,
        q_lat: &q_lat,
        q_qs: qs,
        q_hs: hs,
        q_rope: work.q_rope,
        ns: &ns,
        out: &mut ctx,
        o_qs: qs,
        o_hs: hs,
    });
    matmul(&work.uv, &ctx, t, h, work.out);
}

/// Whether the emulator takes every gated MLP (shapes and lengths).
fn glu_takes(jobs: &[GluProduct<'_, '_>]) -> bool {
    jobs.iter().all(|j| {
        let (f, cols) = (j.gate.rows(), j.gate.cols());
        j.up.rows() == f
            && j.up.cols() == cols
            && j.down.cols() == f
            && j.x.len() == j.t * cols
            && j.y.len() == j.t * j.down.rows()
            && [j.gate, j.up, j.down].iter().all(|w| takes(w, j.t, 1))
    })
}

/// Whether the emulator takes every product (and each output has its length).
fn takes_all(ps: &[Product<'_, '_>]) -> bool {
    ps.iter().all(|p| {
        takes(&p.w, p.t, 1) && p.x.len() == p.t * p.w.cols() && p.y.len() == p.t * p.w.rows()
    })
}

/// Whether `job` is what `kda.cu` takes (as the CUDA backend checks it)
/// and the emulator takes each of its products.
fn kda_takes(job: &KdaJob<'_>) -> bool {
    let n = job.seqs.last().map_or(0, |s| s.rows.end);
    let projs = job.proj.as_ref().map_or(&[][..], |pj| &pj.mats[..]);
    crate::available()
        && job.fits_device_kernel()
        && job
            .f_up
            .iter()
            .chain(&job.g_up)
            .chain(&job.o_proj)
            .chain(projs)
            .all(|m| takes(m, n, 1))
}

impl DeviceBackend for EmuBackend {
    fn name(&self) -> String {
        "cuda-emu (the CUDA kernels on the host)".into()
    }

    fn matmul(&self, w: &MatRef<'_>, _role: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool {
        if !takes(w, t, 1) || x.len() != t * w.cols() || y.len() != t * w.rows() {
            return false;
        }
        matmul(w, x, t, 1, y);
        self.count(1);
        true
    }

    fn matmul_groups(
        &self,
        w: &MatRef<'_>,
        _role: Role,
        groups: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
    ) -> bool {
        if !takes(w, t, groups) || x.len() != groups * t * w.cols() || y.len() != t * w.rows() {
            return false;
        }
        matmul(w, x, t, groups, y);
        self.count(groups);
        true
    }

    fn matmul_batch(&self, ps: &mut [Product<'_, '_>], _hints: &Hints<'_, '_>) -> bool {
        if !takes_all(ps) {
            return false;
        }
        Self::run_batch(ps);
        self.count(ps.len());
        true
    }

    fn glu_mixed(
        &self,
        plain: &mut [Product<'_, '_>],
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        _h: &Hints<'_, '_>,
    ) -> bool {
        if !takes_all(plain) || !glu_takes(jobs) {
            return false;
        }
        Self::run_glu(plain, jobs, act);
        self.count(plain.len() + 3 * jobs.len());
        self.glu_calls.fetch_add(1, Ordering::Relaxed);
        true
    }

    fn glu_batch(&self, jobs: &mut [GluProduct<'_, '_>], act: GluAct, _h: &Hints<'_, '_>) -> bool {
        if !glu_takes(jobs) {
            return false;
        }
        Self::run_glu(&mut [], jobs, act);
        self.count(3 * jobs.len());
        self.glu_calls.fetch_add(1, Ordering::Relaxed);
        true
    }

    fn mla_attend(&self, work: &mut MlaWork<'_>) -> bool {
        let (h, t) = (work.shape.heads, work.ns.len());
        // The layer's projections come along only to the CUDA backend.
        if !crate::available()
            || work.proj.is_some()
            || !work.fits_device_kernel()
            || !takes(&work.uk_t, t, h)
            || !takes(&work.uv, t, h)
            || work.o.is_some_and(|o| !takes(&o.o_proj, t, 1))
        {
            return false;
        }
        match work.o {
            None => mla_work(work),
            Some(o) => {
                // The values, then `mla_gate` and `o_proj`'s product, on
                // the kernels as the CUDA backend launches them.
                let dv = work.uv.rows() / h;
                let mut vals = vec![0f32; h * t * dv];
                mla_work(&mut MlaWork {
                    o: None,
                    out: &mut vals,
                    then: None,
                    proj: None,
                    ..*work
                });
                let mut cat = vec![0f32; h * t * dv];
                crate::mla::mla_gate(&vals, o.gate, (h, t, dv), &mut cat);
                matmul(&o.o_proj, &cat, t, 1, work.out);
            }
        }
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.device_products += 2 + u64::from(work.o.is_some());
        s.device_calls += 1;
        s.device_attention += 1;
        true
    }

    fn moe_tail(&self, tail: &mut MoeTail<'_, '_>, _h: &Hints<'_, '_>) -> bool {
        let rows = tail.rows();
        if !crate::available()
            || !tail.is_consistent()
            || rows == 0
            || tail.up.is_some_and(|u| !takes(&u, rows, 1))
            || tail
                .experts
                .iter()
                .map(|e| e.t * tail.width())
                .sum::<usize>()
                >= 0x7F80_0000
        {
            return false;
        }
        let width = tail.width();
        let mut outs: Vec<Vec<f32>> = tail
            .experts
            .iter()
            .map(|e| vec![0f32; e.t * width])
            .collect();
        let mut jobs: Vec<GluProduct<'_, '_>> = tail
            .experts
            .iter()
            .zip(outs.iter_mut())
            .map(|(e, y)| GluProduct {
                gate: e.gate,
                up: e.up,
                down: e.down,
                role: Role::Expert,
                x: e.x,
                t: e.t,
                y,
            })
            .collect();
        if !glu_takes(&jobs) {
            return false;
        }
        Self::run_glu(&mut [], &mut jobs, tail.act);
        drop(jobs);
        self.combine_and_project(tail, &outs.concat());
        true
    }

    fn kda_step(&self, job: &mut KdaJob<'_>) -> Result<bool, String> {
        if !kda_takes(job) {
            return Ok(false);
        }
        let d = job.dims;
        let (h, kd, p) = (d.heads, d.head_dim, d.width());
        let n = job.seqs.last().map_or(0, |s| s.rows.end);
        let x = inputs(job, n);
        let [pq, pk, pv, xf, xb, xg] = &x;
        let up = |m: Option<MatRef<'_>>, low: &[f32]| {
            m.map(|m| {
                let mut y = vec![0f32; n * p];
                matmul(&m, low, n, 1, &mut y);
                y
            })
        };
        let (f_full, g_full) = (up(job.f_up, xf), up(job.g_up, xg));
        let f = f_full.as_deref().unwrap_or(&xf[..]);
        let g = g_full.as_deref().unwrap_or(&xg[..]);
        let mut core = vec![0f32; if job.o_proj.is_some() { n * p } else { 0 }];
        let out = if job.o_proj.is_some() {
            core.as_mut_ptr()
        } else {
            job.out.as_mut_ptr()
        };
        let hin = job
            .inputs_out
            .as_deref_mut()
            .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
        let (bounded, lb) = d.gate_lower_bound.map_or((0, 0.0), |lb| (1, lb));
        for seq in job.seqs.iter_mut() {
            let [cq, ck, cv] = &mut seq.conv;
            let err = |e: fathom_kernels::state_buf::StateError| e.0;
            let k = KdaLaunch {
                state: seq.s.host_mut().map_err(err)?.as_mut_slice(),
                wins: [
                    cq.host_mut().map_err(err)?.as_mut_slice(),
                    ck.host_mut().map_err(err)?.as_mut_slice(),
                    cv.host_mut().map_err(err)?.as_mut_slice(),
                ],
                pre: [pq, pk, pv],
                f,
                b: xb,
                g,
                taps: job.w.conv,
                a: job.w.a,
                dt: job.w.dt_bias,
                onorm: job.w.o_norm,
                out,
                hin,
                ints: [
                    seq.rows.start as i32,
                    seq.rows.len() as i32,
                    h as i32,
                    kd as i32,
                    d.conv_kernel as i32,
                    n as i32,
                    bounded,
                ],
                floats: [d.q_scale(), KDA_L2_EPS, d.norm_eps, lb],
            };
            // SAFETY: `kda_takes` checked every length for these sizes; `out`
            // is `core` ([N, P]) or the job's output ([N, P] without o_proj),
            // `hin` null or the job's inputs_out of inputs_len(n) values.
            unsafe { kda_launch(k) };
        }
        if let Some(m) = job.o_proj {
            matmul(&m, &core, n, 1, job.out);
        }
        let products = 1
            + usize::from(job.f_up.is_some())
            + usize::from(job.g_up.is_some())
            + usize::from(job.o_proj.is_some())
            + if job.proj.is_some() { 6 } else { 0 };
        self.count(products);
        self.kda_steps.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    fn forget(&self, _range: Range<usize>) {}

    fn stats(&self) -> BackendStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}
