//! Gated NoPE MLA over T new positions, attending through the compressed
//! latent cache (k3-model.md §5).
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

use fathom_kernels::ops::{rms_norm_rows, sigmoid, softmax};
use rayon::prelude::*;

use super::config::{K3Spec, MLA_LOW_RANK_NORM_EPS};
use super::state::MlaCache;
use super::weights::MlaWeights;

/// One query position's head output: absorbed scores over the first `n`
/// cached rows, softmax, context on the latent, then `W_uv` and the gate.
struct HeadCtx<'a> {
    lora: usize,
    width: usize,
    dn: usize,
    scale: f32,
    w_uk: &'a [f32],
    w_uv: &'a [f32],
}

/// Buffers one head reuses across its positions.
#[derive(Default)]
struct Scratch {
    q_lat: Vec<f32>,
    scores: Vec<f32>,
    ctx: Vec<f32>,
}

impl HeadCtx<'_> {
    fn attend(
        &self,
        qh: &[f32],
        rows: &[f32],
        n: usize,
        gate: &[f32],
        o: &mut [f32],
        sc: &mut Scratch,
    ) {
        let (lora, width, dn) = (self.lora, self.width, self.dn);
        let Scratch { q_lat, scores, ctx } = sc;
        // q_lat = W_uk,hᵀ q_nope
        q_lat.clear();
        q_lat.resize(lora, 0.0);
        for (&qi, wr) in qh[..dn].iter().zip(self.w_uk.chunks_exact(lora)) {
            for (ql, &wv) in q_lat.iter_mut().zip(wr) {
                *ql += qi * wv;
            }
        }
        scores.clear();
        for s in 0..n {
            let r = &rows[s * width..(s + 1) * width];
            let nope: f32 = r[..lora].iter().zip(q_lat.iter()).map(|(a, b)| a * b).sum();
            let rope: f32 = r[lora..].iter().zip(&qh[dn..]).map(|(a, b)| a * b).sum();
            scores.push((nope + rope) * self.scale);
        }
        softmax(scores);
        ctx.clear();
        ctx.resize(lora, 0.0);
        for (s, &ps) in scores.iter().enumerate() {
            let r = &rows[s * width..s * width + lora];
            for (cv, &l) in ctx.iter_mut().zip(r) {
                *cv += ps * l;
            }
        }
        for (j, (ov, wr)) in o.iter_mut().zip(self.w_uv.chunks_exact(lora)).enumerate() {
            let mut acc = 0f32;
            for (&wv, &cv) in wr.iter().zip(ctx.iter()) {
                acc += wv * cv;
            }
            *ov = acc * sigmoid(gate[j]);
        }
    }
}

/// MLA attention for the rows `x [N, D]` (already `input_layernorm`ed) of
/// several sequences (`segs[i]` are sequence i's rows, `caches[i]` its
/// cache). Projections run once over all rows; each sequence attends to its
/// own cache, to which its rows are appended. Returns `[N, D]`.
pub fn mla(
    spec: &K3Spec,
    w: &MlaWeights,
    caches: &mut [&mut MlaCache],
    segs: &[super::kda::Segment],
    x: &[f32],
) -> Vec<f32> {
    let n = x.len() / spec.hidden_size;
    let (h, dn, dr, dv, lora) = (
        spec.mla_heads,
        spec.qk_nope_head_dim,
        spec.qk_rope_head_dim,
        spec.v_head_dim,
        spec.kv_lora_rank,
    );
    let dq = dn + dr;
    let width = lora + dr;

    let mut qa = w.q_a_proj.forward(x, n);
    rms_norm_rows(
        &mut qa,
        spec.q_lora_rank,
        &w.q_a_layernorm,
        MLA_LOW_RANK_NORM_EPS,
    );
    let q = w.q_b_proj.forward(&qa, n); // [N, H·dq]
    let mut c = w.kv_a_proj_with_mqa.forward(x, n); // [N, lora + dr]
    for row in c.chunks_exact_mut(width) {
        rms_norm_rows(
            &mut row[..lora],
            lora,
            &w.kv_a_layernorm,
            MLA_LOW_RANK_NORM_EPS,
        );
    }
    // (cache, rows already cached before this step) per sequence.
    let mut past = Vec::with_capacity(caches.len());
    for (cache, seg) in caches.iter_mut().zip(segs) {
        past.push(cache.len());
        cache
            .rows
            .extend_from_slice(&c[seg.start * width..seg.end * width]);
    }
    let caches: &[&mut MlaCache] = caches;
    let gate = w.g_proj.forward(x, n); // [N, H·dv]
    let kv_b = &w.kv_b_proj;
    let attended: usize = segs
        .iter()
        .zip(&past)
        .map(|(s, p)| s.len() * (p + s.len()))
        .sum();
    let per_head = attended * (2 * lora + dr) + (dn + dv) * lora;

    // Per head: [N, dv] outputs.
    let heads: Vec<Vec<f32>> = (0..h)
        .into_par_iter()
        .with_min_len(crate::par_min_len(h, per_head))
        .map(|hh| {
            // This head's W_uk [dn, lora] and W_uv [dv, lora] in f32, decoded
            // once per step (not per position) from the stored precision.
            let uk0 = hh * (dn + dv);
            let w_uk: Vec<f32> = (uk0..uk0 + dn).flat_map(|r| kv_b.row(r)).collect();
            let w_uv: Vec<f32> = (uk0 + dn..uk0 + dn + dv)
                .flat_map(|r| kv_b.row(r))
                .collect();
            let hc = HeadCtx {
                lora,
                width,
                dn,
                scale: 1.0 / (dq as f32).sqrt(),
                w_uk: &w_uk,
                w_uv: &w_uv,
            };
            let mut out = vec![0f32; n * dv];
            let mut sc = Scratch::default();
            for ((cache, seg), &p0) in caches.iter().zip(segs).zip(&past) {
                for (i, ti) in seg.clone().enumerate() {
                    let qh = &q[ti * h * dq + hh * dq..][..dq];
                    let g = &gate[ti * h * dv + hh * dv..][..dv];
                    // causal: this position sees itself and all before
                    hc.attend(
                        qh,
                        &cache.rows,
                        p0 + i + 1,
                        g,
                        &mut out[ti * dv..(ti + 1) * dv],
                        &mut sc,
                    );
                }
            }
            out
        })
        .collect();
    let mut cat = vec![0f32; n * h * dv];
    for (hh, o) in heads.iter().enumerate() {
        for ti in 0..n {
            cat[ti * h * dv + hh * dv..][..dv].copy_from_slice(&o[ti * dv..(ti + 1) * dv]);
        }
    }
    w.o_proj.forward(&cat, n)
}
