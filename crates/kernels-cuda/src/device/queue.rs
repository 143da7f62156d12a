//! One round trip to the device: a batch's weight copies (on the copy
//! stream, an event after each), its input copy, its kernels (products of
//! one shape in one launch) and its result copy, with one synchronisation.

use std::sync::{Arc, MutexGuard};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
use fathom_kernels::backend::{Hints, MatRef, Role, segments};

use super::layout::{Layout, conflicting, relayout};
use super::{CudaBackend, Resident, State};
use crate::CudaError;
use crate::cache::{Class, Key};

impl CudaBackend {
    /// Runs `jobs` on the device in one round trip: the weights each lacks
    /// are copied up on the copy stream (an event after each copy), the
    /// jobs whose weights are all here launch first (products of one shape
    /// together), every other one waits only for its own copies; then the
    /// copies `hints` ask for start ([`CudaBackend::copy_ahead`]). The inputs go up in one copy and
    /// the results come back in one, with one synchronisation of the
    /// compute stream (copies ahead may still be running after it).
    /// `Ok(false)` when declined (a shape out of range, or the weights do
    /// not all fit in the budget at once).
    pub(super) fn run(
        &self,
        jobs: &mut [Job<'_, '_>],
        hints: &Hints<'_, '_>,
    ) -> Result<bool, CudaError> {
        if jobs.is_empty() || !jobs.iter().all(Job::fits) {
            return Ok(false);
        }
        let ws: Vec<(MatRef<'_>, Role)> = jobs.iter().map(|j| (j.w, j.role)).collect();
        let positions = jobs.iter().map(|j| j.t).min().unwrap_or(0);
        let queue = |st: &mut State, p: &Prepared<'_>| self.queue(st, jobs, p);
        let Some(st) = self.round_trip_at(&ws, positions, hints, queue)? else {
            return Ok(false);
        };
        scatter(results(&st)?, jobs.iter_mut().map(|j| &mut *j.y));
        Ok(true)
    }

    /// One round trip over the products `ws` (their weights, in order):
    /// the lock, [`Self::prepare`] (`None`, nothing queued, when they cannot
    /// all be in the budget at once), the missing weights copied up,
    /// `queue`'s staging and launches (ending with the results' copy down)
    /// written on the tape and issued ([`Self::flush`]), then
    /// [`Self::complete`]. The lock comes back held, the results
    /// staged on the host ([`results`]).
    pub(super) fn round_trip(
        &self,
        ws: &[(MatRef<'_>, Role)],
        hints: &Hints<'_, '_>,
        queue: impl FnOnce(&mut State, &Prepared<'_>) -> Result<(), CudaError>,
    ) -> Result<Option<MutexGuard<'_, State>>, CudaError> {
        self.round_trip_at(ws, 0, hints, queue)
    }

    /// [`Self::round_trip`] of products of at least `positions` positions
    /// each (0: unknown): spine products of enough positions may push
    /// other spine out for their copies ([`spine_copy_room`]).
    pub(super) fn round_trip_at(
        &self,
        ws: &[(MatRef<'_>, Role)],
        positions: usize,
        hints: &Hints<'_, '_>,
        queue: impl FnOnce(&mut State, &Prepared<'_>) -> Result<(), CudaError>,
    ) -> Result<Option<MutexGuard<'_, State>>, CudaError> {
        // Measured (once) before the lock: the CPU's probe runs on the
        // thread pool, whose tasks may call the backend.
        let copy_min = if positions >= 2 {
            self.spine_copy_min_t()
        } else {
            usize::MAX
        };
        let mut guard = self.lock_timed();
        let st = &mut *guard;
        st.tape.begin();
        let Some(p) = self.prepare(st, ws, positions >= copy_min, hints) else {
            return Ok(None);
        };
        let queued = self
            .upload_missing(st, ws, &p)
            .and_then(|()| queue(st, &p))
            .and_then(|()| self.flush(st));
        self.complete(st, queued, &p, hints)?;
        Ok(Some(guard))
    }

    /// Issues the operations the call wrote on the tape (one graph launch
    /// when the call repeats one seen before: `tape.rs`).
    pub(super) fn flush(&self, st: &mut State) -> Result<(), CudaError> {
        st.tape
            .flush(&self.stream, st.clock.as_ref(), &mut st.stats, st.reallocs)
    }

    /// The lock on the backend's state, its wait counted.
    pub(super) fn lock_timed(&self) -> MutexGuard<'_, State> {
        let asked = std::time::Instant::now();
        let mut st = self.lock();
        st.stats.lock_wait_ms += asked.elapsed().as_secs_f64() * 1e3;
        st
    }

    /// Before a round trip's copies and launches: the products' segments
    /// (`ws`, in order), their keys and the cache class of their weights,
    /// room made for the missing ones ([`room_by_class`]), expert hits
    /// counted, guesses scored. `None` when they cannot all be in the
    /// budget at once (nothing copied; experts evicted for room may stay
    /// evicted), or when the same bytes are two of them in different
    /// layouts ([`conflicting`]).
    pub(super) fn prepare<'w>(
        &self,
        st: &mut State,
        ws: &[(MatRef<'w>, Role)],
        spine_may_push: bool,
        hints: &Hints<'_, '_>,
    ) -> Option<Prepared<'w>> {
        let segs: Vec<Vec<&[u8]>> = ws.iter().map(|(w, _)| segments(w)).collect();
        let keys: Vec<Key> = segs.iter().flatten().map(|s| key(s)).collect();
        let wanted: Vec<(Key, Layout)> = ws.iter().flat_map(|(w, _)| Layout::wanted(w)).collect();
        if conflicting(&wanted) {
            return None;
        }
        relayout(st, &wanted);
        let mut missing: Vec<Key> = keys
            .iter()
            .filter(|k| !st.cache.contains(k))
            .copied()
            .collect();
        missing.sort_unstable();
        missing.dedup();
        if !room_by_class(st, ws, &segs, &missing, &keys)
            && !(spine_may_push && spine_copy_room(st, ws, &missing, &keys))
        {
            return None;
        }
        for ((_, role), s) in ws.iter().zip(&segs) {
            if *role == Role::Expert {
                if s.iter().all(|s| missing.binary_search(&key(s)).is_err()) {
                    st.stats.vram_expert_hits += 1;
                } else {
                    st.stats.vram_expert_misses += 1;
                }
            }
        }
        self.score(st, &segs, hints);
        let classes = ws.iter().map(|(_, r)| class_of(*r)).collect();
        Some(Prepared {
            segs,
            keys,
            classes,
        })
    }

    /// After the copies and launches (`queued`): the copies `hints` ask
    /// for, the synchronisation, the copies' events retired, the kernels'
    /// time counted.
    fn complete(
        &self,
        st: &mut State,
        queued: Result<(), CudaError>,
        p: &Prepared<'_>,
        hints: &Hints<'_, '_>,
    ) -> Result<(), CudaError> {
        // Copies ahead are a hint: one that fails costs the batch nothing.
        if queued.is_ok() {
            self.copy_ahead_or_count(st, hints, &p.keys);
        }
        let waited = std::time::Instant::now();
        let synced = self.stream.synchronize();
        st.stats.sync_wait_ms += waited.elapsed().as_secs_f64() * 1e3;
        if queued.is_err() || synced.is_err() {
            // Nothing may still read the callers' bytes or the staging.
            let _ = self.copies.synchronize();
            queued?;
            synced?;
        }
        // The kernels waited for every copy they read: those are done.
        for k in &p.keys {
            if let Some(r) = st.cache.get_mut(k) {
                r.ready = None;
            }
        }
        if let Some((a, b)) = &st.clock {
            st.stats.kernel_ms += f64::from(a.elapsed_ms(b)?);
        }
        st.stats.weight_bytes_read += p.segs.iter().flatten().map(|s| s.len() as u64).sum::<u64>();
        st.stats.vram_weight_bytes = st.cache.bytes();
        Ok(())
    }

    /// Makes the timed events a call's kernels are clocked with, once.
    pub(super) fn ensure_clock(&self, st: &mut State) -> Result<(), CudaError> {
        if st.clock.is_none() {
            let ctx = self.stream.context();
            let timed =
                || ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
            st.clock = Some((timed()?, timed()?));
        }
        Ok(())
    }

    /// Copies segment `i` of `w` up on the copy stream, laid out for the
    /// products there ([`Layout`]), an event after it.
    fn upload(
        &self,
        st: &mut State,
        w: &MatRef<'_>,
        i: usize,
        class: Class,
    ) -> Result<(), CudaError> {
        let seg = segments(w)[i];
        if !page_locked(self.stream.context(), seg) {
            st.stats.h2d_pageable_bytes += seg.len() as u64;
        }
        let class = match class {
            Class::Spine => spine_class(seg),
            c => c,
        };
        let buf = self.copies.clone_htod(seg)?;
        // Pageable bytes are staged before the copy returns: a held
        // segment's pages may leave RAM now.
        held_copied(st, seg);
        let layout = Layout::of(w, i);
        self.lay_out(&self.copies, w, layout, &buf)?;
        let ready = Some(self.copies.record_event(None)?);
        st.stats.h2d_bytes += seg.len() as u64;
        st.cache
            .insert(key(seg), Resident { buf, ready, layout }, class);
        Ok(())
    }

    /// Marks the guesses the batch's products (`segs`) and the caller's
    /// CPU products use as right, then logs the hints' own guesses (each
    /// matrix named by its first segment).
    pub(super) fn score(&self, st: &mut State, segs: &[Vec<&[u8]>], hints: &Hints<'_, '_>) {
        let first = |m: &MatRef<'_>| segments(m).first().map(|s| key(s));
        for k in segs.iter().filter_map(|s| s.first().map(|s| key(s))) {
            st.guesses.used(&k);
        }
        for k in hints.elsewhere.iter().filter_map(first) {
            st.guesses.used(&k);
        }
        st.guesses.guessed(hints.guessed.iter().filter_map(first));
        st.stats.guesses_scored = st.guesses.scored;
        st.stats.guesses_right = st.guesses.right;
        st.stats.cpu_expert_products += hints.elsewhere.len() as u64;
        let bytes = hints
            .elsewhere
            .iter()
            .flat_map(segments)
            .map(|s| s.len() as u64);
        st.stats.cpu_expert_bytes += bytes.sum::<u64>();
    }

    /// [`CudaBackend::copy_ahead`]; a failure is counted, never returned.
    pub(super) fn copy_ahead_or_count(&self, st: &mut State, hints: &Hints<'_, '_>, batch: &[Key]) {
        if let Err(e) = self.copy_ahead(st, hints, batch) {
            let _ = self.copies.synchronize();
            st.stats.device_errors += 1;
            st.stats.last_error = Some(format!("copying weights ahead: {e}"));
        }
    }

    /// Starts copying up, behind the batch's own copies, the matrices the
    /// caller multiplies by next, then those it computed on the CPU while
    /// no expert has been turned away, then its guesses while they prove
    /// right: whole matrices in order, until one does not fit without
    /// displacing the batch's weights or another listed matrix. Nothing
    /// waits for them here; their bytes stay put until `forget`, which
    /// waits for a copy still running.
    fn copy_ahead(
        &self,
        st: &mut State,
        hints: &Hints<'_, '_>,
        batch: &[Key],
    ) -> Result<(), CudaError> {
        let none: &[MatRef<'_>] = &[];
        let elsewhere = if st.cache.crowded() {
            none
        } else {
            hints.elsewhere
        };
        let guessed = if st.guesses.worth_copying() {
            hints.guessed
        } else {
            none
        };
        let lists = [(hints.next, false), (elsewhere, false), (guessed, true)];
        let mut keep: Vec<Key> = batch.to_vec();
        for (list, _) in &lists {
            keep.extend(list.iter().flat_map(segments).map(key));
        }
        for (m, guess) in lists
            .iter()
            .flat_map(|(l, g)| l.iter().map(move |m| (m, *g)))
        {
            if Layout::wanted(m)
                .iter()
                .any(|(k, l)| st.cache.get(k).is_some_and(|r| r.layout != *l))
            {
                // Its bytes are here as another matrix's (which the batch
                // may still read): left for its own call to copy again.
                continue;
            }
            let missing: Vec<(usize, &[u8])> = segments(m)
                .into_iter()
                .enumerate()
                .filter(|(_, s)| !st.cache.contains(&key(s)))
                .collect();
            let need: u64 = missing.iter().map(|(_, s)| s.len() as u64).sum();
            if need == 0 {
                continue;
            }
            if !make_room(st, need, &keep, Class::Expert) {
                break;
            }
            for (i, seg) in missing {
                self.upload(st, m, i, Class::Expert)?;
                st.stats.h2d_ahead_bytes += seg.len() as u64;
                if guess {
                    st.stats.h2d_guessed_bytes += seg.len() as u64;
                }
            }
        }
        Ok(())
    }

    /// Writes `jobs`' input copy, kernels and result copy (their weights
    /// already here or on their way).
    fn queue(
        &self,
        st: &mut State,
        jobs: &[Job<'_, '_>],
        p: &Prepared<'_>,
    ) -> Result<(), CudaError> {
        let xs: Vec<&[f32]> = jobs.iter().map(|j| j.x).collect();
        let ny = jobs.iter().map(|j| j.y.len()).sum();
        let (xp, yp) = self.stage(st, &xs, ny)?;
        let (mut ox, mut oy) = (xp, yp);
        let placed: Vec<Placed<'_>> = jobs
            .iter()
            .map(|j| {
                let p = Placed {
                    w: j.w,
                    groups: j.groups,
                    t: j.t,
                    x: ox,
                    y: oy,
                };
                ox += 4 * j.x.len() as u64;
                oy += 4 * j.y.len() as u64;
                p
            })
            .collect();
        let sets = jobs.iter().all(|j| j.role == Role::Spine);
        self.launch_phases(st, &placed, &p.segs, &[jobs.len()], sets, |_| Ok(()))?;
        self.fetch(st, yp, ny)
    }

    /// Copies up the segments of the products `ws` (`p` prepared them)
    /// not yet in VRAM (room already made), each in its product's class.
    fn upload_missing(
        &self,
        st: &mut State,
        ws: &[(MatRef<'_>, Role)],
        p: &Prepared<'_>,
    ) -> Result<(), CudaError> {
        for (((w, _), segs), &class) in ws.iter().zip(&p.segs).zip(&p.classes) {
            for (i, seg) in segs.iter().enumerate() {
                if st.cache.touch(&key(seg)).is_none() {
                    self.upload(st, w, i, class)?;
                }
            }
        }
        Ok(())
    }

    /// The inputs `xs` staged one after another and their copy up written
    /// on the tape, and room for `ny` results: their device addresses.
    pub(super) fn stage(
        &self,
        st: &mut State,
        xs: &[&[f32]],
        ny: usize,
    ) -> Result<(u64, u64), CudaError> {
        let starts: Vec<usize> = xs
            .iter()
            .scan(0, |o, x| {
                let s = *o;
                *o += x.len();
                Some(s)
            })
            .collect();
        self.stage_at(st, xs, &starts, ny)
    }

    /// [`Self::stage`] with input i at `starts[i]` values into the copy
    /// (in order, none overlapping the one before).
    pub(super) fn stage_at(
        &self,
        st: &mut State,
        xs: &[&[f32]],
        starts: &[usize],
        ny: usize,
    ) -> Result<(u64, u64), CudaError> {
        let ctx = self.stream.context();
        let nx = xs
            .iter()
            .zip(starts)
            .map(|(x, s)| s + x.len())
            .max()
            .unwrap_or(0);
        let hx = pinned(ctx, &mut st.hx, nx, &mut st.reallocs)?.as_mut_slice()?;
        pinned(ctx, &mut st.hy, ny, &mut st.reallocs)?;
        let xp = grow(&self.stream, &mut st.x, nx, &mut st.reallocs)?
            .device_ptr(&self.stream)
            .0;
        let yp = grow(&self.stream, &mut st.y, ny, &mut st.reallocs)?
            .device_ptr(&self.stream)
            .0;
        for (x, &at) in xs.iter().zip(starts) {
            hx[at..at + x.len()].copy_from_slice(x);
        }
        // The device buffer holds at least nx values; `hx` is page-locked
        // and not touched again before the synchronisation.
        st.tape.up(xp, &hx[..nx]);
        st.stats.h2d_bytes += 4 * nx as u64;
        Ok((xp, yp))
    }

    /// Writes the copy of `ny` results at `yp` into the host staging.
    pub(super) fn fetch(&self, st: &mut State, yp: u64, ny: usize) -> Result<(), CudaError> {
        let hy = st.hy.as_mut().expect("staged").as_mut_slice()?;
        // The device buffer holds at least ny values written by the
        // kernels before it; `hy` is page-locked and read only after the
        // synchronisation.
        st.tape.down(&mut hy[..ny], yp);
        st.stats.d2h_bytes += 4 * ny as u64;
        Ok(())
    }

    /// A table of device addresses staged (`State`'s `ht`) and its copy up
    /// (to `dt`) written on the tape: its device address.
    pub(super) fn stage_table(&self, st: &mut State, table: &[u64]) -> Result<u64, CudaError> {
        let ctx = self.stream.context();
        let ht = pinned(ctx, &mut st.ht, table.len(), &mut st.reallocs)?.as_mut_slice()?;
        ht[..table.len()].copy_from_slice(table);
        let dt = grow(&self.stream, &mut st.dt, table.len(), &mut st.reallocs)?
            .device_ptr(&self.stream)
            .0;
        let ht = st.ht.as_ref().expect("staged").as_slice()?;
        // The device table holds at least table.len() values; `ht` is
        // page-locked and not touched again before the synchronisation.
        st.tape.up(dt, &ht[..table.len()]);
        Ok(dt)
    }
}

/// What [`CudaBackend::prepare`] found: the products' weight segments
/// (per product, in order), their keys (flattened) and per product the
/// cache class its weights are held in.
pub(super) struct Prepared<'w> {
    pub(super) segs: Vec<Vec<&'w [u8]>>,
    keys: Vec<Key>,
    classes: Vec<Class>,
}

/// The cache class of a product's weights.
fn class_of(role: Role) -> Class {
    match role {
        Role::Spine => Class::Spine,
        Role::Expert => Class::Expert,
    }
}

/// The results of the last round trip, staged on the host.
pub(super) fn results(st: &State) -> Result<&[f32], CudaError> {
    Ok(st.hy.as_ref().expect("staged").as_slice()?)
}

/// Copies the staged results `hy` into `ys`, one after another.
pub(super) fn scatter<'a>(hy: &[f32], ys: impl Iterator<Item = &'a mut [f32]>) {
    let mut off = 0;
    for y in ys {
        y.copy_from_slice(&hy[off..off + y.len()]);
        off += y.len();
    }
}

/// A product as its kernels see it: the weights, `groups` row blocks (1
/// for a plain product), `t` positions, and the device addresses of its
/// input and output.
pub(super) struct Placed<'w> {
    pub(super) w: MatRef<'w>,
    pub(super) groups: usize,
    pub(super) t: usize,
    pub(super) x: u64,
    pub(super) y: u64,
}

/// One product on the device: `groups` row blocks (1 for a plain product).
pub(super) struct Job<'w, 'b> {
    pub(super) w: MatRef<'w>,
    pub(super) role: Role,
    pub(super) groups: usize,
    pub(super) x: &'b [f32],
    pub(super) t: usize,
    pub(super) y: &'b mut [f32],
}

impl Job<'_, '_> {
    /// Shapes the kernels take (`i32` sizes, whole row blocks, matching buffers).
    fn fits(&self) -> bool {
        fits(&self.w, self.groups, self.t, self.x.len(), self.y.len())
    }
}

/// Whether the kernels take `w` in `groups` row blocks at `t` positions
/// with input and output buffers of these lengths: `i32` sizes, whole row
/// blocks, matching buffers.
pub(super) fn fits(w: &MatRef<'_>, groups: usize, t: usize, x_len: usize, y_len: usize) -> bool {
    let (rows, cols) = (w.rows(), w.cols());
    let small = |n: usize| i32::try_from(n).is_ok();
    small(rows)
        && small(cols)
        && small(t)
        && rows > 0
        && t > 0
        && groups > 0
        && rows % groups == 0
        && x_len == groups * t * cols
        && y_len == t * rows
}

/// [`crate::cache::Cache::make_room`], then waits for any evicted entry's
/// copy that may still be running (one copied ahead and never used): its
/// owner may free the host bytes as soon as the entry is gone.
pub(super) fn make_room(st: &mut State, need: u64, keep: &[Key], class: Class) -> bool {
    let Some(gone) = st.cache.make_room(need, keep, class) else {
        return false;
    };
    for r in gone {
        if let Some(ready) = r.ready {
            let _ = ready.synchronize();
        }
    }
    true
}

/// Makes room for the `missing` segments of the products `ws` (their
/// segments `segs`), never evicting one of `keys`: the experts' bytes,
/// then the spine's, each by evicting experts only ([`make_room`] for each
/// class in turn), so nothing pushes out a spine matrix. `false` when they
/// cannot all fit; experts evicted for the first part stay evicted.
fn room_by_class(
    st: &mut State,
    ws: &[(MatRef<'_>, Role)],
    segs: &[Vec<&[u8]>],
    missing: &[Key],
    keys: &[Key],
) -> bool {
    let mut need = [0u64; 3];
    let mut counted = vec![false; missing.len()];
    for ((_, role), ss) in ws.iter().zip(segs) {
        for s in ss {
            let k = key(s);
            if let Ok(i) = missing.binary_search(&k)
                && !std::mem::replace(&mut counted[i], true)
            {
                let at = match (*role, spine_class(s)) {
                    (Role::Expert, _) => 0,
                    (_, Class::Held) => 2,
                    _ => 1,
                };
                need[at] += k.1 as u64;
            }
        }
    }
    let [expert, spine, held] = need;
    (expert == 0 || make_room(st, expert, keys, Class::Expert))
        && (spine == 0 || make_room(st, expert + spine, keys, Class::Spine))
        && (held == 0 || make_room(st, expert + spine + held, keys, Class::Held))
}

/// The class a spine segment's copy enters in: [`Class::Held`] when its
/// host bytes are a checkpoint map held for the device
/// (`fathom_weights::mapped`), else [`Class::Spine`].
pub(super) fn spine_class(seg: &[u8]) -> Class {
    if fathom_weights::mapped::is_held(seg.as_ptr() as usize, seg.len()) {
        Class::Held
    } else {
        Class::Spine
    }
}

/// After `seg`'s copy up has read it: a held segment's pages leave RAM
/// (`fathom_weights::mapped::release_copied`), counted.
pub(super) fn held_copied(st: &mut State, seg: &[u8]) {
    if fathom_weights::mapped::release_copied(seg.as_ptr() as usize, seg.len()) {
        st.stats.h2d_held_bytes += seg.len() as u64;
    }
}

/// Room for a call of spine products only whose weights do not fit
/// beside the spine already here: made by pushing out experts, then other
/// spine, most recently used first (as sequence state does; never spine
/// held on the device), never one of `keys`. Taken only for products of many positions (the caller checks
/// them against [`CudaBackend::spine_copy_min_t`]), where copying the
/// matrix up costs less than the CPU's product; a pass's other spine
/// products then find theirs gone and go to the CPU or, with enough
/// positions, are copied up in turn.
fn spine_copy_room(
    st: &mut State,
    ws: &[(MatRef<'_>, Role)],
    missing: &[Key],
    keys: &[Key],
) -> bool {
    if ws.iter().any(|(_, r)| *r != Role::Spine) {
        return false;
    }
    let need: u64 = missing.iter().map(|k| k.1 as u64).sum();
    // As held spine does: experts and RAM-backed spine may go, held never.
    if !make_room(st, need, keys, Class::Held) {
        return false;
    }
    st.stats.h2d_spine_displacing_bytes += need;
    true
}

/// Whether `bytes` are page-locked host memory (their copy up is direct
/// DMA; pageable bytes are staged by the driver at about a third of the speed).
fn page_locked(ctx: &Arc<CudaContext>, bytes: &[u8]) -> bool {
    use cudarc::driver::sys;
    let mut kind = 0u32;
    // SAFETY: the query only reads the driver's record of this address into
    // `kind`, a 32-bit value as CU_POINTER_ATTRIBUTE_MEMORY_TYPE writes.
    let r = ctx.bind_to_thread().is_ok().then(|| unsafe {
        sys::cuPointerGetAttribute(
            (&mut kind as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            bytes.as_ptr() as u64,
        )
    });
    r == Some(sys::CUresult::CUDA_SUCCESS) && kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32
}

/// The cache key of a host byte segment: its address and length.
pub(super) fn key(s: &[u8]) -> Key {
    (s.as_ptr() as usize, s.len())
}

/// Page-locked host staging of at least `n` values; `reallocs` (the
/// backend's count, which tells its tape to drop graphs that may name the
/// old buffer) counts a new allocation.
pub(super) fn pinned<'a, T: cudarc::driver::DeviceRepr>(
    ctx: &Arc<CudaContext>,
    slot: &'a mut Option<PinnedHostSlice<T>>,
    n: usize,
    reallocs: &mut u64,
) -> Result<&'a mut PinnedHostSlice<T>, CudaError> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        *reallocs += 1;
        // Plain page-locked memory (not write-combined: the host reads results back).
        // SAFETY: the values are written before any is read (x copied in, y copied back).
        *slot =
            Some(unsafe { ctx.alloc_pinned_with_flags::<T>(n.next_power_of_two().max(1024), 0) }?);
    }
    Ok(slot.as_mut().expect("just made"))
}

/// A scratch buffer of at least `n` values; `reallocs` as in [`pinned`].
pub(super) fn grow<'a, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &'a mut Option<CudaSlice<T>>,
    n: usize,
    reallocs: &mut u64,
) -> Result<&'a mut CudaSlice<T>, CudaError> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        *reallocs += 1;
        *slot = Some(stream.alloc_zeros::<T>(n.next_power_of_two().max(1024))?);
    }
    Ok(slot.as_mut().expect("just made"))
}
