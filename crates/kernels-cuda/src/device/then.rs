//! The rest of a layer up to its experts' choice ([`Then`]) in its
//! attention's call: after the attention's launches, `res_mix_dots` and
//! `res_mix_norm` (`glu.cu`) add the attention's output (still on the
//! device) to the residual, mix the earlier blocks in and norm the rows; then the products of
//! the normed rows run as a gated batch does (`glu.rs`: gates and ups with
//! the plain products, the activation, the downs). So a layer makes one
//! round trip up to the point where the host chooses its experts.
//!
//! The call's own staging (`x`, `y`, `hx`, `hy`, the address tables) holds
//! the attention's inputs and output until the synchronisation, so this
//! part stages through a second set ([`swap_sets`]). The residual, the
//! earlier blocks and the norm's and query's vectors go up with each call
//! (the vectors are not kept with the weights: their owners do not
//! `forget` them).

use cudarc::driver::{DevicePtr, LaunchConfig};
use fathom_kernels::backend::{DEVICE_MAX_SOURCES, MatRef, Then, segments};

use super::queue::{Placed, fits, grow, scatter};
use super::tape::Arg;
use super::{CudaBackend, State};
use crate::CudaError;

/// The widest row the mix kernels take (`glu.cu`'s `MIX_ROW`).
const MIX_ROW: usize = 8192;

/// The most values a call's rest stages (the sources it sends up, and
/// as many again for its results): 64 MiB of page-locked and device
/// memory each, outside the VRAM budget. A longer prefill step leaves the
/// rest to the host.
const MAX_STAGED: usize = 1 << 24;

/// Whether the kernels take `then` after an attention output of `out_len`
/// values: consistent shapes, the output `[N, D]` with `D` at most
/// [`MIX_ROW`], at most [`DEVICE_MAX_SOURCES`] sources and
/// [`MAX_STAGED`] values staged, `i32` sizes and at most 65535 rows (a
/// grid's y), products the kernels take.
pub(super) fn then_fits(then: &Then<'_>, out_len: usize) -> bool {
    let (n, d) = (then.rows(), then.d);
    let small = |v: usize| i32::try_from(v).is_ok();
    then.is_consistent()
        && n > 0
        && out_len == n * d
        && d <= MIX_ROW
        && n <= 65535
        && then.blocks.len() < DEVICE_MAX_SOURCES
        && (sources(then).len() + 1) * n * d + 2 * d <= MAX_STAGED
        && staged_results(then) <= MAX_STAGED
        && small(n)
        && small(d)
        && then
            .plain
            .iter()
            .all(|p| fits(&p.w, 1, n, n * d, p.y.len()))
        && then.glu.iter().all(|g| {
            let f = g.gate.rows();
            fits(&g.gate, 1, n, n * d, n * f) && fits(&g.down, 1, n, n * f, g.y.len())
        })
}

/// `then`'s weight segments, its products' ([`products`]' order).
pub(super) fn then_segments<'a>(then: &Then<'a>) -> Vec<&'a [u8]> {
    products(then).iter().flat_map(segments).collect()
}

/// The earlier blocks the kernels read: none without a query.
fn sources<'a>(then: &Then<'a>) -> &'a [Vec<f32>] {
    if then.query.is_some() {
        then.blocks
    } else {
        &[]
    }
}

/// The values a call's rest brings back: the normed rows, then the
/// products' outputs.
fn staged_results(then: &Then<'_>) -> usize {
    let ys = then.glu.iter().map(|g| g.y.len());
    then.x.len()
        + ys.chain(then.plain.iter().map(|p| p.y.len()))
            .sum::<usize>()
}

/// The products in launch order: each gated MLP's gate and up, the plain
/// products, each gated MLP's down.
pub(super) fn products<'a>(then: &Then<'a>) -> Vec<MatRef<'a>> {
    let mut ws: Vec<MatRef<'a>> = then.glu.iter().flat_map(|g| [g.gate, g.up]).collect();
    ws.extend(then.plain.iter().map(|p| p.w));
    ws.extend(then.glu.iter().map(|g| g.down));
    ws
}

/// Swaps the call's staging with the second set (see the module).
fn swap_sets(st: &mut State) {
    let t = &mut st.then;
    std::mem::swap(&mut st.x, &mut t.x);
    std::mem::swap(&mut st.y, &mut t.y);
    std::mem::swap(&mut st.hx, &mut t.hx);
    std::mem::swap(&mut st.hy, &mut t.hy);
    std::mem::swap(&mut st.ht, &mut t.ht);
    std::mem::swap(&mut st.dt, &mut t.dt);
}

impl CudaBackend {
    /// Writes `then` after the attention's launches, which leave its
    /// output at the device address `a` (the products' weights resident:
    /// [`then_segments`]).
    pub(super) fn then_launch(
        &self,
        st: &mut State,
        then: &Then<'_>,
        a: u64,
    ) -> Result<(), CudaError> {
        swap_sets(st);
        let written = self.then_write(st, then, a);
        swap_sets(st);
        written
    }

    fn then_write(&self, st: &mut State, then: &Then<'_>, a: u64) -> Result<(), CudaError> {
        let (n, d) = (then.rows(), then.d);
        let blocks = sources(then);
        let mut xs: Vec<&[f32]> = blocks.iter().map(|b| &b[..]).collect();
        xs.extend([then.partial, then.norm]);
        xs.extend(then.query);
        let ny = staged_results(then);
        let (vp, yp) = self.stage(st, &xs, ny)?;
        // The norm's and the query's vectors after the sources.
        let norm = vp + 4 * ((blocks.len() + 1) * n * d) as u64;
        let query = then.query.map_or(0, |_| norm + 4 * d as u64);
        let sources = blocks.len() + 1;
        let dots = grow(
            &self.stream,
            &mut st.then.dots,
            2 * n * sources,
            &mut st.reallocs,
        )?
        .device_ptr(&self.stream)
        .0;
        let half: usize = then.glu.iter().map(|g| n * g.gate.rows()).sum();
        let gp = grow(&self.stream, &mut st.glu, 2 * half.max(1), &mut st.reallocs)?
            .device_ptr(&self.stream)
            .0;
        self.ensure_clock(st)?;
        st.tape.clock(false);
        self.launch_mix(st, then, (vp, a, dots, yp), (norm, query));
        let placed = place(then, n, (yp, gp, gp + 4 * half as u64));
        let segs: Vec<Vec<&[u8]>> = products(then).iter().map(segments).collect();
        let (ng, np) = (then.glu.len(), then.plain.len());
        let ends: Vec<usize> = if ng == 0 {
            vec![np]
        } else {
            vec![2 * ng + np, 3 * ng + np]
        };
        let act = then.act;
        self.launch_phases(st, &placed, &segs, &ends, true, |st| {
            self.launch_act(&mut st.tape, act, gp, gp + 4 * half as u64, half);
            Ok(())
        })?;
        self.fetch(st, yp, ny)
    }

    /// Writes `res_mix_dots`, `res_mix_sum` and `res_mix_norm`: the sources at `vp`
    /// (blocks, then the residual), the attention's output at `a`, the
    /// sums at `dots`, the normed rows into `xp`.
    fn launch_mix(
        &self,
        st: &mut State,
        then: &Then<'_>,
        (vp, a, dots, xp): (u64, u64, u64, u64),
        (norm, query): (u64, u64),
    ) {
        let rows = then.rows() as u32;
        let (n, d, nb) = (rows as i32, then.d as i32, sources(then).len() as i32);
        let cfg = |grid| LaunchConfig {
            grid_dim: grid,
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (q, sources) = match then.query {
            Some(_) => (query, nb as u32 + 1),
            None => (0, 1),
        };
        // The arguments match `res_mix_dots`, `res_mix_sum` and
        // `res_mix_norm` in `glu.cu`: `vp` holds nb + 1 sources of n·d values, `a` and `xp`
        // n·d each, `dots` 2·n·(nb + 1), `norm` and `q` (or null) d
        // (`then_fits` checked the shapes: d ≤ MIX_ROW, n ≤ 65535).
        let first = [vp, a, nb.slot(), n.slot(), d.slot(), q, dots];
        st.tape
            .kernel(&self.funcs.res_mix_dots, cfg((sources, rows, 1)), first);
        let eps = then.eps.slot();
        let second = [vp, dots, nb.slot(), n.slot(), d.slot(), q, eps, xp];
        let cols = then.d.div_ceil(256) as u32;
        st.tape
            .kernel(&self.funcs.res_mix_sum, cfg((cols, rows, 1)), second);
        let third = [xp, d.slot(), norm, eps];
        st.tape
            .kernel(&self.funcs.res_mix_norm, cfg((rows, 1, 1)), third);
    }

    /// After the call's synchronisation: `then`'s rows and products from
    /// the second staging set, `done` set, the products counted.
    pub(super) fn then_finish(&self, st: &mut State, then: &mut Then<'_>) -> Result<(), CudaError> {
        let hy = st.then.hy.as_ref().expect("staged").as_slice()?;
        let nd = then.x.len();
        then.x.copy_from_slice(&hy[..nd]);
        let ys = then.glu.iter_mut().map(|g| &mut *g.y);
        scatter(
            &hy[nd..],
            ys.chain(then.plain.iter_mut().map(|p| &mut *p.y)),
        );
        then.done = true;
        let ws = products(then);
        st.stats.device_products += ws.len() as u64;
        st.stats.weight_bytes_read += ws
            .iter()
            .flat_map(segments)
            .map(|s| s.len() as u64)
            .sum::<u64>();
        Ok(())
    }
}

/// [`products`] at their device addresses: every input the normed rows at
/// `xp`; the gates' outputs from `gp` and the ups' from `up` (the same
/// offsets), the downs reading the activations there; outputs after the
/// rows at `xp`, the gated MLPs' then the plain products'.
fn place<'w>(then: &Then<'w>, n: usize, (xp, gp, up): (u64, u64, u64)) -> Vec<Placed<'w>> {
    let one = |w, x, y| Placed {
        w,
        groups: 1,
        t: n,
        x,
        y,
    };
    let mut first = Vec::new();
    let mut downs = Vec::new();
    let (mut oh, mut oy) = (0u64, xp + 4 * (n * then.d) as u64);
    for g in &then.glu {
        first.push(one(g.gate, xp, gp + oh));
        first.push(one(g.up, xp, up + oh));
        downs.push(one(g.down, gp + oh, oy));
        oh += 4 * (n * g.gate.rows()) as u64;
        oy += 4 * g.y.len() as u64;
    }
    for p in &then.plain {
        first.push(one(p.w, xp, oy));
        oy += 4 * p.y.len() as u64;
    }
    first.extend(downs);
    first
}
