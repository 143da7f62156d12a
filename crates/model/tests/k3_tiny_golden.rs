//! The K3 forward pass against the independent fp32 reference's golden data
//! (`tests/data/k3-tiny`, copied unchanged from shared/fixtures/k3-tiny).

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use common::{argmax, max_abs_diff};

use fathom_model::experts::{
    ExpertSlot, ExpertSource, ExpertStats, ExpertTicket, ExpertWeights, ResidentExperts,
};
use fathom_model::kimi_k3::moe::Route;
use fathom_model::kimi_k3::weights::AttnWeights;
use fathom_model::{CausalLm, K3Model, Logits, Tracer};
use serde_json::Value;

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3-tiny")
}

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(data().join("golden.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn load() -> K3Model {
    K3Model::load(&data().join("checkpoint")).expect("k3-tiny loads")
}

/// Max |Δ| of last-position logits over the three golden prompts.
fn max_logit_error(model: &K3Model) -> Vec<f32> {
    let g = golden();
    g["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let mut st = model.new_state();
            let logits = model
                .forward(&mut st, &ids(&p["input_ids"]), Logits::Last)
                .unwrap();
            max_abs_diff(&logits, &floats(&p["last_logits"]))
        })
        .collect()
}

#[test]
fn last_logits_match_golden() {
    let errs = max_logit_error(&load());
    eprintln!("max |Δlogit| per prompt: {errs:?}");
    for (i, e) in errs.iter().enumerate() {
        assert!(*e < 1e-3, "prompt {i}: max logit error {e}");
    }
}

#[test]
fn greedy_tokens_by_decode_and_by_recomputation() {
    let model = load();
    let g = golden();
    for (pi, p) in g["prompts"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&p["input_ids"]);
        let want = ids(&p["greedy_tokens"]);
        assert_eq!(want, ids(&p["greedy_tokens_incremental"]));
        // Prefill + single-token decode.
        let mut st = model.new_state();
        let mut logits = model.forward(&mut st, &prompt, Logits::Last).unwrap();
        let mut got = Vec::new();
        for _ in 0..want.len() {
            let next = argmax(&logits);
            got.push(next);
            logits = model.forward(&mut st, &[next], Logits::Last).unwrap();
        }
        assert_eq!(got, want, "prompt {pi}: prefill+decode");
        // Full recomputation from an empty state every step.
        let mut seq = prompt.clone();
        let mut got = Vec::new();
        for _ in 0..want.len() {
            let mut st = model.new_state();
            let next = argmax(&model.forward(&mut st, &seq, Logits::Last).unwrap());
            got.push(next);
            seq.push(next);
        }
        assert_eq!(got, want, "prompt {pi}: recomputation");
    }
}

/// A T-token pass equals T one-token passes bit for bit (the property
/// speculative verification relies on), at every position.
#[test]
fn prefill_equals_token_by_token_bitwise() {
    let model = load();
    let prompt = ids(&golden()["prompts"][1]["input_ids"]);
    let mut st = model.new_state();
    let all = model.forward(&mut st, &prompt, Logits::All).unwrap();
    let v = model.spec.vocab_size;
    let mut st2 = model.new_state();
    for (i, &tok) in prompt.iter().enumerate() {
        let one = model.forward(&mut st2, &[tok], Logits::Last).unwrap();
        assert_eq!(one, all[i * v..(i + 1) * v].to_vec(), "position {i}");
    }
}

#[test]
fn snapshot_restore_replays_identically() {
    let model = load();
    let prompt = ids(&golden()["prompts"][0]["input_ids"]);
    let mut st = model.new_state();
    model.forward(&mut st, &prompt, Logits::Last).unwrap();
    let snap = st.snapshot();
    let a = model.forward(&mut st, &[7, 8, 9], Logits::All).unwrap();
    // Wander off, then come back.
    model.forward(&mut st, &[100, 200], Logits::Last).unwrap();
    st.restore(&snap)
        .expect("the snapshot is this sequence's past");
    assert_eq!(st.pos, prompt.len());
    let b = model.forward(&mut st, &[7, 8, 9], Logits::All).unwrap();
    assert_eq!(a, b);
    // The snapshot does not grow with the sequence: only KDA state is copied.
    let kda_layers = model
        .spec
        .attn_kinds
        .iter()
        .filter(|k| **k == fathom_model::kimi_k3::config::AttnKind::Kda)
        .count();
    let s = &model.spec;
    let per_layer = 4
        * (s.kda_heads * s.kda_head_dim * s.kda_head_dim + 3 * (s.conv_kernel - 1) * s.kda_width());
    assert_eq!(snap.bytes(), kda_layers * per_layer);
}

#[derive(Default)]
struct Stats {
    rows: Vec<(usize, String, Vec<f32>)>,
    routes: Vec<(usize, Vec<Route>)>,
}

impl Tracer for Stats {
    fn tensor(&mut self, layer: usize, name: &str, rows: &[f32]) {
        self.rows.push((layer, name.to_string(), rows.to_vec()));
    }
    fn routes(&mut self, layer: usize, routes: &[Route]) {
        self.routes.push((layer, routes.to_vec()));
    }
}

/// Per-layer statistics and routes localise an error to a layer and a site.
#[test]
fn layer_stats_and_routes_match_golden() {
    let model = load();
    let g = golden();
    let d = model.spec.hidden_size;
    for p in g["prompts"].as_array().unwrap() {
        let mut tr = Stats::default();
        let mut st = model.new_state();
        model
            .forward_traced(&mut st, &ids(&p["input_ids"]), Logits::Last, Some(&mut tr))
            .unwrap();
        for ls in p["layer_stats"].as_array().unwrap() {
            let layer = ls["layer"].as_u64().unwrap() as usize;
            for site in ["attn_in", "attn_out", "mlp_in", "mlp_out"] {
                let (_, _, rows) = tr
                    .rows
                    .iter()
                    .find(|(l, n, _)| *l == layer && n == site)
                    .unwrap();
                let want = &ls[site];
                let l2 = rows.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
                let sum: f64 = rows.iter().map(|&v| v as f64).sum();
                let wl2 = want["l2"].as_f64().unwrap();
                assert!(
                    (l2 - wl2).abs() < 1e-4 * wl2.max(1.0),
                    "layer {layer} {site}: l2 {l2} vs {wl2}"
                );
                let ws = want["sum"].as_f64().unwrap();
                assert!(
                    (sum - ws).abs() < 1e-3 * want["abs_sum"].as_f64().unwrap().max(1.0),
                    "layer {layer} {site}: sum {sum} vs {ws}"
                );
                let last = &rows[rows.len() - d..][..8];
                let err = max_abs_diff(last, &floats(&want["last_pos_first8"]));
                assert!(err < 1e-4, "layer {layer} {site}: first8 off by {err}");
            }
        }
        for (layer, want) in p["routes_prompt"].as_object().unwrap() {
            let layer: usize = layer.parse().unwrap();
            let (_, got) = tr.routes.iter().find(|(l, _)| *l == layer).unwrap();
            for (pos, w) in want.as_array().unwrap().iter().enumerate() {
                assert_eq!(got[pos].ids, ids(w), "layer {layer} position {pos}");
            }
        }
    }
}

/// A source that misreads MXFP4 with the high nibble first.
struct SwappedNibbles(ResidentExperts);

impl ExpertSource for SwappedNibbles {
    fn request(&self, layer: usize, ids: &[u32]) -> fathom_model::Result<ExpertTicket> {
        let got = self.0.request(layer, ids)?.wait_all()?;
        let slots = got
            .into_iter()
            .map(|e| {
                let mut buf = e.buf.clone();
                for (p, _s, [r, c]) in e.parts {
                    for b in &mut buf[p..p + r * c / 2] {
                        *b = b.rotate_left(4);
                    }
                }
                ExpertSlot::Ready(Arc::new(ExpertWeights {
                    buf,
                    parts: e.parts,
                    format: e.format,
                }))
            })
            .collect();
        Ok(ExpertTicket {
            layer,
            ids: ids.to_vec(),
            slots,
        })
    }
    fn stats(&self) -> ExpertStats {
        self.0.stats()
    }
}

#[test]
fn negative_control_swapped_nibbles_fails_the_check() {
    let model = K3Model::load_with(
        &data().join("checkpoint"),
        Box::new(|ck, table| Ok(Arc::new(SwappedNibbles(ResidentExperts::load(ck, table)?)))),
    )
    .unwrap();
    let worst = max_logit_error(&model).into_iter().fold(0.0, f32::max);
    eprintln!("swapped nibbles: max |Δlogit| {worst}");
    assert!(worst > 1.0, "misread MXFP4 went unnoticed: {worst}");
}

#[test]
fn negative_control_a_log_per_channel_fails_the_check() {
    let mut model = load();
    let ck = fathom_weights::Checkpoint::open(&data().join("checkpoint")).unwrap();
    let k = model.spec.kda_head_dim;
    for (i, l) in model.weights.layers.resident_mut() {
        if let AttnWeights::Kda(w) = &mut l.attn {
            let loc = ck
                .get(&format!("language_model.model.layers.{i}.self_attn.A_log"))
                .unwrap();
            let raw = fathom_weights::convert::to_f32(loc.dtype, &ck.read(loc).unwrap()).unwrap();
            // Misreading: exp(A_log[k]) per key channel, shared by all heads.
            for (j, a) in w.a.iter_mut().enumerate() {
                *a = raw[j % k].exp();
            }
        }
    }
    let worst = max_logit_error(&model).into_iter().fold(0.0, f32::max);
    eprintln!("A_log per channel: max |Δlogit| {worst}");
    assert!(worst > 1.0, "per-channel A_log went unnoticed: {worst}");
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let model = load();
    let mut st = model.new_state();
    let e = model.forward(&mut st, &[], Logits::Last).unwrap_err();
    assert_eq!(e.to_string(), "empty input: at least one token is needed");
    let e = model
        .forward(&mut st, &[5, 1024], Logits::Last)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "token id 1024 is outside the vocabulary (size 1024)"
    );
    assert_eq!(st.pos, 0, "a rejected pass leaves the state untouched");
}

/// A source whose every other expert is still "being read": a thread hands
/// them over in reverse order of the request, one by one, and can fail one.
struct LateExperts {
    inner: ResidentExperts,
    /// Fail the n-th late expert of the whole run (None: never).
    fail_at: Option<usize>,
    handed: std::sync::atomic::AtomicUsize,
}

#[derive(Default)]
struct Late {
    done: std::sync::Mutex<Option<Result<Arc<ExpertWeights>, String>>>,
    cv: std::sync::Condvar,
}

impl fathom_model::experts::PendingExpert for Late {
    fn wait(&self) -> fathom_model::Result<Arc<ExpertWeights>> {
        let mut g = self.done.lock().unwrap();
        while g.is_none() {
            g = self.cv.wait(g).unwrap();
        }
        g.clone()
            .unwrap()
            .map_err(fathom_model::ModelError::Experts)
    }
}

impl ExpertSource for LateExperts {
    fn request(&self, layer: usize, ids: &[u32]) -> fathom_model::Result<ExpertTicket> {
        use std::sync::atomic::Ordering;
        let got = self.inner.request(layer, ids)?.wait_all()?;
        let mut slots = Vec::new();
        let mut late = Vec::new();
        for (i, e) in got.into_iter().enumerate() {
            if i % 2 == 0 {
                slots.push(ExpertSlot::Ready(e));
            } else {
                let p = Arc::new(Late::default());
                let n = self.handed.fetch_add(1, Ordering::SeqCst);
                let r = if self.fail_at == Some(n) {
                    Err("injected late read error".to_string())
                } else {
                    Ok(e)
                };
                late.push((p.clone(), r));
                slots.push(ExpertSlot::Pending(p));
            }
        }
        std::thread::spawn(move || {
            for (p, r) in late.into_iter().rev() {
                std::thread::sleep(std::time::Duration::from_micros(300));
                *p.done.lock().unwrap() = Some(r);
                p.cv.notify_all();
            }
        });
        Ok(ExpertTicket {
            layer,
            ids: ids.to_vec(),
            slots,
        })
    }
    fn stats(&self) -> ExpertStats {
        self.inner.stats()
    }
}

fn late_model(fail_at: Option<usize>) -> K3Model {
    K3Model::load_with(
        &data().join("checkpoint"),
        Box::new(move |ck, table| {
            Ok(Arc::new(LateExperts {
                inner: ResidentExperts::load(ck, table)?,
                fail_at,
                handed: Default::default(),
            }))
        }),
    )
    .unwrap()
}

/// Experts that arrive late and out of order give the resident logits bit
/// for bit, and a failed late read is an error naming it (no hang, no
/// partial result). That arrived experts run while others are still read is
/// `moe::tests::arrived_experts_run_while_others_are_read`.
#[test]
fn experts_arriving_out_of_order_give_the_same_bits() {
    let g = golden();
    let late = late_model(None);
    let resident = load();
    for p in g["prompts"].as_array().unwrap() {
        let prompt = ids(&p["input_ids"]);
        let mut a = resident.new_state();
        let mut b = late.new_state();
        let want = resident.forward(&mut a, &prompt, Logits::All).unwrap();
        let got = late.forward(&mut b, &prompt, Logits::All).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&want), bits(&got));
        for t in [7u32, 3, 11] {
            let want = resident.forward(&mut a, &[t], Logits::Last).unwrap();
            let got = late.forward(&mut b, &[t], Logits::Last).unwrap();
            assert_eq!(bits(&want), bits(&got), "decode token {t}");
        }
    }
    let failing = late_model(Some(3));
    let mut st = failing.new_state();
    let prompt = ids(&g["prompts"][0]["input_ids"]);
    let e = failing.forward(&mut st, &prompt, Logits::Last).unwrap_err();
    assert!(e.to_string().contains("injected late read error"), "{e}");
}

fn prompt(i: usize) -> Vec<u32> {
    ids(&golden()["prompts"][i]["input_ids"])
}

/// The properties every family's model has, from the shared harness: a
/// sequence's bits do not depend on the batch, on how the prompt is
/// chunked, and a failed step changes no state; a state of another family
/// with the same hybrid layout is refused by its magic.
#[test]
fn shared_properties_hold() {
    let model = load();
    common::assert_batched_equals_solo(&model, &prompt(0), &prompt(2), &prompt(1));
    common::assert_chunked_equals_one_pass(&model, &prompt(2));
    let lm: Arc<dyn CausalLm> =
        fathom_model::load(&data().join("checkpoint"), Default::default()).unwrap();
    assert_eq!(lm.info().family, "Kimi K3");
    common::assert_state_contract(lm.as_ref(), &prompt(1), b"KLST");
    let failing = K3Model::load_with(
        &data().join("checkpoint"),
        Box::new(|ck, table| {
            Ok(Arc::new(common::FailsOnce {
                inner: ResidentExperts::load(ck, table)?,
                calls: AtomicUsize::new(0),
                // Eight MoE layers: the warm pass takes requests 0..8,
                // the failing step breaks in its third MoE layer.
                fail_at: 10,
            }))
        }),
    )
    .unwrap();
    common::assert_failed_steps_change_nothing(&failing, &prompt(0));
}

/// The model in `dir` with `resident` decoder layers in RAM and the rest
/// read for every pass through a ring of two (with none, the head too, in
/// row blocks).
fn load_tiered(dir: &std::path::Path, resident: usize) -> K3Model {
    let opts = fathom_model::LoadOptions {
        layers: fathom_model::LayerPlan {
            head_on_disk: resident == 0,
            ..fathom_model::LayerPlan::streamed(resident, 2)
        },
        ..Default::default()
    };
    K3Model::load_config(&fathom_model::ModelConfig::read(dir).unwrap(), opts).unwrap()
}

/// The spine wholly and partly streamed gives the resident bits: prefill,
/// decode, batched steps, chunked prefill, snapshots, rollback (`keep`),
/// forks and saved states.
#[test]
fn streamed_spine_is_bit_identical() {
    let resident = load();
    let layers = resident.spec.num_layers;
    let prompts: Vec<Vec<u32>> = (0..3).map(prompt).collect();
    for r in [0, layers / 2] {
        let m = load_tiered(&data().join("checkpoint"), r);
        assert_eq!(m.weights.layers.streamed(), layers - r);
        common::assert_tiers_bit_identical(&resident, &m, &prompts);
        common::assert_batched_equals_solo(&m, &prompt(0), &prompt(2), &prompt(1));
        common::assert_chunked_equals_one_pass(&m, &prompt(2));
        common::assert_state_contract(&m, &prompt(1), b"KLST");
        let head = m.weights.head_reads();
        assert_eq!(head.bytes_read > 0, r == 0, "head read in blocks: {head:?}");
    }
}

/// Every other layer and the head held for the device (their matrices
/// mapped from the checkpoint) with no device installed: the CPU computes them from the
/// map, the rest streamed, with the resident bits.
#[test]
fn held_layers_read_from_the_map_are_bit_identical() {
    let resident = load();
    let layers = resident.spec.num_layers;
    let opts = common::every_other_layer_held(layers);
    let dir = data().join("checkpoint");
    let m = K3Model::load_config(&fathom_model::ModelConfig::read(&dir).unwrap(), opts).unwrap();
    assert_eq!(m.weights.layers.on_device(), layers.div_ceil(2));
    assert_eq!(m.weights.layers.streamed(), layers / 2);
    let prompts: Vec<Vec<u32>> = (0..3).map(prompt).collect();
    common::assert_tiers_bit_identical(&resident, &m, &prompts);
    common::assert_batched_equals_solo(&m, &prompt(0), &prompt(2), &prompt(1));
    // Only the streamed layers are read: each once a pass, and at most a
    // ring's read-ahead past the last.
    let r = m.weights.layers.reads();
    let streamed = (layers / 2) as u64;
    assert!(
        r.passes > 0 && r.layers_read <= streamed * r.passes + 2,
        "{r:?}"
    );
}

/// A streamed layer that cannot be read fails the step, naming the shard
/// and the tensor, and changes no state.
#[test]
fn a_spine_read_error_changes_nothing() {
    let dir = common::fixture_copy("k3-tiny/checkpoint", "spine-cut");
    let m = load_tiered(&dir, 0);
    common::assert_spine_read_error_changes_nothing(&load(), &m, &dir, &prompt(0));
}
