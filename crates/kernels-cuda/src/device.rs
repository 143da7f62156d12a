//! Opening a device, compiling the kernels, and the backend itself.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    LaunchConfig, PinnedHostSlice, PushKernelArg, result,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use fathom_kernels::backend::{Backend, BackendStats, MatRef, Product, Role, segments};
use fathom_kernels::fp8::E4M3;

use crate::cache::{Cache, Class, Key};
use crate::{CudaError, SOURCE};

/// What `probe` found.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub nvrtc: (i32, i32),
}

/// Bytes left free on the device beside the weight cache by default
/// (activations, the CUDA context, other programs).
pub const DEFAULT_MARGIN: u64 = 2 << 30;

fn libraries() -> Result<(i32, i32), CudaError> {
    // SAFETY: only tries to open the shared library by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the call writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    Ok((major, minor))
}

/// Checks the driver, NVRTC and device `ordinal` without compiling anything.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    let nvrtc = libraries()?;
    let count = CudaContext::device_count().map_err(|e| CudaError::NoDevice(e.to_string()))?;
    let count = count.max(0) as usize;
    if count == 0 {
        return Err(CudaError::NoDevice("0 devices".into()));
    }
    if ordinal >= count {
        return Err(CudaError::BadOrdinal { ordinal, count });
    }
    let ctx = CudaContext::new(ordinal)?;
    let (free, total) = ctx.mem_get_info()?;
    Ok(DeviceInfo {
        ordinal,
        name: ctx.name()?,
        compute_capability: ctx.compute_capability()?,
        total_bytes: total as u64,
        free_bytes: free as u64,
        nvrtc,
    })
}

struct Funcs {
    f32: CudaFunction,
    bf16: CudaFunction,
    int8: CudaFunction,
    mxfp4: CudaFunction,
    fp8: CudaFunction,
    int4: CudaFunction,
    bf16_many: CudaFunction,
    mxfp4_many: CudaFunction,
}

struct State {
    cache: Cache<CudaSlice<u8>>,
    x: Option<CudaSlice<f32>>,
    y: Option<CudaSlice<f32>>,
    /// Page-locked host staging for activations and results: their copies
    /// are asynchronous DMA, with one synchronisation per batch of products.
    hx: Option<PinnedHostSlice<f32>>,
    hy: Option<PinnedHostSlice<f32>>,
    /// Address tables of grouped launches, staged and on the device.
    ht: Option<PinnedHostSlice<u64>>,
    dt: Option<CudaSlice<u64>>,
    /// Events marking the end of a job's weight copies on the copy stream.
    events: Vec<CudaEvent>,
    /// Timed events before the first kernel of a call and after its last.
    clock: Option<(CudaEvent, CudaEvent)>,
    stats: BackendStats,
}

/// Matrix products on one CUDA device (see the crate docs).
pub struct CudaBackend {
    info: DeviceInfo,
    stream: Arc<CudaStream>,
    /// Weight copies, so a job's copies overlap the kernels of the jobs before it.
    copies: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: Funcs,
    e4m3: CudaSlice<f32>,
    state: Mutex<State>,
}

fn ptx_cache_path(arch: &str, nvrtc: (i32, i32)) -> Option<PathBuf> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (SOURCE, arch, nvrtc).hash(&mut h);
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(
        base.join("fathom/cuda")
            .join(format!("{:016x}.ptx", h.finish())),
    )
}

/// The kernels' PTX for `arch`: from the cache, else compiled by NVRTC and
/// stored (a cache that cannot be written is skipped).
fn kernels_ptx(arch: &'static str, nvrtc: (i32, i32)) -> Result<Ptx, CudaError> {
    let path = ptx_cache_path(arch, nvrtc);
    if let Some(src) = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(Ptx::from_src(src));
    }
    let opts = CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(SOURCE, opts).map_err(|e| CudaError::Compile {
        arch: arch.into(),
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => other.to_string(),
        },
    })?;
    if let Some(p) = path {
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        let stored = p.parent().map(std::fs::create_dir_all).transpose().is_ok()
            && std::fs::write(&tmp, ptx.to_src()).is_ok()
            && std::fs::rename(&tmp, &p).is_ok();
        if !stored {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(ptx)
}

/// `compute_XY` for the architectures NVRTC knows by a static name.
fn arch_name(cc: (i32, i32)) -> &'static str {
    match cc {
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        (major, _) if major >= 12 => "compute_120",
        (major, _) if major >= 10 => "compute_100",
        (major, _) if major >= 9 => "compute_90",
        _ => "compute_75",
    }
}

impl CudaBackend {
    /// Opens device `ordinal` with `budget` bytes for weights (default:
    /// free memory less [`DEFAULT_MARGIN`]); compiles or loads the kernels.
    pub fn open(ordinal: usize, budget: Option<u64>) -> Result<Arc<Self>, CudaError> {
        let info = probe(ordinal)?;
        let ctx = CudaContext::new(ordinal)?;
        // The backend orders its two streams itself: a job waits for the
        // event after its weight copies, and every batch ends with both
        // streams synchronised, before any buffer is freed or reused.
        // SAFETY: no buffer is used across streams except after such an event.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let copies = ctx.new_stream()?;
        let ptx = kernels_ptx(arch_name(info.compute_capability), info.nvrtc)?;
        let module = ctx.load_module(ptx)?;
        let f = |n: &str| module.load_function(n);
        let funcs = Funcs {
            f32: f("mm_f32")?,
            bf16: f("mm_bf16")?,
            int8: f("mm_int8")?,
            mxfp4: f("mm_mxfp4")?,
            fp8: f("mm_fp8")?,
            int4: f("mm_int4")?,
            bf16_many: f("mm_bf16_many")?,
            mxfp4_many: f("mm_mxfp4_many")?,
        };
        let e4m3 = stream.clone_htod(&E4M3[..])?;
        let budget = budget.unwrap_or(info.free_bytes.saturating_sub(DEFAULT_MARGIN));
        // A probe that fails leaves the bounds unknown (zero), not the device unusable.
        let (hbm, h2d) = crate::probe_bw::bandwidths(&ctx, &stream).unwrap_or((0.0, 0.0));
        let stats = BackendStats {
            hbm_bytes_per_s: hbm,
            h2d_bytes_per_s: h2d,
            ..BackendStats::default()
        };
        Ok(Arc::new(CudaBackend {
            info,
            stream,
            copies,
            _module: module,
            funcs,
            e4m3,
            state: Mutex::new(State {
                cache: Cache::new(budget),
                x: None,
                y: None,
                hx: None,
                hy: None,
                ht: None,
                dt: None,
                events: Vec::new(),
                clock: None,
                stats,
            }),
        }))
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// A page-locker for host read buffers in this backend's context.
    pub fn host_pin(&self) -> crate::CudaHostPin {
        crate::CudaHostPin::new(self.stream.context().clone())
    }

    /// The weight budget in bytes.
    pub fn budget(&self) -> u64 {
        self.lock().cache.budget()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `jobs` on the device in one round trip: the weights each lacks
    /// are copied up on the copy stream (an event after each job's
    /// copies), the jobs whose weights are all here launch first, every
    /// other one waits only for its own copies; the inputs go up in one
    /// copy and the results come back in one, with one synchronisation.
    /// `Ok(false)` when declined (a shape out of range, or the weights do
    /// not all fit in the budget at once).
    fn run(&self, jobs: &mut [Job<'_, '_>]) -> Result<bool, CudaError> {
        if jobs.is_empty() || !jobs.iter().all(Job::fits) {
            return Ok(false);
        }
        let mut st = self.lock();
        let st = &mut *st;
        let segs: Vec<Vec<&[u8]>> = jobs.iter().map(|j| segments(&j.w)).collect();
        let keys: Vec<Key> = segs.iter().flatten().map(|s| key(s)).collect();
        let mut missing: Vec<Key> = keys
            .iter()
            .filter(|k| !st.cache.contains(k))
            .copied()
            .collect();
        missing.sort_unstable();
        missing.dedup();
        let class = if jobs.iter().any(|j| j.role == Role::Spine) {
            Class::Spine
        } else {
            Class::Expert
        };
        let need: u64 = missing.iter().map(|k| k.1 as u64).sum();
        if need > 0 && !st.cache.make_room(need, &keys, class) {
            return Ok(false);
        }
        for (j, s) in jobs.iter().zip(&segs) {
            if j.role == Role::Expert {
                if s.iter().all(|s| missing.binary_search(&key(s)).is_err()) {
                    st.stats.vram_expert_hits += 1;
                } else {
                    st.stats.vram_expert_misses += 1;
                }
            }
        }
        let queued = self.queue(st, jobs, &segs, class);
        // Nothing may still read the callers' bytes or the staging after an error.
        let synced = self.copies.synchronize().and(self.stream.synchronize());
        queued?;
        synced?;
        if let Some((a, b)) = &st.clock {
            st.stats.kernel_ms += f64::from(a.elapsed_ms(b)?);
        }
        let hy = st.hy.as_ref().expect("staged").as_slice()?;
        let mut off = 0;
        for j in jobs.iter_mut() {
            j.y.copy_from_slice(&hy[off..off + j.y.len()]);
            off += j.y.len();
            st.stats.weight_bytes_read +=
                segments(&j.w).iter().map(|s| s.len() as u64).sum::<u64>();
        }
        st.stats.vram_weight_bytes = st.cache.bytes();
        Ok(true)
    }

    /// Queues `jobs`' weight copies, input copy, kernels and result copy
    /// (room for the missing weights already made).
    fn queue(
        &self,
        st: &mut State,
        jobs: &[Job<'_, '_>],
        segs: &[Vec<&[u8]>],
        class: Class,
    ) -> Result<(), CudaError> {
        let ctx = self.stream.context();
        let mut waits: Vec<Option<usize>> = vec![None; jobs.len()];
        let mut events = 0;
        for (i, s) in segs.iter().enumerate() {
            let mut copied = false;
            for seg in s {
                let k = key(seg);
                if st.cache.touch(&k).is_none() {
                    if !page_locked(ctx, seg) {
                        st.stats.h2d_pageable_bytes += seg.len() as u64;
                    }
                    let buf = self.copies.clone_htod(*seg)?;
                    st.stats.h2d_bytes += seg.len() as u64;
                    st.cache.insert(k, buf, class);
                    copied = true;
                }
            }
            if copied {
                if st.events.len() == events {
                    st.events.push(self.stream.context().new_event(None)?);
                }
                st.events[events].record(&self.copies)?;
                waits[i] = Some(events);
                events += 1;
            }
        }
        let (nx, ny) = jobs
            .iter()
            .fold((0, 0), |(a, b), j| (a + j.x.len(), b + j.y.len()));
        let hx = pinned(ctx, &mut st.hx, nx)?.as_mut_slice()?;
        pinned(ctx, &mut st.hy, ny)?;
        let xp = grow(&self.stream, &mut st.x, nx)?
            .device_ptr(&self.stream)
            .0;
        let yp = grow(&self.stream, &mut st.y, ny)?
            .device_ptr(&self.stream)
            .0;
        let mut off = 0;
        for j in jobs {
            hx[off..off + j.x.len()].copy_from_slice(j.x);
            off += j.x.len();
        }
        let cu = self.stream.cu_stream();
        // SAFETY: the device buffer holds at least nx values; `hx` is
        // page-locked and not touched again before the synchronisation.
        unsafe { result::memcpy_htod_async(xp, &hx[..nx], cu) }?;
        st.stats.h2d_bytes += 4 * nx as u64;
        // Offsets of each job's input and output in the staging.
        let mut offs = Vec::with_capacity(jobs.len());
        let (mut ox, mut oy) = (0u64, 0u64);
        for j in jobs {
            offs.push((ox, oy));
            ox += j.x.len() as u64;
            oy += j.y.len() as u64;
        }
        let ptrs: Vec<Vec<u64>> = segs
            .iter()
            .map(|s| {
                s.iter()
                    .map(|s| {
                        st.cache
                            .get(&key(s))
                            .expect("resident")
                            .device_ptr(&self.stream)
                            .0
                    })
                    .collect()
            })
            .collect();
        let at = |i: usize| (xp + 4 * offs[i].0, yp + 4 * offs[i].1);
        // The jobs whose weights are here first, those of one kernel and
        // shape in one launch; then each other job after its own copies.
        let mut launches: Vec<Vec<usize>> = Vec::new();
        for i in (0..jobs.len()).filter(|&i| waits[i].is_none()) {
            match launches
                .iter_mut()
                .find(|l| together(&jobs[l[0]], &jobs[i]))
            {
                Some(l) => l.push(i),
                None => launches.push(vec![i]),
            }
        }
        let tables = self.stage_tables(st, &launches, &ptrs, &at)?;
        if st.clock.is_none() {
            let timed =
                || ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
            st.clock = Some((timed()?, timed()?));
        }
        let (first, last) = st.clock.as_ref().expect("just made");
        first.record(&self.stream)?;
        for (l, tab) in launches.iter().zip(tables) {
            match tab {
                Some(tab) => self.launch_many(&jobs[l[0]], tab, l.len())?,
                None => {
                    let (x, y) = at(l[0]);
                    let j = &jobs[l[0]];
                    self.launch(&j.w, &ptrs[l[0]], x, y, j.groups, j.t)?
                }
            }
        }
        for i in (0..jobs.len()).filter(|&i| waits[i].is_some()) {
            self.stream.wait(&st.events[waits[i].expect("filtered")])?;
            let (x, y) = at(i);
            self.launch(&jobs[i].w, &ptrs[i], x, y, jobs[i].groups, jobs[i].t)?;
        }
        last.record(&self.stream)?;
        let hy = st.hy.as_mut().expect("staged").as_mut_slice()?;
        // SAFETY: the device buffer holds at least ny values written by the
        // kernels on this stream; `hy` is page-locked and read only after
        // the synchronisation.
        unsafe { result::memcpy_dtoh_async(&mut hy[..ny], yp, cu) }?;
        st.stats.d2h_bytes += 4 * ny as u64;
        Ok(())
    }

    /// Device address tables (`[data, scales or 0, x, y]` per product) of
    /// the launches of several products, copied up in one copy; `None` for
    /// a launch of one.
    fn stage_tables(
        &self,
        st: &mut State,
        launches: &[Vec<usize>],
        ptrs: &[Vec<u64>],
        at: &dyn Fn(usize) -> (u64, u64),
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
                let (x, y) = at(i);
                tab.extend([ptrs[i][0], ptrs[i].get(1).copied().unwrap_or(0), x, y]);
            }
        }
        if tab.is_empty() {
            return Ok(starts.iter().map(|_| None).collect());
        }
        let ht = pinned(self.stream.context(), &mut st.ht, tab.len())?.as_mut_slice()?;
        ht[..tab.len()].copy_from_slice(&tab);
        let dt = grow(&self.stream, &mut st.dt, tab.len())?
            .device_ptr(&self.stream)
            .0;
        // SAFETY: the device table holds at least tab.len() values; `ht` is
        // page-locked and not touched again before the synchronisation.
        unsafe { result::memcpy_htod_async(dt, &ht[..tab.len()], self.stream.cu_stream()) }?;
        Ok(starts
            .iter()
            .map(|s| s.map(|s| dt + 8 * s as u64))
            .collect())
    }

    /// Queues `n` products of `first`'s kernel and shape in one launch,
    /// their addresses in the device table at `tab`.
    fn launch_many(&self, first: &Job<'_, '_>, tab: u64, n: usize) -> Result<(), CudaError> {
        let (rows, cols) = (first.w.rows(), first.w.cols());
        let (r, c, t) = (rows as i32, cols as i32, first.t as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(8) as u32, n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = match first.w {
            MatRef::Bf16 { .. } => &self.funcs.bf16_many,
            MatRef::Mxfp4(_) => &self.funcs.mxfp4_many,
            _ => unreachable!("`together` groups only bf16 and MXFP4 products"),
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&tab).arg(&r).arg(&c).arg(&t);
        // SAFETY: the table holds n entries of device addresses of each
        // product's segments, input and output, all of the checked shape.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Queues `w`'s kernel on the stream: weights at the device pointers
    /// `p` (its segments), input at `xp`, output at `yp`.
    fn launch(
        &self,
        w: &MatRef<'_>,
        p: &[u64],
        xp: u64,
        yp: u64,
        groups: usize,
        t: usize,
    ) -> Result<(), CudaError> {
        let (rows, cols) = (w.rows(), w.cols());
        let (r, c, tt, rg) = (rows as i32, cols as i32, t as i32, (rows / groups) as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let e4 = self.e4m3.device_ptr(&self.stream).0;
        let f = match w {
            MatRef::F32 { .. } => &self.funcs.f32,
            MatRef::Bf16 { .. } => &self.funcs.bf16,
            MatRef::Int8 { .. } => &self.funcs.int8,
            MatRef::Mxfp4(_) => &self.funcs.mxfp4,
            MatRef::Fp8(_) => &self.funcs.fp8,
            MatRef::Int4(_) => &self.funcs.int4,
        };
        let mut b = self.stream.launch_builder(f);
        for ptr in p {
            b.arg(ptr);
        }
        let (fp8_ints, int4_shift);
        match w {
            MatRef::Fp8(m) => {
                fp8_ints = [
                    m.row0 as i32,
                    m.shift[0] as i32,
                    m.shift[1] as i32,
                    m.grid_cols as i32,
                ];
                b.arg(&e4);
                for v in &fp8_ints {
                    b.arg(v);
                }
            }
            MatRef::Int4(m) => {
                int4_shift = m.group_shift as i32;
                b.arg(&int4_shift);
            }
            _ => {}
        }
        b.arg(&xp).arg(&yp).arg(&r).arg(&c).arg(&tt).arg(&rg);
        // SAFETY: the arguments match the kernel's parameters in `matmul.cu`
        // (pointers to device copies of the segments, sized by the shapes the caller checked).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

impl CudaBackend {
    /// Runs `jobs`, counting them and their time; a device error leaves
    /// them to the CPU, which gives the same bits (the error is counted and
    /// kept for the run report). A declined batch of several is not counted:
    /// the seam then offers its products one by one.
    fn counted(&self, jobs: &mut [Job<'_, '_>]) -> bool {
        let start = Instant::now();
        let result = self.run(jobs);
        let mut st = self.lock();
        let done = match result {
            Ok(done) => done,
            Err(e) => {
                st.stats.device_errors += 1;
                st.stats.last_error = Some(e.to_string());
                false
            }
        };
        if done {
            let ms = start.elapsed().as_secs_f64() * 1e3;
            st.stats.device_products += jobs.len() as u64;
            st.stats.device_calls += 1;
            st.stats.gpu_ms += ms;
            if jobs[0].role == Role::Expert {
                st.stats.expert_gpu_ms += ms;
            }
        } else if jobs.len() == 1 {
            st.stats.cpu_products += 1;
        }
        done
    }
}

/// One product on the device: `groups` row blocks (1 for a plain product).
struct Job<'w, 'b> {
    w: MatRef<'w>,
    role: Role,
    groups: usize,
    x: &'b [f32],
    t: usize,
    y: &'b mut [f32],
}

impl Job<'_, '_> {
    /// Shapes the kernels take (`i32` sizes, whole row blocks, matching buffers).
    fn fits(&self) -> bool {
        let (rows, cols, g) = (self.w.rows(), self.w.cols(), self.groups);
        let small = |n: usize| i32::try_from(n).is_ok();
        small(rows)
            && small(cols)
            && small(self.t)
            && rows > 0
            && self.t > 0
            && g > 0
            && rows % g == 0
            && self.x.len() == g * self.t * cols
            && self.y.len() == self.t * rows
    }
}

/// Whether two products can share one launch: plain products of one
/// shape and position count in a format with a grouped kernel.
fn together(a: &Job<'_, '_>, b: &Job<'_, '_>) -> bool {
    let kind = |j: &Job<'_, '_>| match j.w {
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
fn key(s: &[u8]) -> Key {
    (s.as_ptr() as usize, s.len())
}

/// Page-locked host staging of at least `n` values.
fn pinned<'a, T: cudarc::driver::DeviceRepr>(
    ctx: &Arc<CudaContext>,
    slot: &'a mut Option<PinnedHostSlice<T>>,
    n: usize,
) -> Result<&'a mut PinnedHostSlice<T>, CudaError> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        // Plain page-locked memory (not write-combined: the host reads results back).
        // SAFETY: the values are written before any is read (x copied in, y copied back).
        *slot =
            Some(unsafe { ctx.alloc_pinned_with_flags::<T>(n.next_power_of_two().max(1024), 0) }?);
    }
    Ok(slot.as_mut().expect("just made"))
}

/// A scratch buffer of at least `n` values.
fn grow<'a, T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &'a mut Option<CudaSlice<T>>,
    n: usize,
) -> Result<&'a mut CudaSlice<T>, CudaError> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        *slot = Some(stream.alloc_zeros::<T>(n.next_power_of_two().max(1024))?);
    }
    Ok(slot.as_mut().expect("just made"))
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{} {}", self.info.ordinal, self.info.name)
    }

    fn matmul(&self, w: &MatRef<'_>, role: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool {
        let w = *w;
        self.counted(&mut [Job {
            w,
            role,
            groups: 1,
            x,
            t,
            y,
        }])
    }

    fn matmul_batch(&self, products: &mut [Product<'_, '_>]) -> bool {
        let mut jobs: Vec<Job<'_, '_>> = products
            .iter_mut()
            .map(|p| Job {
                w: p.w,
                role: p.role,
                groups: 1,
                x: p.x,
                t: p.t,
                y: &mut *p.y,
            })
            .collect();
        self.counted(&mut jobs)
    }

    fn matmul_groups(
        &self,
        w: &MatRef<'_>,
        role: Role,
        groups: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
    ) -> bool {
        let w = *w;
        self.counted(&mut [Job {
            w,
            role,
            groups,
            x,
            t,
            y,
        }])
    }

    fn forget(&self, range: Range<usize>) {
        let mut st = self.lock();
        st.cache.forget(range);
        st.stats.vram_weight_bytes = st.cache.bytes();
    }

    fn stats(&self) -> BackendStats {
        self.lock().stats.clone()
    }
}
