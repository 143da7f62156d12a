//! The device's two bandwidths, measured when a backend opens, so that run
//! reports can set decode beside bounds taken on the same machine in the
//! same process: device memory (a device-to-device copy, bytes read plus
//! written per second) and host → device from page-locked memory.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, result};

use crate::CudaError;

/// Bytes each probe moves per pass.
const PROBE_BYTES: usize = 256 << 20;
const PASSES: usize = 3;

/// (device memory bytes/s, host → device bytes/s); the best of a few
/// passes after a warm-up. Zero for a probe that could not allocate; a
/// failed copy is an error (the caller takes zeros).
pub fn bandwidths(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
) -> Result<(f64, f64), CudaError> {
    let Ok(src) = stream.alloc_zeros::<u8>(PROBE_BYTES) else {
        return Ok((0.0, 0.0));
    };
    let Ok(mut dst) = stream.alloc_zeros::<u8>(PROBE_BYTES) else {
        return Ok((0.0, 0.0));
    };
    let cu = stream.cu_stream();
    let best_dev = best_secs(stream, || {
        let (s, _a) = src.device_ptr(stream);
        let (d, _b) = dst.device_ptr_mut(stream);
        // SAFETY: both buffers hold PROBE_BYTES and belong to `stream`.
        unsafe { result::memcpy_dtod_async(d, s, PROBE_BYTES, cu) }?;
        Ok(())
    })?;
    // SAFETY: the host buffer is only a copy source; its contents do not matter.
    let Ok(host) = (unsafe { ctx.alloc_pinned_with_flags::<u8>(PROBE_BYTES, 0) }) else {
        return Ok((2.0 * PROBE_BYTES as f64 / best_dev, 0.0));
    };
    let best_h2d = best_secs(stream, || Ok(stream.memcpy_htod(&host, &mut dst)?))?;
    let rate = |bytes: f64, s: f64| if s > 0.0 { bytes / s } else { 0.0 };
    Ok((
        rate(2.0 * PROBE_BYTES as f64, best_dev),
        rate(PROBE_BYTES as f64, best_h2d),
    ))
}

/// The fastest of [`PASSES`] timed passes of `pass` (queued, then waited
/// for), after one untimed warm-up.
fn best_secs(
    stream: &Arc<CudaStream>,
    mut pass: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    let mut best = f64::INFINITY;
    for i in 0..=PASSES {
        let t = Instant::now();
        pass()?;
        stream.synchronize()?;
        if i > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    Ok(best)
}
