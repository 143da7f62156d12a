//! `mla.cu` on the emulator: MLA attention over latent caches, launched as
//! the CUDA backend launches it (`device/mla.rs`).

use fathom_kernels::attention::{MlaQuery, MlaShape, SPLIT};

use crate::{ABSENT, EmuLaunch, available, lock};

/// One launch pair's arguments: `table` every cache block's address,
/// `boff[i]` where query i's cache starts in it, the latent queries with
/// query i's head h at `i·q_qs + h·q_hs`, `q_rope [T, H, rope]`, `ns[i]`
/// the rows query i sees, and the context written with the same kind of
/// strides (`o_qs`, `o_hs`).
pub struct MlaLaunch<'a> {
    pub shape: MlaShape,
    pub table: &'a [u64],
    pub boff: &'a [i32],
    pub q_lat: &'a [f32],
    pub q_qs: i64,
    pub q_hs: i64,
    pub q_rope: &'a [f32],
    pub ns: &'a [i32],
    pub out: &'a mut [f32],
    pub o_qs: i64,
    pub o_hs: i64,
}

/// Runs `mla_split` over (split, query, head) blocks of 256 threads, then
/// `mla_merge` per query and head. The caller has checked the shapes (as
/// `MlaWork::fits_device_kernel` does): every address in `table` holds its
/// block, the strides stay inside `q_lat` and `out`.
pub fn mla_launch(l: MlaLaunch<'_>) {
    assert!(available(), "{ABSENT}");
    let sh = l.shape;
    let (h, lora, t) = (sh.heads, sh.lora, l.ns.len());
    assert!(l.boff.len() == t && l.q_rope.len() == t * h * sh.rope);
    let max_splits =
        l.ns.iter()
            .map(|&n| (n as usize).div_ceil(SPLIT))
            .max()
            .unwrap_or(0);
    let parts = t * max_splits * h;
    let (mut ps, mut pm, mut pl) = (
        vec![0f32; parts * SPLIT],
        vec![0f32; parts],
        vec![0f32; parts],
    );
    let mut pc = vec![0f32; parts * lora];
    let split = EmuLaunch {
        grid_x: max_splits as u32,
        grid_y: t as u32,
        grid_z: h as u32,
        block_x: 256,
        shared: 0,
    };
    let merge = EmuLaunch {
        grid_x: t as u32,
        grid_y: h as u32,
        grid_z: 1,
        block_x: 256,
        shared: 0,
    };
    let (hh, lo, ro, ms) = (h as i32, lora as i32, sh.rope as i32, max_splits as i32);
    let _g = lock();
    #[cfg(emu_built)]
    // SAFETY: the table holds every block's address, the queries, row
    // counts and offsets T entries, every scratch buffer its size for T
    // queries of at most max_splits splits; the strides stay inside
    // `q_lat` and `out` (the caller's check).
    unsafe {
        crate::ffi::emu_mla_split(
            &split,
            l.table.as_ptr(),
            l.boff.as_ptr(),
            l.q_lat.as_ptr(),
            l.q_qs,
            l.q_hs,
            l.q_rope.as_ptr(),
            l.ns.as_ptr(),
            hh,
            lo,
            ro,
            sh.scale,
            ms,
            ps.as_mut_ptr(),
            pm.as_mut_ptr(),
            pl.as_mut_ptr(),
            pc.as_mut_ptr(),
        );
        crate::ffi::emu_mla_merge(
            &merge,
            l.ns.as_ptr(),
            hh,
            lo,
            ms,
            pm.as_ptr(),
            pl.as_ptr(),
            pc.as_ptr(),
            l.out.as_mut_ptr(),
            l.o_qs,
            l.o_hs,
        );
    }
    #[cfg(not(emu_built))]
    let _ = (
        split, merge, hh, lo, ro, ms, &mut ps, &mut pm, &mut pl, &mut pc, l,
    );
}

/// `mla.cu`'s `mla_gate` launched as the CUDA backend launches it (blocks
/// of 256 threads, at most 4096): the values `vals [H, T, dv]` by position
/// into `cat [T, H·dv]`, each times σ(gate) when a gate `[T, H·dv]` is
/// given.
pub fn mla_gate(
    vals: &[f32],
    gate: Option<&[f32]>,
    (h, t, dv): (usize, usize, usize),
    cat: &mut [f32],
) {
    assert!(available(), "{ABSENT}");
    let n = h * t * dv;
    assert!(vals.len() == n && cat.len() == n, "values' lengths");
    assert!(gate.is_none_or(|g| g.len() == n), "gate's length");
    let l = EmuLaunch {
        grid_x: n.div_ceil(256).clamp(1, 4096) as u32,
        grid_y: 1,
        grid_z: 1,
        block_x: 256,
        shared: 0,
    };
    // Without a gate its pointer is never read; any valid address does.
    let (gated, g) = (i32::from(gate.is_some()), gate.unwrap_or(vals));
    let _g = lock();
    #[cfg(emu_built)]
    // SAFETY: `vals`, `cat` and `g` each hold H·T·dv values (checked).
    unsafe {
        crate::ffi::emu_mla_gate(
            &l,
            vals.as_ptr(),
            g.as_ptr(),
            gated,
            h as i32,
            t as i32,
            dv as i32,
            cat.as_mut_ptr(),
        )
    }
    #[cfg(not(emu_built))]
    let _ = (l, gated, g, cat);
}

/// Every query's context `[T, H, lora]` over one cache's `blocks` of
/// [`SPLIT`] rows each, as [`fathom_kernels::attention::mla_attend`] takes
/// them. Panics on shapes that function refuses.
pub fn mla_attend(sh: &MlaShape, blocks: &[&[f32]], queries: &[MlaQuery<'_>], out: &mut [f32]) {
    let (h, lora, rope, w) = (sh.heads, sh.lora, sh.rope, sh.width());
    let t = queries.len();
    assert_eq!(out.len(), t * h * lora, "out is [T, H, lora]");
    let rows: usize = blocks.iter().map(|b| b.len()).sum::<usize>() / w.max(1);
    assert!(
        queries.iter().all(|q| q.n >= 1 && q.n <= rows),
        "a query sees 1..=cached rows"
    );
    assert!(
        blocks.iter().rev().skip(1).all(|b| b.len() == SPLIT * w),
        "full blocks"
    );
    for q in queries {
        assert_eq!(q.q_lat.len(), h * lora, "q_lat is [H, lora]");
        assert_eq!(q.q_rope.len(), h * rope, "q_rope is [H, rope]");
    }
    let splits = rows.div_ceil(SPLIT);
    let small = |v: usize| i32::try_from(v).is_ok();
    assert!(
        small(rows)
            && t.checked_mul(splits * h * (SPLIT + lora + 2))
                .is_some_and(small),
        "sizes fit the kernels' ints"
    );
    let ns: Vec<i32> = queries.iter().map(|q| q.n as i32).collect();
    let table: Vec<u64> = blocks.iter().map(|b| b.as_ptr() as u64).collect();
    let q_lat: Vec<f32> = queries.iter().flat_map(|q| q.q_lat).copied().collect();
    let q_rope: Vec<f32> = queries.iter().flat_map(|q| q.q_rope).copied().collect();
    mla_launch(MlaLaunch {
        shape: *sh,
        table: &table,
        boff: &vec![0; t],
        q_lat: &q_lat,
        q_qs: (h * lora) as i64,
        q_hs: lora as i64,
        q_rope: &q_rope,
        ns: &ns,
        out,
        o_qs: (h * lora) as i64,
        o_hs: lora as i64,
    });
}
