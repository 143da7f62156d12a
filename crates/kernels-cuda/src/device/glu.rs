//! Gated MLPs in one round trip: the gate and up products of every job,
//! the activation (`glu.cu`) on the device, then the downs; only the
//! inputs go up and the downs' results come back.

use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use fathom_kernels::backend::{GluProduct, Hints, MatRef, Role};
use fathom_kernels::ops::GluAct;

use super::CudaBackend;
use super::queue::{Placed, grow, scatter};
use crate::CudaError;

/// Whether `j`'s shapes are what the kernels take: gate and up of one
/// shape, down reading their rows, buffers of their lengths, `i32` sizes.
fn takes(j: &GluProduct<'_, '_>) -> bool {
    let (f, cols, out) = (j.gate.rows(), j.gate.cols(), j.down.rows());
    let small = |n: usize| i32::try_from(n).is_ok();
    (j.up.rows(), j.up.cols()) == (f, cols)
        && j.down.cols() == f
        && f > 0
        && out > 0
        && j.t > 0
        && small(f)
        && small(cols)
        && small(out)
        && small(j.t)
        && j.x.len() == j.t * cols
        && j.y.len() == j.t * out
}

impl CudaBackend {
    /// Runs `jobs` in one round trip (see the module). `Ok(false)` when
    /// declined: a shape out of range, or the weights do not all fit in
    /// the budget at once.
    pub(super) fn run_glu(
        &self,
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        hints: &Hints<'_, '_>,
    ) -> Result<bool, CudaError> {
        if jobs.is_empty() || !jobs.iter().all(takes) {
            return Ok(false);
        }
        let n = jobs.len();
        // Products in order: gate and up of each job, then each job's down.
        let mut ws: Vec<(MatRef<'_>, Role)> = Vec::with_capacity(3 * n);
        ws.extend(jobs.iter().flat_map(|j| [(j.gate, j.role), (j.up, j.role)]));
        ws.extend(jobs.iter().map(|j| (j.down, j.role)));
        let mut st = self.lock_timed();
        let st = &mut *st;
        let Some(p) = self.prepare(st, &ws, hints) else {
            return Ok(false);
        };
        let queued = (|| {
            self.upload_missing(st, &p.segs, p.class)?;
            let xs: Vec<&[f32]> = jobs.iter().map(|j| j.x).collect();
            let ny = jobs.iter().map(|j| j.y.len()).sum();
            let (xp, yp) = self.stage(st, &xs, ny)?;
            // The gates' outputs, then the ups' at the same offsets.
            let half: usize = jobs.iter().map(|j| j.t * j.gate.rows()).sum();
            let gp = grow(&self.stream, &mut st.glu, 2 * half)?
                .device_ptr(&self.stream)
                .0;
            let up = gp + 4 * half as u64;
            let placed = place(jobs, (xp, yp, gp, up));
            self.launch_phases(st, &placed, &p.segs, &[2 * n, 3 * n], |_| {
                self.launch_act(act, gp, up, half)
            })?;
            self.fetch(st, yp, ny)
        })();
        let hy = self.complete(st, queued, &p, hints)?;
        scatter(hy, jobs.iter_mut().map(|j| &mut *j.y));
        Ok(true)
    }

    /// Queues `g[i] = act(g[i], u[i])` for `i < n` at the device addresses `g`, `u`.
    fn launch_act(&self, act: GluAct, g: u64, u: u64, n: usize) -> Result<(), CudaError> {
        let (kind, beta, beta_lin) = match act {
            GluAct::Swiglu => (0i32, 1f32, 1f32),
            GluAct::Situ {
                beta,
                beta_lin: Some(bl),
            } => (1, beta, bl),
            GluAct::Situ {
                beta,
                beta_lin: None,
            } => (2, beta, 1.0),
        };
        let n64 = n as i64;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&self.funcs.glu_act);
        b.arg(&g)
            .arg(&u)
            .arg(&n64)
            .arg(&kind)
            .arg(&beta)
            .arg(&beta_lin);
        // SAFETY: `g` and `u` each hold n values on the device (the gates'
        // and ups' outputs); the arguments match `glu_act` in `glu.cu`.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// The products of `jobs` at their device addresses: inputs from `xp`
/// (one after another), gates' outputs from `gp` and ups' from `up` (the
/// same offsets), the downs reading the activations at `gp` and writing
/// from `yp`.
fn place<'w>(
    jobs: &[GluProduct<'w, '_>],
    (xp, yp, gp, up): (u64, u64, u64, u64),
) -> Vec<Placed<'w>> {
    let mut first = Vec::with_capacity(2 * jobs.len());
    let mut downs = Vec::with_capacity(jobs.len());
    let (mut ox, mut oh, mut oy) = (xp, 0u64, yp);
    for j in jobs {
        let t = j.t;
        let one = |w, x, y| Placed {
            w,
            groups: 1,
            t,
            x,
            y,
        };
        first.push(one(j.gate, ox, gp + oh));
        first.push(one(j.up, ox, up + oh));
        downs.push(one(j.down, gp + oh, oy));
        ox += 4 * j.x.len() as u64;
        oh += 4 * (t * j.gate.rows()) as u64;
        oy += 4 * j.y.len() as u64;
    }
    first.extend(downs);
    first
}
