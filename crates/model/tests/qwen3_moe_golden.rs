//! The Qwen3-MoE forward pass against an independent fp32 reference's golden
//! data (`tests/data/qwen3_moe-tiny`: config, weights and golden files
//! copied unchanged from shared/fixtures/qwen3_moe-tiny, whose tokenizer is
//! the tokenizer crate's `tests/data/hf-tiny`): last-position, prefill and cached-decode
//! logits, greedy continuations, per-layer routing and hidden-state norms;
//! then the exactness properties (batched = solo, chunked = one pass) and
//! the sequence-state contract.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use fathom_model::experts::{ExpertSource, ExpertStats, ExpertTicket, ResidentExperts};
use fathom_model::moe::Route;
use fathom_model::qwen3_moe::state::KvState;
use fathom_model::{CausalLm, Logits, ModelError, Qwen3MoeModel, StepInput, Tracer};
use serde_json::Value;

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/qwen3_moe-tiny")
}

fn load() -> Qwen3MoeModel {
    Qwen3MoeModel::load(&data()).expect("qwen3_moe-tiny loads")
}

/// A tensor of `golden.safetensors` (F32 or I64), as f64s with its shape.
struct Tensor {
    shape: Vec<usize>,
    values: Vec<f64>,
}

impl Tensor {
    fn f32s(&self) -> Vec<f32> {
        self.values.iter().map(|&v| v as f32).collect()
    }
    fn ids(&self) -> Vec<u32> {
        self.values.iter().map(|&v| v as u32).collect()
    }
}

/// Reads every tensor of the golden file (safetensors: u64 header length,
/// JSON header, data).
fn golden() -> HashMap<String, Tensor> {
    let bytes = std::fs::read(data().join("golden.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let body = &bytes[8 + n..];
    let mut out = HashMap::new();
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
        out.insert(name.clone(), Tensor { shape, values });
    }
    out
}

fn prompt_count() -> usize {
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(data().join("golden.json")).unwrap())
            .unwrap();
    g["prompts"].as_array().unwrap().len()
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Max |Δ| of last-position logits per golden prompt.
fn max_logit_error(model: &Qwen3MoeModel) -> Vec<f32> {
    let g = golden();
    (0..prompt_count())
        .map(|i| {
            let ids = g[&format!("prompt{i}.input_ids")].ids();
            let mut st = model.new_state();
            let logits = model.forward(&mut st, &ids, Logits::Last).unwrap();
            max_abs_diff(&logits, &g[&format!("prompt{i}.last_logits")].f32s())
        })
        .collect()
}

#[test]
fn last_logits_match_golden() {
    let errs = max_logit_error(&load());
    eprintln!("max |Δlogit| per prompt: {errs:?}");
    assert_eq!(errs.len(), 3);
    for (i, e) in errs.iter().enumerate() {
        assert!(*e < 1e-3, "prompt {i}: max logit error {e}");
    }
}

#[test]
fn prefill_logits_match_golden() {
    let (model, g) = (load(), golden());
    for i in 0..prompt_count() {
        let ids = g[&format!("prompt{i}.input_ids")].ids();
        let want = &g[&format!("prompt{i}.prefill_logits")];
        assert_eq!(want.shape, vec![ids.len(), model.spec.vocab_size]);
        let mut st = model.new_state();
        let got = model.forward(&mut st, &ids, Logits::All).unwrap();
        let e = max_abs_diff(&got, &want.f32s());
        eprintln!("prompt {i}: prefill max |Δlogit| {e}");
        assert!(e < 1e-3, "prompt {i}: prefill logit error {e}");
    }
}

/// Prefill, then greedy decode one token at a time through the cache: the
/// same tokens as the reference, and every step's logits within tolerance.
#[test]
fn greedy_decode_and_step_logits_match_golden() {
    let (model, g) = (load(), golden());
    let v = model.spec.vocab_size;
    for i in 0..prompt_count() {
        let ids = g[&format!("prompt{i}.input_ids")].ids();
        let want = g[&format!("prompt{i}.greedy_ids")].ids();
        let steps = g[&format!("prompt{i}.step_logits")].f32s();
        let mut st = model.new_state();
        let mut logits = model.forward(&mut st, &ids, Logits::Last).unwrap();
        let mut got = Vec::new();
        let mut worst = 0f32;
        for (j, _) in want.iter().enumerate() {
            worst = worst.max(max_abs_diff(&logits, &steps[j * v..(j + 1) * v]));
            let next = argmax(&logits);
            got.push(next);
            logits = model.forward(&mut st, &[next], Logits::Last).unwrap();
        }
        eprintln!("prompt {i}: decode-step max |Δlogit| {worst}");
        assert_eq!(got, want, "prompt {i}: greedy tokens");
        assert!(worst < 1e-3, "prompt {i}: step logit error {worst}");
    }
}

#[derive(Default)]
struct Record {
    routes: Vec<(usize, Vec<Route>)>,
    tensors: Vec<(usize, String, Vec<f32>)>,
}

impl Tracer for Record {
    fn tensor(&mut self, layer: usize, name: &str, rows: &[f32]) {
        self.tensors.push((layer, name.to_string(), rows.to_vec()));
    }
    fn routes(&mut self, layer: usize, routes: &[Route]) {
        self.routes.push((layer, routes.to_vec()));
    }
}

/// Over prompt + greedy tokens in one pass: each layer's chosen experts
/// (as a set) equal the reference's, and each layer's hidden-state norms
/// agree.
#[test]
fn routing_and_hidden_norms_match_golden() {
    let (model, g) = (load(), golden());
    let (d, k) = (model.spec.hidden_size, model.spec.top_k);
    for i in 0..prompt_count() {
        let mut seq = g[&format!("prompt{i}.input_ids")].ids();
        seq.extend(g[&format!("prompt{i}.greedy_ids")].ids());
        let mut rec = Record::default();
        let mut st = model.new_state();
        model
            .forward_traced(&mut st, &seq, Logits::Last, Some(&mut rec))
            .unwrap();
        for l in model.spec.moe_layers() {
            let want = g[&format!("prompt{i}.layer{l}.topk_ids")].ids();
            let margin = g[&format!("prompt{i}.layer{l}.route_margin")].f32s();
            let (_, got) = rec.routes.iter().find(|(ll, _)| *ll == l).unwrap();
            assert_eq!(got.len(), seq.len());
            for (p, r) in got.iter().enumerate() {
                let mut ids = r.ids.clone();
                ids.sort_unstable();
                assert_eq!(
                    ids,
                    want[p * k..(p + 1) * k],
                    "prompt {i} layer {l} position {p} (reference margin {})",
                    margin[p]
                );
                let dm = (r.margin - margin[p]).abs();
                assert!(
                    dm < 1e-3,
                    "prompt {i} layer {l} position {p}: margin off by {dm}"
                );
            }
        }
        let norms = &g[&format!("prompt{i}.hidden_norms")];
        let t = seq.len();
        assert_eq!(norms.shape, vec![model.spec.num_layers + 1, t]);
        let want = norms.f32s();
        for row in 0..=model.spec.num_layers {
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
                let got = h[p * d..(p + 1) * d]
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

fn prompts() -> Vec<Vec<u32>> {
    let g = golden();
    (0..prompt_count())
        .map(|i| g[&format!("prompt{i}.input_ids")].ids())
        .collect()
}

/// Two prompts of different lengths in one step give, bit for bit, what
/// each gives alone; so does a mixed step (one decoding, one prefilling).
#[test]
fn batched_equals_solo_bitwise() {
    let model = load();
    let p = prompts();
    let (a, b) = (&p[0], &p[2]);
    let solo = |toks: &[u32]| {
        let mut st = model.new_state();
        let l = model.forward(&mut st, toks, Logits::All).unwrap();
        (st, l)
    };
    let (mut sa, la) = solo(a);
    let (_, lb) = solo(b);
    let (mut xa, mut xb) = (model.new_state(), model.new_state());
    let out = {
        let mut batch = [
            StepInput {
                state: &mut xa,
                tokens: a,
                logits: Logits::All,
            },
            StepInput {
                state: &mut xb,
                tokens: b,
                logits: Logits::All,
            },
        ];
        CausalLm::step(&model, &mut batch).unwrap()
    };
    assert_eq!(out[0], la, "prompt 0 batched vs alone");
    assert_eq!(out[1], lb, "prompt 2 batched vs alone");
    // Mixed: sequence a decodes one token while a fresh c prefills.
    let next = [argmax(&la[la.len() - model.spec.vocab_size..])];
    let alone = model.forward(&mut sa, &next, Logits::Last).unwrap();
    let mut xc = model.new_state();
    let out = {
        let mut batch = [
            StepInput {
                state: &mut xc,
                tokens: &p[1],
                logits: Logits::Last,
            },
            StepInput {
                state: &mut xa,
                tokens: &next,
                logits: Logits::Last,
            },
        ];
        CausalLm::step(&model, &mut batch).unwrap()
    };
    assert_eq!(out[1], alone, "decode step batched with a prefill");
    let mut sc = model.new_state();
    assert_eq!(out[0], model.forward(&mut sc, &p[1], Logits::Last).unwrap());
}

/// A prompt fed in chunks (or token by token) gives, bit for bit, the
/// logits of one pass at every position, and the same cache.
#[test]
fn chunked_prefill_equals_one_pass_bitwise() {
    let model = load();
    let prompt = &prompts()[2];
    let v = model.spec.vocab_size;
    let mut one = model.new_state();
    let all = model.forward(&mut one, prompt, Logits::All).unwrap();
    for chunks in [vec![1, 7, 30], vec![50, 1], vec![97]] {
        let mut st = model.new_state();
        let mut got = Vec::new();
        let mut at = 0;
        for c in chunks.into_iter().chain([prompt.len()]) {
            let end = (at + c).min(prompt.len());
            got.extend(
                model
                    .forward(&mut st, &prompt[at..end], Logits::All)
                    .unwrap(),
            );
            at = end;
            if at == prompt.len() {
                break;
            }
        }
        assert_eq!(got, all);
        assert_eq!(st.encode_bytes(), one.encode_bytes());
    }
    let mut st = model.new_state();
    for (i, &tok) in prompt.iter().enumerate() {
        let l = model.forward(&mut st, &[tok], Logits::Last).unwrap();
        assert_eq!(l, all[i * v..(i + 1) * v].to_vec(), "position {i}");
    }
}

trait EncodeBytes {
    fn encode_bytes(&self) -> Vec<u8>;
}
impl EncodeBytes for KvState {
    fn encode_bytes(&self) -> Vec<u8> {
        fathom_model::SeqState::encode(self)
    }
}

/// Snapshots, speculative rollback, forks and saved bytes all continue
/// bit-identically; damaged bytes are refused.
#[test]
fn state_contract() {
    let model: Arc<dyn CausalLm> = fathom_model::load(&data(), Default::default()).unwrap();
    assert_eq!(model.info().family, "Qwen3-MoE");
    let prompt = &prompts()[1];
    let mut a = model.new_state();
    model.forward(a.as_mut(), prompt, Logits::None).unwrap();
    let snap = a.snapshot();
    let want = model.forward(a.as_mut(), &[7, 8, 9], Logits::All).unwrap();
    model
        .forward(a.as_mut(), &[100, 200], Logits::Last)
        .unwrap();
    a.restore(snap.as_ref()).unwrap();
    assert_eq!(a.pos(), prompt.len());
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
    assert_eq!(a.encode(), b.encode());
    // Fork and saved bytes continue alike.
    let mut f = a.fork();
    let mut d = model.decode_state(&a.encode()).unwrap();
    let la = model.forward(a.as_mut(), &[42, 43], Logits::All).unwrap();
    assert_eq!(
        model.forward(f.as_mut(), &[42, 43], Logits::All).unwrap(),
        la
    );
    assert_eq!(
        model.forward(d.as_mut(), &[42, 43], Logits::All).unwrap(),
        la
    );
    // Damaged or foreign bytes are refused with a reason.
    let bytes = b.encode();
    let err = |x: &[u8]| model.decode_state(x).err().expect("refused").to_string();
    assert!(err(&bytes[..bytes.len() - 3]).contains("ends early"));
    assert!(err(b"K3ST....").contains("magic"));
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

/// A source that fails its n-th request.
struct FailsOnce {
    inner: ResidentExperts,
    calls: AtomicUsize,
    fail_at: usize,
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

/// A step that fails part-way (an expert read in layer 2) leaves every
/// state as it was; bad tokens name their sequence.
#[test]
fn failed_steps_change_nothing() {
    let model = Qwen3MoeModel::load_with(
        &data(),
        Box::new(|ck, table| {
            Ok(Arc::new(FailsOnce {
                inner: ResidentExperts::load(ck, table)?,
                calls: AtomicUsize::new(0),
                fail_at: 6,
            }))
        }),
    )
    .unwrap();
    let p = prompts();
    let mut a = model.new_state();
    model.forward(&mut a, &p[0], Logits::None).unwrap(); // requests 0..=3
    let before = fathom_model::SeqState::encode(&a);
    let e = model.forward(&mut a, &[5, 6], Logits::Last).unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    assert_eq!(fathom_model::SeqState::encode(&a), before);
    let mut b = model.new_state();
    let mut batch = [
        StepInput {
            state: &mut a,
            tokens: &[5],
            logits: Logits::Last,
        },
        StepInput {
            state: &mut b,
            tokens: &[3, 4096],
            logits: Logits::Last,
        },
    ];
    let e = CausalLm::step(&model, &mut batch).unwrap_err();
    assert_eq!(e.seq, Some(1));
    assert_eq!(
        e.to_string(),
        "token id 4096 is outside the vocabulary (size 4096)"
    );
    assert_eq!(fathom_model::SeqState::encode(&a), before);
}
