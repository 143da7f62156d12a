//! An MLA layer's absorbed attention on the device (`Backend::mla_attend`:
//! `uk_t`'s grouped product, the attention over each sequence's cache,
//! `uv`'s grouped product, in one call) against the CPU kernels step by
//! step, bit for bit: two sequences (their kept and sent blocks
//! interleaved in one table), queries seeing one row to every row of a
//! cache of full blocks and a partial one; the full blocks kept on the
//! device between calls (only partial blocks and queries go up again); a
//! block changed after `forget` copied anew; a prefill run in chunks of
//! queries; the values gated and through an output projection in the
//! same call (`MlaOut`); full blocks beyond the budget declined with
//! nothing written.
//! Without a CUDA device (real or emulated) the test prints why it skipped.

use fathom_kernels::attention::{MlaShape, SPLIT};
use fathom_kernels::backend::{
    Backend, MatRef, MlaAngles, MlaOut, MlaProj, MlaQueryProj, MlaSeqWork, MlaWork, mla_work_cpu,
    then_cpu,
};

mod common;

use common::{Lcg, Rest, open};

impl Lcg {
    fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() as f32 / u32::MAX as f32 - 0.5) * 2.0 * amp)
            .collect()
    }
    fn bf16(&mut self, n: usize) -> Vec<u16> {
        self.vec(n, 0.4)
            .iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect()
    }
}

const SH: MlaShape = MlaShape {
    heads: 5,
    lora: 36,
    rope: 12,
    scale: 0.17,
};
const DN: usize = 20;
const DV: usize = 24;

#[test]
fn mla_attention_on_the_device_gives_the_cpus_bits() {
    let Some(dev) = open(Some(64 << 20)) else {
        return;
    };
    let (h, w) = (SH.heads, SH.width());
    let mut g = Lcg(7);
    let (rows_a, rows_b) = (3 * SPLIT + 41, SPLIT + 100);
    let mut cache_a = g.vec(rows_a * w, 2.0);
    let cache_b = g.vec(rows_b * w, 2.0);
    let ns = [
        1usize,
        SPLIT - 1,
        SPLIT,
        SPLIT + 1,
        2 * SPLIT + 3,
        rows_a,
        7,
        rows_b,
    ];
    let t = ns.len();
    let q_nope = g.vec(h * t * DN, 1.5);
    let q_rope = g.vec(t * h * SH.rope, 1.5);
    let (uk, uv) = (g.bf16(h * SH.lora * DN), g.bf16(h * DV * SH.lora));
    let block_bytes = (4 * SPLIT * w) as u64;
    // An output projection [96, H·dv] and a gate [T, H·dv] after the values.
    let (o_w, gate) = (g.bf16(96 * h * DV), g.vec(t * h * DV, 3.0));
    let o_proj = MatRef::Bf16 {
        w: &o_w,
        rows: 96,
        cols: h * DV,
    };
    // The device's values (with `o`, the gated values through `o_proj`)
    // and the CPU's as bits; `None` when declined.
    let both = |b: &dyn Backend, cache_a: &[f32], stable: usize, o: Option<MlaOut<'_>>| {
        let seqs = [
            MlaSeqWork {
                blocks: cache_a.chunks(SPLIT * w).collect(),
                stable,
                queries: 0..6,
                first: 0,
            },
            MlaSeqWork {
                blocks: cache_b.chunks(SPLIT * w).collect(),
                stable: stable.min(1),
                queries: 6..8,
                first: 0,
            },
        ];
        let width = o.map_or(h * DV, |o| o.o_proj.rows());
        let mut out = vec![f32::NAN; t * width];
        let mut work = MlaWork {
            shape: SH,
            seqs: &seqs,
            ns: &ns,
            q_nope: &q_nope,
            q_rope: &q_rope,
            uk_t: MatRef::Bf16 {
                w: &uk,
                rows: h * SH.lora,
                cols: DN,
            },
            uv: MatRef::Bf16 {
                w: &uv,
                rows: h * DV,
                cols: SH.lora,
            },
            o,
            out: &mut out,
            then: None,
            proj: None,
        };
        assert!(work.fits_device_kernel());
        let mut want = vec![0f32; t * width];
        mla_work_cpu(&mut MlaWork {
            out: &mut want,
            then: None,
            proj: None,
            ..work
        });
        if !b.mla_attend(&mut work) {
            assert!(
                out.iter().all(|v| v.is_nan()),
                "declined work wrote its output"
            );
            return None;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        Some((bits(&out), bits(&want)))
    };
    let run_o = |cache_a: &[f32], stable: usize, o: Option<MlaOut<'_>>| {
        let before = dev.stats();
        let (d, c) = both(dev.as_ref(), cache_a, stable, o).expect("taken");
        assert_eq!(d, c, "stable {stable}, output projection {}", o.is_some());
        dev.stats().since(&before)
    };
    let run = |cache_a: &[f32], stable: usize| run_o(cache_a, stable, None);
    // First call: the three full blocks go up and stay.
    let first = run(&cache_a, 3);
    assert_eq!((first.device_attention, first.device_calls), (1, 1));
    assert!(first.h2d_bytes >= 3 * block_bytes, "{first:?}");
    // Second call: only the partial blocks, the queries and the table.
    let again = run(&cache_a, 3);
    assert!(again.h2d_bytes < block_bytes, "{again:?}");
    // Nothing kept: every block goes up each call, same bits.
    let none = run(&cache_a, 0);
    assert!(none.h2d_bytes >= 3 * block_bytes, "{none:?}");
    // A full block changes after its owner forgets it: copied anew.
    let b1 = SPLIT * w..2 * SPLIT * w;
    let start = cache_a[b1.clone()].as_ptr() as usize;
    dev.forget(start..start + 4 * b1.len());
    for v in &mut cache_a[b1] {
        *v = -*v * 0.5;
    }
    let changed = run(&cache_a, 3);
    assert!(changed.h2d_bytes >= block_bytes, "{changed:?}");
    // The values gated and through an output projection in the same call
    // (and ungated): one call, one product more.
    for gate in [Some(&gate[..]), None] {
        let o = MlaOut { gate, o_proj };
        let st = run_o(&cache_a, 3, Some(o));
        assert_eq!((st.device_calls, st.device_products), (1, 3));
    }
    // A prefill in chunks of three queries, with and without the projection.
    dev.limit_mla_scratch(3 * 4 * h * (SPLIT + SH.lora + 2));
    run(&cache_a, 3);
    let o = MlaOut {
        gate: Some(&gate),
        o_proj,
    };
    run_o(&cache_a, 3, Some(o));
    dev.limit_mla_scratch(usize::MAX);
    // Full blocks beyond the budget: declined, nothing written.
    let Some(small) = open(Some(block_bytes)) else {
        return;
    };
    assert!(both(small.as_ref(), &cache_a, 3, None).is_none());
    // Without kept blocks the small device takes it.
    let (d, c) = both(small.as_ref(), &cache_a, 0, None).expect("taken");
    assert_eq!(d, c);
}

/// The rest of the layer up to its experts' choice ([`Then`]) in the
/// attention's call, bit for bit against the CPU's steps: rows wider than
/// one of the mix kernels' tiles (4096) with a tail past the last full
/// chunk of 32, with and without earlier blocks and a query; then one
/// call a step, the rest's products counted.
#[test]
fn an_mla_step_with_its_layers_rest_gives_the_twins_bits() {
    let Some(dev) = open(None) else {
        return;
    };
    const D: usize = 4107;
    let (h, w) = (SH.heads, SH.width());
    let mut g = Lcg(11);
    let cache = g.vec(40 * w, 2.0);
    let ns = [38usize, 39, 40];
    let t = ns.len();
    let q_nope = g.vec(h * t * DN, 1.5);
    let q_rope = g.vec(t * h * SH.rope, 1.5);
    let (uk, uv) = (g.bf16(h * SH.lora * DN), g.bf16(h * DV * SH.lora));
    let (o_w, gate) = (g.bf16(D * h * DV), g.vec(t * h * DV, 3.0));
    for (nb, query) in [(0, false), (2, true), (1, true)] {
        let seqs = [MlaSeqWork {
            blocks: vec![&cache[..]],
            stable: 0,
            queries: 0..t,
            first: 0,
        }];
        let o = MlaOut {
            gate: Some(&gate),
            o_proj: MatRef::Bf16 {
                w: &o_w,
                rows: D,
                cols: h * DV,
            },
        };
        let run = |device: bool| {
            let mut rest = Rest::new(&dev, &mut Lcg(5 + nb as u64), t, D, nb, query);
            let mut out = vec![f32::NAN; t * D];
            let mut work = MlaWork {
                shape: SH,
                seqs: &seqs,
                ns: &ns,
                q_nope: &q_nope,
                q_rope: &q_rope,
                uk_t: MatRef::Bf16 {
                    w: &uk,
                    rows: h * SH.lora,
                    cols: DN,
                },
                uv: MatRef::Bf16 {
                    w: &uv,
                    rows: h * DV,
                    cols: SH.lora,
                },
                o: Some(o),
                out: &mut out,
                then: Some(rest.then()),
                proj: None,
            };
            let before = dev.stats();
            if device {
                assert!(dev.mla_attend(&mut work), "the device takes it");
                assert!(work.then.as_ref().is_some_and(|t| t.done));
            } else {
                mla_work_cpu(&mut work);
                let a = work.out.to_vec();
                then_cpu(work.then.as_mut().expect("given"), &a);
            }
            drop(work);
            let st = dev.stats().since(&before);
            let bits: Vec<u32> = out.iter().map(|v| v.to_bits()).chain(rest.bits()).collect();
            (bits, st)
        };
        let (got, st) = run(true);
        let (want, _) = run(false);
        let first = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(
            got == want,
            "{nb} blocks, query {query}: the bits differ from value {first:?} of {}",
            got.len()
        );
        // uk_t, uv, o_proj and the rest's five products, in one call.
        assert_eq!((st.device_calls, st.device_products), (1, 8));
    }
}

/// An MLA step with the layer's projections in the same call
/// ([`MlaProj`]): the queries (low-rank with their norm, or one product),
/// the new rows (normed, rotated where the family has a rotary step, with
/// interleaved pairs or not) joining caches that end mid-block, at a
/// block's end, or are empty, a prefill chunk crossing a block boundary,
/// the gate; output and new rows bit for bit against the twin, one call.
#[test]
fn an_mla_step_with_its_projections_gives_the_twins_bits() {
    let Some(dev) = open(None) else {
        return;
    };
    const D: usize = 300;
    const R: usize = 40;
    let (h, w, dr) = (SH.heads, SH.width(), SH.rope);
    let mut g = Lcg(23);
    let x_w = |g: &mut Lcg, rows: usize| g.bf16(rows * D);
    let (qa, qb, qf) = (
        x_w(&mut g, R),
        g.bf16(h * (DN + dr) * R),
        x_w(&mut g, h * (DN + dr)),
    );
    let (kv_a, gate_w) = (x_w(&mut g, w), x_w(&mut g, h * DV));
    let (q_norm, kv_norm) = (g.vec(R, 2.0), g.vec(SH.lora, 2.0));
    let (uk, uv, o_w) = (
        g.bf16(h * SH.lora * DN),
        g.bf16(h * DV * SH.lora),
        g.bf16(64 * h * DV),
    );
    fn bf(w: &[u16], rows: usize, cols: usize) -> MatRef<'_> {
        MatRef::Bf16 { w, rows, cols }
    }
    // (cached rows, new rows) of three sequences.
    let shape = [(SPLIT + 250, 9usize), (0, 3), (SPLIT, 1)];
    let caches: Vec<Vec<f32>> = shape.iter().map(|&(p0, _)| g.vec(p0 * w, 2.0)).collect();
    let t: usize = shape.iter().map(|s| s.1).sum();
    let x = g.vec(t * D, 1.0);
    let (cos, sin) = (g.vec(t * dr / 2, 1.0), g.vec(t * dr / 2, 1.0));
    let mut ns = Vec::new();
    for &(p0, k) in &shape {
        ns.extend((1..=k).map(|i| p0 + i));
    }
    let low = MlaQueryProj::LowRank {
        a: bf(&qa, R, D),
        norm: &q_norm,
        eps: 1e-6,
        b: bf(&qb, h * (DN + dr), R),
    };
    let full = MlaQueryProj::Full(bf(&qf, h * (DN + dr), D));
    let angles = |interleaved| MlaAngles {
        cos: &cos,
        sin: &sin,
        interleaved,
    };
    let gate = bf(&gate_w, h * DV, D);
    // K3 (low-rank, gated, no rotary step), DeepSeek-V3 (low-rank,
    // interleaved pairs), a full-rank query with rotate-half pairs.
    let cases = [
        (low, Some(gate), None),
        (low, None, Some(angles(true))),
        (full, None, Some(angles(false))),
    ];
    for (k, (q, gate, angles)) in cases.into_iter().enumerate() {
        let run = |device: bool| {
            let mut at = 0;
            let seqs: Vec<MlaSeqWork<'_>> = shape
                .iter()
                .zip(&caches)
                .map(|(&(p0, n), c)| {
                    at += n;
                    MlaSeqWork {
                        blocks: c.chunks(SPLIT * w).collect(),
                        stable: p0 / SPLIT,
                        queries: at - n..at,
                        first: 0,
                    }
                })
                .collect();
            let (mut out, mut rows) = (vec![f32::NAN; t * 64], vec![f32::NAN; t * w]);
            let mut work = MlaWork {
                shape: SH,
                seqs: &seqs,
                ns: &ns,
                q_nope: &[],
                q_rope: &[],
                uk_t: bf(&uk, h * SH.lora, DN),
                uv: bf(&uv, h * DV, SH.lora),
                o: Some(MlaOut {
                    gate: None,
                    o_proj: bf(&o_w, 64, h * DV),
                }),
                out: &mut out,
                then: None,
                proj: Some(MlaProj {
                    x: &x,
                    q,
                    kv_a: bf(&kv_a, w, D),
                    kv_norm: &kv_norm,
                    kv_eps: 1e-6,
                    gate,
                    angles,
                    rows_out: &mut rows,
                }),
            };
            assert!(work.fits_device_kernel(), "case {k}");
            let before = dev.stats();
            if device {
                assert!(dev.mla_attend(&mut work), "case {k}: the device takes it");
            } else {
                mla_work_cpu(&mut work);
            }
            drop(work);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&out), bits(&rows), dev.stats().since(&before))
        };
        let (d, c) = (run(true), run(false));
        assert_eq!(d.1, c.1, "case {k}: the new rows");
        assert_eq!(d.0, c.0, "case {k}: the output");
        // uk_t, uv, o_proj, kv_a, the queries (two when low-rank), the gate.
        let products = 5
            + usize::from(gate.is_some())
            + usize::from(matches!(q, MlaQueryProj::LowRank { .. }));
        assert_eq!(
            (d.2.device_calls, d.2.device_products),
            (1, products as u64),
            "case {k}"
        );
    }
}

/// The attention at more shapes, bit for bit against the CPU's steps:
/// 3 heads of a 64-wide latent and 16-wide position part (multiples of 8
/// and 32), 5 heads of 36 and 12 with scores spread over hundreds (large
/// values, a scale of 4), so most weights underflow to zero, 17 heads of
/// 520 and 8 (two head groups) and 2 of 600 and 8 (a head a block); one
/// sequence whose queries see one row, a split less one, a split, a split
/// and one, and every row of a cache of three splits and a partial one.
#[test]
fn mla_attention_at_other_shapes_and_underflowing_weights_keeps_the_bits() {
    let Some(dev) = open(None) else {
        return;
    };
    let shapes = [
        (
            MlaShape {
                heads: 3,
                lora: 64,
                rope: 16,
                scale: 0.125,
            },
            0.5f32,
        ),
        (
            MlaShape {
                heads: 5,
                lora: 36,
                rope: 12,
                scale: 4.0,
            },
            3.0,
        ),
        // Two groups of `mla_split_heads` (16 heads, then 1), more latent
        // values than a thread's two a pass take.
        (
            MlaShape {
                heads: 17,
                lora: 520,
                rope: 8,
                scale: 0.05,
            },
            0.5,
        ),
        // Rows wider than `mla_split_heads` stages: a head a block.
        (
            MlaShape {
                heads: 2,
                lora: 600,
                rope: 8,
                scale: 0.05,
            },
            0.5,
        ),
    ];
    for (k, (sh, amp)) in shapes.into_iter().enumerate() {
        let (h, w) = (sh.heads, sh.width());
        let mut g = Lcg(11 + k as u64);
        let rows = 3 * SPLIT + 77;
        let cache = g.vec(rows * w, amp);
        let ns = [1usize, SPLIT - 1, SPLIT, SPLIT + 1, rows];
        let t = ns.len();
        let (q_nope, q_rope) = (g.vec(h * t * DN, amp), g.vec(t * h * sh.rope, amp));
        let (uk, uv) = (g.bf16(h * sh.lora * DN), g.bf16(h * DV * sh.lora));
        let seqs = [MlaSeqWork {
            blocks: cache.chunks(SPLIT * w).collect(),
            stable: 3,
            queries: 0..t,
            first: 0,
        }];
        let run = |device: bool| {
            let mut out = vec![f32::NAN; t * h * DV];
            let mut work = MlaWork {
                shape: sh,
                seqs: &seqs,
                ns: &ns,
                q_nope: &q_nope,
                q_rope: &q_rope,
                uk_t: MatRef::Bf16 {
                    w: &uk,
                    rows: h * sh.lora,
                    cols: DN,
                },
                uv: MatRef::Bf16 {
                    w: &uv,
                    rows: h * DV,
                    cols: sh.lora,
                },
                o: None,
                out: &mut out,
                then: None,
                proj: None,
            };
            assert!(work.fits_device_kernel(), "shape {k}");
            if device {
                assert!(dev.mla_attend(&mut work), "shape {k}: the device takes it");
            } else {
                mla_work_cpu(&mut work);
            }
            out.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
        };
        if k == 1 {
            // Head 0 of the last query (every row): most of its weights
            // exp(s − max) are below the smallest subnormal.
            let (lo, rope) = (sh.lora, sh.rope);
            let mut q_lat = vec![0f32; lo];
            let uk0 = MatRef::Bf16 {
                w: &uk[..lo * DN],
                rows: lo,
                cols: DN,
            };
            uk0.cpu(&q_nope[(t - 1) * DN..][..DN], 1, &mut q_lat);
            let q_r = &q_rope[(t - 1) * h * rope..][..rope];
            let scores: Vec<f64> = cache
                .chunks(w)
                .map(|c| {
                    let dot = |a: &[f32], b: &[f32]| -> f64 {
                        a.iter()
                            .zip(b)
                            .map(|(&x, &y)| f64::from(x) * f64::from(y))
                            .sum()
                    };
                    f64::from(sh.scale) * (dot(&q_lat, &c[..lo]) + dot(q_r, &c[lo..]))
                })
                .collect();
            let max = scores.iter().copied().fold(f64::MIN, f64::max);
            let gone = scores.iter().filter(|&&s| s - max < -104.0).count();
            assert!(2 * gone > rows, "{gone} of {rows} weights underflow");
        }
        let (d, c) = (run(true), run(false));
        assert!(d == c, "shape {k}: the device's values");
        for b in cache.chunks(SPLIT * w) {
            let start = b.as_ptr() as usize;
            dev.forget(start..start + 4 * b.len());
        }
    }
}

/// The widest norm `fits_device_kernel` lets through is the row `mla.cu`
/// stages in shared memory (runs without a device).
#[test]
fn the_mla_norms_limit_is_the_kernels() {
    let want = format!(
        "#define MLA_NORM_MAX {}\n",
        fathom_kernels::backend::DEVICE_MAX_NORM
    );
    assert!(
        fathom_kernels_cuda::SOURCE.contains(&want),
        "mla.cu lacks {want:?}"
    );
}
