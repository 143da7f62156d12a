//! fathom's CUDA kernels (`fathom-kernels-cuda/src/*.cu`) compiled for the
//! host with a small emulator of the CUDA C they use (`emu/emu.h`: every
//! CUDA thread a fiber, a block's threads switching at `__syncthreads` and
//! warp shuffles), behind the backend seam as [`EmuBackend`]. It lets a
//! machine without a GPU check the kernels' arithmetic — the bits of each
//! product, activation and KDA step — against the CPU twins, and run whole
//! models with every product on the kernels. It is slow (a fiber switch
//! per thread at every shuffle) and not a device: copies, caches, streams
//! and the VRAM budget are the CUDA backend's; launches here use the same
//! grid and block shapes as the CUDA backend's.
//!
//! The crate also builds an emulated NVIDIA driver and NVRTC
//! ([`driver_dir`], [`install_driver`]; `emu/driver.cpp`, `emu/nvrtc.cpp`)
//! that run the CUDA backend itself — copies, caches, streams, budgets —
//! with its kernels on this emulator: `fathom-kernels-cuda`'s tests and
//! `fathom --device cuda` use it where the real driver is absent.

mod backend;
mod mla;

pub use backend::EmuBackend;
pub use mla::{MlaLaunch, mla_attend, mla_launch};

use fathom_kernels::backend::{MatRef, segments};
use fathom_kernels::ops::GluAct;
use std::path::Path;

/// Whether the emulator was built (the build needs a C++17 compiler).
pub fn available() -> bool {
    cfg!(emu_built)
}

/// Why [`available`] is false, for a test's skip line.
pub const ABSENT: &str = "the CUDA kernels' host emulator was not built (it builds on Linux, for \
     the build machine itself, with a C++17 compiler; install g++ and rebuild)";

/// The folder holding the emulated NVIDIA driver and NVRTC (`libcuda.so`,
/// `libnvrtc.so`: `emu/driver.cpp`, `emu/nvrtc.cpp`), which run fathom's
/// whole CUDA backend on this emulator; `None` where they were not built.
/// A child process finds them through `LD_LIBRARY_PATH`.
pub fn driver_dir() -> Option<&'static Path> {
    #[cfg(emu_driver)]
    return Some(Path::new(env!("FATHOM_EMU_DRIVER_DIR")));
    #[cfg(not(emu_driver))]
    None
}

/// Loads the emulated driver and NVRTC into this process, so that
/// `cudarc` (which opens `libcuda.so` and `libnvrtc.so` by name, and gets
/// an already loaded library of that soname) uses them. Call it before
/// anything CUDA; it cannot be undone. An error says why they are absent.
pub fn install_driver() -> Result<&'static Path, String> {
    let dir = driver_dir().ok_or_else(|| {
        "the emulated CUDA driver was not built (no C++17 compiler when fathom-cuda-emu was \
         compiled)"
            .to_string()
    })?;
    for lib in ["libcuda.so", "libnvrtc.so"] {
        let path = dir.join(lib);
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|e| e.to_string())?;
        // SAFETY: loads a library this crate's build script made; its
        // initialisers only set up statics. The handle is kept for the
        // process's life.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            return Err(format!("{}: dlopen failed", path.display()));
        }
    }
    Ok(dir)
}

#[repr(C)]
pub(crate) struct EmuLaunch {
    grid_x: u32,
    grid_y: u32,
    grid_z: u32,
    block_x: u32,
    shared: u32,
}

/// The CUDA backend's launch of a matrix product: 8 warps a block of 256
/// threads, [`MatRef::device_rows_a_block`] rows a block, `n` products
/// along y.
fn mm_launch(w: &MatRef<'_>, t: usize, n: usize) -> EmuLaunch {
    let per_block = w.device_rows_a_block(t);
    EmuLaunch {
        grid_x: w.rows().div_ceil(per_block) as u32,
        grid_y: n as u32,
        grid_z: 1,
        block_x: 256,
        shared: 0,
    }
}

#[cfg(emu_built)]
pub(crate) mod ffi {
    use super::EmuLaunch;
    type F = *const f32;
    type M = *mut f32;
    unsafe extern "C" {
        pub fn emu_mm_f32(l: &EmuLaunch, w: F, x: F, y: M, r: i32, c: i32, t: i32, rg: i32);
        pub fn emu_mm_bf16(
            l: &EmuLaunch,
            w: *const u16,
            x: F,
            y: M,
            r: i32,
            c: i32,
            t: i32,
            rg: i32,
        );
        pub fn emu_mm_int8(
            l: &EmuLaunch,
            q: *const i8,
            s: F,
            x: F,
            y: M,
            r: i32,
            c: i32,
            t: i32,
            rg: i32,
        );
        pub fn emu_mxfp4_lanes(l: &EmuLaunch, p: *mut u32, r: i32, c: i32);
        pub fn emu_bf16_lanes(l: &EmuLaunch, w: *mut u16, r: i32, c: i32);
        pub fn emu_mm_mxfp4(
            l: &EmuLaunch,
            p: *const u8,
            s: *const u8,
            x: F,
            y: M,
            r: i32,
            c: i32,
            t: i32,
            rg: i32,
        );
        pub fn emu_mm_fp8(
            l: &EmuLaunch,
            q: *const u8,
            s: F,
            e4m3: F,
            row0: i32,
            sh_r: i32,
            sh_c: i32,
            grid_cols: i32,
            x: F,
            y: M,
            r: i32,
            c: i32,
            t: i32,
            rg: i32,
        );
        pub fn emu_mm_int4(
            l: &EmuLaunch,
            p: *const u8,
            s: *const u16,
            sh_g: i32,
            x: F,
            y: M,
            r: i32,
            c: i32,
            t: i32,
            rg: i32,
        );
        pub fn emu_mm_bf16_many(l: &EmuLaunch, tab: *const u64, r: i32, c: i32, t: i32);
        pub fn emu_mm_mxfp4_many(l: &EmuLaunch, tab: *const u64, r: i32, c: i32, t: i32);
        pub fn emu_glu_act(l: &EmuLaunch, g: M, u: F, n: i64, kind: i32, beta: f32, bl: f32);
        pub fn emu_mla_gate(
            l: &EmuLaunch,
            vals: F,
            gate: F,
            gated: i32,
            heads: i32,
            t: i32,
            dv: i32,
            cat: M,
        );
        pub fn emu_moe_combine(
            l: &EmuLaunch,
            o: F,
            off: *const u32,
            w: F,
            k: i32,
            width: i32,
            norm: i32,
            nw: F,
            eps: f32,
            s: M,
        );
        pub fn emu_mla_split(
            l: &EmuLaunch,
            blocks: *const u64,
            boff: *const i32,
            q_lat: F,
            q_qs: i64,
            q_hs: i64,
            q_rope: F,
            ns: *const i32,
            heads: i32,
            lora: i32,
            rope: i32,
            scale: f32,
            max_splits: i32,
            ps: M,
            pm: M,
            pl: M,
            pc: M,
        );
        pub fn emu_mla_merge(
            l: &EmuLaunch,
            ns: *const i32,
            heads: i32,
            lora: i32,
            max_splits: i32,
            pm: F,
            pl: F,
            pc: F,
            out: M,
            o_qs: i64,
            o_hs: i64,
        );
        pub fn emu_kda_step(
            l: &EmuLaunch,
            s: M,
            wq: M,
            wk: M,
            wv: M,
            pq: F,
            pk: F,
            pv: F,
            f: F,
            b: F,
            g: F,
            tq: F,
            tk: F,
            tv: F,
            a: F,
            dt: F,
            onorm: F,
            out: M,
            row0: i32,
            t: i32,
            heads: i32,
            kd: i32,
            kernel: i32,
            q_scale: f32,
            l2_eps: f32,
            norm_eps: f32,
            bounded: i32,
            lb: f32,
            hin: M,
            n_rows: i32,
        );
    }
}

/// The emulator's state is one global: launches take turns.
static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(crate) fn lock() -> std::sync::MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn small(v: usize) -> bool {
    i32::try_from(v).is_ok()
}

/// Whether [`matmul`] takes `w` with `t` positions and `groups` blocks:
/// sizes fit the kernels' `int`s, MXFP4 columns are whole blocks.
pub fn takes(w: &MatRef<'_>, t: usize, groups: usize) -> bool {
    let (rows, cols) = (w.rows(), w.cols());
    available()
        && t > 0
        && groups > 0
        && rows % groups == 0
        && rows.checked_mul(cols).is_some_and(small)
        && rows.checked_mul(t).is_some_and(small)
        && cols.checked_mul(t).is_some_and(small)
        && !matches!(w, MatRef::Mxfp4(m) if m.cols % 32 != 0)
}

/// A bf16 or MXFP4 matrix's bytes as the CUDA backend holds them in VRAM:
/// its segments in 16-byte aligned memory (the kernels' widest load), the
/// first rearranged by `matmul.cu`'s `bf16_lanes` or `mxfp4_lanes`,
/// launched as the backend launches it behind the copy up (bf16 only when
/// its width is a multiple of 8). `None` for the other formats (their
/// bytes go up as they are).
struct Uploaded {
    segs: Vec<Vec<u128>>,
}

impl Uploaded {
    fn of(w: &MatRef<'_>) -> Option<Self> {
        let (rows, cols) = match *w {
            MatRef::Bf16 { rows, cols, .. } if cols % 8 == 0 => (rows, cols),
            MatRef::Mxfp4(m) => (m.rows, m.cols),
            _ => return None,
        };
        let copy = |b: &[u8]| {
            let mut v = vec![0u128; b.len().div_ceil(16)];
            bytes_mut(&mut v)[..b.len()].copy_from_slice(b);
            v
        };
        let mut up = Self {
            segs: segments(w).into_iter().map(copy).collect(),
        };
        let warps = rows * (cols / 256);
        let l = EmuLaunch {
            grid_x: warps.div_ceil(8) as u32,
            grid_y: 1,
            grid_z: 1,
            block_x: 256,
            shared: 0,
        };
        let (r, c, first) = (rows as i32, cols as i32, up.segs[0].as_mut_ptr());
        let _g = lock();
        #[cfg(emu_built)]
        if warps > 0 {
            // SAFETY: the kernel rewrites the full 256-column chunks of the
            // `rows` rows of `cols` values in place, inside the first
            // segment's copy (its length is the format's for the shape).
            unsafe {
                if matches!(w, MatRef::Mxfp4(_)) {
                    ffi::emu_mxfp4_lanes(&l, first.cast(), r, c)
                } else {
                    ffi::emu_bf16_lanes(&l, first.cast(), r, c)
                }
            }
        }
        #[cfg(not(emu_built))]
        let _ = (l, r, c, first);
        Some(up)
    }

    /// `w` (the matrix this was made of) reading these bytes.
    fn mat<'s>(&'s self, w: &MatRef<'_>) -> MatRef<'s> {
        let seg = |i: usize, len: usize| &bytes(&self.segs[i])[..len];
        match *w {
            MatRef::Bf16 { w: v, rows, cols } => {
                let b = seg(0, 2 * v.len());
                // SAFETY: the copy is 16-byte aligned and holds v.len() u16s.
                let w = unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u16>(), v.len()) };
                MatRef::Bf16 { w, rows, cols }
            }
            MatRef::Mxfp4(m) => MatRef::Mxfp4(fathom_weights::mxfp4::Mxfp4Ref {
                packed: seg(0, m.packed.len()),
                scales: seg(1, m.scales.len()),
                ..m
            }),
            _ => unreachable!("only bf16 and MXFP4 matrices are uploaded"),
        }
    }
}

fn bytes(v: &[u128]) -> &[u8] {
    // SAFETY: any initialised u128 slice may be viewed as its bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn bytes_mut(v: &mut [u128]) -> &mut [u8] {
    // SAFETY: as `bytes`; every byte pattern is a valid u128.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

/// `y[g] = x[g] · W[g]ᵀ` for `w`'s rows split into `groups` equal blocks
/// (one block: `y[t, rows] = x[t, cols] Wᵀ`) on the emulated kernel of
/// `w`'s format, launched as the CUDA backend launches it. Panics unless
/// [`takes`] and the slices have the shapes' lengths.
pub fn matmul(w: &MatRef<'_>, x: &[f32], t: usize, groups: usize, y: &mut [f32]) {
    assert!(
        takes(w, t, groups),
        "the emulator does not take this product"
    );
    let up = Uploaded::of(w);
    let w = &up.as_ref().map_or(*w, |u| u.mat(w));
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), groups * t * cols, "input length");
    assert_eq!(y.len(), t * rows, "output length");
    let (r, c, tt, rg) = (rows as i32, cols as i32, t as i32, (rows / groups) as i32);
    let l = mm_launch(w, t, 1);
    let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
    let _g = lock();
    #[cfg(emu_built)]
    // SAFETY: each kernel reads `w`'s segments, `x` and writes `y` within the
    // lengths checked above (the formats' own lengths are MatRef's invariants).
    unsafe {
        match *w {
            MatRef::F32 { w, .. } => ffi::emu_mm_f32(&l, w.as_ptr(), xp, yp, r, c, tt, rg),
            MatRef::Bf16 { w, .. } => ffi::emu_mm_bf16(&l, w.as_ptr(), xp, yp, r, c, tt, rg),
            MatRef::Int8 { q, scale, .. } => {
                ffi::emu_mm_int8(&l, q.as_ptr(), scale.as_ptr(), xp, yp, r, c, tt, rg)
            }
            MatRef::Mxfp4(m) => ffi::emu_mm_mxfp4(
                &l,
                m.packed.as_ptr(),
                m.scales.as_ptr(),
                xp,
                yp,
                r,
                c,
                tt,
                rg,
            ),
            MatRef::Fp8(m) => {
                let e4 = fathom_kernels::fp8::E4M3;
                ffi::emu_mm_fp8(
                    &l,
                    m.q.as_ptr(),
                    m.scale.as_ptr(),
                    e4.as_ptr(),
                    m.row0 as i32,
                    m.shift[0] as i32,
                    m.shift[1] as i32,
                    m.grid_cols as i32,
                    xp,
                    yp,
                    r,
                    c,
                    tt,
                    rg,
                )
            }
            MatRef::Int4(m) => ffi::emu_mm_int4(
                &l,
                m.packed.as_ptr(),
                m.scale.as_ptr(),
                m.group_shift as i32,
                xp,
                yp,
                r,
                c,
                tt,
                rg,
            ),
        }
    }
    #[cfg(not(emu_built))]
    let _ = (l, xp, yp, r, c, tt, rg);
}

/// Whether [`matmul_many`] takes these products together: all bf16 or all
/// MXFP4, one shape, one position count (what the CUDA backend groups).
pub fn takes_many(ws: &[MatRef<'_>], t: usize) -> bool {
    let Some(first) = ws.first() else {
        return false;
    };
    let kind = |w: &MatRef<'_>| match w {
        MatRef::Bf16 { .. } => 1,
        MatRef::Mxfp4(_) => 2,
        _ => 0,
    };
    kind(first) != 0
        && ws.iter().all(|w| {
            kind(w) == kind(first)
                && w.rows() == first.rows()
                && w.cols() == first.cols()
                && takes(w, t, 1)
        })
        && small(ws.len())
}

/// Several products of one format and shape in one launch (`mm_*_many`,
/// their addresses in a table): `ys[i] = xs[i] · ws[i]ᵀ`. Panics unless
/// [`takes_many`] and every slice has its shape's length.
pub fn matmul_many(ws: &[MatRef<'_>], xs: &[&[f32]], t: usize, ys: &mut [&mut [f32]]) {
    assert!(
        takes_many(ws, t),
        "the emulator does not group these products"
    );
    assert!(
        xs.len() == ws.len() && ys.len() == ws.len(),
        "one input and output a product"
    );
    let (rows, cols) = (ws[0].rows(), ws[0].cols());
    let ups: Vec<Option<Uploaded>> = ws.iter().map(Uploaded::of).collect();
    let ws: Vec<MatRef<'_>> = ws
        .iter()
        .zip(&ups)
        .map(|(w, u)| u.as_ref().map_or(*w, |u| u.mat(w)))
        .collect();
    let mut tab = Vec::with_capacity(4 * ws.len());
    for ((w, x), y) in ws.iter().zip(xs).zip(ys.iter_mut()) {
        assert!(
            x.len() == t * cols && y.len() == t * rows,
            "product lengths"
        );
        let s = segments(w);
        tab.extend([
            s[0].as_ptr() as u64,
            s.get(1).map_or(0, |s| s.as_ptr() as u64),
            x.as_ptr() as u64,
            y.as_mut_ptr() as u64,
        ]);
    }
    let l = mm_launch(&ws[0], t, ws.len());
    let (r, c, tt) = (rows as i32, cols as i32, t as i32);
    let _g = lock();
    #[cfg(emu_built)]
    // SAFETY: the table holds, per product, its weight segments, input and
    // output (host addresses, the emulator's "device" memory), all of the
    // shapes checked above.
    unsafe {
        if matches!(ws[0], MatRef::Bf16 { .. }) {
            ffi::emu_mm_bf16_many(&l, tab.as_ptr(), r, c, tt)
        } else {
            ffi::emu_mm_mxfp4_many(&l, tab.as_ptr(), r, c, tt)
        }
    }
    #[cfg(not(emu_built))]
    let _ = (l, r, c, tt, tab);
}

/// `g[i] = act(g[i], u[i])` by `glu.cu`'s `glu_act`, launched as the CUDA
/// backend launches it. Panics unless `g` and `u` have one length.
pub fn glu_act(act: GluAct, g: &mut [f32], u: &[f32]) {
    assert!(available(), "{ABSENT}");
    assert_eq!(g.len(), u.len(), "gate and up lengths");
    let (kind, beta, bl) = act.kernel_args();
    let n = g.len();
    let l = EmuLaunch {
        grid_x: n.div_ceil(256).clamp(1, 4096) as u32,
        grid_y: 1,
        grid_z: 1,
        block_x: 256,
        shared: 0,
    };
    let _g = lock();
    #[cfg(emu_built)]
    // SAFETY: `g` and `u` hold n values each.
    unsafe {
        ffi::emu_glu_act(&l, g.as_mut_ptr(), u.as_ptr(), n as i64, kind, beta, bl)
    }
    #[cfg(not(emu_built))]
    let _ = (l, kind, beta, bl, n);
}

/// `glu.cu`'s `moe_combine` launched as the CUDA backend launches it (a
/// block of 256 threads a row): `s [rows, width]` each row's sum of `o`'s
/// rows at the offsets `off` (values) weighted by `w` (`rows·k` each, in
/// rank order), RMS-normed with `norm`'s weight and ε when given.
pub fn moe_combine(
    o: &[f32],
    (off, w, k): (&[u32], &[f32], usize),
    norm: Option<(&[f32], f32)>,
    width: usize,
    s: &mut [f32],
) {
    assert!(available(), "{ABSENT}");
    let rows = s.len() / width.max(1);
    assert!(rows > 0 && s.len() == rows * width, "sums' length");
    assert!(
        off.len() == rows * k && w.len() == rows * k,
        "picks' lengths"
    );
    assert!(
        off.iter().all(|&a| a as usize + width <= o.len()),
        "offsets inside the outputs"
    );
    assert!(norm.is_none_or(|(nw, _)| nw.len() == width), "norm width");
    let l = EmuLaunch {
        grid_x: rows as u32,
        grid_y: 1,
        grid_z: 1,
        block_x: 256,
        shared: 0,
    };
    // Without a norm its weight is never read; any valid address does.
    let (has, nw, eps) = norm.map_or((0, w, 0.0), |(nw, eps)| (1, nw, eps));
    let _g = lock();
    #[cfg(emu_built)]
    // SAFETY: `o` holds every row the offsets name (checked), `off` and
    // `w` rows·k values, `nw` and each row of `s` width values.
    unsafe {
        ffi::emu_moe_combine(
            &l,
            o.as_ptr(),
            off.as_ptr(),
            w.as_ptr(),
            k as i32,
            width as i32,
            has,
            nw.as_ptr(),
            eps,
            s.as_mut_ptr(),
        )
    }
    #[cfg(not(emu_built))]
    let _ = (l, has, nw, eps);
}

/// One sequence's launch of `kda.cu`'s `kda_step` (grid: the heads; block:
/// a thread per channel), as the CUDA backend's: the buffers and sizes it
/// takes, checked by the caller ([`backend`]'s `kda_takes`).
pub(crate) struct KdaLaunch<'a> {
    pub state: &'a mut [f32],
    pub wins: [&'a mut [f32]; 3],
    pub pre: [&'a [f32]; 3],
    pub f: &'a [f32],
    pub b: &'a [f32],
    pub g: &'a [f32],
    pub taps: [&'a [f32]; 3],
    pub a: &'a [f32],
    pub dt: &'a [f32],
    pub onorm: &'a [f32],
    pub out: *mut f32,
    pub hin: *mut f32,
    pub ints: [i32; 7],
    pub floats: [f32; 4],
}

/// Runs `k` (`ints`: row0, t, heads, kd, kernel, n_rows, whether the decay
/// has a lower bound; `floats`: q_scale, l2_eps, norm_eps, lower bound).
///
/// # Safety
/// `out` holds `n_rows · heads · kd` values and `hin` is null or holds
/// `KdaJob::inputs_len` values for `n_rows`; every slice has the length
/// `kda_step` reads for those sizes.
pub(crate) unsafe fn kda_launch(k: KdaLaunch<'_>) {
    let [row0, t, heads, kd, kernel, n_rows, bounded] = k.ints;
    let [q_scale, l2, eps, lb] = k.floats;
    let l = EmuLaunch {
        grid_x: heads as u32,
        grid_y: 1,
        grid_z: 1,
        block_x: kd as u32,
        shared: (4 * (4 * kd + 2)) as u32,
    };
    let [wq, wk, wv] = k.wins;
    let _g = lock();
    #[cfg(emu_built)]
    // SAFETY: as the function's contract states.
    unsafe {
        ffi::emu_kda_step(
            &l,
            k.state.as_mut_ptr(),
            wq.as_mut_ptr(),
            wk.as_mut_ptr(),
            wv.as_mut_ptr(),
            k.pre[0].as_ptr(),
            k.pre[1].as_ptr(),
            k.pre[2].as_ptr(),
            k.f.as_ptr(),
            k.b.as_ptr(),
            k.g.as_ptr(),
            k.taps[0].as_ptr(),
            k.taps[1].as_ptr(),
            k.taps[2].as_ptr(),
            k.a.as_ptr(),
            k.dt.as_ptr(),
            k.onorm.as_ptr(),
            k.out,
            row0,
            t,
            heads,
            kd,
            kernel,
            q_scale,
            l2,
            eps,
            bounded,
            lb,
            k.hin,
            n_rows,
        )
    }
    #[cfg(not(emu_built))]
    let _ = (
        l, wq, wk, wv, row0, t, heads, kd, kernel, n_rows, q_scale, l2, eps, lb,
    );
}
