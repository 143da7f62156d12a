//! Shared checks of a family against an independent reference's golden data
//! (`tests/data/<family>-tiny`, copied from shared/fixtures): the
//! golden files' reader and the properties every `CausalLm` must have
//! (batched = solo, chunked = one pass, the sequence-state contract).

#![allow(dead_code, unused_macros, unused_imports)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use fathom_model::experts::{ExpertSource, ExpertStats, ExpertTicket, ResidentExperts};
use fathom_model::moe::Route;
use fathom_model::{CausalLm, Logits, ModelError, StepInput, Tracer};
use serde_json::Value;

mod tiers;
pub use tiers::*;

pub fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// A tensor of `golden.safetensors` (F32 or I64), as f64s with its shape.
pub struct Tensor {
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

impl Tensor {
    pub fn f32s(&self) -> Vec<f32> {
        self.values.iter().map(|&v| v as f32).collect()
    }
    pub fn ids(&self) -> Vec<u32> {
        self.values.iter().map(|&v| v as u32).collect()
    }
}

/// The golden data: `prompt{i}.{input_ids, greedy_ids, last_logits,
/// step_logits, prefill_logits, hidden_norms, layer{l}.topk_ids,
/// layer{l}.route_margin}`.
pub struct Golden {
    tensors: HashMap<String, Tensor>,
    pub prompts: usize,
}

impl Golden {
    /// Reads `golden.json` (for the prompt count) and every tensor of
    /// `golden.safetensors` (u64 header length, JSON header, data).
    pub fn load(dir: &Path) -> Self {
        let summary: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let body = &bytes[8 + n..];
        let mut tensors = HashMap::new();
        for (name, t) in header.as_object().unwrap() {
            if name == "__metadata__" {
                continue;
            }
            let [a, b] = [0, 1].map(|i| t["data_offsets"][i].as_u64().unwrap() as usize);
            let raw = &body[a..b];
            let values = match t["dtype"].as_str().unwrap() {
                "F32" => raw
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                "I64" => raw
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("{name}: unexpected dtype {other}"),
            };
            let shape = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            tensors.insert(name.clone(), Tensor { shape, values });
        }
        Golden {
            tensors,
            prompts: summary["prompts"].as_array().unwrap().len(),
        }
    }

    /// Prompt `i`'s tensor `name`.
    pub fn get(&self, i: usize, name: &str) -> &Tensor {
        let key = format!("prompt{i}.{name}");
        self.tensors
            .get(&key)
            .unwrap_or_else(|| panic!("golden has no {key}"))
    }

    pub fn input_ids(&self, i: usize) -> Vec<u32> {
        self.get(i, "input_ids").ids()
    }
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Max |Δ| of last-position logits per golden prompt.
pub fn last_logit_errors(model: &dyn CausalLm, g: &Golden) -> Vec<f32> {
    (0..g.prompts)
        .map(|i| {
            let mut st = model.new_state();
            let logits = model
                .forward(st.as_mut(), &g.input_ids(i), Logits::Last)
                .unwrap();
            max_abs_diff(&logits, &g.get(i, "last_logits").f32s())
        })
        .collect()
}

/// Max |Δ| of every prompt position's logits per golden prompt.
pub fn prefill_logit_errors(model: &dyn CausalLm, g: &Golden) -> Vec<f32> {
    (0..g.prompts)
        .map(|i| {
            let ids = g.input_ids(i);
            let want = g.get(i, "prefill_logits");
            assert_eq!(want.shape, vec![ids.len(), model.info().vocab_size]);
            let mut st = model.new_state();
            let got = model.forward(st.as_mut(), &ids, Logits::All).unwrap();
            max_abs_diff(&got, &want.f32s())
        })
        .collect()
}

/// Prefill, then greedy decode one token at a time through the state: the
/// reference's tokens exactly; returns each prompt's worst step-logit error.
pub fn greedy_step_errors(model: &dyn CausalLm, g: &Golden) -> Vec<f32> {
    let v = model.info().vocab_size;
    (0..g.prompts)
        .map(|i| {
            let want = g.get(i, "greedy_ids").ids();
            let steps = g.get(i, "step_logits").f32s();
            let mut st = model.new_state();
            let mut logits = model
                .forward(st.as_mut(), &g.input_ids(i), Logits::Last)
                .unwrap();
            let mut got = Vec::new();
            let mut worst = 0f32;
            for j in 0..want.len() {
                worst = worst.max(max_abs_diff(&logits, &steps[j * v..(j + 1) * v]));
                got.push(argmax(&logits));
                logits = model.forward(st.as_mut(), &[got[j]], Logits::Last).unwrap();
            }
            assert_eq!(got, want, "prompt {i}: greedy tokens");
            worst
        })
        .collect()
}

/// What a traced pass reports.
#[derive(Default)]
pub struct Record {
    pub routes: Vec<(usize, Vec<Route>)>,
    pub tensors: Vec<(usize, String, Vec<f32>)>,
}

impl Tracer for Record {
    fn tensor(&mut self, layer: usize, name: &str, rows: &[f32]) {
        self.tensors.push((layer, name.to_string(), rows.to_vec()));
    }
    fn routes(&mut self, layer: usize, routes: &[Route]) {
        self.routes.push((layer, routes.to_vec()));
    }
}

/// Over prompt + greedy tokens in one pass (`traced(tokens)` runs it): each
/// MoE layer's chosen experts (as a set) equal the reference's and the
/// margins agree; each layer's output norms agree (`embeddings` and
/// `layer_out` traces).
pub fn check_routes_and_norms(
    g: &Golden,
    hidden: usize,
    layers: usize,
    top_k: usize,
    traced: impl Fn(&[u32]) -> Record,
) {
    for i in 0..g.prompts {
        let mut seq = g.input_ids(i);
        seq.extend(g.get(i, "greedy_ids").ids());
        let rec = traced(&seq);
        let mut checked = 0;
        for (l, got) in &rec.routes {
            let want = g.get(i, &format!("layer{l}.topk_ids")).ids();
            let margin = g.get(i, &format!("layer{l}.route_margin")).f32s();
            assert_eq!(got.len(), seq.len());
            for (p, r) in got.iter().enumerate() {
                let mut ids = r.ids.clone();
                ids.sort_unstable();
                let m = margin[p];
                assert_eq!(
                    ids,
                    want[p * top_k..(p + 1) * top_k],
                    "prompt {i} layer {l} position {p} (reference margin {m})"
                );
                let dm = (r.margin - m).abs();
                assert!(
                    dm < 1e-3 || (r.margin.is_infinite() && m.is_infinite()),
                    "prompt {i} layer {l} position {p}: margin {} vs {m}",
                    r.margin
                );
            }
            checked += 1;
        }
        assert!(checked > 0, "no MoE layer reported its routes");
        let norms = g.get(i, "hidden_norms");
        let t = seq.len();
        assert_eq!(norms.shape, vec![layers + 1, t]);
        let want = norms.f32s();
        for row in 0..=layers {
            let (name, layer) = if row == 0 {
                ("embeddings", 0)
            } else {
                ("layer_out", row - 1)
            };
            let (_, _, h) = rec
                .tensors
                .iter()
                .find(|(l, n, _)| *l == layer && n == name)
                .unwrap();
            for p in 0..t {
                let got = h[p * hidden..(p + 1) * hidden]
                    .iter()
                    .map(|&x| (x as f64).powi(2))
                    .sum::<f64>()
                    .sqrt();
                let w = want[row * t + p] as f64;
                assert!(
                    (got - w).abs() <= 1e-4 * w.max(1.0),
                    "prompt {i} row {row} position {p}: norm {got} vs {w}"
                );
            }
        }
    }
}

fn step_all(model: &dyn CausalLm, parts: Vec<StepInput<'_>>) -> Vec<Vec<f32>> {
    let mut parts = parts;
    model.step(&mut parts).unwrap()
}

/// Two prompts of different lengths in one step give, bit for bit, what
/// each gives alone; so does a mixed step (one decoding, one prefilling).
pub fn assert_batched_equals_solo(model: &dyn CausalLm, a: &[u32], b: &[u32], c: &[u32]) {
    let v = model.info().vocab_size;
    let solo = |toks: &[u32]| {
        let mut st = model.new_state();
        let l = model.forward(st.as_mut(), toks, Logits::All).unwrap();
        (st, l)
    };
    let (mut sa, la) = solo(a);
    let (_, lb) = solo(b);
    let (mut xa, mut xb) = (model.new_state(), model.new_state());
    let out = step_all(
        model,
        vec![
            StepInput {
                state: xa.as_mut(),
                tokens: a,
                logits: Logits::All,
            },
            StepInput {
                state: xb.as_mut(),
                tokens: b,
                logits: Logits::All,
            },
        ],
    );
    assert_eq!(out[0], la, "first prompt batched vs alone");
    assert_eq!(out[1], lb, "second prompt batched vs alone");
    let next = [argmax(&la[la.len() - v..])];
    let alone = model.forward(sa.as_mut(), &next, Logits::Last).unwrap();
    let mut xc = model.new_state();
    let out = step_all(
        model,
        vec![
            StepInput {
                state: xc.as_mut(),
                tokens: c,
                logits: Logits::Last,
            },
            StepInput {
                state: xa.as_mut(),
                tokens: &next,
                logits: Logits::Last,
            },
        ],
    );
    assert_eq!(out[1], alone, "decode step batched with a prefill");
    let mut sc = model.new_state();
    assert_eq!(out[0], model.forward(sc.as_mut(), c, Logits::Last).unwrap());
}

/// A prompt fed in chunks (or token by token) gives, bit for bit, the
/// logits of one pass at every position, and the same saved state.
pub fn assert_chunked_equals_one_pass(model: &dyn CausalLm, prompt: &[u32]) {
    let v = model.info().vocab_size;
    let mut one = model.new_state();
    let all = model.forward(one.as_mut(), prompt, Logits::All).unwrap();
    for chunks in [vec![1, 7, 30], vec![50, 1], vec![prompt.len() - 1]] {
        let mut st = model.new_state();
        let mut got = Vec::new();
        let mut at = 0;
        for c in chunks.into_iter().chain([prompt.len()]) {
            let end = (at + c).min(prompt.len());
            let l = model.forward(st.as_mut(), &prompt[at..end], Logits::All);
            got.extend(l.unwrap());
            at = end;
            if at == prompt.len() {
                break;
            }
        }
        assert_eq!(got, all);
        assert_eq!(st.encode().unwrap(), one.encode().unwrap());
    }
    let mut st = model.new_state();
    for (i, &tok) in prompt.iter().enumerate() {
        let l = model.forward(st.as_mut(), &[tok], Logits::Last).unwrap();
        assert_eq!(l, all[i * v..(i + 1) * v].to_vec(), "position {i}");
    }
}

/// Snapshots, speculative rollback, forks and saved bytes all continue
/// bit-identically; damaged or foreign bytes are refused with a reason.
pub fn assert_state_contract(model: &dyn CausalLm, prompt: &[u32], foreign_magic: &[u8; 4]) {
    let mut a = model.new_state();
    model.forward(a.as_mut(), prompt, Logits::None).unwrap();
    let snap = a.snapshot();
    let want = model.forward(a.as_mut(), &[7, 8, 9], Logits::All).unwrap();
    model
        .forward(a.as_mut(), &[100, 200], Logits::Last)
        .unwrap();
    a.restore(snap.as_ref()).unwrap();
    assert_eq!(a.pos(), prompt.len());
    assert_eq!(
        model.forward(a.as_mut(), &[7, 8, 9], Logits::All).unwrap(),
        want
    );
    a.restore(snap.as_ref()).unwrap();
    // Speculative: feed 5, keep 3 = fed only those 3.
    a.begin_pass();
    let five = model
        .forward(a.as_mut(), &[7, 8, 9, 10, 11], Logits::All)
        .unwrap();
    assert_eq!(five[..want.len()], want[..]);
    a.keep(3).unwrap();
    assert_eq!(a.pos(), prompt.len() + 3);
    let mut b = model.new_state();
    model.forward(b.as_mut(), prompt, Logits::None).unwrap();
    model.forward(b.as_mut(), &[7, 8, 9], Logits::None).unwrap();
    assert_eq!(a.encode().unwrap(), b.encode().unwrap());
    // Fork and saved bytes continue alike.
    let mut f = a.fork();
    let mut d = model.decode_state(&a.encode().unwrap()).unwrap();
    let la = model.forward(a.as_mut(), &[42, 43], Logits::All).unwrap();
    let lf = model.forward(f.as_mut(), &[42, 43], Logits::All).unwrap();
    let ld = model.forward(d.as_mut(), &[42, 43], Logits::All).unwrap();
    assert_eq!((&lf, &ld), (&la, &la));
    let bytes = b.encode().unwrap();
    let err = |x: &[u8]| model.decode_state(x).err().expect("refused").to_string();
    assert!(err(&bytes[..bytes.len() - 3]).contains("ends early"));
    let mut foreign = bytes.clone();
    foreign[..4].copy_from_slice(foreign_magic);
    assert!(err(&foreign).contains("magic"));
    let mut more = bytes.clone();
    more.push(0);
    assert!(err(&more).contains("left over"));
    let mut huge = bytes.clone();
    huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(err(&huge).contains("position"));
    let mut nan = bytes.clone();
    let at = nan.len() - 4;
    nan[at..].copy_from_slice(&f32::NAN.to_le_bytes());
    assert!(err(&nan).contains("non-finite"));
}

/// An expert source that fails its n-th request.
pub struct FailsOnce {
    pub inner: ResidentExperts,
    pub calls: AtomicUsize,
    pub fail_at: usize,
}

impl ExpertSource for FailsOnce {
    fn request(&self, layer: usize, ids: &[u32]) -> fathom_model::Result<ExpertTicket> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == self.fail_at {
            return Err(ModelError::Experts("injected read error".into()));
        }
        self.inner.request(layer, ids)
    }
    fn stats(&self) -> ExpertStats {
        self.inner.stats()
    }
}

/// A step that fails part-way (the source's `fail_at`-th request, after
/// `warm` consumed the earlier ones) leaves the state as it was; a bad
/// token names its sequence.
pub fn assert_failed_steps_change_nothing(model: &dyn CausalLm, warm: &[u32]) {
    let vocab = model.info().vocab_size as u32;
    let mut a = model.new_state();
    model.forward(a.as_mut(), warm, Logits::None).unwrap();
    let before = a.encode().unwrap();
    let e = model
        .forward(a.as_mut(), &[5, 6], Logits::Last)
        .unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    assert_eq!(a.encode().unwrap(), before);
    let mut b = model.new_state();
    let e = model
        .step(&mut [
            StepInput {
                state: a.as_mut(),
                tokens: &[5],
                logits: Logits::Last,
            },
            StepInput {
                state: b.as_mut(),
                tokens: &[3, vocab],
                logits: Logits::Last,
            },
        ])
        .unwrap_err();
    assert_eq!(e.seq, Some(1));
    assert_eq!(
        e.to_string(),
        format!("token id {vocab} is outside the vocabulary (size {vocab})")
    );
    assert_eq!(a.encode().unwrap(), before);
}

/// Asserts each prompt's `what` logit error is within `tol` (3 prompts).
pub fn within(fixture: &str, what: &str, errs: &[f32], tol: f32) {
    eprintln!("{fixture}: {what} max |Δlogit| per prompt: {errs:?}");
    assert_eq!(errs.len(), 3, "{fixture}: golden prompts");
    for (i, e) in errs.iter().enumerate() {
        assert!(*e < tol, "{fixture} prompt {i}: {what} logit error {e}");
    }
}

/// A family's checks against its golden fixture and the properties every
/// `CausalLm` must have, as tests: `family_golden_tests!(Family type,
/// "fixture", "Family name", foreign state magic, step at which a
/// FailsOnce source fails)`. The test file declares `mod common;` at its
/// root; the tests land in the module the macro is invoked in, beside its
/// `load()`, `golden()` and `worst()` helpers.
macro_rules! family_golden_tests {
    ($family:ty, $fixture:literal, $name:literal, $foreign:literal, $fail_at:literal) => {
        use std::sync::Arc;
        use std::sync::atomic::AtomicUsize;

        use crate::common::{FailsOnce, Golden, Record};
        use fathom_model::experts::ResidentExperts;
        use fathom_model::{CausalLm, Logits, Model};

        const FIXTURE: &str = $fixture;

        pub fn load() -> Model<$family> {
            Model::<$family>::load(&crate::common::data(FIXTURE))
                .unwrap_or_else(|e| panic!("{FIXTURE} loads: {e}"))
        }

        pub fn golden() -> Golden {
            Golden::load(&crate::common::data(FIXTURE))
        }

        /// The worst last-logit error of `model` over the golden prompts.
        pub fn worst(model: &Model<$family>) -> f32 {
            crate::common::last_logit_errors(model, &golden())
                .into_iter()
                .fold(0.0, f32::max)
        }

        #[test]
        fn last_logits_match_golden() {
            let errs = crate::common::last_logit_errors(&load(), &golden());
            crate::common::within(FIXTURE, "last", &errs, 1e-3);
        }

        #[test]
        fn prefill_logits_match_golden() {
            let errs = crate::common::prefill_logit_errors(&load(), &golden());
            crate::common::within(FIXTURE, "prefill", &errs, 1e-3);
        }

        /// Prefill, then greedy decode through the cache: the reference's
        /// tokens, and every step's logits within tolerance.
        #[test]
        fn greedy_decode_and_step_logits_match_golden() {
            let errs = crate::common::greedy_step_errors(&load(), &golden());
            crate::common::within(FIXTURE, "decode-step", &errs, 1e-3);
        }

        #[test]
        fn routing_and_hidden_norms_match_golden() {
            let model = load();
            let s = &model.spec;
            crate::common::check_routes_and_norms(
                &golden(),
                s.hidden_size,
                s.num_layers,
                s.top_k,
                |seq| {
                    let mut rec = Record::default();
                    let mut st = model.new_state();
                    model
                        .forward_traced(&mut st, seq, Logits::Last, Some(&mut rec))
                        .unwrap();
                    rec
                },
            );
        }

        #[test]
        fn batched_equals_solo_bitwise() {
            let g = golden();
            let (a, b, c) = (g.input_ids(0), g.input_ids(2), g.input_ids(1));
            crate::common::assert_batched_equals_solo(&load(), &a, &b, &c);
        }

        #[test]
        fn chunked_prefill_equals_one_pass_bitwise() {
            crate::common::assert_chunked_equals_one_pass(&load(), &golden().input_ids(2));
        }

        /// Loaded through the registry; a state of another family with the
        /// same layout is refused by its magic.
        #[test]
        fn state_contract() {
            let model: Arc<dyn CausalLm> =
                fathom_model::load(&crate::common::data(FIXTURE), Default::default()).unwrap();
            assert_eq!(model.info().family, $name);
            crate::common::assert_state_contract(model.as_ref(), &golden().input_ids(1), $foreign);
        }

        /// A step that fails part-way (an expert read) leaves every state
        /// as it was.
        #[test]
        fn failed_steps_change_nothing() {
            let model = Model::<$family>::load_with(
                &crate::common::data(FIXTURE),
                Box::new(|ck, table| {
                    Ok(Arc::new(FailsOnce {
                        inner: ResidentExperts::load(ck, table)?,
                        calls: AtomicUsize::new(0),
                        fail_at: $fail_at,
                    }))
                }),
            )
            .unwrap();
            crate::common::assert_failed_steps_change_nothing(&model, &golden().input_ids(0));
        }

        /// The model in `dir` with `resident` decoder layers in RAM and the
        /// rest read for every pass through a ring of two (with none, the head
        /// too, in row blocks).
        pub fn load_tiered(dir: &std::path::Path, resident: usize) -> Model<$family> {
            let opts = fathom_model::LoadOptions {
                layers: fathom_model::LayerPlan {
                    head_on_disk: resident == 0,
                    ..fathom_model::LayerPlan::streamed(resident, 2)
                },
                ..Default::default()
            };
            Model::<$family>::load_config(&fathom_model::ModelConfig::read(dir).unwrap(), opts)
                .unwrap_or_else(|e| panic!("{FIXTURE} loads with a streamed spine: {e}"))
        }

        /// The spine wholly and partly streamed gives the resident bits:
        /// prefill, decode, batched steps, chunked prefill, snapshots,
        /// rollback (`keep`), forks and saved states.
        #[test]
        fn streamed_spine_is_bit_identical() {
            let (resident, g) = (load(), golden());
            let layers = resident.spec.num_layers;
            for r in [0, layers / 2] {
                let m = load_tiered(&crate::common::data(FIXTURE), r);
                assert_eq!(m.weights.layers.streamed(), layers - r);
                let prompts: Vec<Vec<u32>> = (0..g.prompts).map(|i| g.input_ids(i)).collect();
                crate::common::assert_tiers_bit_identical(&resident, &m, &prompts);
                let (a, b, c) = (g.input_ids(0), g.input_ids(2), g.input_ids(1));
                crate::common::assert_batched_equals_solo(&m, &a, &b, &c);
                crate::common::assert_chunked_equals_one_pass(&m, &g.input_ids(2));
                crate::common::assert_state_contract(&m, &g.input_ids(1), $foreign);
                let head = m.weights.head_reads();
                assert_eq!(head.bytes_read > 0, r == 0, "head read in blocks: {head:?}");
            }
        }

        /// Every other layer and the head held for the device (their
        /// matrices mapped from the checkpoint,
        /// `fathom_model::linear::loading_held`) with no
        /// device installed: the CPU computes them from the map, the rest
        /// streamed, with the resident bits.
        #[test]
        fn held_layers_read_from_the_map_are_bit_identical() {
            let (resident, g) = (load(), golden());
            let layers = resident.spec.num_layers;
            let opts = crate::common::every_other_layer_held(layers);
            let dir = crate::common::data(FIXTURE);
            let m = Model::<$family>::load_config(
                &fathom_model::ModelConfig::read(&dir).unwrap(),
                opts,
            )
            .unwrap_or_else(|e| panic!("{FIXTURE} loads with held layers: {e}"));
            assert_eq!(m.weights.layers.on_device(), layers.div_ceil(2));
            assert_eq!(m.weights.layers.streamed(), layers / 2);
            let prompts: Vec<Vec<u32>> = (0..g.prompts).map(|i| g.input_ids(i)).collect();
            crate::common::assert_tiers_bit_identical(&resident, &m, &prompts);
            // Only the streamed layers are read: each once a pass, and at
            // most a ring's read-ahead past the last.
            let r = m.weights.layers.reads();
            let streamed = (layers / 2) as u64;
            assert!(
                r.passes > 0 && r.layers_read <= streamed * r.passes + 2,
                "{r:?}"
            );
        }

        /// A streamed layer that cannot be read fails the step, naming the
        /// shard and the tensor, and changes no state.
        #[test]
        fn a_spine_read_error_changes_nothing() {
            let dir = crate::common::fixture_copy(FIXTURE, "spine-cut");
            let m = load_tiered(&dir, 0);
            crate::common::assert_spine_read_error_changes_nothing(
                &load(),
                &m,
                &dir,
                &golden().input_ids(0),
            );
        }
    };
}
pub(crate) use family_golden_tests;
