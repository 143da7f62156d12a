//! MLA attention over one sequence's latent cache on the device
//! (`mla.cu`): the cache's full blocks are kept with the weights (keyed by
//! their host address; the cache forgets a block before it changes or goes),
//! the partial last block goes up with the queries each call, then a
//! launch per chunk of queries of `mla_split` (a block per split and query)
//! and `mla_merge` (a block per query), and the context comes back with one
//! synchronisation.

use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg, result};
use fathom_kernels::attention::SPLIT;
use fathom_kernels::backend::{MatRef, MlaWork, segments};

use super::queue::{grow, pinned};
use super::{CudaBackend, State};
use crate::CudaError;

/// The most partial-result values (scores, maxima, sums, contexts) one
/// launch pair keeps on the device by default: 256 MiB. Longer prefills
/// run in chunks of queries; each query's result is its own, so the bits
/// do not move.
pub(super) const SCRATCH_FLOATS: usize = 1 << 26;

/// Where a call's pieces are on the device.
struct Placed {
    table: u64,
    q_lat: u64,
    q_rope: u64,
    ns: u64,
    out: u64,
}

impl CudaBackend {
    /// `work` on the device (see the module); `Ok(false)` when declined: a
    /// shape the kernels do not take, or the full blocks do not fit in the
    /// budget at once.
    pub(super) fn mla(&self, work: &mut MlaWork<'_, '_>) -> Result<bool, CudaError> {
        let sh = work.shape;
        let per_query = work.max_splits() * sh.heads * (SPLIT + sh.lora + 2);
        let limit = self.mla_scratch.load(std::sync::atomic::Ordering::Relaxed);
        if !work.fits_device_kernel() || per_query > limit {
            return Ok(false);
        }
        let mut st = self.lock_timed();
        let st = &mut *st;
        let Some(placed) = self.mla_stage(st, work)? else {
            return Ok(false);
        };
        let t = work.queries.len();
        let chunk = (limit / per_query).clamp(1, t);
        let queued = self.mla_launch(st, work, &placed, chunk);
        let waited = std::time::Instant::now();
        let synced = self.stream.synchronize();
        st.stats.sync_wait_ms += waited.elapsed().as_secs_f64() * 1e3;
        queued?;
        synced?;
        if let Some((a, b)) = &st.clock {
            st.stats.kernel_ms += f64::from(a.elapsed_ms(b)?);
        }
        let hy = st.hy.as_ref().expect("staged").as_slice()?;
        work.out.copy_from_slice(&hy[..work.out.len()]);
        st.stats.device_attention += 1;
        st.stats.vram_weight_bytes = st.cache.bytes();
        Ok(true)
    }

    /// The full blocks here (kept), the queries, the rows each sees and the
    /// changing blocks up in one copy, the block table in another; `None`
    /// (nothing copied) when the full blocks do not fit the budget at once.
    fn mla_stage(
        &self,
        st: &mut State,
        work: &MlaWork<'_, '_>,
    ) -> Result<Option<Placed>, CudaError> {
        let sh = work.shape;
        let t = work.queries.len();
        let segs: Vec<&[u8]> = work.blocks[..work.stable]
            .iter()
            .map(|b| {
                let m = MatRef::F32 {
                    w: b,
                    rows: 1,
                    cols: b.len(),
                };
                segments(&m)[0]
            })
            .collect();
        let Some((mut table, _)) = self.weights_here(st, &segs)? else {
            return Ok(None);
        };
        let q_lat: Vec<f32> = work.queries.iter().flat_map(|q| q.q_lat).copied().collect();
        let q_rope: Vec<f32> = work
            .queries
            .iter()
            .flat_map(|q| q.q_rope)
            .copied()
            .collect();
        // The rows each query sees, as the kernels' ints (bit patterns).
        let ns: Vec<f32> = work
            .queries
            .iter()
            .map(|q| f32::from_bits(q.n as u32))
            .collect();
        let changing = &work.blocks[work.stable..];
        let mut xs: Vec<&[f32]> = vec![&q_lat, &q_rope, &ns];
        xs.extend(changing.iter().copied());
        let (xp, yp) = self.stage(st, &xs, t * sh.heads * sh.lora)?;
        let at = |floats: usize| xp + 4 * floats as u64;
        let mut off = q_lat.len() + q_rope.len() + t;
        for b in changing {
            table.push(at(off));
            off += b.len();
        }
        let ht = pinned(self.stream.context(), &mut st.ht, table.len())?.as_mut_slice()?;
        ht[..table.len()].copy_from_slice(&table);
        let dt = grow(&self.stream, &mut st.dt, table.len())?
            .device_ptr(&self.stream)
            .0;
        let ht = st.ht.as_ref().expect("staged").as_slice()?;
        // SAFETY: the device table holds at least table.len() values; `ht`
        // is page-locked and not touched again before the synchronisation.
        unsafe { result::memcpy_htod_async(dt, &ht[..table.len()], self.stream.cu_stream()) }?;
        Ok(Some(Placed {
            table: dt,
            q_lat: at(0),
            q_rope: at(q_lat.len()),
            ns: at(q_lat.len() + q_rope.len()),
            out: yp,
        }))
    }

    /// The launches, `chunk` queries at a time, clocked, and the context's
    /// copy back into the host staging.
    fn mla_launch(
        &self,
        st: &mut State,
        work: &MlaWork<'_, '_>,
        p: &Placed,
        chunk: usize,
    ) -> Result<(), CudaError> {
        let sh = work.shape;
        let (h, lora, t, ms) = (sh.heads, sh.lora, work.queries.len(), work.max_splits());
        let parts = chunk * ms * h;
        let scratch = grow(&self.stream, &mut st.mla, parts * (SPLIT + lora + 2))?
            .device_ptr(&self.stream)
            .0;
        let ps = scratch;
        let pm = ps + 4 * (parts * SPLIT) as u64;
        let pl = pm + 4 * parts as u64;
        let pc = pl + 4 * parts as u64;
        let (hh, lo, ro, msi) = (h as i32, lora as i32, sh.rope as i32, ms as i32);
        self.ensure_clock(st)?;
        st.clock
            .as_ref()
            .expect("just made")
            .0
            .record(&self.stream)?;
        for c0 in (0..t).step_by(chunk) {
            let c = chunk.min(t - c0) as u64;
            let q_lat = p.q_lat + 4 * (c0 * h * lora) as u64;
            let q_rope = p.q_rope + 4 * (c0 * h * sh.rope) as u64;
            let ns = p.ns + 4 * c0 as u64;
            let out = p.out + 4 * (c0 * h * lora) as u64;
            let split = LaunchConfig {
                grid_dim: (ms as u32, c as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(&self.funcs.mla_split);
            b.arg(&p.table).arg(&q_lat).arg(&q_rope).arg(&ns);
            b.arg(&hh).arg(&lo).arg(&ro).arg(&sh.scale).arg(&msi);
            b.arg(&ps).arg(&pm).arg(&pl).arg(&pc);
            // SAFETY: the arguments match `mla_split` in `mla.cu`: the table
            // holds every block's device address (all but the last SPLIT rows
            // of lora + rope values), the queries and row counts hold `c`
            // entries from `c0`, the scratch `c · ms · h` partials
            // (`fits_device_kernel` checked the shapes).
            unsafe { b.launch(split) }?;
            let merge = LaunchConfig {
                grid_dim: (c as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(&self.funcs.mla_merge);
            b.arg(&ns).arg(&hh).arg(&lo).arg(&msi);
            b.arg(&pm).arg(&pl).arg(&pc).arg(&out);
            // SAFETY: as above; `out` holds `c · h · lora` values from `c0`.
            unsafe { b.launch(merge) }?;
        }
        st.clock
            .as_ref()
            .expect("made above")
            .1
            .record(&self.stream)?;
        self.fetch(st, p.out, t * h * lora)
    }
}
