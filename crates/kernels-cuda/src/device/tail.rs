//! A MoE layer's routed experts through their combine in one round trip
//! ([`MoeTail`]): the experts' gate and up products, the activation, their
//! downs, each row's rank-order sum with the optional norm (`moe_combine`
//! in `glu.cu`), then the optional projection. The experts' outputs and
//! the sums stay on the device; only the layer's output comes back.

use cudarc::driver::{DevicePtr, LaunchConfig};
use fathom_kernels::backend::{Hints, MatRef, MoeTail, Role};

use super::queue::{Placed, Prepared, fits, grow, results, scatter};
use super::tape::{Arg, Tape};
use super::{CudaBackend, State};
use crate::CudaError;

/// Whether the kernels take `tail`: consistent lengths, every size an
/// `i32`, the experts' outputs addressable by offsets below `f32`'s
/// infinity bits (they travel as `f32` bit patterns: none is then a NaN
/// that a float move could quieten).
fn takes(tail: &MoeTail<'_, '_>) -> bool {
    let small = |n: usize| i32::try_from(n).is_ok();
    let width = tail.width();
    let outs: usize = tail.experts.iter().map(|e| e.t * width).sum();
    tail.is_consistent()
        && tail.rows() > 0
        && small(width)
        && small(tail.k)
        && small(tail.rows())
        && outs < 0x7F80_0000
        && tail
            .experts
            .iter()
            .all(|e| small(e.gate.rows()) && small(e.gate.cols()) && small(e.t))
        && tail.up.is_none_or(|u| {
            let rows = tail.rows();
            fits(&u, 1, rows, rows * width, tail.y.len())
        })
}

impl CudaBackend {
    /// Runs `tail` in one round trip (see the module). `Ok(false)` when
    /// declined: a shape out of range, or the weights do not all fit in
    /// the budget at once.
    pub(super) fn run_tail(
        &self,
        tail: &mut MoeTail<'_, '_>,
        hints: &Hints<'_, '_>,
    ) -> Result<bool, CudaError> {
        if !takes(tail) {
            return Ok(false);
        }
        let n = tail.experts.len();
        // Products in order: gate and up of each expert, each down, `up`.
        let mut ws: Vec<(MatRef<'_>, Role)> = Vec::with_capacity(3 * n + 1);
        ws.extend(
            tail.experts
                .iter()
                .flat_map(|e| [(e.gate, Role::Expert), (e.up, Role::Expert)]),
        );
        ws.extend(tail.experts.iter().map(|e| (e.down, Role::Expert)));
        ws.extend(tail.up.map(|u| (u, Role::Spine)));
        let queue = |st: &mut State, p: &Prepared<'_>| {
            let (rows, width, k) = (tail.rows(), tail.width(), tail.k);
            let offs = pick_offsets(tail);
            let mut xs: Vec<&[f32]> = tail.experts.iter().map(|e| e.x).collect();
            xs.extend([tail.weights, &offs[..]]);
            xs.extend(tail.norm.map(|(w, _)| w));
            let (xp, yp) = self.stage(st, &xs, tail.y.len())?;
            let half: usize = tail.experts.iter().map(|e| e.t * e.gate.rows()).sum();
            let outs: usize = tail.experts.iter().map(|e| e.t * width).sum();
            let sums = if tail.up.is_some() { rows * width } else { 0 };
            let gp = grow(
                &self.stream,
                &mut st.glu,
                2 * half + outs + sums,
                &mut st.reallocs,
            )?
            .device_ptr(&self.stream)
            .0;
            let at = |floats: usize| gp + 4 * floats as u64;
            let (upp, dp, sp) = (at(half), at(2 * half), at(2 * half + outs));
            let sp = if tail.up.is_some() { sp } else { yp };
            let placed = place(tail, (xp, gp, upp, dp), (sp, yp));
            // After the inputs: the weights, the offsets, the norm's weight.
            let nx: usize = tail.experts.iter().map(|e| e.x.len()).sum();
            let (wp, op) = (xp + 4 * nx as u64, xp + 4 * (nx + rows * k) as u64);
            let combine = Combine {
                outs: dp,
                offs: op,
                weights: wp,
                norm: tail.norm.map(|(_, eps)| (op + 4 * (rows * k) as u64, eps)),
                sums: sp,
                rows,
                width,
                k,
            };
            let ends = [2 * n, 3 * n, 3 * n + usize::from(tail.up.is_some())];
            let mut phase = 0;
            self.launch_phases(st, &placed, &p.segs, &ends, false, |st| {
                phase += 1;
                match phase {
                    1 => self.launch_act(&mut st.tape, tail.act, gp, upp, half),
                    _ => self.launch_combine(&mut st.tape, &combine),
                }
                Ok(())
            })?;
            self.fetch(st, yp, tail.y.len())
        };
        let Some(mut st) = self.round_trip(&ws, hints, queue)? else {
            return Ok(false);
        };
        scatter(results(&st)?, std::iter::once(&mut *tail.y));
        st.stats.device_moe_tails += 1;
        Ok(true)
    }

    /// Writes `moe_combine` (`glu.cu`): one block a row.
    fn launch_combine(&self, tape: &mut Tape, c: &Combine) {
        let cfg = LaunchConfig {
            grid_dim: (c.rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (k, width) = (c.k as i32, c.width as i32);
        let (norm, (nw, eps)) = match c.norm {
            Some(n) => (1i32, n),
            // Without a norm its weight is never read; any device address does.
            None => (0, (c.weights, 0.0f32)),
        };
        // The arguments match `moe_combine` in `glu.cu`; `outs` holds
        // every expert's output rows the offsets name (checked against the
        // pick rows), `offs` and `weights` rows·k values, the norm's weight
        // and each row of `sums` `width` values.
        let args = [
            c.outs,
            c.offs,
            c.weights,
            k.slot(),
            width.slot(),
            norm.slot(),
            nw,
            eps.slot(),
            c.sums,
        ];
        tape.kernel(&self.funcs.moe_combine, cfg, args);
    }
}

/// The picks as offsets (in values) into the experts' outputs laid one
/// after another, their bits carried as `f32`s so they ride in the inputs'
/// copy (`takes` checked that they stay below the NaN patterns).
fn pick_offsets(tail: &MoeTail<'_, '_>) -> Vec<f32> {
    let width = tail.width();
    let starts: Vec<usize> = tail
        .experts
        .iter()
        .scan(0, |o, e| {
            let s = *o;
            *o += e.t * width;
            Some(s)
        })
        .collect();
    tail.picks
        .iter()
        .map(|&(e, r)| f32::from_bits((starts[e as usize] + r as usize * width) as u32))
        .collect()
}

/// `moe_combine`'s device addresses and sizes.
struct Combine {
    outs: u64,
    offs: u64,
    weights: u64,
    norm: Option<(u64, f32)>,
    sums: u64,
    rows: usize,
    width: usize,
    k: usize,
}

/// The products at their device addresses: expert `i`'s input from `xp`
/// (one after another), its gate's output from `gp` and its up's from
/// `upp` (the same offsets), its down reading the activation at `gp` and
/// writing from `dp`; `up` (the projection) reading the sums at `sp` and
/// writing `yp`. In order: gates and ups, downs, the projection.
fn place<'w>(
    tail: &MoeTail<'w, '_>,
    (xp, gp, upp, dp): (u64, u64, u64, u64),
    (sp, yp): (u64, u64),
) -> Vec<Placed<'w>> {
    let n = tail.experts.len();
    let mut first = Vec::with_capacity(3 * n + 1);
    let mut downs = Vec::with_capacity(n);
    let (mut ox, mut oh, mut od) = (xp, 0u64, dp);
    let one = |w, t, x, y| Placed {
        w,
        groups: 1,
        t,
        x,
        y,
    };
    for e in tail.experts {
        first.push(one(e.gate, e.t, ox, gp + oh));
        first.push(one(e.up, e.t, ox, upp + oh));
        downs.push(one(e.down, e.t, gp + oh, od));
        ox += 4 * e.x.len() as u64;
        oh += 4 * (e.t * e.gate.rows()) as u64;
        od += 4 * (e.t * e.down.rows()) as u64;
    }
    first.extend(downs);
    first.extend(tail.up.map(|u| one(u, tail.rows(), sp, yp)));
    first
}
