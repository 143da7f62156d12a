//! A grouped-query attention layer on the device in one call
//! (`Backend::gqa_attend`: the q, k, v products with their biases, the
//! heads' norms, the rotary step, the new rows into each cache, the
//! attention with its window and sinks, `o_proj` and its bias) against
//! the CPU twin, bit for bit: caches ending mid-block, at a block's end or
//! empty, a prefill chunk crossing a block boundary; Qwen3-MoE's shape
//! (per-head norms) and GPT-OSS's (biases, sinks, a sliding window that
//! skips whole splits), whole and in chunks of queries, kept blocks
//! reused; declined work writes nothing.
//! Without a CUDA device (real or emulated) the test prints why it skipped.

use fathom_kernels::attention::SPLIT;
use fathom_kernels::backend::{
    Backend, Biased, GqaWork, MatRef, MlaSeqWork, gqa_work_cpu, then_cpu,
};
use fathom_kernels::gqa::GqaShape;

mod common;

use common::{Lcg, Rest, open};

fn vec(g: &mut Lcg, n: usize, amp: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (g.next() as f32 / u32::MAX as f32 - 0.5) * 2.0 * amp)
        .collect()
}

fn bf16(g: &mut Lcg, n: usize) -> Vec<u16> {
    vec(g, n, 0.4)
        .iter()
        .map(|v| (v.to_bits() >> 16) as u16)
        .collect()
}

fn bf(w: &[u16], rows: usize, cols: usize) -> MatRef<'_> {
    MatRef::Bf16 { w, rows, cols }
}

#[test]
fn a_gqa_layer_on_the_device_gives_the_twins_bits() {
    let Some(dev) = open(None) else {
        return;
    };
    const D: usize = 96;
    const DOUT: usize = 80;
    let (h, kvh, hd) = (4usize, 2usize, 16usize);
    let (qw, kvw) = (h * hd, kvh * hd);
    let w = 2 * kvw;
    let mut g = Lcg(31);
    let (wq, wk, wv, wo) = (
        bf16(&mut g, qw * D),
        bf16(&mut g, kvw * D),
        bf16(&mut g, kvw * D),
        bf16(&mut g, DOUT * qw),
    );
    let (bq, bk, bv, bo) = (
        vec(&mut g, qw, 0.5),
        vec(&mut g, kvw, 0.5),
        vec(&mut g, kvw, 0.5),
        vec(&mut g, DOUT, 0.5),
    );
    let (qn, kn, sinks) = (
        vec(&mut g, hd, 2.0),
        vec(&mut g, hd, 2.0),
        vec(&mut g, h, 3.0),
    );
    // (cached rows, new rows) of three sequences.
    let shape = [(SPLIT + 250, 9usize), (0, 3), (SPLIT, 1)];
    let caches: Vec<Vec<f32>> = shape
        .iter()
        .map(|&(p0, _)| vec(&mut g, p0 * w, 2.0))
        .collect();
    let t: usize = shape.iter().map(|s| s.1).sum();
    let x = vec(&mut g, t * D, 1.0);
    let (cos, sin) = (vec(&mut g, t * hd / 2, 1.0), vec(&mut g, t * hd / 2, 1.0));
    let mut ns = Vec::new();
    for &(p0, k) in &shape {
        ns.extend((1..=k).map(|i| p0 + i));
    }
    let plain = |m| Biased { w: m, bias: None };
    let biased = |m, b| Biased {
        w: m,
        bias: Some(b),
    };
    let qwen = (
        [
            plain(bf(&wq, qw, D)),
            plain(bf(&wk, kvw, D)),
            plain(bf(&wv, kvw, D)),
        ],
        Some((&qn[..], &kn[..], 1e-6f32)),
        None,
        plain(bf(&wo, DOUT, qw)),
        None,
    );
    let oss = (
        [
            biased(bf(&wq, qw, D), &bq[..]),
            biased(bf(&wk, kvw, D), &bk[..]),
            biased(bf(&wv, kvw, D), &bv[..]),
        ],
        None,
        Some(&sinks[..]),
        biased(bf(&wo, DOUT, qw), &bo[..]),
        Some(20),
    );
    for (case, (qkv, qk_norm, sinks, o_proj, window)) in [qwen, oss].into_iter().enumerate() {
        let sh = GqaShape {
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
            scale: 0.25,
            window,
        };
        // `trim`: each cache's blocks before the first its step's queries
        // see (a window's) left out, as the model hands them.
        let run_with = |b: Option<&dyn Backend>, mut rest: Option<&mut Rest>, trim: bool| {
            let mut at = 0;
            let seqs: Vec<MlaSeqWork<'_>> = shape
                .iter()
                .zip(&caches)
                .map(|(&(p0, n), c)| {
                    at += n;
                    let all: Vec<&[f32]> = c.chunks(SPLIT * w).collect();
                    let first = if trim {
                        (sh.first_row(p0 + 1) / SPLIT).min(all.len())
                    } else {
                        0
                    };
                    MlaSeqWork {
                        blocks: all[first..].to_vec(),
                        stable: (p0 / SPLIT).saturating_sub(first),
                        queries: at - n..at,
                        first,
                    }
                })
                .collect();
            let (mut out, mut rows) = (vec![f32::NAN; t * DOUT], vec![f32::NAN; t * w]);
            let mut work = GqaWork {
                shape: sh,
                seqs: &seqs,
                ns: &ns,
                x: &x,
                qkv,
                qk_norm,
                cos: &cos,
                sin: &sin,
                sinks,
                o_proj,
                out: &mut out,
                rows_out: &mut rows,
                then: rest.as_deref_mut().map(Rest::then),
            };
            assert!(work.fits_device_kernel(), "case {case}");
            let before = dev.stats();
            match b {
                Some(b) => {
                    assert!(b.gqa_attend(&mut work), "case {case}: the device takes it");
                    assert!(work.then.as_ref().is_none_or(|t| t.done), "case {case}");
                }
                None => {
                    gqa_work_cpu(&mut work);
                    let a = work.out.to_vec();
                    if let Some(t) = work.then.as_mut() {
                        then_cpu(t, &a);
                    }
                }
            }
            drop(work);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (bits(&out), bits(&rows), dev.stats().since(&before))
        };
        let run = |b: Option<&dyn Backend>, rest: Option<&mut Rest>| run_with(b, rest, false);
        let want = run(None, None);
        let got = run(Some(dev.as_ref()), None);
        assert_eq!(got.1, want.1, "case {case}: the new rows");
        assert_eq!(got.0, want.0, "case {case}: the output");
        assert_eq!(
            (got.2.device_calls, got.2.device_products),
            (1, 4),
            "case {case}"
        );
        // Again with the two full blocks kept (from the first call on):
        // they do not go up again.
        let again = run(Some(dev.as_ref()), None);
        assert_eq!(
            (again.0, again.1),
            (want.0.clone(), want.1.clone()),
            "case {case}"
        );
        let block = (4 * SPLIT * w) as u64;
        if case == 0 {
            let (a, b) = (got.2.h2d_bytes, again.2.h2d_bytes);
            assert!(a >= b + 2 * block, "case {case}: {a} then {b} bytes up");
        }
        // In chunks of two queries.
        dev.limit_mla_scratch(2 * 3 * h * (SPLIT + hd + 2));
        let chunked = run(Some(dev.as_ref()), None);
        dev.limit_mla_scratch(usize::MAX);
        assert_eq!(
            (&chunked.0, &chunked.1),
            (&want.0, &want.1),
            "case {case}: chunked"
        );
        // The window's earlier blocks left out: the same bits, and (GPT-OSS's
        // window of 20) the first cache's first block neither kept nor sent.
        let trimmed = run_with(Some(dev.as_ref()), None, true);
        let twin_trimmed = run_with(None, None, true);
        assert_eq!(
            (&trimmed.0, &trimmed.1),
            (&want.0, &want.1),
            "case {case}: trimmed"
        );
        assert_eq!(
            (&twin_trimmed.0, &twin_trimmed.1),
            (&want.0, &want.1),
            "case {case}"
        );
        if window.is_some() {
            assert!(
                sh.first_row(SPLIT + 251) / SPLIT == 1,
                "the window starts in block 1"
            );
        }
        // With the rest of the layer up to its experts' choice in the call
        // (`Then`): the output, the new rows and the rest's results.
        let mut rests = [0, 1].map(|_| Rest::new(&dev, &mut Lcg(9), t, DOUT, 0, false));
        let [r_dev, r_cpu] = &mut rests;
        let with = run(Some(dev.as_ref()), Some(r_dev));
        let twin = run(None, Some(r_cpu));
        assert_eq!(
            (&with.0, &with.1),
            (&twin.0, &twin.1),
            "case {case}: with the rest"
        );
        assert_eq!(
            (&with.0, &with.1),
            (&want.0, &want.1),
            "case {case}: with the rest"
        );
        assert!(
            r_dev.bits().eq(r_cpu.bits()),
            "case {case}: the rest's bits"
        );
        // q, k, v, o_proj and the rest's five products, in one call.
        assert_eq!(
            (with.2.device_calls, with.2.device_products),
            (1, 9),
            "case {case}"
        );
    }
}

/// A work beyond the device's budget is declined with nothing written.
#[test]
fn a_gqa_layer_beyond_the_budget_is_declined() {
    let Some(dev) = open(Some(4096)) else {
        return;
    };
    let (h, hd, d) = (2usize, 16usize, 512usize);
    let mut g = Lcg(5);
    let wq = bf16(&mut g, h * hd * d);
    let x = vec(&mut g, d, 1.0);
    let (cos, sin) = (vec(&mut g, hd / 2, 1.0), vec(&mut g, hd / 2, 1.0));
    let p = Biased {
        w: bf(&wq, h * hd, d),
        bias: None,
    };
    let o = bf16(&mut g, d * h * hd);
    let seqs = [MlaSeqWork {
        blocks: Vec::new(),
        stable: 0,
        queries: 0..1,
        first: 0,
    }];
    let (mut out, mut rows) = (vec![f32::NAN; d], vec![f32::NAN; 2 * h * hd]);
    let mut work = GqaWork {
        shape: GqaShape {
            heads: h,
            kv_heads: h,
            head_dim: hd,
            scale: 0.25,
            window: None,
        },
        seqs: &seqs,
        ns: &[1],
        x: &x,
        qkv: [p, p, p],
        qk_norm: None,
        cos: &cos,
        sin: &sin,
        sinks: None,
        o_proj: Biased {
            w: bf(&o, d, h * hd),
            bias: None,
        },
        out: &mut out,
        rows_out: &mut rows,
        then: None,
    };
    assert!(work.fits_device_kernel());
    assert!(
        !dev.gqa_attend(&mut work),
        "64 KiB of weights in a 4 KiB budget"
    );
    drop(work);
    assert!(
        out.iter().chain(&rows).all(|v| v.is_nan()),
        "declined work wrote"
    );
}
