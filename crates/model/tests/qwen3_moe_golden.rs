//! The Qwen3-MoE forward pass against an independent fp32 reference's golden
//! data (`tests/data/qwen3_moe-tiny`: config, weights and golden files
//! copied unchanged from shared/fixtures/qwen3_moe-tiny, whose tokenizer is
//! the tokenizer crate's `tests/data/hf-tiny`): last-position, prefill and
//! cached-decode logits, greedy continuations, per-layer routing and
//! hidden-state norms; then the exactness properties (batched = solo,
//! chunked = one pass) and the sequence-state contract.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use common::{FailsOnce, Golden, Record, data};
use fathom_model::experts::ResidentExperts;
use fathom_model::{CausalLm, Logits, Qwen3MoeModel};

const NAME: &str = "qwen3_moe-tiny";

fn load() -> Qwen3MoeModel {
    Qwen3MoeModel::load(&data(NAME)).expect("qwen3_moe-tiny loads")
}

fn golden() -> Golden {
    Golden::load(&data(NAME))
}

#[test]
fn last_logits_match_golden() {
    let errs = common::last_logit_errors(&load(), &golden());
    eprintln!("max |Δlogit| per prompt: {errs:?}");
    assert_eq!(errs.len(), 3);
    for (i, e) in errs.iter().enumerate() {
        assert!(*e < 1e-3, "prompt {i}: max logit error {e}");
    }
}

#[test]
fn prefill_logits_match_golden() {
    let errs = common::prefill_logit_errors(&load(), &golden());
    eprintln!("prefill max |Δlogit| per prompt: {errs:?}");
    for (i, e) in errs.iter().enumerate() {
        assert!(*e < 1e-3, "prompt {i}: prefill logit error {e}");
    }
}

/// Prefill, then greedy decode through the cache: the reference's tokens,
/// and every step's logits within tolerance.
#[test]
fn greedy_decode_and_step_logits_match_golden() {
    let errs = common::greedy_step_errors(&load(), &golden());
    eprintln!("decode-step max |Δlogit| per prompt: {errs:?}");
    for (i, e) in errs.iter().enumerate() {
        assert!(*e < 1e-3, "prompt {i}: step logit error {e}");
    }
}

#[test]
fn routing_and_hidden_norms_match_golden() {
    let model = load();
    let s = &model.spec;
    common::check_routes_and_norms(&golden(), s.hidden_size, s.num_layers, s.top_k, |seq| {
        let mut rec = Record::default();
        let mut st = model.new_state();
        model
            .forward_traced(&mut st, seq, Logits::Last, Some(&mut rec))
            .unwrap();
        rec
    });
}

#[test]
fn batched_equals_solo_bitwise() {
    let g = golden();
    let (a, b, c) = (g.input_ids(0), g.input_ids(2), g.input_ids(1));
    common::assert_batched_equals_solo(&load(), &a, &b, &c);
}

#[test]
fn chunked_prefill_equals_one_pass_bitwise() {
    common::assert_chunked_equals_one_pass(&load(), &golden().input_ids(2));
}

#[test]
fn state_contract() {
    let model: Arc<dyn CausalLm> = fathom_model::load(&data(NAME), Default::default()).unwrap();
    assert_eq!(model.info().family, "Qwen3-MoE");
    common::assert_state_contract(model.as_ref(), &golden().input_ids(1), b"K3ST");
}

/// A step that fails part-way (an expert read in layer 2 of the second
/// pass) leaves every state as it was.
#[test]
fn failed_steps_change_nothing() {
    let model = Qwen3MoeModel::load_with(
        &data(NAME),
        Box::new(|ck, table| {
            Ok(Arc::new(FailsOnce {
                inner: ResidentExperts::load(ck, table)?,
                calls: AtomicUsize::new(0),
                fail_at: 6,
            }))
        }),
    )
    .unwrap();
    common::assert_failed_steps_change_nothing(&model, &golden().input_ids(0));
}

/// Without renormalising the top-k weights the logits move well past the
/// tolerance: the check has teeth.
#[test]
fn negative_control_without_topk_renormalisation() {
    let mut model = load();
    let mut spec = (*model.spec).clone();
    spec.norm_topk_prob = false;
    model.spec = Arc::new(spec);
    let worst = common::last_logit_errors(&model, &golden())
        .into_iter()
        .fold(0.0, f32::max);
    eprintln!("no top-k renormalisation: max |Δlogit| {worst}");
    assert!(worst > 1e-2, "the renormalisation went unnoticed: {worst}");
}

/// A copy of the fixture whose config.json declares `rope_scaling`.
fn with_rope_scaling(tag: &str, scaling: serde_json::Value) -> std::path::PathBuf {
    let src = data(NAME);
    let dir = std::env::temp_dir().join(format!("fathom-qwen3-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["model.safetensors", "golden.json", "golden.safetensors"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    cfg["rope_scaling"] = scaling;
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// YaRN from config.json reaches the attention: at factor 1 it is the
/// plain rotation (the golden logits hold), at factor 4 the logits move.
#[test]
fn yarn_from_the_config_reaches_the_rotation() {
    let worst = |dir: &std::path::Path| {
        let m = Qwen3MoeModel::load(dir).expect("loads with rope_scaling");
        common::last_logit_errors(&m, &golden())
            .into_iter()
            .fold(0.0, f32::max)
    };
    let one = with_rope_scaling(
        "yarn1",
        serde_json::json!({"rope_type": "yarn", "factor": 1.0,
            "original_max_position_embeddings": 40960}),
    );
    let four = with_rope_scaling(
        "yarn4",
        serde_json::json!({"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 10240}),
    );
    let (w1, w4) = (worst(&one), worst(&four));
    let _ = (
        std::fs::remove_dir_all(&one),
        std::fs::remove_dir_all(&four),
    );
    assert!(w1 <= 1e-3, "yarn factor 1 must be the plain rotation: {w1}");
    assert!(w4 > 1e-2, "yarn factor 4 changed nothing: {w4}");
}
