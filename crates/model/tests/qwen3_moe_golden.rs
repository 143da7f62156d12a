//! The Qwen3-MoE forward pass against an independent fp32 reference's golden
//! data (`tests/data/qwen3_moe-tiny`: config, weights and golden files
//! copied unchanged from shared/fixtures/qwen3_moe-tiny, whose tokenizer is
//! the tokenizer crate's `tests/data/hf-tiny`): last-position, prefill and
//! cached-decode logits, greedy continuations, per-layer routing and
//! hidden-state norms; then the exactness properties (batched = solo,
//! chunked = one pass) and the sequence-state contract.

mod common;

common::family_golden_tests!(
    fathom_model::qwen3_moe::Qwen3Moe,
    "qwen3_moe-tiny",
    "Qwen3-MoE",
    b"K3ST",
    6
);

/// Without renormalising the top-k weights the logits move well past the
/// tolerance: the check has teeth.
#[test]
fn negative_control_without_topk_renormalisation() {
    let mut model = load();
    let mut spec = (*model.spec).clone();
    spec.norm_topk_prob = false;
    model.spec = Arc::new(spec);
    let worst = worst(&model);
    eprintln!("no top-k renormalisation: max |Δlogit| {worst}");
    assert!(worst > 1e-2, "the renormalisation went unnoticed: {worst}");
}

/// A copy of the fixture whose config.json declares `rope_scaling`.
fn with_rope_scaling(tag: &str, scaling: serde_json::Value) -> std::path::PathBuf {
    let src = common::data(FIXTURE);
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
        let m = fathom_model::Qwen3MoeModel::load(dir).expect("loads with rope_scaling");
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
