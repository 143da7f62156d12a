//! The emulated driver (`emu/driver.cpp`, `emu/nvrtc.cpp`) refuses what a
//! device would refuse or what would be silently wrong there: a copy that
//! leaves its allocation, a kernel reading host memory or another
//! device's memory, memory beyond the device's, a program other than the
//! kernels' source or compiled with FMA contraction; and it runs a kernel
//! from the same launch the backend makes, and a captured graph's kernels
//! and copies at each launch, refusing what stream capture refuses. One test, because the
//! environment it sets (two devices, 1 MiB each) is read once per process.

use std::ffi::{CString, c_void};

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUdeviceptr, CUresult};
use cudarc::nvrtc::result as nvrtc;

fn code(e: result::DriverError) -> CUresult {
    e.0
}

/// Compiles `src` with `opts` on the emulated NVRTC: its log on failure.
fn compile(src: &str, opts: &[&str]) -> Result<Vec<i8>, String> {
    let c = CString::new(src).unwrap();
    let prog = nvrtc::create_program(&c, None).map_err(|e| e.to_string())?;
    // SAFETY: a program just created; the options are plain strings.
    let r = unsafe { nvrtc::compile_program(prog, opts) };
    let out = match r {
        // SAFETY: the program compiled; its PTX is read once.
        Ok(()) => Ok(unsafe { nvrtc::get_ptx(prog) }.unwrap()),
        // SAFETY: the program exists; its log is read once.
        Err(_) => Err(unsafe { nvrtc::get_program_log(prog) }
            .unwrap()
            .iter()
            .map(|&b| b as u8 as char)
            .collect()),
    };
    // SAFETY: destroyed once.
    unsafe { nvrtc::destroy_program(prog) }.unwrap();
    out
}

const OPTS: [&str; 4] = [
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
];

#[test]
fn the_emulated_driver_refuses_what_a_device_would() {
    if fathom_cuda_emu::driver_dir().is_none() {
        eprintln!("skipped: {}", fathom_cuda_emu::ABSENT);
        return;
    }
    // SAFETY: this binary's only test sets them before the driver starts.
    unsafe {
        std::env::set_var("FATHOM_EMU_GPUS", "2");
        std::env::set_var("FATHOM_EMU_VRAM_MIB", "1");
    }
    fathom_cuda_emu::install_driver().unwrap();
    result::init().unwrap();
    let ptx = nvrtc_refuses_other_programs_and_options();
    driver_refuses_bad_copies_and_launches(&ptx);
}

/// NVRTC takes only the kernels' source, only without contraction or
/// fast math; the kernels' "PTX".
fn nvrtc_refuses_other_programs_and_options() -> Vec<i8> {
    let source = fathom_kernels_cuda_source();
    let ptx = compile(&source, &OPTS).unwrap();
    let log = compile("extern \"C\" __global__ void k() {}", &OPTS).unwrap_err();
    assert!(log.contains("not the kernels' source"), "{log}");
    let log = compile(&source, &OPTS[1..]).unwrap_err();
    assert!(log.contains("--fmad=false"), "{log}");
    let log = compile(&source, &[&OPTS[..], &["--fmad=true"]].concat()).unwrap_err();
    assert!(log.contains("--fmad=false"), "{log}");
    let log = compile(&source, &[&OPTS[..], &["--use_fast_math"]].concat()).unwrap_err();
    assert!(log.contains("rounding"), "{log}");
    ptx
}

/// Copies out of their allocation, memory beyond the device's, kernels
/// reading host memory or another device's memory are refused; a good
/// launch computes.
fn driver_refuses_bad_copies_and_launches(ptx: &[i8]) {
    let ctx = |i| {
        let d = result::device::get(i).unwrap();
        // SAFETY: a device the driver listed.
        let c = unsafe { result::primary_ctx::retain(d) }.unwrap();
        // SAFETY: its primary context.
        unsafe { result::ctx::set_current(c) }.unwrap();
    };
    ctx(0);
    // SAFETY: every pointer below is an allocation made here or a live host
    // buffer; the refused calls touch nothing.
    unsafe {
        let a: CUdeviceptr = result::malloc_sync(16).unwrap();
        let mut fresh = [0f32; 4];
        result::memcpy_dtoh_sync(&mut fresh, a).unwrap();
        assert!(fresh.iter().all(|v| v.is_nan()), "fresh memory: {fresh:?}");
        let e = result::memcpy_htod_sync(a + 8, &[1f32; 4]).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_INVALID_VALUE);
        let e = result::malloc_sync(2 << 20).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_OUT_OF_MEMORY);

        // y = w·x for a 1×4 f32 matrix, then the same with x on the host.
        let module = result::module::load_data(ptx.as_ptr().cast()).unwrap();
        let f = result::module::get_function(module, CString::new("mm_f32").unwrap()).unwrap();
        let (w, x, y) = (
            a,
            result::malloc_sync(16).unwrap(),
            result::malloc_sync(4).unwrap(),
        );
        result::memcpy_htod_sync(w, &[1f32, 2., 3., 4.]).unwrap();
        result::memcpy_htod_sync(x, &[1f32, 1., 1., 0.5]).unwrap();
        let host_x = [1f32; 4];
        let launch_on = |x: CUdeviceptr, s: sys::CUstream| {
            let (mut w, mut x, mut y) = (w, x, y);
            let (mut rows, mut cols, mut t, mut rows_g) = (1i32, 4i32, 1i32, 1i32);
            let mut params: Vec<*mut c_void> = vec![
                (&raw mut w).cast(),
                (&raw mut x).cast(),
                (&raw mut y).cast(),
                (&raw mut rows).cast(),
                (&raw mut cols).cast(),
                (&raw mut t).cast(),
                (&raw mut rows_g).cast(),
            ];
            result::launch_kernel(f, (1, 1, 1), (32, 1, 1), 0, s, &mut params)
        };
        let launch = |x: CUdeviceptr| launch_on(x, std::ptr::null_mut());
        launch(x).unwrap();
        let mut out = [0f32];
        result::memcpy_dtoh_sync(&mut out, y).unwrap();
        assert_eq!(out[0], 8.0);
        let e = launch(host_x.as_ptr() as CUdeviceptr).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        // Device 1 cannot read device 0's memory.
        ctx(1);
        let e = launch(x).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);

        // Stream capture: the capturing thread may not allocate (the
        // capture ends invalid); a copy from page-locked memory and a launch
        // are recorded, not run, and run at each launch of the graph,
        // reading the staging as it is then.
        ctx(0);
        let s = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        let pinned = result::malloc_host(16, 0).unwrap().cast::<f32>();
        let staged = std::slice::from_raw_parts_mut(pinned, 4);
        staged.copy_from_slice(&[2., 2., 2., 2.]);
        result::memcpy_htod_sync(y, &[0f32]).unwrap();
        result::stream::begin_capture(s, mode).unwrap();
        let e = result::malloc_sync(16).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        let e = result::stream::end_capture(s).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        result::stream::begin_capture(s, mode).unwrap();
        result::memcpy_htod_async(x, &*staged, s).unwrap();
        launch_on(x, s).unwrap();
        let graph = result::stream::end_capture(s).unwrap();
        result::memcpy_dtoh_sync(&mut out, y).unwrap();
        assert_eq!(out[0], 0.0, "a captured launch does not run");
        let exec = result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)).unwrap();
        result::graph::launch(exec, s).unwrap();
        result::memcpy_dtoh_sync(&mut out, y).unwrap();
        assert_eq!(out[0], 20.0);
        staged.copy_from_slice(&[1., 0., 0., 1.]);
        result::graph::launch(exec, s).unwrap();
        result::memcpy_dtoh_sync(&mut out, y).unwrap();
        assert_eq!(out[0], 5.0, "a replay reads the staging as it is now");
        // A captured copy from pageable memory ends the capture as invalid.
        result::stream::begin_capture(s, mode).unwrap();
        let e = result::memcpy_htod_async(x, &host_x, s).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        let e = result::stream::end_capture(s).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        // So does a memset on the capturing stream.
        result::stream::begin_capture(s, mode).unwrap();
        let e = result::memset_d8_async(y, 0, 4, s).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        let e = result::stream::end_capture(s).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        // Only the thread that began a thread-local capture ends it, and a
        // capturing stream is not destroyed.
        result::stream::begin_capture(s, mode).unwrap();
        let e = result::stream::destroy(s).unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        let other = s as usize;
        // The stream lives until after the thread is joined.
        let ended = std::thread::spawn(move || {
            result::stream::end_capture(other as sys::CUstream).map(|_| ())
        });
        let e = ended.join().unwrap().unwrap_err();
        assert_eq!(code(e), CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
        result::graph::destroy(result::stream::end_capture(s).unwrap()).unwrap();
        result::stream::destroy(s).unwrap();
        result::graph::exec_destroy(exec).unwrap();
        result::graph::destroy(graph).unwrap();
        result::free_host(pinned.cast()).unwrap();
    }
}

/// The `.cu` files in `fathom_kernels_cuda::SOURCE`'s order.
fn fathom_kernels_cuda_source() -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernels-cuda/src");
    // The build script's list (`SOURCES` in build.rs).
    env!("FATHOM_EMU_SOURCES")
        .split(',')
        .map(|f| std::fs::read_to_string(dir.join(f)).unwrap())
        .collect()
}
