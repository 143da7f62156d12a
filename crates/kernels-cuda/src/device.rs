//! Opening a device, compiling the kernels, and the backend itself.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, PinnedHostSlice,
};
use fathom_kernels::backend::{
    BackendStats, DeviceBackend, GluProduct, GqaWork, Hints, MatRef, MlaWork, MoeTail, Product,
    Role, segments,
};
use fathom_kernels::fp8::E4M3;
use fathom_kernels::kda::KdaJob;
use fathom_kernels::ops::GluAct;
use fathom_kernels::state_buf::StateKey;

use crate::CudaError;
use crate::cache::Cache;
use crate::guess::GuessLog;

mod blocks;
mod glu;
mod gqa;
mod kda;
mod launch;
mod layout;
mod mla;
mod ptx;
mod queue;
mod tail;
mod tape;
mod then;

use ptx::{Knobs, arch_name, kernels_ptx};
use queue::Job;

/// What `probe` found.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    /// Devices the driver shows.
    pub devices: usize,
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
        devices: count,
        name: ctx.name()?,
        compute_capability: ctx.compute_capability()?,
        total_bytes: total as u64,
        free_bytes: free as u64,
        nvrtc,
    })
}

/// Declares [`Funcs`] from the kernels' list (`kernel_list.rs`).
macro_rules! funcs {
    ($($(#[$doc:meta])* $field:ident: $name:ident,)*) => {
        /// Every kernel of the module, loaded once.
        struct Funcs {
            $($(#[$doc])* $field: CudaFunction,)*
        }

        impl Funcs {
            fn load(module: &Arc<CudaModule>) -> Result<Funcs, cudarc::driver::DriverError> {
                Ok(Funcs {
                    $($field: module.load_function(stringify!($name))?,)*
                })
            }
        }
    };
}

kernels!(funcs);

/// A second set of staging buffers (see `State`'s), for the part of a
/// call that follows its first ([`then`]).
#[derive(Default)]
struct Staging {
    x: Option<CudaSlice<f32>>,
    y: Option<CudaSlice<f32>>,
    hx: Option<PinnedHostSlice<f32>>,
    hy: Option<PinnedHostSlice<f32>>,
    ht: Option<PinnedHostSlice<u64>>,
    dt: Option<CudaSlice<u64>>,
    /// The depth mix's sums (`then.rs`; never swapped).
    dots: Option<CudaSlice<f32>>,
}

struct State {
    cache: Cache<Resident>,
    x: Option<CudaSlice<f32>>,
    y: Option<CudaSlice<f32>>,
    /// A KDA step's forget gate, output gate and head outputs between its
    /// products.
    kf: Option<CudaSlice<f32>>,
    kg: Option<CudaSlice<f32>>,
    ko: Option<CudaSlice<f32>>,
    /// Gated MLPs' gate and up outputs between their products.
    glu: Option<CudaSlice<f32>>,
    /// MLA attention's partial results (`device/mla.rs`).
    mla: Option<CudaSlice<f32>>,
    /// Page-locked host staging for activations and results: their copies
    /// are asynchronous DMA, with one synchronisation per batch of products.
    hx: Option<PinnedHostSlice<f32>>,
    hy: Option<PinnedHostSlice<f32>>,
    /// Address tables of grouped launches, staged and on the device.
    ht: Option<PinnedHostSlice<u64>>,
    dt: Option<CudaSlice<u64>>,
    /// The staging of a layer's rest after its attention in one call.
    then: Staging,
    /// Sequences' states whose newest copies are here, by their host
    /// copies' names (`fathom_kernels::state_buf`).
    states: HashMap<StateKey, CudaSlice<f32>>,
    /// Their bytes (counted against the VRAM budget).
    state_bytes: u64,
    /// The scores of the guessed matrices callers handed over.
    guesses: GuessLog,
    /// Timed events before the first kernel of a call and after its last.
    clock: Option<(CudaEvent, CudaEvent)>,
    /// The call's operations on the compute stream, issued together (as a
    /// graph when the call repeats one: `device/tape.rs`).
    tape: tape::Tape,
    /// Staging and scratch buffers reallocated so far (`queue::pinned`,
    /// `queue::grow`): the tape drops its graphs when this moves.
    reallocs: u64,
    stats: BackendStats,
}

/// A weight segment in device memory. `ready` marks the end of its copy
/// up (on the copy stream) while that may still be running; a kernel that
/// reads the segment waits for it.
struct Resident {
    buf: CudaSlice<u8>,
    ready: Option<CudaEvent>,
    /// How its bytes sit here (as the matrix it was copied for reads them).
    layout: layout::Layout,
}

impl Resident {
    fn is_ready(&self) -> bool {
        self.ready.as_ref().is_none_or(|e| e.is_complete())
    }
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
    /// The most partial results an MLA launch pair keeps (`device/mla.rs`).
    mla_scratch: std::sync::atomic::AtomicUsize,
    /// Blocks of the one-position bf16 products the device runs at once
    /// (multiprocessors × blocks each holds; 0: unknown), and the most row
    /// pairs a warp of them takes (`launch.rs`).
    bf16_slots: std::sync::atomic::AtomicUsize,
    bf16_pairs: std::sync::atomic::AtomicUsize,
    /// Whether bf16, MXFP4 and int8 products of [`launch::TILE_T`]
    /// positions or more take the tiled kernels (`tile.cu`; the knob
    /// `TILES=0` turns them off).
    tiles: bool,
    /// Whether MLA attention takes `mla_split_heads` (a group of heads a
    /// block; the knob `MLA_HEADS=0` keeps `mla_split`, a head a block).
    mla_heads: bool,
    /// The fewest positions for which a spine product the budget has no
    /// room for is copied up, pushing other spine out, rather than left
    /// to the CPU ([`spine_copy_min_t`]).
    spine_copy_min: std::sync::atomic::AtomicUsize,
    /// Host → device bytes/s from page-locked memory, measured at open.
    h2d: f64,
    state: Mutex<State>,
}

/// The fewest positions from which copying a bf16 spine matrix up from
/// pageable memory (about a third of `h2d`, the page-locked rate) takes
/// less time than the CPU's product at `cpu_flops`: the CPU's time grows
/// with the positions (2 flops per weight and position), the copy's does
/// not. At least 2; `usize::MAX` (never) when either rate is unknown.
pub fn spine_copy_min_t(cpu_flops: f64, h2d: f64) -> usize {
    if cpu_flops <= 0.0 || h2d <= 0.0 {
        return usize::MAX;
    }
    // A bf16 weight is 2 bytes: the CPU takes 2·t flops for what the copy
    // moves in 2 bytes, so they cost the same at t = cpu_flops / copy rate.
    let t = (cpu_flops / (h2d / 3.0)).ceil();
    if t.is_finite() {
        (t as usize).max(2)
    } else {
        usize::MAX
    }
}

/// The CPU's rate (flops/s) at the products of many positions a spine
/// matrix takes when the device declines it: a 512 × 1024 bf16 product
/// of 16 positions on the current thread pool, the best of three.
fn cpu_flops() -> f64 {
    use fathom_kernels::backend::MatRef;
    let (rows, cols, t) = (512, 1024, 16);
    let w = vec![0x3F80u16; rows * cols];
    let x = vec![0.5f32; t * cols];
    let mut y = vec![0f32; t * rows];
    let m = MatRef::Bf16 { w: &w, rows, cols };
    let best = (0..3)
        .map(|_| {
            let t0 = Instant::now();
            m.cpu(&x, t, &mut y);
            t0.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    2.0 * (rows * cols * t) as f64 / best.max(1e-9)
}

/// Blocks of 256 threads of the one-position bf16 kernels (alone, grouped,
/// in sets) the device runs at once: multiprocessors × the fewest blocks
/// one holds of any of them (the driver's occupancy figures); 0 when a
/// query fails.
fn bf16_slots(ctx: &Arc<CudaContext>, f: &Funcs) -> usize {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
    let Ok(sms) = ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) else {
        return 0;
    };
    let per_sm = [&f.bf16, &f.bf16_many, &f.bf16_set]
        .iter()
        .map(|f| f.occupancy_max_active_blocks_per_multiprocessor(256, 0, None))
        .try_fold(u32::MAX, |m, b| b.map(|b| m.min(b)));
    per_sm.map_or(0, |b| sms.max(0) as usize * b as usize)
}

impl CudaBackend {
    /// Opens device `ordinal` with `budget` bytes for weights (default:
    /// free memory less [`DEFAULT_MARGIN`]); compiles or loads the kernels.
    pub fn open(ordinal: usize, budget: Option<u64>) -> Result<Arc<Self>, CudaError> {
        let info = probe(ordinal)?;
        let ctx = CudaContext::new(ordinal)?;
        // The backend orders its two streams itself: a kernel waits for the
        // event after the copy of every weight it reads; each batch ends
        // with the compute stream synchronised (copies ahead may run on);
        // an entry leaves the cache (forget, eviction) only after its copy
        // has ended; device buffers are freed on the stream that copied them.
        // SAFETY: no buffer is used across streams except after such an event.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let copies = ctx.new_stream()?;
        let knobs = Knobs::from_env()?;
        let ptx = kernels_ptx(arch_name(info.compute_capability), info.nvrtc, &knobs)?;
        let module = ctx.load_module(ptx)?;
        let funcs = Funcs::load(&module)?;
        let e4m3 = stream.clone_htod(&E4M3[..])?;
        let slots = bf16_slots(&ctx, &funcs);
        let pairs = knobs.get("BF16_PAIRS").unwrap_or(usize::MAX);
        let tile = knobs.get("TILES") != Some(0);
        let mla_heads = knobs.get("MLA_HEADS") != Some(0);
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
            mla_scratch: mla::SCRATCH_FLOATS.into(),
            bf16_slots: slots.into(),
            bf16_pairs: pairs.into(),
            tiles: tile,
            mla_heads,
            spine_copy_min: 0.into(),
            h2d,
            state: Mutex::new(State {
                cache: Cache::new(budget),
                guesses: GuessLog::default(),
                states: HashMap::new(),
                state_bytes: 0,
                x: None,
                y: None,
                kf: None,
                kg: None,
                ko: None,
                glu: None,
                mla: None,
                hx: None,
                hy: None,
                ht: None,
                dt: None,
                then: Staging::default(),
                clock: None,
                tape: tape::Tape::new(),
                reallocs: 0,
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

    /// Caps the partial results one MLA launch pair keeps on the device
    /// (values; default 2²⁶), so that tests can make a prefill run in
    /// chunks of queries.
    pub fn limit_mla_scratch(&self, floats: usize) {
        self.mla_scratch
            .store(floats, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the blocks of the one-position bf16 products the device runs at
    /// once, as the backend found them when it opened (`None`) or as given
    /// (0: a block for every 16 rows, however many), so that tests can make
    /// every warp take several row pairs; the bits are the same either way.
    pub fn set_bf16_slots(&self, slots: Option<usize>) {
        let found = bf16_slots(self.stream.context(), &self.funcs);
        self.bf16_slots
            .store(slots.unwrap_or(found), std::sync::atomic::Ordering::Relaxed);
    }

    /// Lets calls that repeat run as CUDA graphs (the default), or issues
    /// every call's operations one by one; the bits are the same either way.
    pub fn set_graphs(&self, on: bool) {
        self.lock().tape.set_graphs(on);
    }

    /// The fewest positions for which a spine product that does not fit
    /// beside the spine here is copied up, pushing other spine out: from
    /// the host → device rate measured when the backend opened (`h2d`)
    /// and the CPU's, measured the first time it is asked for
    /// ([`spine_copy_min_t`]).
    pub fn spine_copy_min_t(&self) -> usize {
        use std::sync::atomic::Ordering::Relaxed;
        match self.spine_copy_min.load(Relaxed) {
            0 => {
                let t = spine_copy_min_t(cpu_flops(), self.h2d);
                self.spine_copy_min.store(t, Relaxed);
                t
            }
            t => t,
        }
    }

    /// Sets the threshold of [`CudaBackend::spine_copy_min_t`]
    /// (`None`: measured again when next asked for), so that tests choose
    /// either side; the bits are the same either way.
    pub fn set_spine_copy_min_t(&self, t: Option<usize>) {
        self.spine_copy_min.store(
            t.map_or(0, |t| t.max(2)),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// The weight budget in bytes.
    pub fn budget(&self) -> u64 {
        self.lock().cache.budget()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl CudaBackend {
    /// Runs `jobs`, counting them and their time; a device error leaves
    /// them to the CPU, which gives the same bits (the error is counted and
    /// kept for the run report). A declined batch is not counted: the seam
    /// then offers its products one by one.
    fn counted(&self, jobs: &mut [Job<'_, '_>], hints: &Hints<'_, '_>, batch: bool) -> bool {
        let (n, role) = (jobs.len(), jobs.first().map_or(Role::Spine, |j| j.role));
        self.counted_with(n, role, batch, || self.run(jobs, hints))
    }

    /// [`CudaBackend::counted`] of any round trip of `products` products.
    fn counted_with(
        &self,
        products: usize,
        role: Role,
        batch: bool,
        run: impl FnOnce() -> Result<bool, CudaError>,
    ) -> bool {
        let start = Instant::now();
        let result = run();
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
            st.stats.device_products += products as u64;
            st.stats.device_calls += 1;
            st.stats.gpu_ms += ms;
            if role == Role::Expert {
                st.stats.expert_gpu_ms += ms;
            }
        } else if !batch {
            st.stats.cpu_products += 1;
        }
        done
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Graphs go before the module their kernels come from.
        self.lock().tape.clear();
        // Copies ahead may still read host bytes their owners free next.
        let _ = self.copies.synchronize();
    }
}

impl DeviceBackend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{} {}", self.info.ordinal, self.info.name)
    }

    fn matmul(&self, w: &MatRef<'_>, role: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool {
        let w = *w;
        self.counted(
            &mut [Job {
                w,
                role,
                groups: 1,
                x,
                t,
                y,
            }],
            &Hints::default(),
            false,
        )
    }

    fn matmul_batch(&self, products: &mut [Product<'_, '_>], hints: &Hints<'_, '_>) -> bool {
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
        self.counted(&mut jobs, hints, true)
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
        self.counted(
            &mut [Job {
                w,
                role,
                groups,
                x,
                t,
                y,
            }],
            &Hints::default(),
            false,
        )
    }

    fn glu_batch(
        &self,
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        hints: &Hints<'_, '_>,
    ) -> bool {
        let (n, role) = (3 * jobs.len(), jobs.first().map_or(Role::Spine, |j| j.role));
        self.counted_with(n, role, true, || self.run_glu(&mut [], jobs, act, hints))
    }

    fn glu_mixed(
        &self,
        plain: &mut [Product<'_, '_>],
        jobs: &mut [GluProduct<'_, '_>],
        act: GluAct,
        hints: &Hints<'_, '_>,
    ) -> bool {
        let n = 3 * jobs.len() + plain.len();
        let role = jobs.first().map_or(Role::Spine, |j| j.role);
        self.counted_with(n, role, true, || self.run_glu(plain, jobs, act, hints))
    }

    fn hint(&self, hints: &Hints<'_, '_>) {
        let mut st = self.lock();
        let st = &mut *st;
        self.score(st, &[], hints);
        self.copy_ahead_or_count(st, hints, &[]);
    }

    fn missing_bytes(&self, ws: &[MatRef<'_>]) -> Vec<usize> {
        let st = self.lock();
        ws.iter()
            .map(|w| {
                let segs = segments(w);
                let gone = segs.iter().filter(|s| !st.cache.contains(&queue::key(s)));
                gone.map(|s| s.len()).sum()
            })
            .collect()
    }

    fn experts_crowded(&self) -> bool {
        self.lock().cache.crowded()
    }

    fn kda_step(&self, job: &mut KdaJob<'_>) -> Result<bool, String> {
        let start = Instant::now();
        let result = self.kda(job);
        let mut st = self.lock();
        let failed = |st: &mut State, e: &CudaError| {
            st.stats.device_errors += 1;
            st.stats.last_error = Some(format!("KDA step: {e}"));
        };
        match result {
            Ok(done) => {
                if done {
                    st.stats.gpu_ms += start.elapsed().as_secs_f64() * 1e3;
                }
                Ok(done)
            }
            // Nothing ran: the CPU takes the step.
            Err(kda::KdaFailure::Before(e)) => {
                failed(&mut st, &e);
                Ok(false)
            }
            Err(kda::KdaFailure::After(e)) => {
                failed(&mut st, &e);
                Err(format!("the device failed during a KDA step: {e}"))
            }
        }
    }

    fn mla_attend(&self, work: &mut MlaWork<'_>) -> bool {
        // Two products (the absorbing ones) beside the attention, the
        // output projection and the layer's projections when they come
        // along.
        let projs = work.proj.as_ref().map_or(0, |p| p.products().len());
        let n = 2 + usize::from(work.o.is_some()) + projs;
        self.counted_with(n, Role::Spine, true, || self.mla(work))
    }

    fn gqa_attend(&self, work: &mut GqaWork<'_>) -> bool {
        // q, k, v and the output projection.
        self.counted_with(4, Role::Spine, true, || self.gqa(work))
    }

    fn moe_tail(&self, tail: &mut MoeTail<'_, '_>, hints: &Hints<'_, '_>) -> bool {
        let n = 3 * tail.experts.len() + usize::from(tail.up.is_some());
        self.counted_with(n, Role::Expert, true, || self.run_tail(tail, hints))
    }

    fn state_forget(&self, key: StateKey) {
        self.forget_state(key);
    }

    fn state_read(&self, key: StateKey, out: &mut [f32]) -> Result<(), String> {
        self.read_state(key, out).map_err(|e| e.to_string())
    }

    fn state_copy(&self, src: StateKey, dst: StateKey) -> Result<(), String> {
        self.copy_state(src, dst).map_err(|e| e.to_string())
    }

    fn forget(&self, range: Range<usize>) {
        let mut st = self.lock();
        let gone: Vec<StateKey> = st
            .states
            .keys()
            .filter(|k| range.contains(&k.0))
            .copied()
            .collect();
        for k in gone {
            kda::take_state(&mut st, k);
        }
        for gone in st.cache.forget(range) {
            // The owner frees the bytes next: a copy from them must be over.
            if let Some(ready) = gone.ready {
                let _ = ready.synchronize();
            }
        }
        st.stats.vram_weight_bytes = st.cache.bytes();
    }

    fn stats(&self) -> BackendStats {
        self.lock().stats.clone()
    }
}
