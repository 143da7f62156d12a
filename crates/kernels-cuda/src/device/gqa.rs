//! A grouped-query attention layer for a step's sequences in one round
//! trip ([`GqaWork`]): the layer's normed rows go up; the q, k, v
//! products, `gqa_prep` (biases, the heads' norms, the rotary step; the
//! new `[K | V]` rows written into their cache blocks and after the
//! output), `gqa_split` and `gqa_merge` (`gqa.cu`, in chunks of queries
//! within the scratch cap, as MLA's), `o_proj` and its bias run on the
//! device; the output and the new rows come back. The caches' full blocks
//! are kept with the weights (keyed by their host address), partial blocks
//! go up each call with room for the new rows.

use cudarc::driver::{DevicePtr, LaunchConfig};
use fathom_kernels::attention::SPLIT;
use fathom_kernels::backend::{Biased, GqaWork, MatRef, segments};

use super::blocks::{Blocks, kept_segments};
use super::launch::Ready;
use super::mla::{split_at_lens, starts_of, with_pieces};
use super::queue::{fits, grow};
use super::tape::{Arg, Tape};
use super::{CudaBackend, State};
use crate::CudaError;

/// Where a call's pieces are on the device.
struct Placed {
    /// q's, k's, v's and `o_proj`'s segments.
    mats: [Vec<u64>; 4],
    /// Biases (q, k, v, o), the norms' weights (q, k) and the sinks: 0
    /// where absent.
    bias: [u64; 4],
    norm: [u64; 2],
    sinks: u64,
    x: u64,
    angles: (u64, u64),
    ns: u64,
    boff: u64,
    table: u64,
    out: u64,
    /// Whether the work's `then` comes along (its weights are here).
    then: bool,
}

impl CudaBackend {
    /// `work` on the device (see the module); `Ok(false)` when declined:
    /// a shape the kernels do not take, or the weights and full blocks do
    /// not fit in the budget at once.
    pub(super) fn gqa(&self, work: &mut GqaWork<'_>) -> Result<bool, CudaError> {
        let sh = work.shape;
        let (h, hd, t) = (sh.heads, sh.head_dim, work.ns.len());
        let per_query = work.max_splits() * h * (SPLIT + hd + 2);
        let limit = self.mla_scratch.load(std::sync::atomic::Ordering::Relaxed);
        let product_fits = |p: &Biased<'_>, cols: usize| fits(&p.w, 1, t, t * cols, t * p.w.rows());
        let dm = work.qkv[0].w.cols();
        if !work.fits_device_kernel()
            || per_query > limit
            || !work.qkv.iter().all(|p| product_fits(p, dm))
            || !product_fits(&work.o_proj, h * hd)
        {
            return Ok(false);
        }
        let mut st = self.lock_timed();
        let st = &mut *st;
        st.tape.begin();
        let with_then = work
            .then
            .as_ref()
            .is_some_and(|w| super::then::then_fits(w, work.out.len()));
        // Without room for `then`'s weights too, the attention alone.
        let mut placed = self.gqa_stage(st, work, with_then)?;
        if placed.is_none() && with_then {
            placed = self.gqa_stage(st, work, false)?;
        }
        let Some(placed) = placed else {
            return Ok(false);
        };
        // At most 65535 queries a launch (the grid's y).
        let chunk = (limit / per_query.max(1)).clamp(1, t.min(65535));
        let queued = self
            .gqa_launch(st, work, &placed, chunk)
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
        work.rows_out
            .copy_from_slice(&hy[n_out..n_out + work.rows_out.len()]);
        if let Some(t) = work.then.as_mut().filter(|_| placed.then) {
            self.then_finish(st, t)?;
        }
        st.stats.device_attention += 1;
        st.stats.weight_bytes_read += work
            .qkv
            .iter()
            .chain([&work.o_proj])
            .flat_map(|p| segments(&p.w))
            .map(|s| s.len() as u64)
            .sum::<u64>();
        st.stats.vram_weight_bytes = st.cache.bytes();
        Ok(true)
    }

    /// The products' weights and the full blocks here (kept); the rows
    /// each query sees, where its cache starts in the table, the normed
    /// rows, the angles, biases, norms, sinks and the partial blocks (with
    /// room for the step's new rows, `blocks.rs`) up in one
    /// copy, the block table in another; `None` (nothing copied) when the
    /// weights and full blocks do not fit the budget at once.
    fn gqa_stage(
        &self,
        st: &mut State,
        work: &GqaWork<'_>,
        with_then: bool,
    ) -> Result<Option<Placed>, CudaError> {
        let prods = [&work.qkv[0], &work.qkv[1], &work.qkv[2], &work.o_proj];
        let psegs: Vec<Vec<&[u8]>> = prods.iter().map(|p| segments(&p.w)).collect();
        let mut segs: Vec<&[u8]> = psegs.iter().flatten().copied().collect();
        segs.extend(kept_segments(work.seqs));
        let then = work.then.as_ref().filter(|_| with_then);
        segs.extend(then.map(super::then::then_segments).unwrap_or_default());
        let mut mats: Vec<MatRef<'_>> = prods.iter().map(|p| p.w).collect();
        mats.extend(then.map(super::then::products).unwrap_or_default());
        let Some((ptrs, _)) = self.weights_here(st, &segs, &mats)? else {
            return Ok(None);
        };
        let np = psegs.iter().map(Vec::len).sum::<usize>();
        let ns: Vec<f32> = work.ns.iter().map(|&n| f32::from_bits(n as u32)).collect();
        let w = work.shape.width();
        let after: Vec<usize> = work.seqs.iter().map(|s| work.seq_rows(s).1).collect();
        let zeros = vec![0f32; SPLIT * w];
        let blocks = Blocks::plan(work.seqs, &after, (work.ns.len(), w), &zeros);
        let none: &[f32] = &[];
        let (qn, kn) = work.qk_norm.map_or((none, none), |(a, b, _)| (a, b));
        let mut xs: Vec<&[f32]> = vec![&ns, &blocks.boff, work.x, work.cos, work.sin];
        xs.extend(prods.iter().map(|p| p.bias.unwrap_or(none)));
        xs.extend([qn, kn, work.sinks.unwrap_or(none)]);
        let (starts, head) = with_pieces(starts_of(&xs), &blocks.pieces);
        // A piece's address, 0 when it is empty (absent).
        let present: Vec<bool> = xs.iter().map(|v| !v.is_empty()).collect();
        xs.extend(&blocks.pieces);
        let (xp, yp) = self.stage_at(st, &xs, &starts, work.out.len() + work.rows_out.len())?;
        let at = |k: usize| xp + 4 * starts[k] as u64;
        let opt = |k: usize| if present[k] { at(k) } else { 0 };
        let dt = self.stage_table(st, &blocks.table(&ptrs[np..], xp, head))?;
        let mats = split_at_lens(&ptrs[..np], &psegs);
        Ok(Some(Placed {
            mats: [0, 1, 2, 3].map(|i| mats[i].clone()),
            bias: [opt(5), opt(6), opt(7), opt(8)],
            norm: [opt(9), opt(10)],
            sinks: opt(11),
            x: at(2),
            angles: (at(3), at(4)),
            ns: at(0),
            boff: at(1),
            table: dt,
            out: yp,
            then: then.is_some(),
        }))
    }

    /// The launches written, clocked: the three products, `gqa_prep` for
    /// q, k and v, the attention `chunk` queries at a time, `o_proj` and
    /// its bias; then the output's and the new rows' copy back.
    fn gqa_launch(
        &self,
        st: &mut State,
        work: &GqaWork<'_>,
        p: &Placed,
        chunk: usize,
    ) -> Result<(), CudaError> {
        let sh = work.shape;
        let (h, kvh, hd, t) = (sh.heads, sh.kv_heads, sh.head_dim, work.ns.len());
        let (qw, kvw, ms) = (h * hd, kvh * hd, work.max_splits());
        let parts = chunk * ms * h;
        let raw = t * (qw + 2 * kvw);
        let scratch = grow(
            &self.stream,
            &mut st.mla,
            raw + 2 * t * qw + parts * (SPLIT + hd + 2),
            &mut st.reallocs,
        )?
        .device_ptr(&self.stream)
        .0;
        let f = |floats: usize| scratch + 4 * floats as u64;
        let raws = [f(0), f(t * qw), f(t * (qw + kvw))];
        let (q, ctx) = (f(raw), f(raw + t * qw));
        let ps = f(raw + 2 * t * qw);
        let pm = ps + 4 * (parts * SPLIT) as u64;
        let pl = pm + 4 * parts as u64;
        let pc = pl + 4 * parts as u64;
        self.ensure_clock(st)?;
        let tape = &mut st.tape;
        tape.clock(false);
        let ready: Vec<Ready<'_, '_>> = (work.qkv.iter().zip(&p.mats).zip(&raws))
            .map(|((m, segs), &y)| Ready {
                w: &m.w,
                p: segs,
                x: p.x,
                y,
                t,
            })
            .collect();
        self.launch_ready(tape, &ready);
        self.launch_preps(tape, work, p, (raws, q));
        for c0 in (0..t).step_by(chunk) {
            let c = chunk.min(t - c0);
            self.gqa_chunk(tape, work, p, (c0, c), (q, ctx), (ps, pm, pl, pc));
        }
        self.launch(tape, &work.o_proj.w, &p.mats[3], ctx, p.out, 1, t);
        if p.bias[3] != 0 {
            let n = work.out.len();
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let (n64, cols) = (n as i64, work.o_proj.w.rows() as i32);
            // `bias_rows` in `gqa.cu`: the output's n values, `cols` biases.
            let args = [p.out, p.bias[3], n64.slot(), cols.slot()];
            tape.kernel(&self.funcs.bias_rows, cfg, args);
        }
        tape.clock(true);
        self.fetch(st, p.out, work.out.len() + work.rows_out.len())?;
        match work.then.as_ref().filter(|_| p.then) {
            Some(t) => self.then_launch(st, t, p.out),
            None => Ok(()),
        }
    }

    /// Writes `gqa_prep` for q (into `q`), k and v (into the new rows after
    /// the output and into their cache blocks) from their raw products.
    fn launch_preps(
        &self,
        tape: &mut Tape,
        work: &GqaWork<'_>,
        p: &Placed,
        (raws, q): ([u64; 3], u64),
    ) {
        let sh = work.shape;
        let (h, kvh, hd, t) = (sh.heads, sh.kv_heads, sh.head_dim, work.ns.len());
        let (qw, kvw) = (h * hd, kvh * hd);
        let rows = p.out + 4 * work.out.len() as u64;
        let eps = work.qk_norm.map_or(0.0, |n| n.2);
        // (source, heads, bias, norm, roped, destination, stride, offset, into the cache)
        let preps = [
            (raws[0], h, p.bias[0], p.norm[0], true, q, qw, 0, false),
            (
                raws[1],
                kvh,
                p.bias[1],
                p.norm[1],
                true,
                rows,
                2 * kvw,
                0,
                true,
            ),
            (raws[2], kvh, p.bias[2], 0, false, rows, 2 * kvw, kvw, true),
        ];
        for (src, heads, bias, norm, roped, dst, stride, off, cached) in preps {
            let cfg = LaunchConfig {
                grid_dim: (t as u32, heads as u32, 1),
                block_dim: (hd.next_multiple_of(32).min(256) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let table = if cached { p.table } else { 0 };
            let (hh, hdi, nm, rp) = (
                heads as i32,
                hd as i32,
                i32::from(norm != 0),
                i32::from(roped),
            );
            let (st64, off, wi) = (stride as i64, off as i32, sh.width() as i32);
            // The arguments match `gqa_prep` in `gqa.cu`: t rows of heads·hd
            // values at `src`, the bias and norm (hd values, or 0), the
            // angles t·hd/2 each, the destination's rows `stride` apart;
            // with the table, each row's cache block (rows w wide).
            let args = [
                src,
                hh.slot(),
                hdi.slot(),
                bias,
                norm,
                eps.slot(),
                nm.slot(),
            ];
            let args: Vec<u64> = args
                .into_iter()
                .chain([
                    p.angles.0,
                    p.angles.1,
                    rp.slot(),
                    dst,
                    st64.slot(),
                    off.slot(),
                ])
                .chain([table, p.boff, p.ns, wi.slot()])
                .collect();
            tape.kernel(&self.funcs.gqa_prep, cfg, args);
        }
    }

    /// Writes the attention of queries `c0..c0 + c`: `gqa_split` a block
    /// per split, query and head, `gqa_merge` a block per query and head;
    /// the queries at `q`, the context into `ctx` (both `[T, H, hd]`).
    fn gqa_chunk(
        &self,
        tape: &mut Tape,
        work: &GqaWork<'_>,
        p: &Placed,
        (c0, c): (usize, usize),
        (q, ctx): (u64, u64),
        (ps, pm, pl, pc): (u64, u64, u64, u64),
    ) {
        let sh = work.shape;
        let (h, hd, ms) = (sh.heads, sh.head_dim, work.max_splits());
        let (hh, kvh, hdi, msi) = (h as i32, sh.kv_heads as i32, hd as i32, ms as i32);
        let window = sh.window.map_or(0, |w| w.min(i32::MAX as usize)) as i32;
        let (qc, ns, boff) = (
            q + 4 * (c0 * h * hd) as u64,
            p.ns + 4 * c0 as u64,
            p.boff + 4 * c0 as u64,
        );
        let out = ctx + 4 * (c0 * h * hd) as u64;
        let cfg = |grid| LaunchConfig {
            grid_dim: grid,
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // The arguments match `gqa_split` in `gqa.cu`: the table holds every
        // block's address, the queries, row counts and offsets `c` entries
        // from `c0`, the scratch `c · ms · h` partials (`fits_device_kernel`
        // checked the shapes).
        let split = [p.table, boff, qc, ns, hh.slot(), kvh.slot(), hdi.slot()];
        let split: Vec<u64> = split
            .into_iter()
            .chain([sh.scale.slot(), window.slot(), msi.slot(), ps, pm, pl, pc])
            .collect();
        tape.kernel(
            &self.funcs.gqa_split,
            cfg((ms as u32, c as u32, h as u32)),
            split,
        );
        // As above; the context is [T, H, hd] from query c0.
        let merge = [
            ns,
            hh.slot(),
            hdi.slot(),
            window.slot(),
            msi.slot(),
            p.sinks,
            pm,
            pl,
            pc,
            out,
        ];
        tape.kernel(&self.funcs.gqa_merge, cfg((c as u32, h as u32, 1)), merge);
    }
}
