//! An MLA layer's absorbed attention for a step's sequences in one round
//! trip: the no-position queries go up — or, with the layer's projections
//! ([`fathom_kernels::backend::MlaProj`]), its normed rows, and the
//! queries, the gate and the step's new cache rows are made here
//! (`launch_proj`) —, `uk_t`'s grouped product makes the latent queries,
//! `mla.cu` attends over every sequence's cache (`mla_split` a block per
//! split, query and head, `mla_merge` a block per query and head, in
//! chunks of queries within a scratch cap), `uv`'s grouped product makes
//! the values, and only those come back — or, with
//! [`fathom_kernels::backend::MlaOut`], `mla_gate` puts them by position
//! (times σ(gate)) and `o_proj` makes the layer's output, and only that
//! (and the new rows) comes back. The caches' blocks: `blocks.rs`.

use cudarc::driver::{DevicePtr, LaunchConfig};
use fathom_kernels::attention::SPLIT;
use fathom_kernels::backend::{MlaProj, MlaQueryProj, MlaWork, segments};

use super::blocks::{Blocks, kept_segments};
use super::launch::Ready;
use super::queue::{fits, grow};
use super::tape::{Arg, Tape};
use super::{CudaBackend, State};
use crate::CudaError;

/// Heads `mla_split_heads` takes at once, and the widest row (lora +
/// rope) it stages (`MLA_HG`, `MLA_HW` in `mla.cu`).
const MLA_HG: usize = 16;
const MLA_HW: usize = 576;

/// The most partial-result values (scores, maxima, sums, contexts) one
/// launch pair keeps on the device by default: 256 MiB. Longer prefills
/// run in chunks of queries; each query's result is its own, so the bits
/// do not move.
pub(super) const SCRATCH_FLOATS: usize = 1 << 26;

/// Where a call's projections' pieces are on the device
/// ([`MlaWork::proj`]).
#[derive(Clone)]
struct ProjPlaced {
    /// Each product's segments, in [`MlaProj::products`]' order.
    mats: Vec<Vec<u64>>,
    /// The staged rows, angles (cos, sin; any address without) and norms'
    /// weights (the queries' only with low-rank queries).
    x: u64,
    angles: (u64, u64),
    q_norm: u64,
    kv_norm: u64,
}

/// Where a call's pieces are on the device.
#[derive(Clone)]
struct Placed {
    /// `uk_t`'s, `uv`'s and `o_proj`'s segments.
    uk_t: Vec<u64>,
    uv: Vec<u64>,
    o_proj: Vec<u64>,
    /// The gate's values, if any.
    gate: Option<u64>,
    table: u64,
    q_nope: u64,
    q_rope: u64,
    ns: u64,
    boff: u64,
    out: u64,
    /// Whether the work's `then` comes along (its weights are here).
    then: bool,
    proj: Option<ProjPlaced>,
}

impl CudaBackend {
    /// `work` on the device (see the module); `Ok(false)` when declined: a
    /// shape the kernels do not take, or the products' weights and the
    /// full blocks do not fit in the budget at once.
    pub(super) fn mla(&self, work: &mut MlaWork<'_>) -> Result<bool, CudaError> {
        let sh = work.shape;
        let (h, t) = (sh.heads, work.ns.len());
        let per_query = work.scratch_per_query().unwrap_or(usize::MAX);
        let limit = self.mla_scratch.load(std::sync::atomic::Ordering::Relaxed);
        let (dn, dv) = (work.uk_t.cols(), work.uv.rows() / h.max(1));
        if !work.fits_device_kernel()
            || per_query > limit
            || !fits(&work.uk_t, h, t, h * t * dn, h * t * sh.lora)
            || !fits(&work.uv, h, t, h * t * sh.lora, h * t * dv)
            || work
                .o
                .is_some_and(|o| !fits(&o.o_proj, 1, t, t * h * dv, work.out.len()))
            || !work.proj.as_ref().is_none_or(|p| {
                p.products()
                    .iter()
                    .all(|m| fits(m, 1, t, t * m.cols(), t * m.rows()))
            })
        {
            return Ok(false);
        }
        let mut st = self.lock_timed();
        let st = &mut *st;
        st.tape.begin();
        let with_then = work.o.is_some()
            && work
                .then
                .as_ref()
                .is_some_and(|w| super::then::then_fits(w, work.out.len()));
        // Without room for `then`'s weights too, the attention alone.
        let mut placed = self.mla_stage(st, work, with_then)?;
        if placed.is_none() && with_then {
            placed = self.mla_stage(st, work, false)?;
        }
        let Some(placed) = placed else {
            return Ok(false);
        };
        // At most 65535 queries a launch (the grid's y).
        let chunk = (limit / per_query).clamp(1, t.min(65535));
        let queued = self
            .mla_launch(st, work, &placed, chunk)
            .and_then(|()| self.flush(st));
        let waited = std::time::Instant::now();
        let synced = self.stream.synchronize();
        st.stats.sync_wait_ms += waited.elapsed().as_secs_f64() * 1e3;
        queued?;
        synced?;
        if let Some((a, b)) = &st.clock {
            st.stats.kernel_ms += f64::from(a.elapsed_ms(b)?);
        }
        let hy = st.hy.as_ref().expect("staged").as_slice()?;
        let n_out = work.out.len();
        work.out.copy_from_slice(&hy[..n_out]);
        if let Some(p) = work.proj.as_mut() {
            p.rows_out
                .copy_from_slice(&hy[n_out..n_out + p.rows_out.len()]);
        }
        if let Some(t) = work.then.as_mut().filter(|_| placed.then) {
            self.then_finish(st, t)?;
        }
        st.stats.device_attention += 1;
        let o_proj = work.o.map(|o| o.o_proj);
        let projs = work.proj.as_ref().map_or_else(Vec::new, MlaProj::products);
        st.stats.weight_bytes_read += [work.uk_t, work.uv]
            .iter()
            .chain(&o_proj)
            .chain(&projs)
            .flat_map(segments)
            .map(|s| s.len() as u64)
            .sum::<u64>();
        st.stats.vram_weight_bytes = st.cache.bytes();
        Ok(true)
    }

    /// The products' weights (`o_proj`'s and the projections' too) and the
    /// full blocks here (kept); the no-position queries, the position parts,
    /// the rows each query sees, where its cache starts in the table, the
    /// gate, the projections' rows, angles and norms, and the partial
    /// blocks (each with room for the step's new rows, padded to
    /// `blocks.rs`) up in one copy, the block table in another; `None`
    /// (nothing copied) when the weights and full blocks do not fit the
    /// budget at once.
    fn mla_stage(
        &self,
        st: &mut State,
        work: &MlaWork<'_>,
        with_then: bool,
    ) -> Result<Option<Placed>, CudaError> {
        let (uk, uv) = (segments(&work.uk_t), segments(&work.uv));
        let op = work.o.map_or_else(Vec::new, |o| segments(&o.o_proj));
        let projs = work.proj.as_ref().map_or_else(Vec::new, MlaProj::products);
        let psegs: Vec<Vec<&[u8]>> = projs.iter().map(segments).collect();
        let mut segs: Vec<&[u8]> = uk.iter().chain(&uv).chain(&op).copied().collect();
        segs.extend(psegs.iter().flatten());
        segs.extend(kept_segments(work.seqs));
        let then = work.then.as_ref().filter(|_| with_then);
        segs.extend(then.map(super::then::then_segments).unwrap_or_default());
        let mut mats = vec![work.uk_t, work.uv];
        mats.extend(work.o.map(|o| o.o_proj));
        mats.extend(&projs);
        mats.extend(then.map(super::then::products).unwrap_or_default());
        let Some((ptrs, _)) = self.weights_here(st, &segs, &mats)? else {
            return Ok(None);
        };
        let (nw, nu, no) = (
            uk.len(),
            uk.len() + uv.len(),
            uk.len() + uv.len() + op.len(),
        );
        let np = no + psegs.iter().map(Vec::len).sum::<usize>();
        // The kernels' ints travel as f32 bit patterns in the one staging copy.
        let ns: Vec<f32> = work.ns.iter().map(|&n| f32::from_bits(n as u32)).collect();
        let w = work.shape.width();
        let after: Vec<usize> = work.seqs.iter().map(|s| work.seq_rows(s).1).collect();
        let zeros = vec![0f32; SPLIT * w];
        let blocks = Blocks::plan(work.seqs, &after, (work.ns.len(), w), &zeros);
        let gate = work.o.and_then(|o| o.gate).unwrap_or(&[]);
        let mut xs: Vec<&[f32]> = vec![work.q_nope, work.q_rope, &ns, &blocks.boff, gate];
        if let Some(p) = &work.proj {
            let (cos, sin) = p.angles.map_or((&[][..], &[][..]), |a| (a.cos, a.sin));
            let q_norm = match p.q {
                MlaQueryProj::LowRank { norm, .. } => norm,
                MlaQueryProj::Full(_) => &[],
            };
            xs.extend([p.x, cos, sin, q_norm, p.kv_norm]);
        }
        let (starts, head) = with_pieces(starts_of(&xs), &blocks.pieces);
        xs.extend(&blocks.pieces);
        let ny = work.out.len() + work.proj.as_ref().map_or(0, |p| p.rows_out.len());
        let (xp, yp) = self.stage_at(st, &xs, &starts, ny)?;
        let at = |k: usize| xp + 4 * starts[k] as u64;
        let dt = self.stage_table(st, &blocks.table(&ptrs[np..], xp, head))?;
        let proj = work.proj.as_ref().map(|_| ProjPlaced {
            mats: split_at_lens(&ptrs[no..np], &psegs),
            x: at(5),
            angles: (at(6), at(7)),
            q_norm: at(8),
            kv_norm: at(9),
        });
        Ok(Some(Placed {
            uk_t: ptrs[..nw].to_vec(),
            uv: ptrs[nw..nu].to_vec(),
            o_proj: ptrs[nu..no].to_vec(),
            gate: (!gate.is_empty()).then(|| at(4)),
            table: dt,
            q_nope: at(0),
            q_rope: at(1),
            ns: at(2),
            boff: at(3),
            out: yp,
            then: then.is_some(),
            proj,
        }))
    }

    /// Writes the attention of queries `c0..c0 + c` (`mla_split` a block per
    /// split, query and head, `mla_merge` a block per query and head): latent queries at
    /// `q_lat`, context into `ctx` (both `[H, T, lora]`), the partials at
    /// `ps`, `pm`, `pl`, `pc`.
    fn launch_chunk(
        &self,
        tape: &mut Tape,
        work: &MlaWork<'_>,
        p: &Placed,
        (c0, c): (usize, usize),
        (q_lat, ctx): (u64, u64),
        (ps, pm, pl, pc): (u64, u64, u64, u64),
    ) {
        let sh = work.shape;
        let (h, lora, t, ms) = (sh.heads, sh.lora, work.ns.len(), work.max_splits());
        let (hh, lo, ro, msi) = (h as i32, lora as i32, sh.rope as i32, ms as i32);
        // Latent queries and context are [H, T, lora].
        let (qs, hs) = (lora as i64, (t * lora) as i64);
        let c = c as u32;
        let ql = q_lat + 4 * (c0 * lora) as u64;
        let qr = p.q_rope + 4 * (c0 * h * sh.rope) as u64;
        let (ns, boff) = (p.ns + 4 * c0 as u64, p.boff + 4 * c0 as u64);
        let out = ctx + 4 * (c0 * lora) as u64;
        let cfg = |grid| LaunchConfig {
            grid_dim: grid,
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // The arguments match `mla_split` in `mla.cu`: the table holds
        // every block's device address (each cache's blocks but the last
        // SPLIT rows of lora + rope values), the queries, row counts and
        // offsets `c` entries from `c0` with strides inside [H, T, lora],
        // the scratch `c · ms · h` partials (`fits_device_kernel` checked
        // the shapes).
        let split = [
            p.table,
            boff,
            ql,
            qs.slot(),
            hs.slot(),
            qr,
            ns,
            hh.slot(),
            lo.slot(),
            ro.slot(),
            sh.scale.slot(),
            msi.slot(),
            ps,
            pm,
            pl,
            pc,
        ];
        if self.mla_heads && sh.lora + sh.rope <= MLA_HW {
            let groups = h.div_ceil(MLA_HG) as u32;
            tape.kernel(
                &self.funcs.mla_split_heads,
                cfg((ms as u32, c, groups)),
                split,
            );
        } else {
            tape.kernel(&self.funcs.mla_split, cfg((ms as u32, c, h as u32)), split);
        }
        // As above; the context is [H, T, lora] with `c` queries written
        // from `c0`.
        let merge = [
            ns,
            hh.slot(),
            lo.slot(),
            msi.slot(),
            pm,
            pl,
            pc,
            out,
            qs.slot(),
            hs.slot(),
        ];
        tape.kernel(&self.funcs.mla_merge, cfg((c, h as u32, 1)), merge);
    }

    /// Writes `mla_gate` (`mla.cu`): the values at `vals` `[H, T, dv]` by
    /// position into `cat` `[T, H·dv]`, each times σ(gate) with a gate.
    fn launch_mla_gate(
        &self,
        tape: &mut Tape,
        gate: Option<u64>,
        (vals, cat): (u64, u64),
        (h, t, dv): (usize, usize, usize),
    ) {
        let n = h * t * dv;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // Without a gate its pointer is never read; any device address does.
        let (gated, g) = (i32::from(gate.is_some()), gate.unwrap_or(vals));
        let (hh, tt, d) = (h as i32, t as i32, dv as i32);
        // The arguments match `mla_gate` in `mla.cu`; `vals`, `cat` and
        // (with a gate) `g` each hold H·T·dv values in the scratch or the
        // staged inputs.
        let args = [vals, g, gated.slot(), hh.slot(), tt.slot(), d.slot(), cat];
        tape.kernel(&self.funcs.mla_gate, cfg, args);
    }

    /// The launches written, clocked: with `proj` the projections first
    /// ([`Self::launch_proj`]), then `uk_t`'s product, the attention `chunk`
    /// queries at a time, `uv`'s product (with `o`, into the scratch, then
    /// `mla_gate` and `o_proj`); then the result's copy back into the host
    /// staging (with `proj`, the new rows after it).
    fn mla_launch(
        &self,
        st: &mut State,
        work: &MlaWork<'_>,
        p: &Placed,
        chunk: usize,
    ) -> Result<(), CudaError> {
        let sh = work.shape;
        let (h, lora, t, ms) = (sh.heads, sh.lora, work.ns.len(), work.max_splits());
        let parts = chunk * ms * h;
        let lat = h * t * lora;
        // With `o`: the values [H, T, dv] and by position [T, H·dv].
        let vals = if work.o.is_some() {
            h * t * (work.uv.rows() / h)
        } else {
            0
        };
        let proj = work.proj.as_ref().map_or(0, |pr| proj_scratch(work, pr));
        let scratch = grow(
            &self.stream,
            &mut st.mla,
            2 * lat + parts * (SPLIT + lora + 2) + 2 * vals + proj,
            &mut st.reallocs,
        )?
        .device_ptr(&self.stream)
        .0;
        let q_lat = scratch;
        let ctx = q_lat + 4 * lat as u64;
        let ps = ctx + 4 * lat as u64;
        let pm = ps + 4 * (parts * SPLIT) as u64;
        let pl = pm + 4 * parts as u64;
        let pc = pl + 4 * parts as u64;
        let vp = pc + 4 * (parts * lora) as u64;
        self.ensure_clock(st)?;
        let tape = &mut st.tape;
        tape.clock(false);
        let mut p = p.clone();
        if let (Some(pr), Some(pp)) = (&work.proj, &p.proj) {
            let at = vp + 4 * (2 * vals) as u64;
            let (q_nope, q_rope, gate) = self.launch_proj(tape, work, (pr, pp), (&p, at));
            (p.q_nope, p.q_rope) = (q_nope, q_rope);
            p.gate = p.gate.or(gate);
        }
        let p = &p;
        self.launch(tape, &work.uk_t, &p.uk_t, p.q_nope, q_lat, h, t);
        for c0 in (0..t).step_by(chunk) {
            let c = chunk.min(t - c0);
            self.launch_chunk(tape, work, p, (c0, c), (q_lat, ctx), (ps, pm, pl, pc));
        }
        match work.o {
            None => self.launch(tape, &work.uv, &p.uv, ctx, p.out, h, t),
            Some(o) => {
                let cat = vp + 4 * vals as u64;
                self.launch(tape, &work.uv, &p.uv, ctx, vp, h, t);
                self.launch_mla_gate(tape, p.gate, (vp, cat), (h, t, work.uv.rows() / h));
                self.launch(tape, &o.o_proj, &p.o_proj, cat, p.out, 1, t);
            }
        }
        tape.clock(true);
        let rows = work.proj.as_ref().map_or(0, |pr| pr.rows_out.len());
        self.fetch(st, p.out, work.out.len() + rows)?;
        match work.then.as_ref().filter(|_| p.then) {
            Some(t) => self.then_launch(st, t, p.out),
            None => Ok(()),
        }
    }

    /// Writes the projections' launches into the scratch from `at`: the
    /// queries' products (with the low-rank norm between), `mla_queries`,
    /// `kv_a`'s product and `mla_rows` (the new rows into their blocks and
    /// after the output at `out`), the gate's product. Gives where the
    /// no-position queries, the position parts and the gate (if any) are.
    fn launch_proj(
        &self,
        tape: &mut Tape,
        work: &MlaWork<'_>,
        (pr, pp): (&MlaProj<'_>, &ProjPlaced),
        (p, at): (&Placed, u64),
    ) -> (u64, u64, Option<u64>) {
        let sh = work.shape;
        let (h, lora, dr, t) = (sh.heads, sh.lora, sh.rope, work.ns.len());
        let dn = work.uk_t.cols();
        let [qa, q, c, g, qn, qr] = proj_places(work, pr, at);
        let seg = |i: usize| pp.mats.get(i).map_or(&[][..], Vec::as_slice);
        let cfg = |grid: usize| LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // The products of the rows `pp.x` first, in one set launch: the
        // queries' first (or only) one, kv_a's, the gate's; the segments
        // in that order with the low-rank queries' second after the first.
        let (first, low) = match &pr.q {
            MlaQueryProj::LowRank { a, b, .. } => (a, Some(b)),
            MlaQueryProj::Full(m) => (m, None),
        };
        let after = usize::from(low.is_some());
        let one = |w, i, y| Ready {
            w,
            p: seg(i),
            x: pp.x,
            y,
            t,
        };
        let mut ready = vec![
            one(first, 0, if low.is_some() { qa } else { q }),
            one(&pr.kv_a, 1 + after, c),
        ];
        ready.extend(pr.gate.as_ref().map(|m| one(m, 2 + after, g)));
        self.launch_ready(tape, &ready);
        if let MlaQueryProj::LowRank { a, eps, b, .. } = pr.q {
            let r = a.rows() as i32;
            // The arguments match `mla_norm_rows` in `mla.cu`: t rows of
            // r ≤ MLA_NORM_MAX values at `qa`, r weights staged.
            let args = [qa, r.slot(), pp.q_norm, eps.slot()];
            tape.kernel(&self.funcs.mla_norm_rows, cfg(t), args);
            self.launch(tape, &b, seg(1), qa, q, 1, t);
        }
        let (roped, inter) = pr
            .angles
            .map_or((0i32, 0i32), |a| (1, i32::from(a.interleaved)));
        let (cs, sn) = pp.angles;
        let (ti, hh, dni, dri) = (t as i32, h as i32, dn as i32, dr as i32);
        let n = t * h * (dn + dr);
        // The arguments match `mla_queries` in `mla.cu`: `q` holds t rows
        // of H·(dn + dr), the outputs H·t·dn and t·H·dr values; the angles
        // t·dr/2 each when `roped`.
        let qargs = [q, ti.slot(), hh.slot(), dni.slot(), dri.slot(), cs, sn];
        let qargs: Vec<u64> = qargs
            .into_iter()
            .chain([roped.slot(), inter.slot(), qn, qr])
            .collect();
        tape.kernel(
            &self.funcs.mla_queries,
            cfg(n.div_ceil(256).clamp(1, 4096)),
            qargs,
        );
        let (lo, kv_eps) = (lora as i32, pr.kv_eps);
        // The arguments match `mla_rows` in `mla.cu`: `c` holds t rows of
        // lora + dr wide rows (lora ≤ MLA_NORM_MAX), the table every block of
        // each sequence after the step (its new rows' blocks in staging),
        // `ns`/`boff` t entries; the rows go after the output's values.
        let rows_at = p.out + 4 * work.out.len() as u64;
        let rargs = [c, lo.slot(), dri.slot(), pp.kv_norm, kv_eps.slot(), cs, sn];
        let rargs: Vec<u64> = rargs
            .into_iter()
            .chain([roped.slot(), inter.slot(), p.table, p.boff, p.ns, rows_at])
            .collect();
        tape.kernel(&self.funcs.mla_rows, cfg(t), rargs);
        (qn, qr, pr.gate.map(|_| g))
    }
}

/// The projections' scratch values for `work`: the low-rank queries, the
/// queries, the new rows, the gate, then the queries split.
fn proj_scratch(work: &MlaWork<'_>, pr: &MlaProj<'_>) -> usize {
    let t = work.ns.len();
    let sh = work.shape;
    let r = match pr.q {
        MlaQueryProj::LowRank { a, .. } => a.rows(),
        MlaQueryProj::Full(_) => 0,
    };
    let dq = sh.heads * (work.uk_t.cols() + sh.rope);
    let g = pr.gate.map_or(0, |m| m.rows());
    t * (r + 2 * dq + sh.width() + g)
}

/// Where [`proj_scratch`]'s parts start from `at`: the low-rank queries,
/// the queries, the new rows, the gate, the no-position queries, the
/// position parts.
fn proj_places(work: &MlaWork<'_>, pr: &MlaProj<'_>, at: u64) -> [u64; 6] {
    let t = work.ns.len();
    let sh = work.shape;
    let r = match pr.q {
        MlaQueryProj::LowRank { a, .. } => a.rows(),
        MlaQueryProj::Full(_) => 0,
    };
    let dn = work.uk_t.cols();
    let dq = sh.heads * (dn + sh.rope);
    let g = pr.gate.map_or(0, |m| m.rows());
    let lens = [t * r, t * dq, t * sh.width(), t * g, t * sh.heads * dn];
    let mut out = [at; 6];
    for k in 0..5 {
        out[k + 1] = out[k] + 4 * lens[k] as u64;
    }
    out
}

/// Where each of `xs` starts in their one copy, in values, and last where
/// what follows them may start: one after another, each at a multiple of
/// four values (16 bytes, as the tiled products copy their inputs: a
/// projection's input after T row counts would otherwise sit 8 bytes off
/// for odd T and leave the tiles).
pub(super) fn starts_of(xs: &[&[f32]]) -> Vec<usize> {
    let mut out: Vec<usize> = xs
        .iter()
        .scan(0, |o, v| {
            let s = *o;
            *o = (s + v.len()).next_multiple_of(4);
            Some(s)
        })
        .collect();
    let end = match (out.last(), xs.last()) {
        (Some(s), Some(v)) => (s + v.len()).next_multiple_of(4),
        _ => 0,
    };
    out.push(end);
    out
}

/// `starts` (from [`starts_of`], the head's) followed by the starts of
/// `pieces` one after another from the head's end; and that end.
pub(super) fn with_pieces(mut starts: Vec<usize>, pieces: &[&[f32]]) -> (Vec<usize>, usize) {
    let head = starts.pop().unwrap_or(0);
    let mut at = head;
    for p in pieces {
        starts.push(at);
        at += p.len();
    }
    (starts, head)
}

/// `ptrs` cut as `segs` is: each matrix's segments' device addresses.
pub(super) fn split_at_lens(ptrs: &[u64], segs: &[Vec<&[u8]>]) -> Vec<Vec<u64>> {
    let mut at = 0;
    segs.iter()
        .map(|m| {
            let v = ptrs[at..at + m.len()].to_vec();
            at += m.len();
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{starts_of, with_pieces};

    /// A call's inputs start at multiples of four values, in order, none
    /// over the one before (a projection's input after 17 row counts and
    /// 17 offsets at 36, not 34); the pieces follow packed from the head's
    /// end.
    #[test]
    fn staged_inputs_start_at_multiples_of_16_bytes() {
        let (a, b, c) = (vec![0f32; 17], vec![0f32; 17], vec![0f32; 300]);
        let empty: [f32; 0] = [];
        let starts = starts_of(&[&empty, &a, &b, &c, &empty]);
        assert_eq!(starts, [0, 0, 20, 40, 340, 340]);
        let (p1, p2) = (vec![0f32; 7], vec![0f32; 5]);
        let (all, head) = with_pieces(starts, &[&p1, &p2]);
        assert_eq!(head, 340);
        assert_eq!(all, [0, 0, 20, 40, 340, 340, 347]);
    }
}
