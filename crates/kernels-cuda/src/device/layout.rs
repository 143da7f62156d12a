//! How a weight segment's bytes sit in VRAM. bf16 matrices whose width is
//! a multiple of 8 and MXFP4 matrices are rearranged once, when their copy
//! up lands (`bf16_lanes`, `mxfp4_lanes` in `matmul.cu`): in each full
//! chunk of 256 columns of a row, lane l's eight values (columns
//! c + l + 32u) sit together, as the products read them. Every other
//! segment keeps the host's layout. The cache keys a copy by its host
//! bytes' address and length, so the same bytes seen later as another
//! matrix (another format or width) must not be read in the first one's
//! layout: [`relayout`] drops such a copy before the call copies it again.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig};
use fathom_kernels::backend::{MatRef, segments};

use super::queue::key;
use super::tape::{Arg, launch_now};
use super::{CudaBackend, State};
use crate::CudaError;
use crate::cache::Key;

/// A segment's layout in VRAM.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Layout {
    /// As on the host.
    Host,
    /// A bf16 matrix's values, `cols` wide, in lane order.
    Bf16Lanes(usize),
    /// An MXFP4 matrix's codes, `cols` wide, in lane order.
    Mxfp4Lanes(usize),
}

impl Layout {
    /// The layout of segment `i` of `w` in VRAM: lane order for the first
    /// segment (the values or codes) of a bf16 matrix whose width is a
    /// multiple of 8 or an MXFP4 matrix, with at least one full chunk;
    /// else the host's.
    pub(super) fn of(w: &MatRef<'_>, i: usize) -> Self {
        let chunks = |rows: usize, cols: usize| rows * (cols / 256) > 0;
        match *w {
            MatRef::Bf16 { rows, cols, .. } if i == 0 && cols % 8 == 0 && chunks(rows, cols) => {
                Layout::Bf16Lanes(cols)
            }
            MatRef::Mxfp4(m) if i == 0 && chunks(m.rows, m.cols) => Layout::Mxfp4Lanes(m.cols),
            _ => Layout::Host,
        }
    }

    /// Each segment of `w` with the layout it needs here.
    pub(super) fn wanted(w: &MatRef<'_>) -> Vec<(Key, Layout)> {
        let segs = segments(w);
        segs.iter()
            .enumerate()
            .map(|(i, s)| (key(s), Layout::of(w, i)))
            .collect()
    }
}

/// Whether `wanted` names one segment in two layouts (the same bytes as
/// two matrices in one call): such a call is declined, since one copy
/// cannot serve both.
pub(super) fn conflicting(wanted: &[(Key, Layout)]) -> bool {
    let mut seen = <foldhash::HashMap<Key, Layout> as foldhash::HashMapExt>::new();
    wanted
        .iter()
        .any(|(k, l)| *seen.entry(*k).or_insert(*l) != *l)
}

/// Drops the copies here of the segments `wanted` names that are held in
/// another layout (the same bytes copied for another matrix), after any
/// copy of theirs still running ends, so the call copies them again.
/// Only between calls: nothing of this call reads them yet.
pub(super) fn relayout(st: &mut State, wanted: &[(Key, Layout)]) {
    for (k, layout) in wanted {
        if st.cache.get(k).is_some_and(|r| r.layout != *layout) {
            for gone in st.cache.forget(k.0..k.0 + k.1) {
                if let Some(ready) = gone.ready {
                    let _ = ready.synchronize();
                }
            }
        }
    }
    st.stats.vram_weight_bytes = st.cache.bytes();
}

impl CudaBackend {
    /// Lays out the values of `w` just copied into `buf` (its first
    /// segment) as `layout` (`Layout::of(w, 0)`), on `stream` behind the
    /// copy: the lane-order rearrangement of `matmul.cu`, or nothing for
    /// the host's layout.
    pub(super) fn lay_out(
        &self,
        stream: &Arc<CudaStream>,
        w: &MatRef<'_>,
        layout: Layout,
        buf: &CudaSlice<u8>,
    ) -> Result<(), CudaError> {
        let (f, cols) = match layout {
            Layout::Host => return Ok(()),
            Layout::Bf16Lanes(cols) => (&self.funcs.bf16_lanes, cols),
            Layout::Mxfp4Lanes(cols) => (&self.funcs.mxfp4_lanes, cols),
        };
        let rows = w.rows();
        let warps = rows * (cols / 256);
        let (r, c) = (rows as i32, cols as i32);
        let cfg = LaunchConfig {
            grid_dim: (warps.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let dst = buf.device_ptr(stream).0;
        // The arguments match `*_lanes(T*, int, int)`: `buf` holds the
        // `rows` rows of `cols` values of `w`'s format (`Layout::of`).
        launch_now(stream, f, cfg, vec![dst, r.slot(), c.slot()])
    }
}
