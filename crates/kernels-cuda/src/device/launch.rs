//! How a call's products launch: phase by phase, those whose weights are
//! here first; products of one kernel and shape in one launch through a
//! table of addresses; and set launches — several bf16 products of any
//! shapes and one position count in one launch (`mm_bf16_set`,
//! `mm_bf16_rows_set` in `grouped.cu`): a layer's projections of one
//! input, which were a launch each (a launch of a few blocks costs about
//! as much as one of hundreds: its ramp and tail).

use cudarc::driver::{DevicePtr, LaunchConfig};
use fathom_kernels::backend::MatRef;

use super::queue::{Placed, key};
use super::tape::{Arg, Tape};
use super::{CudaBackend, State};
use crate::CudaError;

/// The most products in one set launch (`SET_MAX` in `grouped.cu`).
pub(super) const SET_MAX: usize = 8;

/// The fewest positions for which bf16, MXFP4 and int8 products take the
/// tiled kernels (`tile.cu`): a block's tile is 16 rows × 16 positions.
pub(crate) const TILE_T: usize = 16;

/// Rows and positions of a tiled kernel's block (`TB_R`, `TB_P` in
/// `tile.cu`), and its threads.
const TILE_ROWS: usize = 16;
const TILE_POSITIONS: usize = 16;
const TILE_THREADS: u32 = 128;

/// Blocks of a tiled product of `rows` rows at `t` positions.
fn tiles(rows: usize, t: usize) -> usize {
    rows.div_ceil(TILE_ROWS) * t.div_ceil(TILE_POSITIONS)
}

/// A tiled launch of `blocks` blocks for each of `n` products.
fn tile_config(blocks: usize, n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, n as u32, 1),
        block_dim: (TILE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A plain product ready to launch: its weights at the device addresses
/// `p` (its segments), input at `x`, output at `y`, `t` positions.
#[derive(Clone, Copy)]
pub(super) struct Ready<'a, 'w> {
    pub(super) w: &'a MatRef<'w>,
    pub(super) p: &'a [u64],
    pub(super) x: u64,
    pub(super) y: u64,
    pub(super) t: usize,
}

/// How a phase's ready products launch: a set of bf16 products (any
/// shapes), or products of one kernel and shape (one, or several through
/// an address table).
pub(super) enum Planned {
    Set(Vec<usize>),
    Group(Vec<usize>),
}

/// The launches of the ready products `ready` (indices into `placed`):
/// with `sets`, the plain bf16 products of each position count, unless all
/// of one shape, in set launches of up to [`SET_MAX`]; every other product
/// with those of its kernel and shape ([`together`]: one launch, its
/// addresses in a table).
pub(super) fn plan(
    placed: &[Placed<'_>],
    ready: impl Iterator<Item = usize>,
    sets: bool,
) -> Vec<Planned> {
    let ready: Vec<usize> = ready.collect();
    let bf16 = |i: usize| sets && settable(&placed[i]);
    let (classes, rest) = bf16_classes(&ready, bf16, |i| placed[i].t);
    let mut out = Vec::new();
    for class in classes {
        if class
            .iter()
            .all(|&j| together(&placed[class[0]], &placed[j]))
        {
            out.push(Planned::Group(class));
            continue;
        }
        for c in class.chunks(SET_MAX) {
            out.push(match c {
                [one] => Planned::Group(vec![*one]),
                _ => Planned::Set(c.to_vec()),
            });
        }
    }
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for i in rest {
        match groups
            .iter_mut()
            .find(|l| together(&placed[l[0]], &placed[i]))
        {
            Some(l) => l.push(i),
            None => groups.push(vec![i]),
        }
    }
    out.extend(groups.into_iter().map(Planned::Group));
    out
}

/// The indices `ready` for which `bf16` holds, split by position count
/// (`t`) in order of first appearance, each class in order; and the others.
fn bf16_classes(
    ready: &[usize],
    bf16: impl Fn(usize) -> bool,
    t: impl Fn(usize) -> usize,
) -> (Vec<Vec<usize>>, Vec<usize>) {
    let mut classes: Vec<Vec<usize>> = Vec::new();
    let mut rest = Vec::new();
    for &i in ready {
        if !bf16(i) {
            rest.push(i);
        } else if let Some(c) = classes.iter_mut().find(|c| t(c[0]) == t(i)) {
            c.push(i);
        } else {
            classes.push(vec![i]);
        }
    }
    (classes, rest)
}

/// Whether a product can join a set launch: a plain bf16 product.
fn settable(p: &Placed<'_>) -> bool {
    matches!(p.w, MatRef::Bf16 { .. }) && p.groups == 1
}

impl CudaBackend {
    /// Writes the launches of the plain products `items` (weights here,
    /// none reading another's output): the bf16 ones of each position count
    /// [`SET_MAX`] at a time in one set launch, every other one alone.
    pub(super) fn launch_ready(&self, tape: &mut Tape, items: &[Ready<'_, '_>]) {
        let all: Vec<usize> = (0..items.len()).collect();
        let bf16 = |i: usize| matches!(items[i].w, MatRef::Bf16 { .. });
        let (classes, rest) = bf16_classes(&all, bf16, |i| items[i].t);
        let chunks = classes.iter().flat_map(|c| c.chunks(SET_MAX));
        for c in chunks.chain(rest.chunks(1)) {
            if let [one] = c {
                let q = &items[*one];
                self.launch(tape, q.w, q.p, q.x, q.y, 1, q.t);
            } else {
                let set: Vec<Ready<'_, '_>> = c.iter().map(|&j| items[j]).collect();
                self.launch_set(tape, &set);
            }
        }
    }

    /// Writes one launch of the bf16 products `set` (two to [`SET_MAX`],
    /// one position count): entry i's blocks after those of the entries
    /// before it (`mm_bf16_set`, `mm_bf16_rows_set`), spread at one
    /// position as [`Self::spread`] says.
    pub(super) fn launch_set(&self, tape: &mut Tape, set: &[Ready<'_, '_>]) {
        debug_assert!((2..=SET_MAX).contains(&set.len()));
        let t = set[0].t;
        // `mm_bf16_tile_set` reads bf16 only (sets hold nothing else).
        let bf16 = |q: &Ready<'_, '_>| matches!(q.w, MatRef::Bf16 { .. });
        if set.iter().all(|q| bf16(q) && self.tiled(q.w, q.t, 1, q.x)) {
            return self.launch_tile_set(tape, set);
        }
        // `Bf16Set` in `grouped.cu`: SET_MAX entries of four 64-bit values.
        let mut tail = vec![0u64; 4 * SET_MAX];
        let pairs: usize = set.iter().map(|q| q.w.rows().div_ceil(2)).sum();
        let sp = if t == 1 {
            self.spread(pairs)
        } else {
            Spread::FULL
        };
        let mut blocks = 0;
        for (e, q) in tail.chunks_exact_mut(4).zip(set) {
            let (rows, cols) = (q.w.rows(), q.w.cols());
            debug_assert!(q.w.device_rows_a_block(t) == 16 && q.t == t);
            blocks += sp.blocks(rows);
            e.copy_from_slice(&[q.p[0], q.x, q.y, rows as u64 | (cols as u64) << 32]);
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (sp.threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = if t > 1 {
            &self.funcs.bf16_rows_set
        } else {
            &self.funcs.bf16_set
        };
        let (n, tt, kk) = (set.len() as i32, t as i32, sp.k as i32);
        // The set holds `n` entries of device addresses of bf16 weights,
        // input and output and their shapes (each checked by `fits`), then
        // zeros: the structure `Bf16Set` that `mm_bf16_set` takes last.
        tape.kernel_with(f, cfg, [n.slot(), tt.slot(), kk.slot()], tail);
    }

    /// Whether `w`'s product at `t` positions (in `groups` blocks, input
    /// at the device address `x`) takes the tiled kernels: plain bf16 of
    /// [`TILE_T`] positions or more with rows of a multiple of 8 columns,
    /// MXFP4 with rows of whole chunks of 256 (in VRAM in lane order), or
    /// int8 with rows of a multiple of 16; the input 16-byte aligned
    /// (copied 16 bytes at a time).
    pub(super) fn tiled(&self, w: &MatRef<'_>, t: usize, groups: usize, x: u64) -> bool {
        let format = match w {
            MatRef::Bf16 { cols, .. } => cols % 8 == 0,
            MatRef::Mxfp4(m) => m.cols % 256 == 0,
            MatRef::Int8 { cols, .. } => cols % 16 == 0,
            _ => false,
        };
        self.tiles && format && t >= TILE_T && groups == 1 && x.is_multiple_of(16)
    }

    /// The set `set` (every product [`Self::tiled`]) in one tiled launch:
    /// entry i's tiles after those of the entries before it.
    fn launch_tile_set(&self, tape: &mut Tape, set: &[Ready<'_, '_>]) {
        let t = set[0].t;
        let mut tail = vec![0u64; 4 * SET_MAX];
        for (e, q) in tail.chunks_exact_mut(4).zip(set) {
            let (rows, cols) = (q.w.rows(), q.w.cols());
            e.copy_from_slice(&[q.p[0], q.x, q.y, rows as u64 | (cols as u64) << 32]);
        }
        let cfg = tile_config(set.iter().map(|q| tiles(q.w.rows(), t)).sum(), 1);
        let (n, tt) = (set.len() as i32, t as i32);
        // `Bf16Set` as `launch_set` writes it.
        tape.kernel_with(&self.funcs.bf16_tile_set, cfg, [n.slot(), tt.slot()], tail);
        tape.tiled();
    }

    /// How a one-position bf16 launch of `pairs` row pairs (two rows a
    /// warp) spreads over the device: blocks of 256 threads, a pair a
    /// warp, when the device holds all their warps at once or their waves
    /// together are at least nine tenths full (pairs ≥ 0.9 × warps held ×
    /// waves); else k pairs a warp (k the waves it would take, capped by
    /// `BF16_PAIRS`) in blocks of 64 threads. A launch of 1.13 waves (7,168
    /// rows on an H100) spent its last part with a few blocks running
    /// alone; taking two pairs a warp in blocks of 256, half of its
    /// multiprocessors held twice the warps of the others (ncu of the K3DIM
    /// decode at 5c57824 as scripts/ncu-steps.py's header gives it, with
    /// the warps-an-SM and DRAM-busy metrics: 13 warps an SM, DRAM 55-60 %
    /// busy). The head's 25.9 waves and a 12,288-row
    /// product's 1.94 keep a pair a warp. Which warp sums a row never
    /// changes its bits.
    pub(super) fn spread(&self, pairs: usize) -> Spread {
        use std::sync::atomic::Ordering::Relaxed;
        let warps = 8 * self.bf16_slots.load(Relaxed);
        if warps == 0 || pairs <= warps {
            return Spread::FULL;
        }
        let waves = pairs.div_ceil(warps);
        let k = waves.min(self.bf16_pairs.load(Relaxed));
        if 10 * pairs >= 9 * warps * waves || k <= 1 {
            return Spread::FULL;
        }
        Spread { k, threads: 64 }
    }

    /// The grid's first dimension for `rows` rows of `w` at `t` positions
    /// in a launch of `n` products of its shape, and its threads a block:
    /// a block of 256 for every [`MatRef::device_rows_a_block`] rows, or
    /// for one-position bf16 as [`Self::spread`] says.
    fn grid_x(&self, w: &MatRef<'_>, t: usize, n: usize) -> (u32, u32) {
        match w {
            MatRef::Bf16 { .. } if t == 1 => {
                let sp = self.spread(n * w.rows().div_ceil(2));
                (sp.blocks(w.rows()) as u32, sp.threads as u32)
            }
            _ => (w.rows().div_ceil(w.device_rows_a_block(t)) as u32, 256),
        }
    }
}

/// A one-position bf16 launch's shape ([`CudaBackend::spread`]): `k` row
/// pairs a warp, `threads` a block (two rows a warp: `threads / 16` rows a
/// block before `k`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Spread {
    pub(super) k: usize,
    pub(super) threads: usize,
}

impl Spread {
    /// A pair a warp, 256 threads a block: 16 rows a block.
    const FULL: Spread = Spread { k: 1, threads: 256 };

    /// Blocks for a product of `rows` rows: `ceil(ceil(rows / (threads /
    /// 16)) / k)`, as `set_pick` in `grouped.cu` counts them.
    fn blocks(&self, rows: usize) -> usize {
        rows.div_ceil(self.threads / 16).div_ceil(self.k)
    }
}

impl<'w> Placed<'w> {
    /// The product ready to launch with its weights at `p`.
    pub(super) fn ready<'a>(&'a self, p: &'a [u64]) -> Ready<'a, 'w> {
        Ready {
            w: &self.w,
            p,
            x: self.x,
            y: self.y,
            t: self.t,
        }
    }
}

impl CudaBackend {
    /// Writes the launches of `placed` (their weights' segments `segs`, all
    /// resident or on their way) phase by phase — phase `p` the products up to
    /// `ends[p]` —, `between` queued after each phase but the last. Within a phase the products whose weights are
    /// here go first — with `sets`, bf16 ones of one position count in one
    /// set launch when there are two to [`SET_MAX`] of them; else those of
    /// one kernel and shape in one launch —; then each other one after its
    /// own copies. The launches are clocked. Calls of routed experts pass
    /// no `sets`: a set launch names its products' addresses in its
    /// arguments, so a call of other experts could not replay its graph,
    /// while a grouped launch reads them from a table.
    pub(super) fn launch_phases(
        &self,
        st: &mut State,
        placed: &[Placed<'_>],
        segs: &[Vec<&[u8]>],
        ends: &[usize],
        sets: bool,
        mut between: impl FnMut(&mut State) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let phases: Vec<std::ops::Range<usize>> = ends
            .iter()
            .scan(0, |start, &end| {
                let r = *start..end;
                *start = end;
                Some(r)
            })
            .collect();
        let (pending, ptrs) = self.resident(st, segs);
        let launches: Vec<Vec<Planned>> = phases
            .iter()
            .map(|ph| plan(placed, ph.clone().filter(|&i| !pending[i]), sets))
            .collect();
        let groups: Vec<Vec<usize>> = launches
            .iter()
            .flatten()
            .filter_map(|l| match l {
                Planned::Group(g) => Some(g.clone()),
                Planned::Set(_) => None,
            })
            .collect();
        let mut tables = self.stage_tables(st, &groups, placed, &ptrs)?.into_iter();
        self.ensure_clock(st)?;
        st.tape.clock(false);
        for (p, (ph, ls)) in phases.iter().zip(&launches).enumerate() {
            for l in ls {
                match l {
                    Planned::Set(set) => {
                        let ready: Vec<Ready<'_, '_>> =
                            set.iter().map(|&i| placed[i].ready(&ptrs[i])).collect();
                        self.launch_set(&mut st.tape, &ready);
                    }
                    Planned::Group(l) => {
                        let q = &placed[l[0]];
                        match tables.next().flatten() {
                            Some(tab) => {
                                let tiled = l.iter().all(|&i| {
                                    let q = &placed[i];
                                    self.tiled(&q.w, q.t, q.groups, q.x)
                                });
                                self.launch_many(&mut st.tape, q, tab, l.len(), tiled)
                            }
                            None => self.launch(
                                &mut st.tape,
                                &q.w,
                                &ptrs[l[0]],
                                q.x,
                                q.y,
                                q.groups,
                                q.t,
                            ),
                        }
                    }
                }
            }
            for i in ph.clone().filter(|&i| pending[i]) {
                for seg in &segs[i] {
                    if let Some(ready) = st.cache.get(&key(seg)).and_then(|r| r.ready.as_ref()) {
                        st.tape.wait(ready);
                    }
                }
                let q = &placed[i];
                self.launch(&mut st.tape, &q.w, &ptrs[i], q.x, q.y, q.groups, q.t);
            }
            if p + 1 < phases.len() {
                between(st)?;
            }
        }
        st.tape.clock(true);
        Ok(())
    }

    /// For each product's segments `segs` (all in the cache): whether a
    /// copy of one may still be running (the product then waits for it),
    /// and their device addresses.
    fn resident(&self, st: &State, segs: &[Vec<&[u8]>]) -> (Vec<bool>, Vec<Vec<u64>>) {
        let here = |s: &[u8]| st.cache.get(&key(s)).expect("resident");
        let pending = segs
            .iter()
            .map(|s| s.iter().any(|s| !here(s).is_ready()))
            .collect();
        let ptrs = segs
            .iter()
            .map(|s| {
                s.iter()
                    .map(|s| here(s).buf.device_ptr(&self.stream).0)
                    .collect()
            })
            .collect();
        (pending, ptrs)
    }

    /// Device address tables (`[data, scales or 0, x, y]` per product) of
    /// the launches of several products, their copy up (one) written on
    /// the tape; `None` for a launch of one.
    fn stage_tables(
        &self,
        st: &mut State,
        launches: &[Vec<usize>],
        placed: &[Placed<'_>],
        ptrs: &[Vec<u64>],
    ) -> Result<Vec<Option<u64>>, CudaError> {
        let mut tab: Vec<u64> = Vec::new();
        let mut starts = Vec::with_capacity(launches.len());
        for l in launches {
            if l.len() < 2 {
                starts.push(None);
                continue;
            }
            starts.push(Some(tab.len()));
            for &i in l {
                let q = &placed[i];
                tab.extend([ptrs[i][0], ptrs[i].get(1).copied().unwrap_or(0), q.x, q.y]);
            }
        }
        if tab.is_empty() {
            return Ok(starts.iter().map(|_| None).collect());
        }
        let dt = self.stage_table(st, &tab)?;
        Ok(starts
            .iter()
            .map(|s| s.map(|s| dt + 8 * s as u64))
            .collect())
    }

    /// Writes `n` products of `first`'s kernel and shape in one launch,
    /// their addresses in the device table at `tab`.
    /// With `tiled`, every product [`Self::tiled`]: the tiled kernel.
    fn launch_many(&self, tape: &mut Tape, first: &Placed<'_>, tab: u64, n: usize, tiled: bool) {
        let (rows, cols) = (first.w.rows(), first.w.cols());
        let (r, c, t) = (rows as i32, cols as i32, first.t as i32);
        if tiled {
            let cfg = tile_config(tiles(rows, first.t), n);
            let f = match first.w {
                MatRef::Mxfp4(_) => &self.funcs.mxfp4_tile_many,
                _ => &self.funcs.bf16_tile_many,
            };
            tape.kernel(f, cfg, [tab.slot(), r.slot(), c.slot(), t.slot()]);
            return tape.tiled();
        }
        let (gx, threads) = self.grid_x(&first.w, first.t, n);
        let cfg = LaunchConfig {
            grid_dim: (gx, n as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = match first.w {
            MatRef::Bf16 { .. } if first.t > 1 => &self.funcs.bf16_rows_many,
            MatRef::Bf16 { .. } => &self.funcs.bf16_many,
            MatRef::Mxfp4(_) => &self.funcs.mxfp4_many,
            _ => unreachable!("`together` groups only bf16 and MXFP4 products"),
        };
        // The table holds n entries of device addresses of each product's
        // segments, input and output, all of the checked shape.
        tape.kernel(f, cfg, [tab.slot(), r.slot(), c.slot(), t.slot()]);
    }

    /// Writes `w`'s kernel: weights at the device pointers `p` (its
    /// segments), input at `xp`, output at `yp`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch(
        &self,
        tape: &mut Tape,
        w: &MatRef<'_>,
        p: &[u64],
        xp: u64,
        yp: u64,
        groups: usize,
        t: usize,
    ) {
        let (rows, cols) = (w.rows(), w.cols());
        let (r, c, tt, rg) = (rows as i32, cols as i32, t as i32, (rows / groups) as i32);
        if self.tiled(w, t, groups, xp) {
            let cfg = tile_config(tiles(rows, t), 1);
            // `mm_bf16_tile`'s, `mm_mxfp4_tile`'s and `mm_int8_tile`'s parameters: the
            // weights' device segments, input, output and the shapes the
            // caller checked.
            let mut args = p.to_vec();
            args.extend([xp, yp, r.slot(), c.slot(), tt.slot()]);
            let f = match w {
                MatRef::Mxfp4(_) => &self.funcs.mxfp4_tile,
                MatRef::Int8 { .. } => &self.funcs.int8_tile,
                _ => &self.funcs.bf16_tile,
            };
            tape.kernel(f, cfg, args);
            return tape.tiled();
        }
        let (gx, threads) = self.grid_x(w, t, 1);
        let cfg = LaunchConfig {
            grid_dim: (gx, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let e4 = self.e4m3.device_ptr(&self.stream).0;
        let f = match w {
            MatRef::F32 { .. } => &self.funcs.f32,
            MatRef::Bf16 { .. } if t > 1 => &self.funcs.bf16_rows,
            MatRef::Bf16 { .. } => &self.funcs.bf16,
            MatRef::Int8 { .. } => &self.funcs.int8,
            MatRef::Mxfp4(_) => &self.funcs.mxfp4,
            MatRef::Fp8(_) => &self.funcs.fp8,
            MatRef::Int4(_) => &self.funcs.int4,
        };
        let mut args: Vec<u64> = p.to_vec();
        match w {
            MatRef::Fp8(m) => {
                args.push(e4);
                let ints = [
                    m.row0 as i32,
                    m.shift[0] as i32,
                    m.shift[1] as i32,
                    m.grid_cols as i32,
                ];
                args.extend(ints.map(|v| v.slot()));
            }
            MatRef::Int4(m) => args.push((m.group_shift as i32).slot()),
            _ => {}
        }
        args.extend([xp, yp, r.slot(), c.slot(), tt.slot(), rg.slot()]);
        // The arguments match the kernel's parameters in `matmul.cu`
        // (pointers to device copies of the segments, sized by the shapes
        // the caller checked).
        tape.kernel(f, cfg, args);
    }
}

/// Whether two products can share one launch: plain products of one
/// shape and position count in a format with a grouped kernel.
pub(super) fn together(a: &Placed<'_>, b: &Placed<'_>) -> bool {
    let kind = |j: &Placed<'_>| match j.w {
        MatRef::Bf16 { .. } => Some(0),
        MatRef::Mxfp4(_) => Some(1),
        _ => None,
    };
    kind(a).is_some()
        && kind(a) == kind(b)
        && a.groups == 1
        && b.groups == 1
        && (a.w.rows(), a.w.cols(), a.t) == (b.w.rows(), b.w.cols(), b.t)
}
