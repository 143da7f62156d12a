//! An MLA layer's projections taken into its attention's call
//! ([`super::MlaWork::proj`]), so that a device needs one round trip from
//! the layer's normed rows to its output: the queries (a low-rank pair
//! with the RMSNorm between, or one product), the step's new cache rows
//! (`kv_a_proj_with_mqa`, the latent part's RMSNorm, the rotary step of
//! the position part where the family has one) and the output gate's
//! input. [`mla_proj_cpu`] is the order a device repeats; it is the
//! model's own host path, step for step.

use super::MatRef;
use crate::attention::{MlaShape, SPLIT};
use crate::ops::rms_norm_rows;

/// The widest row a device's MLA norms take (`mla.cu`'s `MLA_NORM_MAX`).
pub const DEVICE_MAX_NORM: usize = 8192;

/// How an [`MlaProj`] makes the queries `q [T, H·(dn + rope)]`.
#[derive(Clone, Copy)]
pub enum MlaQueryProj<'a> {
    /// `q = b(RMSNorm(x aᵀ; norm, eps))` ([`crate::ops::rms_norm`]).
    LowRank {
        a: MatRef<'a>,
        norm: &'a [f32],
        eps: f32,
        b: MatRef<'a>,
    },
    /// `q = x Wᵀ`.
    Full(MatRef<'a>),
}

/// The rotary step's angles for the step's rows, `cos` and `sin` `[T,
/// rope/2]` each; `interleaved` when the checkpoint pairs adjacent values
/// (each head's values are de-interleaved before the rotate-half rotation).
#[derive(Clone, Copy)]
pub struct MlaAngles<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub interleaved: bool,
}

/// An MLA layer's projections from its normed rows `x [T, D]`: the queries
/// ([`MlaQueryProj`]), the new cache rows `[T, lora + rope]` = `x kv_aᵀ`
/// with the latent part RMSNormed (`kv_norm`, `kv_eps`) and, with
/// `angles`, the position part rotated, and with `gate` (`[H·dv, D]`) the
/// output gate's input `x gateᵀ`. The new rows are written to `rows_out`
/// (the caller appends them to the caches after the call).
pub struct MlaProj<'a> {
    pub x: &'a [f32],
    pub q: MlaQueryProj<'a>,
    pub kv_a: MatRef<'a>,
    pub kv_norm: &'a [f32],
    pub kv_eps: f32,
    pub gate: Option<MatRef<'a>>,
    pub angles: Option<MlaAngles<'a>>,
    pub rows_out: &'a mut [f32],
}

/// What [`mla_proj_cpu`] gives, as the rest of an MLA step takes it.
pub struct MlaProjected {
    /// `[H, T, dn]`.
    pub q_nope: Vec<f32>,
    /// `[T, H, rope]`, rotated with angles.
    pub q_rope: Vec<f32>,
    /// The new cache rows `[T, lora + rope]`.
    pub rows: Vec<f32>,
    /// `[T, H·dv]`, with a gate.
    pub gate: Option<Vec<f32>>,
}

impl MlaProj<'_> {
    /// The products this brings into the call.
    pub fn products(&self) -> Vec<MatRef<'_>> {
        let mut m = match self.q {
            MlaQueryProj::LowRank { a, b, .. } => vec![a, b],
            MlaQueryProj::Full(q) => vec![q],
        };
        m.push(self.kv_a);
        m.extend(self.gate);
        m
    }

    /// The products' shapes, the norms' and angles' lengths and `rows_out`'s
    /// for `t` rows of `sh`, `dn` no-position query values a head and
    /// `hdv` gated values a row, within a device's limits.
    pub fn fits(&self, sh: &MlaShape, dn: usize, hdv: usize, t: usize) -> bool {
        let dm = self.kv_a.cols();
        let (w, dq) = (sh.width(), sh.heads * (dn + sh.rope));
        let small = |v: usize| i32::try_from(v).is_ok();
        let q_ok = match self.q {
            MlaQueryProj::LowRank { a, norm, b, .. } => {
                let r = a.rows();
                a.cols() == dm
                    && r > 0
                    && r <= DEVICE_MAX_NORM
                    && norm.len() == r
                    && b.cols() == r
                    && b.rows() == dq
                    && t.checked_mul(r).is_some_and(small)
            }
            MlaQueryProj::Full(q) => q.cols() == dm && q.rows() == dq,
        };
        let angles_ok = self.angles.is_none_or(|a| {
            let half = sh.rope / 2;
            sh.rope.is_multiple_of(2) && a.cos.len() == t * half && a.sin.len() == t * half
        });
        dm > 0
            && q_ok
            && angles_ok
            && self.x.len() == t * dm
            && t.checked_mul(dm.max(dq).max(w)).is_some_and(small)
            && self.kv_a.rows() == w
            && self.kv_a.cols() == dm
            && sh.lora <= DEVICE_MAX_NORM
            && self.kv_norm.len() == sh.lora
            && self.gate.is_none_or(|g| g.rows() == hdv && g.cols() == dm)
            && self.rows_out.len() == t * w
    }
}

/// `x`'s heads (`[heads, dr]`) rotated: each de-interleaved when
/// `interleaved`, then `a = x₁ cos − x₂ sin`, `b = x₂ cos + x₁ sin` over
/// its halves, each product rounded.
pub fn rotate_heads(x: &mut [f32], dr: usize, cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = dr / 2;
    let mut tmp = vec![0f32; dr];
    for head in x.chunks_exact_mut(dr) {
        if interleaved {
            for i in 0..half {
                tmp[i] = head[2 * i];
                tmp[half + i] = head[2 * i + 1];
            }
            head.copy_from_slice(&tmp);
        }
        let (a, b) = head.split_at_mut(half);
        for i in 0..half {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/// [`MlaProj`] on the CPU for `t` rows of `sh` with `dn` no-position query
/// values a head: the twin a device matches.
pub fn mla_proj_cpu(p: &MlaProj<'_>, sh: &MlaShape, dn: usize, t: usize) -> MlaProjected {
    let (h, lora, dr, w) = (sh.heads, sh.lora, sh.rope, sh.width());
    let product = |m: &MatRef<'_>, x: &[f32]| {
        let mut y = vec![0f32; t * m.rows()];
        m.cpu(x, t, &mut y);
        y
    };
    let q = match &p.q {
        MlaQueryProj::LowRank { a, norm, eps, b } => {
            let mut qa = product(a, p.x);
            rms_norm_rows(&mut qa, a.rows(), norm, *eps);
            product(b, &qa)
        }
        MlaQueryProj::Full(m) => product(m, p.x),
    };
    let dq = dn + dr;
    let mut q_nope = Vec::with_capacity(h * t * dn);
    for hh in 0..h {
        for ti in 0..t {
            q_nope.extend_from_slice(&q[(ti * h + hh) * dq..][..dn]);
        }
    }
    let mut q_rope = vec![0f32; t * h * dr];
    for ti in 0..t {
        for hh in 0..h {
            q_rope[(ti * h + hh) * dr..][..dr].copy_from_slice(&q[(ti * h + hh) * dq + dn..][..dr]);
        }
    }
    let mut rows = product(&p.kv_a, p.x);
    for (ti, row) in rows.chunks_exact_mut(w).enumerate() {
        rms_norm_rows(&mut row[..lora], lora, p.kv_norm, p.kv_eps);
        if let Some(a) = &p.angles {
            let (c, s) = (
                &a.cos[ti * dr / 2..][..dr / 2],
                &a.sin[ti * dr / 2..][..dr / 2],
            );
            rotate_heads(&mut row[lora..], dr, c, s, a.interleaved);
            rotate_heads(
                &mut q_rope[ti * h * dr..][..h * dr],
                dr,
                c,
                s,
                a.interleaved,
            );
        }
    }
    let gate = p.gate.as_ref().map(|g| product(g, p.x));
    MlaProjected {
        q_nope,
        q_rope,
        rows,
        gate,
    }
}

/// A sequence's blocks after its step's new rows `new` (`[k, w]`) join
/// its cached blocks `blocks` (all but the last [`SPLIT`] rows): the full
/// cached blocks as they are, then the rest (the last partial block and
/// the new rows) in blocks of [`SPLIT`] rows.
pub fn blocks_with<'a>(
    blocks: &[&'a [f32]],
    new: &[f32],
    w: usize,
) -> (Vec<&'a [f32]>, Vec<Vec<f32>>) {
    let full_len = SPLIT * w;
    let kept = blocks.iter().take_while(|b| b.len() == full_len).count();
    let mut rest: Vec<f32> = blocks[kept..].concat();
    rest.extend_from_slice(new);
    let owned = rest.chunks(full_len).map(<[f32]>::to_vec).collect();
    (blocks[..kept].to_vec(), owned)
}
