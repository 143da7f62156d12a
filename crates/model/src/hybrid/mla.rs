//! NoPE MLA over T new positions, attending through the compressed latent
//! cache (k3-model.md §5), from the layer's query and `kv_a` projections to
//! the per-head values (the family applies its output gate, if any, and
//! `o_proj`).
//!
//! Computation order ("absorbed"): the cache holds, per token, the
//! normalised latent `lat = RMSNorm(c[:kv_lora])` and the shared key part
//! `kr = c[kv_lora:]`. Per-head keys and values are never materialised:
//!
//! ```text
//! k_h·q_h  = (W_uk,h lat)·q_nope,h + kr·q_rope,h = lat·(W_uk,hᵀ q_nope,h) + kr·q_rope,h
//! Σ p v_h  = Σ_s p_s W_uv,h lat_s = W_uv,h (Σ_s p_s lat_s)
//! ```
//! where `W_uk,h` / `W_uv,h` are head h's `qk_nope` / `v_head_dim` row blocks
//! of `kv_b_proj`. So a step costs `H·N·(kv_lora + rope)` for scores plus
//! `H·N·kv_lora` for the context, and the cache is 576 floats/token for K3.
//! This equals the expanded form up to fp32 summation order; the golden
//! logits (computed in the expanded order) hold to ~1e-4.
//!
//! No rotary transform anywhere (`mla_use_nope`); the "rope" slices are
//! ordinary dimensions. Scores are scaled by `1/sqrt(qk_nope + qk_rope)`.
//!
//! The attention itself is `fathom_kernels::attention::mla_attend`: every
//! head in one pass over the cache rows, in fixed 256-row splits merged in
//! order, so a position's result is the same in a prefill chunk, a decode
//! step or a verification pass, batched or not, at any thread count.

use fathom_kernels::attention::{MlaAccum, MlaQuery, MlaShape};
use fathom_kernels::ops::rms_norm_rows;
use rayon::prelude::*;

use crate::error::Result;

use super::MlaDims;
use super::state::MlaCache;
use crate::linear::Linear;

/// `kv_b_proj` (`[H·(dn + dv), lora]`, head-major) rearranged once at load
/// for the absorbed form: `uk_t` holds every head's `W_uk,hᵀ` (`[H·lora,
/// dn]`, so `q_lat = W_uk,hᵀ q_nope` is a matrix product) and `uv` every
/// head's `W_uv,h` (`[H·dv, lora]`). Same bytes and precision as stored.
#[derive(Debug)]
pub struct AbsorbedKvB {
    pub uk_t: Linear,
    pub uv: Linear,
}

impl AbsorbedKvB {
    pub fn new(d: &MlaDims, kv_b: &Linear) -> Self {
        let (h, dn, dv) = (d.heads, d.qk_nope_head_dim, d.v_head_dim);
        let per = dn + dv;
        let uk_t = Linear::stack(
            (0..h)
                .map(|hh| kv_b.transposed_rows(hh * per..hh * per + dn))
                .collect(),
        );
        let uv = Linear::stack(
            (0..h)
                .map(|hh| kv_b.select_rows(hh * per + dn..(hh + 1) * per))
                .collect(),
        );
        AbsorbedKvB { uk_t, uv }
    }
}

/// MLA for the rows of several sequences (`segs[i]` are sequence i's rows,
/// `caches[i]` its cache, to which its rows are appended), from the queries
/// `q [N, H·dq]` and the raw `kv_a_proj_with_mqa` output `c [N, lora + dr]`.
/// Returns the per-head values `[N, H·dv]`.
pub fn mla_heads(
    d: &MlaDims,
    kv_a_layernorm: &[f32],
    kv_b: &AbsorbedKvB,
    caches: &mut [&mut MlaCache],
    segs: &[super::kda::Segment],
    q: &[f32],
    mut c: Vec<f32>,
) -> Result<Vec<f32>> {
    let n = segs.last().map_or(0, |s| s.end);
    let (h, dn, dr, dv, lora) = (
        d.heads,
        d.qk_nope_head_dim,
        d.qk_rope_head_dim,
        d.v_head_dim,
        d.kv_lora_rank,
    );
    let dq = dn + dr;
    let width = lora + dr;
    for row in c.chunks_exact_mut(width) {
        rms_norm_rows(&mut row[..lora], lora, kv_a_layernorm, d.norm_eps);
    }
    // (cache, rows already cached before this step) per sequence.
    let mut past = Vec::with_capacity(caches.len());
    for (cache, seg) in caches.iter_mut().zip(segs) {
        past.push(cache.len());
        cache.push_rows(&c[seg.start * width..seg.end * width])?;
    }
    let caches: &[&mut MlaCache] = caches;
    // Absorbed queries: q_lat[t, h] = W_uk,hᵀ q_nope[t, h]; q_rope[t, h] as is.
    let per_head: Vec<Vec<f32>> = (0..h)
        .into_par_iter()
        .map(|hh| {
            let mut qn = Vec::with_capacity(n * dn);
            for ti in 0..n {
                qn.extend_from_slice(&q[ti * h * dq + hh * dq..][..dn]);
            }
            kv_b.uk_t.forward_rows(hh * lora..(hh + 1) * lora, &qn, n)
        })
        .collect();
    let mut q_lat = vec![0f32; n * h * lora];
    let mut q_rope = vec![0f32; n * h * dr];
    for ti in 0..n {
        for (hh, ql) in per_head.iter().enumerate() {
            q_lat[(ti * h + hh) * lora..][..lora].copy_from_slice(&ql[ti * lora..(ti + 1) * lora]);
            let src = &q[ti * h * dq + hh * dq + dn..][..dr];
            q_rope[(ti * h + hh) * dr..][..dr].copy_from_slice(src);
        }
    }
    let shape = MlaShape {
        heads: h,
        lora,
        rope: dr,
        scale: 1.0 / (dq as f32).sqrt(),
    };
    // Context on the latent, [N, H, lora]: each sequence's rows attend to its cache.
    let mut ctx = vec![0f32; n * h * lora];
    for ((cache, seg), &p0) in caches.iter().zip(segs).zip(&past) {
        let queries: Vec<MlaQuery<'_>> = seg
            .clone()
            .enumerate()
            .map(|(i, ti)| MlaQuery {
                q_lat: &q_lat[ti * h * lora..(ti + 1) * h * lora],
                q_rope: &q_rope[ti * h * dr..(ti + 1) * h * dr],
                // causal: this position sees itself and all before
                n: p0 + i + 1,
            })
            .collect();
        let out = &mut ctx[seg.start * h * lora..seg.end * h * lora];
        let mut acc = MlaAccum::new(shape, &queries);
        cache.windows(p0 + seg.len(), |first, blocks| acc.add(first, blocks))?;
        acc.finish(out);
    }
    // Output per head through W_uv: [N, H·dv].
    let outs: Vec<Vec<f32>> = (0..h)
        .into_par_iter()
        .map(|hh| {
            let mut c = Vec::with_capacity(n * lora);
            for ti in 0..n {
                c.extend_from_slice(&ctx[(ti * h + hh) * lora..][..lora]);
            }
            kv_b.uv.forward_rows(hh * dv..(hh + 1) * dv, &c, n)
        })
        .collect();
    let mut cat = vec![0f32; n * h * dv];
    for ti in 0..n {
        for (hh, o) in outs.iter().enumerate() {
            cat[ti * h * dv + hh * dv..][..dv].copy_from_slice(&o[ti * dv..(ti + 1) * dv]);
        }
    }
    Ok(cat)
}
