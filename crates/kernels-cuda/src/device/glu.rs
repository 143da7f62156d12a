//! Gated MLPs in one round trip: the gate and up products of every job
//! (and any plain products beside them), the activation (`glu.cu`) on the
//! device, then the downs; only the inputs go up and the downs' (and plain
//! products') results come back.

use cudarc::driver::{DevicePtr, LaunchConfig};
use fathom_kernels::backend::{GluProduct, Hints, MatRef, Product, Role};
use fathom_kernels::ops::GluAct;

use super::queue::{Placed, Prepared, fits, grow, results, scatter};
use super::tape::{Arg, Tape};
use super::{CudaBackend, State};
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
    /// Runs `jobs`, and the plain products `plain` beside their gates and
    /// ups, in one round trip (see the module). `Ok(false)` when declined:
    /// a shape out of range, or the weights do not all fit in the budget
    /// at once.
    pub(super) fn run_glu(
        &self,
        plain: &mut [Product<'_, '_>],
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        hints: &Hints<'_, '_>,
    ) -> Result<bool, CudaError> {
        if jobs.is_empty()
            || !jobs.iter().all(takes)
            || !plain
                .iter()
                .all(|p| fits(&p.w, 1, p.t, p.x.len(), p.y.len()))
        {
            return Ok(false);
        }
        let (n, np) = (jobs.len(), plain.len());
        // Products in order: gate and up of each job, the plain products,
        // then each job's down.
        let mut ws: Vec<(MatRef<'_>, Role)> = Vec::with_capacity(3 * n + np);
        ws.extend(jobs.iter().flat_map(|j| [(j.gate, j.role), (j.up, j.role)]));
        ws.extend(plain.iter().map(|p| (p.w, p.role)));
        ws.extend(jobs.iter().map(|j| (j.down, j.role)));
        // Routed experts change from call to call: no set launches for them.
        let sets = ws.iter().all(|(_, r)| *r == Role::Spine);
        let queue = |st: &mut State, p: &Prepared<'_>| {
            let xs: Vec<&[f32]> = jobs
                .iter()
                .map(|j| j.x)
                .chain(plain.iter().map(|p| p.x))
                .collect();
            let ny = jobs
                .iter()
                .map(|j| j.y.len())
                .chain(plain.iter().map(|p| p.y.len()))
                .sum();
            let (xp, yp) = self.stage(st, &xs, ny)?;
            // The gates' outputs, then the ups' at the same offsets.
            let half: usize = jobs.iter().map(|j| j.t * j.gate.rows()).sum();
            let gp = grow(&self.stream, &mut st.glu, 2 * half, &mut st.reallocs)?
                .device_ptr(&self.stream)
                .0;
            let up = gp + 4 * half as u64;
            let placed = place(jobs, plain, (xp, yp, gp, up));
            self.launch_phases(
                st,
                &placed,
                &p.segs,
                &[2 * n + np, 3 * n + np],
                sets,
                |st| {
                    self.launch_act(&mut st.tape, act, gp, up, half);
                    Ok(())
                },
            )?;
            self.fetch(st, yp, ny)
        };
        let Some(st) = self.round_trip(&ws, hints, queue)? else {
            return Ok(false);
        };
        let ys = jobs.iter_mut().map(|j| &mut *j.y);
        scatter(results(&st)?, ys.chain(plain.iter_mut().map(|p| &mut *p.y)));
        Ok(true)
    }

    /// Writes `g[i] = act(g[i], u[i])` for `i < n` at the device addresses `g`, `u`.
    pub(super) fn launch_act(&self, tape: &mut Tape, act: GluAct, g: u64, u: u64, n: usize) {
        let (kind, beta, beta_lin) = act.kernel_args();
        let n64 = n as i64;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // `g` and `u` each hold n values on the device (the gates' and
        // ups' outputs); the arguments match `glu_act` in `glu.cu`.
        let args = [g, u, n64.slot(), kind.slot(), beta.slot(), beta_lin.slot()];
        tape.kernel(&self.funcs.glu_act, cfg, args);
    }
}

/// The products at their device addresses: inputs from `xp` (the jobs',
/// then the plain products', one after another), gates' outputs from `gp`
/// and ups' from `up` (the same offsets), the downs reading the
/// activations at `gp` and writing from `yp`, the plain products' outputs
/// after the downs'. In order: gates and ups, plain products, downs.
fn place<'w>(
    jobs: &[GluProduct<'w, '_>],
    plain: &[Product<'w, '_>],
    (xp, yp, gp, up): (u64, u64, u64, u64),
) -> Vec<Placed<'w>> {
    let mut first = Vec::with_capacity(2 * jobs.len() + plain.len());
    let mut downs = Vec::with_capacity(jobs.len());
    let (mut ox, mut oh, mut oy) = (xp, 0u64, yp);
    let one = |w, t, x, y| Placed {
        w,
        groups: 1,
        t,
        x,
        y,
    };
    for j in jobs {
        let t = j.t;
        first.push(one(j.gate, t, ox, gp + oh));
        first.push(one(j.up, t, ox, up + oh));
        downs.push(one(j.down, t, gp + oh, oy));
        ox += 4 * j.x.len() as u64;
        oh += 4 * (t * j.gate.rows()) as u64;
        oy += 4 * j.y.len() as u64;
    }
    for p in plain {
        first.push(one(p.w, p.t, ox, oy));
        ox += 4 * p.x.len() as u64;
        oy += 4 * p.y.len() as u64;
    }
    first.extend(downs);
    first
}
