//! Opening a device, compiling the kernels, and the backend itself.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PinnedHostSlice, PushKernelArg, result,
};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use fathom_kernels::backend::{Backend, BackendStats, MatRef, Role, segments};
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
}

struct State {
    cache: Cache<CudaSlice<u8>>,
    x: Option<CudaSlice<f32>>,
    y: Option<CudaSlice<f32>>,
    /// Page-locked host staging for activations and results: their copies
    /// are asynchronous DMA, with one synchronisation per product.
    hx: Option<PinnedHostSlice<f32>>,
    hy: Option<PinnedHostSlice<f32>>,
    stats: BackendStats,
}

/// Matrix products on one CUDA device (see the crate docs).
pub struct CudaBackend {
    info: DeviceInfo,
    stream: Arc<CudaStream>,
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
        // One stream, synchronised after every product: no cross-stream events needed.
        // SAFETY: every buffer is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
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
            _module: module,
            funcs,
            e4m3,
            state: Mutex::new(State {
                cache: Cache::new(budget),
                x: None,
                y: None,
                hx: None,
                hy: None,
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

    /// Device copies of `segs` (uploading the missing ones); `None` when
    /// they cannot all fit. Counts hits for experts.
    fn resident(
        &self,
        st: &mut State,
        segs: &[&[u8]],
        role: Role,
    ) -> Result<Option<Vec<u64>>, CudaError> {
        let keys: Vec<Key> = segs
            .iter()
            .map(|s| (s.as_ptr() as usize, s.len()))
            .collect();
        let missing: u64 = keys
            .iter()
            .filter(|k| !st.cache.contains(k))
            .map(|k| k.1 as u64)
            .sum();
        if role == Role::Expert {
            if missing == 0 {
                st.stats.vram_expert_hits += 1;
            } else {
                st.stats.vram_expert_misses += 1;
            }
        }
        let class = if role == Role::Expert {
            Class::Expert
        } else {
            Class::Spine
        };
        if missing > 0 && !st.cache.make_room(missing, &keys, class) {
            return Ok(None);
        }
        let mut ptrs = Vec::with_capacity(keys.len());
        for (k, s) in keys.iter().zip(segs) {
            if st.cache.touch(k).is_none() {
                let buf = self.stream.clone_htod(*s)?;
                st.stats.h2d_bytes += s.len() as u64;
                st.cache.insert(*k, buf, class);
            }
            let buf = st.cache.get(k).expect("just inserted");
            ptrs.push(buf.device_ptr(&self.stream).0);
        }
        st.stats.vram_weight_bytes = st.cache.bytes();
        Ok(Some(ptrs))
    }

    /// The product on the device (`groups` row blocks, each with its own
    /// input; 1 for a plain product); `Ok(false)` when declined.
    fn run(
        &self,
        w: &MatRef<'_>,
        role: Role,
        groups: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
    ) -> Result<bool, CudaError> {
        let (rows, cols) = (w.rows(), w.cols());
        let fits = |n: usize| i32::try_from(n).is_ok();
        if !(fits(rows) && fits(cols) && fits(t)) || rows == 0 || t == 0 {
            return Ok(false);
        }
        if groups == 0 || rows % groups != 0 || x.len() != groups * t * cols || y.len() != t * rows
        {
            return Ok(false);
        }
        let mut st = self.lock();
        let st = &mut *st;
        let Some(p) = self.resident(st, &segments(w), role)? else {
            return Ok(false);
        };
        // Every buffer first: after the first asynchronous copy, an error
        // must wait for the stream before the staging can be reused.
        let ctx = self.stream.context();
        let hx = pinned(ctx, &mut st.hx, x.len())?.as_mut_slice()?;
        let hy = pinned(ctx, &mut st.hy, y.len())?.as_mut_slice()?;
        let xp = grow(&self.stream, &mut st.x, x.len())?
            .device_ptr(&self.stream)
            .0;
        let yp = grow(&self.stream, &mut st.y, y.len())?
            .device_ptr(&self.stream)
            .0;
        hx[..x.len()].copy_from_slice(x);
        let cu = self.stream.cu_stream();
        let queued = (|| {
            // SAFETY: the device buffer holds at least x.len() values; `hx` is
            // page-locked and not touched again before the synchronisation.
            unsafe { result::memcpy_htod_async(xp, &hx[..x.len()], cu) }?;
            self.launch(w, &p, xp, yp, groups, t)?;
            // SAFETY: the device buffer holds at least y.len() values written by
            // the kernel on this stream; `hy` is page-locked and read only after
            // the synchronisation.
            unsafe { result::memcpy_dtoh_async(&mut hy[..y.len()], yp, cu) }?;
            Ok::<(), CudaError>(())
        })();
        let synced = self.stream.synchronize();
        queued?;
        synced?;
        y.copy_from_slice(&hy[..y.len()]);
        st.stats.h2d_bytes += std::mem::size_of_val(x) as u64;
        st.stats.d2h_bytes += std::mem::size_of_val(y) as u64;
        st.stats.weight_bytes_read += segments(w).iter().map(|s| s.len() as u64).sum::<u64>();
        Ok(true)
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
    /// Runs `product`, counting it and its time; a device error leaves the
    /// product to the CPU, which gives the same bits (the error is counted
    /// and kept for the run report).
    fn counted(&self, product: impl FnOnce() -> Result<bool, CudaError>) -> bool {
        let start = Instant::now();
        let result = product();
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
            st.stats.device_products += 1;
            st.stats.gpu_ms += start.elapsed().as_secs_f64() * 1e3;
        } else {
            st.stats.cpu_products += 1;
        }
        done
    }
}

/// Page-locked host staging of at least `n` values.
fn pinned<'a>(
    ctx: &Arc<CudaContext>,
    slot: &'a mut Option<PinnedHostSlice<f32>>,
    n: usize,
) -> Result<&'a mut PinnedHostSlice<f32>, CudaError> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        // Plain page-locked memory (not write-combined: the host reads results back).
        // SAFETY: the values are written before any is read (x copied in, y copied back).
        *slot = Some(unsafe {
            ctx.alloc_pinned_with_flags::<f32>(n.next_power_of_two().max(1024), 0)
        }?);
    }
    Ok(slot.as_mut().expect("just made"))
}

/// A scratch buffer of at least `n` values.
fn grow<'a>(
    stream: &Arc<CudaStream>,
    slot: &'a mut Option<CudaSlice<f32>>,
    n: usize,
) -> Result<&'a mut CudaSlice<f32>, CudaError> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        *slot = Some(stream.alloc_zeros::<f32>(n.next_power_of_two().max(1024))?);
    }
    Ok(slot.as_mut().expect("just made"))
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{} {}", self.info.ordinal, self.info.name)
    }

    fn matmul(&self, w: &MatRef<'_>, role: Role, x: &[f32], t: usize, y: &mut [f32]) -> bool {
        self.counted(|| self.run(w, role, 1, x, t, y))
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
        self.counted(|| self.run(w, role, groups, x, t, y))
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
