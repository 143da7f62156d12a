//! The x86 splits of the latent-cache attention (AVX2 and AVX-512): the
//! arithmetic of `attention::split_partial_simple`, with more independent
//! values per instruction and nothing else changed.
//!
//! Per tile of eight heads:
//! * the queries are packed once per split as `[chunk][head][8 lanes]`, so
//!   a chunk's queries are one contiguous run (and an AVX-512 register holds
//!   two heads' lanes: `[head 2p | head 2p+1]` against a row chunk broadcast
//!   to both halves);
//! * scores: several rows × several heads in flight. Each head's lane `l` is
//!   still `fma(row[8c + l], q[8c + l], ·)` over the chunks in order; the
//!   lanes are folded exactly as [`dot_lanes`] folds them, and the tail runs
//!   in order after the fold;
//! * softmax weights are stored row-major (`[row][head]`, one cache line per
//!   row) and the context is accumulated a column block at a time for the
//!   eight heads in registers while the split's rows stream past: each value
//!   is still `fma(p_j, lat_j, ·)` over the rows in order from zero.
//!
//! So the result is the twin's bit for bit (the attention parity tests run
//! whichever table the CPU selects; `FATHOM_KERNELS` picks another).

use std::arch::x86_64::*;

use crate::attention::{HEAD_TILE, MlaQuery, MlaShape, Partial, dot_lanes, recycle, scratch};
use crate::expf::exp_softmax;
use crate::expf::x86::exp_shifted;

/// Which vector width a split runs at.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Width {
    Avx2,
    Avx512,
}

/// The split's partial; see the module docs.
///
/// # Safety
/// The CPU supports AVX2 and FMA, and AVX-512 F for [`Width::Avx512`]
/// (the kernel table's selection checks both).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn split_partial(
    wd: Width,
    sh: &MlaShape,
    blocks: &[&[f32]],
    q: &MlaQuery<'_>,
    k: usize,
    len: usize,
) -> Partial {
    let (h, lora, w) = (sh.heads, sh.lora, sh.width());
    let rows = &blocks[k][..len * w];
    let mut s = scratch(h * len);
    let mut m = vec![f32::NEG_INFINITY; h];
    let mut l = vec![0f32; h];
    let mut c = scratch(h * lora);
    let mut p = scratch(HEAD_TILE * len);
    let mut e = scratch(len);
    let wide = wd == Width::Avx512;
    let mut h0 = 0;
    while h0 + HEAD_TILE <= h {
        let lat_q = pack(q.q_lat, lora, h0);
        let rope_q = pack(q.q_rope, sh.rope, h0);
        let tile = &mut s[h0 * len..(h0 + HEAD_TILE) * len];
        // SAFETY: the caller's CPU runs this width.
        unsafe { scores(wd, sh, rows, q, (&lat_q, &rope_q), h0, tile) };
        for t in 0..HEAD_TILE {
            let hh = h0 + t;
            for j in 0..len {
                m[hh] = m[hh].max(tile[t * len + j]);
            }
            // SAFETY: the caller's CPU runs this width.
            unsafe { exp_shifted(wide, &tile[t * len..(t + 1) * len], m[hh], &mut e) };
            for (j, &v) in e[..len].iter().enumerate() {
                p[j * HEAD_TILE + t] = v;
                l[hh] += v;
            }
        }
        let ctx = &mut c[h0 * lora..(h0 + HEAD_TILE) * lora];
        // SAFETY: as above.
        unsafe { context(wd, &p, ctx, rows, (len, lora, w)) };
        h0 += HEAD_TILE;
    }
    recycle(p);
    recycle(e);
    for hh in h0..h {
        single_head(sh, rows, q, hh, len, (&mut s, &mut m, &mut l, &mut c));
    }
    recycle(s);
    Partial { m, l, c }
}

/// One head the tiles do not cover, in the twin's loops (inlined into the
/// AVX2 + FMA caller, so `mul_add` is one instruction, not a library call).
#[inline(always)]
fn single_head(
    sh: &MlaShape,
    rows: &[f32],
    q: &MlaQuery<'_>,
    hh: usize,
    len: usize,
    (s, m, l, c): (&mut [f32], &mut [f32], &mut [f32], &mut [f32]),
) {
    let (lora, rope, w) = (sh.lora, sh.rope, sh.width());
    let ql = &q.q_lat[hh * lora..(hh + 1) * lora];
    let qr = &q.q_rope[hh * rope..(hh + 1) * rope];
    for (j, r) in rows.chunks_exact(w).enumerate() {
        let (lat, kr) = r.split_at(lora);
        let v = (dot_lanes(lat, ql) + dot_lanes(kr, qr)) * sh.scale;
        s[hh * len + j] = v;
        m[hh] = m[hh].max(v);
    }
    for (j, r) in rows.chunks_exact(w).enumerate() {
        let p = exp_softmax(s[hh * len + j] - m[hh]);
        l[hh] += p;
        for (cv, &x) in c[hh * lora..(hh + 1) * lora].iter_mut().zip(&r[..lora]) {
            *cv = p.mul_add(x, *cv);
        }
    }
}

/// The tile's queries (`stride` wide per head) packed per 8-lane chunk as
/// `[chunk][head][lane]`; only whole chunks.
fn pack(qv: &[f32], stride: usize, h0: usize) -> Vec<f32> {
    let chunks = stride / 8;
    let mut out = vec![0f32; chunks * HEAD_TILE * 8];
    for ch in 0..chunks {
        for t in 0..HEAD_TILE {
            let src = &qv[(h0 + t) * stride + ch * 8..][..8];
            out[(ch * HEAD_TILE + t) * 8..][..8].copy_from_slice(src);
        }
    }
    out
}

/// Scores of the head tile at `h0` for every row into `tile[t * len + j]`.
#[target_feature(enable = "avx2,fma")]
unsafe fn scores(
    wd: Width,
    sh: &MlaShape,
    rows: &[f32],
    q: &MlaQuery<'_>,
    (lat_q, rope_q): (&[f32], &[f32]),
    h0: usize,
    tile: &mut [f32],
) {
    let (lora, rope, w) = (sh.lora, sh.rope, sh.width());
    let len = rows.len() / w;
    // Rows whose lanes one call computes (AVX-512: 4, AVX2: 2).
    let group = if wd == Width::Avx512 { 4 } else { 2 };
    let mut j = 0;
    while j < len {
        let nr = (len - j).min(group);
        // Rows past `nr` repeat the last one (computed, not stored).
        let r: [&[f32]; 4] = std::array::from_fn(|i| &rows[(j + i.min(nr - 1)) * w..][..w]);
        // SAFETY: packed tables hold whole chunks; row chunks stay in `w`.
        let (a, b) = unsafe {
            match wd {
                Width::Avx512 => (
                    lanes512(&r, 0, lat_q, lora / 8),
                    lanes512(&r, lora, rope_q, rope / 8),
                ),
                Width::Avx2 => (
                    lanes256(&r, 0, lat_q, lora / 8),
                    lanes256(&r, lora, rope_q, rope / 8),
                ),
            }
        };
        for (i, ri) in r.iter().enumerate().take(nr) {
            for t in 0..HEAD_TILE {
                let hh = h0 + t;
                let ql = &q.q_lat[hh * lora..(hh + 1) * lora];
                let qr = &q.q_rope[hh * rope..(hh + 1) * rope];
                let x = fold(&a[i][t], &ri[..lora], ql, lora / 8 * 8);
                let y = fold(&b[i][t], &ri[lora..], qr, rope / 8 * 8);
                tile[t * len + j + i] = (x + y) * sh.scale;
            }
        }
        j += nr;
    }
}

/// Lane sums `[row][head][lane]` of four rows (from `off`, `chunks` chunks
/// of 8) against the packed tile: a zmm per (row, head pair).
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn lanes512(
    r: &[&[f32]; 4],
    off: usize,
    packed: &[f32],
    chunks: usize,
) -> [[[f32; 8]; HEAD_TILE]; 4] {
    const PAIRS: usize = HEAD_TILE / 2;
    let mut acc = [[_mm512_setzero_ps(); PAIRS]; 4];
    for ch in 0..chunks {
        let mut x = [_mm512_setzero_ps(); 4];
        for (xi, ri) in x.iter_mut().zip(r) {
            // SAFETY: `off + 8 ch + 8 <= w` (the caller's chunk count).
            let v = unsafe { _mm256_loadu_pd(ri.as_ptr().add(off + ch * 8) as *const f64) };
            *xi = _mm512_castpd_ps(_mm512_broadcast_f64x4(v));
        }
        for p in 0..PAIRS {
            // SAFETY: the packed table holds chunks × HEAD_TILE × 8 floats.
            let qv = unsafe { _mm512_loadu_ps(packed.as_ptr().add((ch * PAIRS + p) * 16)) };
            for i in 0..4 {
                acc[i][p] = _mm512_fmadd_ps(x[i], qv, acc[i][p]);
            }
        }
    }
    let mut out = [[[0f32; 8]; HEAD_TILE]; 4];
    for i in 0..4 {
        for p in 0..PAIRS {
            let mut t = [0f32; 16];
            // SAFETY: `t` holds 16 floats.
            unsafe { _mm512_storeu_ps(t.as_mut_ptr(), acc[i][p]) };
            out[i][2 * p].copy_from_slice(&t[..8]);
            out[i][2 * p + 1].copy_from_slice(&t[8..]);
        }
    }
    out
}

/// [`lanes512`] for AVX2: two rows × four heads in flight, the tile in
/// two halves (rows 2 and 3 are left zero).
#[target_feature(enable = "avx2,fma")]
unsafe fn lanes256(
    r: &[&[f32]; 4],
    off: usize,
    packed: &[f32],
    chunks: usize,
) -> [[[f32; 8]; HEAD_TILE]; 4] {
    let mut out = [[[0f32; 8]; HEAD_TILE]; 4];
    for half in 0..2 {
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        for ch in 0..chunks {
            // SAFETY: `off + 8 ch + 8 <= w`; the packed table holds whole chunks.
            unsafe {
                let x0 = _mm256_loadu_ps(r[0].as_ptr().add(off + ch * 8));
                let x1 = _mm256_loadu_ps(r[1].as_ptr().add(off + ch * 8));
                let base = packed.as_ptr().add((ch * HEAD_TILE + half * 4) * 8);
                for t in 0..4 {
                    let qv = _mm256_loadu_ps(base.add(t * 8));
                    acc[0][t] = _mm256_fmadd_ps(x0, qv, acc[0][t]);
                    acc[1][t] = _mm256_fmadd_ps(x1, qv, acc[1][t]);
                }
            }
        }
        for i in 0..2 {
            for t in 0..4 {
                // SAFETY: the destination holds 8 floats.
                unsafe { _mm256_storeu_ps(out[i][half * 4 + t].as_mut_ptr(), acc[i][t]) };
            }
        }
    }
    out
}

/// [`dot_lanes`]'s fold of eight lanes, then its tail from `body` in order.
#[inline(always)]
fn fold(a: &[f32; 8], x: &[f32], q: &[f32], body: usize) -> f32 {
    let mut s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    for i in body..q.len() {
        s = x[i].mul_add(q[i], s);
    }
    s
}

/// The tile's context rows `ctx[t * lora + col] = Σ_j p[j][t] · lat_j[col]`
/// (fused, rows in order from zero): eight heads × one column block in
/// registers (AVX-512: 16 columns, AVX2: 8), the tail columns in order.
#[target_feature(enable = "avx2,fma")]
unsafe fn context(
    wd: Width,
    p: &[f32],
    ctx: &mut [f32],
    rows: &[f32],
    (len, lora, w): (usize, usize, usize),
) {
    let step = if wd == Width::Avx512 { 16 } else { 8 };
    let body = lora / step * step;
    // Rows a chunk holds: their cache lines stay in L1 while every column
    // block passes over them (each value's fma chain still runs over the
    // rows in order; a chunk resumes from the previous chunk's sums).
    const ROW_CHUNK: usize = 8;
    for j0 in (0..len).step_by(ROW_CHUNK) {
        let j1 = (j0 + ROW_CHUNK).min(len);
        for cc in (0..body).step_by(step) {
            // SAFETY: `cc + step <= lora`; the caller's CPU runs this width.
            unsafe {
                match wd {
                    Width::Avx512 => context512(p, ctx, rows, (j0, j1, lora, w), cc),
                    Width::Avx2 => context256(p, ctx, rows, (j0, j1, lora, w), cc),
                }
            }
        }
    }
    for cc in body..lora {
        for t in 0..HEAD_TILE {
            let mut a = 0f32;
            for j in 0..len {
                a = p[j * HEAD_TILE + t].mul_add(rows[j * w + cc], a);
            }
            ctx[t * lora + cc] = a;
        }
    }
}

#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn context512(
    p: &[f32],
    ctx: &mut [f32],
    rows: &[f32],
    (j0, j1, lora, w): (usize, usize, usize, usize),
    cc: usize,
) {
    let mut acc = [_mm512_setzero_ps(); HEAD_TILE];
    if j0 > 0 {
        for (t, a) in acc.iter_mut().enumerate() {
            // SAFETY: the tile's context holds `HEAD_TILE × lora` values.
            *a = unsafe { _mm512_loadu_ps(ctx.as_ptr().add(t * lora + cc)) };
        }
    }
    for j in j0..j1 {
        // SAFETY: row `j < len`, columns `cc..cc + 16` within `lora <= w`;
        // `p` holds `len × HEAD_TILE` weights.
        unsafe {
            let x = _mm512_loadu_ps(rows.as_ptr().add(j * w + cc));
            let pj = p.as_ptr().add(j * HEAD_TILE);
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_set1_ps(*pj.add(t)), x, *a);
            }
        }
    }
    for (t, a) in acc.iter().enumerate() {
        // SAFETY: 16 floats at `t * lora + cc` are within the tile's context.
        unsafe { _mm512_storeu_ps(ctx.as_mut_ptr().add(t * lora + cc), *a) };
    }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn context256(
    p: &[f32],
    ctx: &mut [f32],
    rows: &[f32],
    (j0, j1, lora, w): (usize, usize, usize, usize),
    cc: usize,
) {
    let mut acc = [_mm256_setzero_ps(); HEAD_TILE];
    if j0 > 0 {
        for (t, a) in acc.iter_mut().enumerate() {
            // SAFETY: the tile's context holds `HEAD_TILE × lora` values.
            *a = unsafe { _mm256_loadu_ps(ctx.as_ptr().add(t * lora + cc)) };
        }
    }
    for j in j0..j1 {
        // SAFETY: as in `context512`, for 8 columns.
        unsafe {
            let x = _mm256_loadu_ps(rows.as_ptr().add(j * w + cc));
            let pj = p.as_ptr().add(j * HEAD_TILE);
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_broadcast_ss(&*pj.add(t)), x, *a);
            }
        }
    }
    for (t, a) in acc.iter().enumerate() {
        // SAFETY: 8 floats at `t * lora + cc` are within the tile's context.
        unsafe { _mm256_storeu_ps(ctx.as_mut_ptr().add(t * lora + cc), *a) };
    }
}
