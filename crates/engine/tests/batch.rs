//! Batching never changes output: every sequence of a batch gets exactly
//! the tokens it gets alone — greedy and seeded sampling, prompts of
//! different lengths, prefill chunked to a small step budget, sequences
//! joining and leaving mid-run, 1 or all threads, resident and streamed with
//! a cache of one expert. A failed step leaves every state as it was and the
//! engine usable.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use fathom_engine::{
    Engine, EngineOptions, Event, FinishReason, Request, SamplingParams, SeqId, generate,
};
use fathom_model::experts::{
    ExpertSlot, ExpertSource, ExpertStats, ExpertTicket, ExpertWeights, ResidentExperts,
};
use fathom_model::{CausalLm, LoadOptions, Logits, ModelError, StepInput};
use fathom_stream::{StreamConfig, StreamedExperts};

type Lm = Arc<dyn CausalLm>;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/k3-tiny/checkpoint")
}

fn code_small() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/k3-code-small");
    p.join("config.json").is_file().then_some(p)
}

fn resident(dir: &Path) -> Lm {
    fathom_model::load(dir, LoadOptions::default()).unwrap()
}

fn streamed(dir: &Path, cache: usize) -> Lm {
    let opts = LoadOptions {
        experts: Some(Box::new(move |ck, table| {
            let cfg = StreamConfig::new(table.top_k, cache);
            Ok(Arc::new(StreamedExperts::new(ck, table, &cfg)?))
        })),
        ..Default::default()
    };
    fathom_model::load(dir, opts).unwrap()
}

/// Eight requests: prompts of 1..=13 tokens, greedy and sampled, different lengths.
fn requests(vocab: u32) -> Vec<(Vec<u32>, usize, SamplingParams)> {
    (0..8u32)
        .map(|i| {
            let len = 1 + (i as usize * 5) % 13;
            let prompt = (0..len as u32)
                .map(|j| (7 + i * 131 + j * 37) % vocab)
                .collect();
            let sp = if i % 2 == 0 {
                SamplingParams::default()
            } else {
                SamplingParams {
                    temperature: 0.9,
                    top_k: 40,
                    top_p: 0.9,
                    seed: 100 + i as u64,
                    ..Default::default()
                }
            };
            (prompt, 6 + (i as usize * 3) % 9, sp)
        })
        .collect()
}

fn request(r: &(Vec<u32>, usize, SamplingParams)) -> Request {
    let mut q = Request::new(r.0.clone(), r.1);
    q.sampling = r.2.clone();
    q
}

fn solo(lm: &Lm, r: &(Vec<u32>, usize, SamplingParams)) -> Vec<u32> {
    generate(lm, request(r), None, |_| ControlFlow::Continue(()))
        .unwrap()
        .output_ids
}

/// Runs the requests together; half join after `join_after` steps.
fn batched(
    lm: &Lm,
    reqs: &[(Vec<u32>, usize, SamplingParams)],
    budget: usize,
    join_after: usize,
) -> Vec<(Vec<u32>, FinishReason)> {
    let opts = EngineOptions {
        max_step_tokens: budget,
        max_batch: 64,
    };
    let mut e = Engine::new(lm.clone(), opts, None);
    let mut ids: Vec<Option<SeqId>> = vec![None; reqs.len()];
    let mut out: Vec<Option<(Vec<u32>, FinishReason)>> = vec![None; reqs.len()];
    for (i, r) in reqs.iter().enumerate().step_by(2) {
        ids[i] = Some(e.submit(request(r)).unwrap());
    }
    let mut steps = 0;
    while out.iter().any(Option::is_none) {
        if steps == join_after {
            for (i, r) in reqs.iter().enumerate().skip(1).step_by(2) {
                ids[i] = Some(e.submit(request(r)).unwrap());
            }
        }
        for ev in e.step() {
            if let Event::Finished { seq, done } = ev {
                let i = ids.iter().position(|&x| x == Some(seq)).unwrap();
                out[i] = Some((done.output_ids, done.reason));
            }
        }
        steps += 1;
        assert!(steps < 10_000, "the engine does not finish");
    }
    assert!(e.stats().mean_batch_size() > 1.5, "{:?}", e.stats());
    out.into_iter().map(Option::unwrap).collect()
}

fn check_batched_equals_solo(lm: &Lm, reference: &Lm) {
    let reqs = requests(lm.info().vocab_size as u32);
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| solo(reference, r)).collect();
    // Sampling is really on: the sampled requests differ from greedy.
    let greedy = solo(
        reference,
        &(reqs[1].0.clone(), reqs[1].1, SamplingParams::default()),
    );
    assert_ne!(
        greedy, want[1],
        "seeded sampling should leave greedy's path"
    );
    for (budget, join) in [(512, 0), (7, 0), (5, 3), (64, 9)] {
        let got = batched(lm, &reqs, budget, join);
        for (i, ((ids, reason), w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(ids, w, "request {i}, budget {budget}, join after {join}");
            assert_eq!(*reason, FinishReason::Length);
        }
    }
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let got = one_thread.install(|| batched(lm, &reqs, 16, 2));
    for (i, ((ids, _), w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(ids, w, "request {i}, one thread");
    }
}

#[test]
fn k3_tiny_batched_equals_solo() {
    let lm = resident(&tiny());
    check_batched_equals_solo(&lm, &lm);
}

#[test]
fn k3_tiny_streamed_with_a_tiny_cache_batched_equals_resident_solo() {
    check_batched_equals_solo(&streamed(&tiny(), 1), &resident(&tiny()));
}

#[test]
fn k3_code_small_batched_equals_solo() {
    let Some(dir) = code_small() else {
        eprintln!("skipped: shared/models/k3-code-small is not beside the repository");
        return;
    };
    let lm = resident(&dir);
    check_batched_equals_solo(&lm, &lm);
    check_batched_equals_solo(&streamed(&dir, 4), &lm);
}

#[test]
fn cancelled_sequences_end_and_the_others_go_on() {
    let lm = resident(&tiny());
    let reqs = requests(1024);
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| solo(&lm, r)).collect();
    let mut e = Engine::new(lm.clone(), EngineOptions::default(), None);
    let ids: Vec<SeqId> = reqs.iter().map(|r| e.submit(request(r)).unwrap()).collect();
    let mut got = vec![None; reqs.len()];
    let mut steps = 0;
    while got.iter().any(Option::is_none) {
        if steps == 3 {
            e.cancel(ids[2]);
        }
        for ev in e.step() {
            if let Event::Finished { seq, done } = ev {
                let i = ids.iter().position(|&x| x == seq).unwrap();
                got[i] = Some((done.output_ids, done.reason));
            }
        }
        steps += 1;
    }
    for (i, g) in got.into_iter().enumerate() {
        let (ids, reason) = g.unwrap();
        if i == 2 {
            assert_eq!(reason, FinishReason::Cancelled);
            assert!(ids.len() < want[i].len() && want[i].starts_with(&ids));
        } else {
            assert_eq!(ids, want[i], "request {i}");
        }
    }
}

/// Resident experts, except that chosen calls fail or return NaN weights.
struct Faulty {
    inner: ResidentExperts,
    calls: AtomicUsize,
    fail_at: usize,
    nan_at: usize,
}

impl ExpertSource for Faulty {
    fn request(&self, layer: usize, ids: &[u32]) -> fathom_model::Result<ExpertTicket> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n == self.fail_at {
            return Err(ModelError::Experts("injected read error".into()));
        }
        let t = self.inner.request(layer, ids)?;
        if n == self.nan_at {
            let slots = t
                .wait_all()?
                .into_iter()
                .map(|e| {
                    let mut buf = e.buf.clone();
                    for &(_, s, [r, c]) in &e.parts {
                        buf[s..s + r * c / 32].fill(0xFF); // E8M0 NaN
                    }
                    ExpertSlot::Ready(Arc::new(ExpertWeights {
                        buf,
                        parts: e.parts,
                        format: e.format,
                    }))
                })
                .collect();
            return Ok(ExpertTicket {
                layer,
                ids: ids.to_vec(),
                slots,
            });
        }
        Ok(t)
    }
    fn stats(&self) -> ExpertStats {
        self.inner.stats()
    }
}

fn faulty(fail_at: usize, nan_at: usize) -> Lm {
    let opts = LoadOptions {
        experts: Some(Box::new(move |ck, table| {
            Ok(Arc::new(Faulty {
                inner: ResidentExperts::load(ck, table)?,
                calls: AtomicUsize::new(0),
                fail_at,
                nan_at,
            }))
        })),
        ..Default::default()
    };
    fathom_model::load(&tiny(), opts).unwrap()
}

#[test]
fn a_failed_step_leaves_every_state_unchanged() {
    let good = resident(&tiny());
    // The second step fails at its second MoE layer, after the first has run.
    let moe = good.info().moe_layers;
    assert!(moe >= 2);
    let lm = faulty(moe + 1, usize::MAX);
    let (pa, pb) = ([1u32, 5, 9, 200], [3u32, 4]);
    let mut a = lm.new_state();
    let mut b = lm.new_state();
    let step = |a: &mut dyn fathom_model::SeqState,
                b: &mut dyn fathom_model::SeqState,
                ta: &[u32],
                tb: &[u32]| {
        let mut batch = [
            StepInput {
                state: a,
                tokens: ta,
                logits: Logits::Last,
            },
            StepInput {
                state: b,
                tokens: tb,
                logits: Logits::All,
            },
        ];
        lm.step(&mut batch)
    };
    step(a.as_mut(), b.as_mut(), &pa, &pb).unwrap();
    a.begin_pass(); // a journaled (speculative) pass must be restored too
    let err = step(a.as_mut(), b.as_mut(), &[7, 8], &[9]).unwrap_err();
    assert!(
        err.seq.is_none() && err.to_string().contains("injected"),
        "{err}"
    );
    assert_eq!((a.pos(), b.pos()), (4, 2));
    // Retried, the step gives exactly what a model that never failed gives.
    a.begin_pass();
    let got = step(a.as_mut(), b.as_mut(), &[7, 8], &[9]).unwrap();
    a.keep(1).unwrap();
    let mut ra = good.new_state();
    let mut rb = good.new_state();
    good.forward(ra.as_mut(), &pa, Logits::Last).unwrap();
    good.forward(rb.as_mut(), &pb, Logits::Last).unwrap();
    let want_a = good.forward(ra.as_mut(), &[7, 8], Logits::Last).unwrap();
    let want_b = good.forward(rb.as_mut(), &[9], Logits::All).unwrap();
    assert_eq!(got[0], want_a);
    assert_eq!(got[1], want_b);
    // After keeping one of a's two positions, a continues as if fed [7] only.
    let mut rc = good.new_state();
    good.forward(rc.as_mut(), &pa, Logits::Last).unwrap();
    good.forward(rc.as_mut(), &[7], Logits::Last).unwrap();
    let next = good.forward(rc.as_mut(), &[11], Logits::Last).unwrap();
    assert_eq!(lm.forward(a.as_mut(), &[11], Logits::Last).unwrap(), next);
}

#[test]
fn the_engine_survives_failed_steps() {
    let good = resident(&tiny());
    let reqs = requests(1024);
    let want: Vec<Vec<u32>> = reqs.iter().map(|r| solo(&good, r)).collect();
    // A transient read error mid-run: every sequence still gets its tokens.
    let got = batched(&faulty(7, usize::MAX), &reqs, 512, 0);
    for (i, ((ids, _), w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(ids, w, "request {i} after a read error");
    }
    // NaN weights in one step: the first sequence of that step ends with an
    // error naming the cause; the step is re-run for the others.
    let got = batched(&faulty(usize::MAX, 7), &reqs, 512, 0);
    let failed: Vec<usize> = (0..got.len())
        .filter(|&i| matches!(got[i].1, FinishReason::Error(_)))
        .collect();
    assert_eq!(failed.len(), 1, "{got:?}");
    let FinishReason::Error(msg) = &got[failed[0]].1 else {
        unreachable!()
    };
    assert!(msg.contains("non-finite"), "{msg}");
    for (i, ((ids, _), w)) in got.iter().zip(&want).enumerate() {
        if i != failed[0] {
            assert_eq!(ids, w, "request {i} after NaN weights");
        }
    }
}
