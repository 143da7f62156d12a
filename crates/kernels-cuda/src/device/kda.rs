//! A KDA layer's core on the device (`kda.cu`), and the sequences' states
//! it leaves there: named by their host copies' address and length,
//! counted against the VRAM budget, copied back or copied on the device
//! when the owner asks, dropped with their owners.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};
use fathom_kernels::backend::{MatRef, segments};
use fathom_kernels::kda::KdaJob;
use fathom_kernels::state_buf::{StateBuf, StateKey};

use super::launch::Ready;
use super::layout::{Layout, conflicting, relayout};
use super::queue::{grow, held_copied, key, make_room, pinned, spine_class};
use super::tape::{Arg, Tape};
use super::then;
use super::{CudaBackend, Resident, State};
use crate::CudaError;
use crate::cache::{Class, Key};

/// How a KDA step failed: before anything ran (nothing changed: the
/// caller may run it on the CPU) or after a launch (a state may have moved
/// on: the step must fail).
pub(super) enum KdaFailure {
    Before(CudaError),
    After(CudaError),
}

/// What a step needs on the device before its first launch.
struct Staged {
    /// Inputs (pre q, k, v, f, b, g), then the parameters (conv taps q, k,
    /// v, a, dt_bias, o_norm); `at[3]` and `at[5]` are the full forget and
    /// output gates (their up-projections' outputs when the job has them).
    at: [u64; 12],
    /// The staged low-rank forget-gate input and the up-projection's
    /// segments, when the job has one; the output gate's likewise.
    f_up: Option<(u64, Vec<u64>)>,
    g_up: Option<(u64, Vec<u64>)>,
    /// The head outputs' scratch and `o_proj`'s segments, when it has one.
    o_proj: Option<(u64, Vec<u64>)>,
    out: u64,
    /// Where the journal's inputs go (0: none).
    hin: u64,
    /// With `proj`: the staged rows `x`, each projection's segments and
    /// where its output goes (the inputs' places above; the forget gate's
    /// low-rank part where the up-projection reads it).
    proj: Option<(u64, Vec<Vec<u64>>, [u64; 6])>,
    /// Per sequence: S and the q, k, v windows.
    states: Vec<[u64; 4]>,
    ny: usize,
    /// Whether the job's `then` comes along (its weights are here).
    then: bool,
}

impl CudaBackend {
    /// Runs `job` in one round trip: its inputs go up in one copy, the
    /// layer's parameters are kept with the weights (copied up on first
    /// use; their owner forgets them when it drops them), each sequence's
    /// states are copied up unless their newest copies are here already —
    /// all before the first launch —, then one launch per sequence (a
    /// block per head) and the outputs back with one synchronisation.
    /// `Ok(false)` when declined: a shape the kernel does not take.
    pub(super) fn kda(&self, job: &mut KdaJob<'_>) -> Result<bool, KdaFailure> {
        if !job.fits_device_kernel() {
            return Ok(false);
        }
        let out_len = job.out.len();
        let asked = std::time::Instant::now();
        let mut st = self.lock();
        let st = &mut *st;
        st.stats.lock_wait_ms += asked.elapsed().as_secs_f64() * 1e3;
        st.tape.begin();
        let with_then = job.o_proj.is_some()
            && job
                .then
                .as_ref()
                .is_some_and(|t| then::then_fits(t, out_len));
        // Without room for `then`'s weights too, the step alone.
        let mut staged = self.kda_stage(st, job, with_then);
        if with_then && matches!(staged, Ok(None)) {
            staged = self.kda_stage(st, job, false);
        }
        // Staged and written, nothing launched yet.
        let written = staged.and_then(|staged| match staged {
            Some(s) => self.kda_launch(st, job, &s).map(|()| Some(s.then)),
            None => Ok(None),
        });
        let then_on = match written {
            Ok(Some(then_on)) => then_on,
            // No room for the step's weights: declined with nothing copied
            // (not a device error: the CPU takes the step).
            Ok(None) => return Ok(false),
            Err(e) => {
                // Copies made for this job hold nothing its owners will ask for.
                for s in &job.seqs {
                    let bufs = [&*s.s, &*s.conv[0], &*s.conv[1], &*s.conv[2]];
                    for b in bufs.into_iter().filter(|b| b.host().is_some()) {
                        take_state(st, b.key());
                    }
                }
                let _ = self.stream.synchronize();
                return Err(KdaFailure::Before(e));
            }
        };
        let ran = self.flush(st);
        st.stats.device_calls += 1;
        let waited = std::time::Instant::now();
        let synced = self.stream.synchronize();
        st.stats.sync_wait_ms += waited.elapsed().as_secs_f64() * 1e3;
        ran.and(synced.map_err(CudaError::from))
            .map_err(KdaFailure::After)?;
        if let Some((a, b)) = &st.clock
            && let Ok(ms) = a.elapsed_ms(b)
        {
            st.stats.kernel_ms += f64::from(ms);
        }
        let hy = st
            .hy
            .as_ref()
            .expect("staged")
            .as_slice()
            .map_err(|e| KdaFailure::After(e.into()))?;
        job.out.copy_from_slice(&hy[..out_len]);
        if let Some(buf) = job.inputs_out.as_deref_mut() {
            buf.copy_from_slice(&hy[out_len..out_len + buf.len()]);
        }
        for s in job.seqs.iter_mut() {
            s.s.set_on_device();
            s.conv.iter_mut().for_each(|c| c.set_on_device());
        }
        if let Some(t) = job.then.as_mut().filter(|_| then_on) {
            self.then_finish(st, t).map_err(KdaFailure::After)?;
        }
        // The products in the call count as the products they are.
        let projs = job.proj.as_ref().map_or(&[][..], |pj| &pj.mats[..]);
        let ups = job.f_up.iter().chain(&job.g_up);
        for m in ups.chain(&job.o_proj).chain(projs) {
            st.stats.device_products += 1;
            st.stats.weight_bytes_read += segments(m).iter().map(|s| s.len() as u64).sum::<u64>();
        }
        Ok(true)
    }

    /// Everything before the first launch: parameters and states here,
    /// inputs copied up, output room; `None` (nothing copied) when the
    /// weights do not fit the budget together. Nothing here changes a state.
    fn kda_stage(
        &self,
        st: &mut State,
        job: &KdaJob<'_>,
        with_then: bool,
    ) -> Result<Option<Staged>, CudaError> {
        let p = job.dims.width();
        let n = job.seqs.last().map_or(0, |s| s.rows.end);
        let (mut segs, [nf, ng, no]) = weight_segments(job);
        let psegs = proj_segments(job);
        let nw = segs.len();
        segs.extend(psegs.iter().flatten());
        let then = job.then.as_ref().filter(|_| with_then);
        segs.extend(then.map(then::then_segments).unwrap_or_default());
        let ups = job.f_up.iter().chain(&job.g_up);
        let mut mats: Vec<MatRef<'_>> = ups.chain(&job.o_proj).copied().collect();
        mats.extend(job.proj.iter().flat_map(|pj| pj.mats.iter().copied()));
        mats.extend(then.map(then::products).unwrap_or_default());
        let Some((ptrs, keep)) = self.weights_here(st, &segs, &mats)? else {
            return Ok(None);
        };
        let mut states = Vec::with_capacity(job.seqs.len());
        for seq in &job.seqs {
            let bufs: [&StateBuf; 4] = [&*seq.s, &*seq.conv[0], &*seq.conv[1], &*seq.conv[2]];
            let mut ptrs = [0u64; 4];
            for (ptr, buf) in ptrs.iter_mut().zip(bufs) {
                *ptr = self.state_here(st, buf, &keep)?;
            }
            states.push(ptrs);
        }
        let (places, xd) = self.stage_inputs(st, job, n)?;
        let out_len = job.out.len();
        let ny = out_len + job.inputs_out.as_ref().map_or(0, |b| b.len());
        pinned(self.stream.context(), &mut st.hy, ny, &mut st.reallocs)?;
        let yp = grow(&self.stream, &mut st.y, ny, &mut st.reallocs)?
            .device_ptr(&self.stream)
            .0;
        let mut at = [0u64; 12];
        at[..6].copy_from_slice(&places);
        at[6..].copy_from_slice(&ptrs[..6]);
        // A gate's up-projection: its full output goes to a scratch buffer
        // that takes the gate's place in `at`; the staged low-rank input
        // is where the up-projection reads.
        let mut up = |segs: &[u64], scratch: bool, slot: usize| -> Result<_, CudaError> {
            if segs.is_empty() {
                return Ok(None);
            }
            let buf = if scratch { &mut st.kg } else { &mut st.kf };
            let full = grow(&self.stream, buf, n * p, &mut st.reallocs)?
                .device_ptr(&self.stream)
                .0;
            Ok(Some((
                std::mem::replace(&mut at[slot], full),
                segs.to_vec(),
            )))
        };
        let f_up = up(&ptrs[6..6 + nf], false, 3)?;
        let g_up = up(&ptrs[6 + nf..6 + nf + ng], true, 5)?;
        let o_proj = if no == 0 {
            None
        } else {
            let ko = grow(&self.stream, &mut st.ko, n * p, &mut st.reallocs)?
                .device_ptr(&self.stream)
                .0;
            let first = 6 + nf + ng;
            Some((ko, ptrs[first..first + no].to_vec()))
        };
        let proj = job.proj.as_ref().map(|_| {
            let mut at_seg = nw;
            let per: Vec<Vec<u64>> = psegs
                .iter()
                .map(|m| {
                    let v = ptrs[at_seg..at_seg + m.len()].to_vec();
                    at_seg += m.len();
                    v
                })
                .collect();
            (xd, per, places)
        });
        let hin = if ny > out_len {
            yp + 4 * out_len as u64
        } else {
            0
        };
        Ok(Some(Staged {
            at,
            f_up,
            g_up,
            o_proj,
            out: yp,
            hin,
            proj,
            states,
            ny,
            then: then.is_some(),
        }))
    }

    /// The step's inputs up in one copy: their six places on the device
    /// (pre q, k, v, f, b, g, one after another) and where the copied rows
    /// start — the inputs themselves, or with `proj` only its rows `x`,
    /// after the places its products fill.
    fn stage_inputs(
        &self,
        st: &mut State,
        job: &KdaJob<'_>,
        n: usize,
    ) -> Result<([u64; 6], u64), CudaError> {
        let x = &job.x;
        let parts: [&[f32]; 6] = [x.pre[0], x.pre[1], x.pre[2], x.f, x.b, x.g];
        let (lens, up): ([usize; 6], Vec<&[f32]>) = match &job.proj {
            Some(pj) => (pj.mats.map(|m| n * m.rows()), vec![pj.x]),
            None => (parts.map(|v| v.len()), parts.to_vec()),
        };
        let skip: usize = if job.proj.is_some() {
            lens.iter().sum()
        } else {
            0
        };
        let sent: usize = up.iter().map(|v| v.len()).sum();
        let hx =
            pinned(self.stream.context(), &mut st.hx, sent, &mut st.reallocs)?.as_mut_slice()?;
        let mut off = 0;
        for v in &up {
            hx[off..off + v.len()].copy_from_slice(v);
            off += v.len();
        }
        let xp = grow(&self.stream, &mut st.x, skip + sent, &mut st.reallocs)?
            .device_ptr(&self.stream)
            .0;
        let mut places = [0u64; 6];
        let mut off = 0;
        for (place, len) in places.iter_mut().zip(lens) {
            *place = xp + 4 * off as u64;
            off += len;
        }
        let hx = st.hx.as_ref().expect("staged").as_slice()?;
        let dst = xp + 4 * skip as u64;
        // The device buffer holds `skip + sent` values from `xp`; `hx` is
        // page-locked and not written again before the synchronisation.
        st.tape.up(dst, &hx[..sent]);
        st.stats.h2d_bytes += 4 * sent as u64;
        Ok((places, dst))
    }

    /// Writes the products, one launch per sequence, then the outputs' copy back.
    fn kda_launch(&self, st: &mut State, job: &KdaJob<'_>, s: &Staged) -> Result<(), CudaError> {
        let d = job.dims;
        let (h, kd, kernel) = (d.heads as i32, d.head_dim as i32, d.conv_kernel as i32);
        let (q_scale, l2, eps) = (d.q_scale(), fathom_kernels::kda::KDA_L2_EPS, d.norm_eps);
        let n = job.seqs.last().map_or(0, |s| s.rows.end);
        let n_rows = n as i32;
        // The decay's form: lb·σ(a·z) with a lower bound, else −a·softplus(z).
        let (bounded, lb) = match d.gate_lower_bound {
            Some(lb) => (1i32, lb),
            None => (0, 0.0f32),
        };
        self.ensure_clock(st)?;
        let tape = &mut st.tape;
        tape.clock(false);
        self.launch_projections(tape, job, s, n);
        let core = s.o_proj.as_ref().map_or(s.out, |(ko, _)| *ko);
        let cfg = LaunchConfig {
            grid_dim: (d.heads as u32, 1, 1),
            block_dim: (d.head_dim as u32, 1, 1),
            shared_mem_bytes: (4 * (4 * d.head_dim + 2)) as u32,
        };
        for (seq, ptrs) in job.seqs.iter().zip(&s.states) {
            let (row0, t) = (seq.rows.start as i32, seq.rows.len() as i32);
            let mut args: Vec<u64> = ptrs.iter().chain(&s.at).copied().collect();
            args.extend([
                core,
                row0.slot(),
                t.slot(),
                h.slot(),
                kd.slot(),
                kernel.slot(),
            ]);
            args.extend([
                q_scale.slot(),
                l2.slot(),
                eps.slot(),
                bounded.slot(),
                lb.slot(),
            ]);
            args.extend([s.hin, n_rows.slot()]);
            // The arguments match `kda_step` in `kda.cu`: device copies of
            // the sequence's states, the staged inputs and the parameters,
            // sized as `fits_device_kernel` checked (rows tiling
            // 0..n_rows); `kd` ≤ 1024 threads, `kernel` ≤ KDA_MAX_KERNEL.
            tape.kernel(&self.funcs.kda, cfg, args);
        }
        if let (Some(m), Some((ko, segs))) = (&job.o_proj, &s.o_proj) {
            self.launch(tape, m, segs, *ko, s.out, 1, n);
        }
        tape.clock(true);
        let hy = st.hy.as_mut().expect("staged").as_mut_slice()?;
        // The device buffer holds `ny` values written by the kernels before
        // it; `hy` is page-locked and read after the synchronisation.
        st.tape.down(&mut hy[..s.ny], s.out);
        st.stats.d2h_bytes += 4 * s.ny as u64;
        match job.then.as_ref().filter(|_| s.then) {
            Some(t) => self.then_launch(st, t, s.out),
            None => Ok(()),
        }
    }

    /// Writes the step's projections of its rows (one set launch when bf16),
    /// then the gates' up-projections, which read their outputs.
    fn launch_projections(&self, tape: &mut Tape, job: &KdaJob<'_>, s: &Staged, n: usize) {
        if let (Some(pj), Some((xd, segs, places))) = (&job.proj, &s.proj) {
            let ready: Vec<Ready<'_, '_>> = (pj.mats.iter().zip(segs).zip(places))
                .map(|((w, p), &y)| Ready {
                    w,
                    p,
                    x: *xd,
                    y,
                    t: n,
                })
                .collect();
            self.launch_ready(tape, &ready);
        }
        let ups = [(&job.f_up, &s.f_up, s.at[3]), (&job.g_up, &s.g_up, s.at[5])];
        let ready: Vec<Ready<'_, '_>> = ups
            .iter()
            .filter_map(|(m, staged, y)| {
                let (w, (low, p)) = (m.as_ref()?, staged.as_ref()?);
                Some(Ready {
                    w,
                    p,
                    x: *low,
                    y: *y,
                    t: n,
                })
            })
            .collect();
        self.launch_ready(tape, &ready);
    }

    /// The device addresses of a step's weight segments (the layer's
    /// parameters, the products' matrices), each kept in the weight cache
    /// (copied up on the compute stream the first time, so the launches
    /// after it see it), and their keys (to keep them while the step makes
    /// room for states); `mats` are the matrices among them, laid out for
    /// their products ([`Layout`]). `None`, nothing copied, when they do not
    /// fit or the same bytes are two of `mats` in different layouts.
    pub(super) fn weights_here(
        &self,
        st: &mut State,
        segs: &[&[u8]],
        mats: &[MatRef<'_>],
    ) -> Result<Option<(Vec<u64>, Vec<Key>)>, CudaError> {
        let keys: Vec<Key> = segs.iter().map(|s| key(s)).collect();
        // The matrices by their first segment, whose layout in VRAM may
        // differ from the host's ([`Layout`]); the other segments keep it.
        let firsts: foldhash::HashMap<Key, &MatRef<'_>> = mats
            .iter()
            .filter_map(|m| segments(m).first().map(|s| (key(s), m)))
            .collect();
        let layout = |k: &Key| firsts.get(k).map_or(Layout::Host, |m| Layout::of(m, 0));
        let by_mat: Vec<(Key, Layout)> = mats.iter().flat_map(Layout::wanted).collect();
        if conflicting(&by_mat) {
            return Ok(None);
        }
        let wanted: Vec<(Key, Layout)> = keys.iter().map(|k| (*k, layout(k))).collect();
        relayout(st, &wanted);
        // Room for all the missing ones at once (never evicting the step's
        // own), or `None` before anything is copied.
        // The room is made in the held class when any missing segment is
        // held (asked only of the missing ones: a call whose weights are
        // all here looks nothing up).
        let mut seen = <foldhash::HashSet<Key> as foldhash::HashSetExt>::new();
        let (mut missing, mut class) = (0u64, Class::Spine);
        for (s, k) in segs.iter().zip(&keys) {
            if !st.cache.contains(k) && seen.insert(*k) {
                missing += s.len() as u64;
                if class != Class::Held {
                    class = spine_class(s);
                }
            }
        }
        if missing > 0 && !make_room(st, missing, &keys, class) {
            return Ok(None);
        }
        let mut ptrs = Vec::with_capacity(segs.len());
        for (seg, k) in segs.iter().zip(&keys) {
            if st.cache.touch(k).is_none() {
                let buf = self.stream.clone_htod(*seg)?;
                held_copied(st, seg);
                let layout = layout(k);
                if let Some(m) = firsts.get(k) {
                    self.lay_out(&self.stream, m, layout, &buf)?;
                }
                st.stats.h2d_bytes += seg.len() as u64;
                let r = Resident {
                    buf,
                    ready: None,
                    layout,
                };
                st.cache.insert(*k, r, spine_class(seg));
            } else if let Some(ready) = st.cache.get(k).and_then(|r| r.ready.as_ref()) {
                // A copy still running on the copy stream (made for a batch
                // of products): the launches wait for it.
                self.stream.wait(ready)?;
            }
            ptrs.push(
                st.cache
                    .get(k)
                    .expect("just made")
                    .buf
                    .device_ptr(&self.stream)
                    .0,
            );
        }
        Ok(Some((ptrs, keys)))
    }

    /// The device address of `buf`'s copy here, copied up first when its
    /// newest copy is the host's (room made in the budget, never evicting
    /// `keep`).
    fn state_here(&self, st: &mut State, buf: &StateBuf, keep: &[Key]) -> Result<u64, CudaError> {
        let key = buf.key();
        if let Some(host) = buf.host() {
            let dev = match take_state(st, key) {
                Some(mut dev) if dev.len() == host.len() => {
                    self.stream.memcpy_htod(host, &mut dev)?;
                    dev
                }
                _ => {
                    self.room_for_state(st, 4 * host.len() as u64, keep)?;
                    self.stream.clone_htod(host)?
                }
            };
            st.stats.h2d_bytes += 4 * host.len() as u64;
            insert_state(st, key, dev);
        }
        let dev = st.states.get(&key).ok_or_else(|| {
            CudaError::Driver("a sequence's state is marked on the device but is not here".into())
        })?;
        Ok(dev.device_ptr(&self.stream).0)
    }

    /// Room in the VRAM budget for `bytes` more of states.
    fn room_for_state(&self, st: &mut State, bytes: u64, keep: &[Key]) -> Result<(), CudaError> {
        st.cache.set_outside(st.state_bytes);
        if make_room(st, bytes, keep, Class::State) {
            Ok(())
        } else {
            Err(CudaError::Driver(format!(
                "no room in the VRAM budget for {bytes} more bytes of sequence state"
            )))
        }
    }

    pub(super) fn read_state(&self, key: StateKey, out: &mut [f32]) -> Result<(), CudaError> {
        let mut st = self.lock();
        let dev = state_of(&st, key, out.len())?;
        self.stream.memcpy_dtoh(dev, out)?;
        self.stream.synchronize()?;
        st.stats.d2h_bytes += 4 * out.len() as u64;
        Ok(())
    }

    pub(super) fn copy_state(&self, src: StateKey, dst: StateKey) -> Result<(), CudaError> {
        let mut st = self.lock();
        let st = &mut *st;
        if src.1 != dst.1 {
            return Err(CudaError::Driver(
                "state copies of different lengths".into(),
            ));
        }
        let n = src.1 / 4;
        state_of(st, src, n)?;
        let mut to = match take_state(st, dst) {
            Some(d) if d.len() == n => d,
            _ => {
                self.room_for_state(st, src.1 as u64, &[])?;
                // SAFETY: every value is written by the copy below before any is read.
                unsafe { self.stream.alloc::<f32>(n) }?
            }
        };
        let from = st.states.get(&src).expect("checked");
        self.stream.memcpy_dtod(from, &mut to)?;
        insert_state(st, dst, to);
        Ok(())
    }

    pub(super) fn forget_state(&self, key: StateKey) {
        let mut st = self.lock();
        take_state(&mut st, key);
    }
}

/// A step's weight segments: the six parameters, then the forget gate's
/// up-projection's (`nf` of them), the output gate's (`ng`) and
/// `o_proj`'s (`no`), with `[nf, ng, no]`.
fn weight_segments<'a>(job: &KdaJob<'a>) -> (Vec<&'a [u8]>, [usize; 3]) {
    let w = &job.w;
    let params = [w.conv[0], w.conv[1], w.conv[2], w.a, w.dt_bias, w.o_norm];
    let mut segs: Vec<&[u8]> = params
        .iter()
        .map(|v| {
            segments(&MatRef::F32 {
                w: v,
                rows: 1,
                cols: v.len(),
            })[0]
        })
        .collect();
    let mut counts = [0; 3];
    for (m, count) in [job.f_up, job.g_up, job.o_proj].iter().zip(&mut counts) {
        let more = m.as_ref().map(segments).unwrap_or_default();
        *count = more.len();
        segs.extend(more);
    }
    (segs, counts)
}

/// The projections' weight segments of a job with `proj`, per matrix.
fn proj_segments<'a>(job: &KdaJob<'a>) -> Vec<Vec<&'a [u8]>> {
    job.proj
        .as_ref()
        .map_or_else(Vec::new, |pj| pj.mats.iter().map(segments).collect())
}

/// `st.state_bytes` (and the budget's share of it) after a change.
fn count_states(st: &mut State) {
    st.cache.set_outside(st.state_bytes);
    st.stats.vram_state_bytes = st.state_bytes;
}

fn insert_state(st: &mut State, key: StateKey, dev: CudaSlice<f32>) {
    st.state_bytes += 4 * dev.len() as u64;
    if let Some(old) = st.states.insert(key, dev) {
        st.state_bytes -= 4 * old.len() as u64;
    }
    count_states(st);
}

/// Removes the copy named `key` from the table (and the count).
pub(super) fn take_state(st: &mut State, key: StateKey) -> Option<CudaSlice<f32>> {
    let old = st.states.remove(&key)?;
    st.state_bytes -= 4 * old.len() as u64;
    count_states(st);
    Some(old)
}

fn state_of(st: &State, key: StateKey, n: usize) -> Result<&CudaSlice<f32>, CudaError> {
    match st.states.get(&key) {
        Some(d) if d.len() == n => Ok(d),
        _ => Err(CudaError::Driver(format!(
            "no device copy of the state at {:#x} ({n} values)",
            key.0
        ))),
    }
}
