//! The DeepSeek-V3 / Kimi K2 forward pass against an independent fp32
//! reference's golden data, for both fixtures (`tests/data/deepseek_v3-tiny`:
//! grouped routing, 4 groups keep 2; `tests/data/kimi_k2-tiny`: Kimi K2's
//! shape, 32 experts in one group, top-8, its YaRN parameters; config,
//! weights and golden files copied unchanged from shared/fixtures, whose
//! tokenizer is the tokenizer crate's `tests/data/hf-tiny`): last-position,
//! prefill and cached-decode logits, greedy continuations, per-layer
//! routing and hidden-state norms; then batched = solo, chunked = one pass
//! and the sequence-state contract; negative controls show the rotary
//! layout and the YaRN attention scale matter.

mod common;

use common::data;
use fathom_model::Logits;
use fathom_model::deepseek_v3::tensors::check_tensors;
use fathom_weights::Checkpoint;

/// The shared checks and this family's negative controls, per fixture.
macro_rules! fixture_tests {
    ($m:ident, $fixture:literal) => {
        mod $m {
            crate::common::family_golden_tests!(
                fathom_model::deepseek_v3::DeepseekV3,
                $fixture,
                "DeepSeek-V3",
                b"Q3ST",
                4
            );
            use fathom_kernels::rope::Rope;
            /// Rotating the rope channels as rotate-half pairs instead of the
            /// checkpoint's interleaved pairs moves the logits well past the tolerance.
            #[test]
            fn negative_control_rope_layout() {
                let mut model = load();
                let mut spec = (*model.spec).clone();
                spec.rope_interleave = false;
                model.spec = Arc::new(spec);
                let w = worst(&model);
                eprintln!("{FIXTURE}: rotate-half pairs: max |Δlogit| {w}");
                assert!(w > 1e-2, "the rotary layout went unnoticed: {w}");
            }

            /// Plain rotary frequencies instead of YaRN's move them as well.
            #[test]
            fn negative_control_yarn_frequencies() {
                let mut model = load();
                model.parts.rope = Rope::new(model.spec.qk_rope_head_dim, model.spec.rope.theta);
                let w = worst(&model);
                eprintln!("{FIXTURE}: plain rotary frequencies: max |Δlogit| {w}");
                assert!(w > 1e-2, "the YaRN frequencies went unnoticed: {w}");
            }

            /// Without YaRN's mscale² in the attention scale the logits move too.
            #[test]
            fn negative_control_attention_scale() {
                let mut model = load();
                let mut spec = (*model.spec).clone();
                spec.rope
                    .yarn
                    .as_mut()
                    .expect("the fixture uses YaRN")
                    .mscale_all_dim = None;
                model.spec = Arc::new(spec);
                let w = worst(&model);
                eprintln!("{FIXTURE}: plain softmax scale: max |Δlogit| {w}");
                assert!(w > 1e-2, "the YaRN attention scale went unnoticed: {w}");
            }
        }
    };
}

fixture_tests!(deepseek_v3, "deepseek_v3-tiny");
fixture_tests!(kimi_k2, "kimi_k2-tiny");

/// The Kimi K2 fixture declares `model_type` `deepseek_v3` (as the
/// reference writes it); a config saying `kimi_k2`, as Moonshot's releases
/// do, loads through the registry into the same family and reports its type.
#[test]
fn kimi_k2_model_type_loads_through_the_registry() {
    let dir = std::env::temp_dir().join(format!("fathom-kimi-k2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = data("kimi_k2-tiny");
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["model_type"] = "kimi_k2".into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let m = fathom_model::load(&dir, Default::default()).unwrap();
    let ours = {
        let mut st = m.new_state();
        m.forward(st.as_mut(), &kimi_k2::golden().input_ids(0), Logits::Last)
            .unwrap()
    };
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        (m.info().family, m.info().model_type.as_str()),
        ("DeepSeek-V3", "kimi_k2")
    );
    let want = kimi_k2::golden().get(0, "last_logits").f32s();
    assert!(common::max_abs_diff(&ours, &want) < 1e-3);
}

/// Tensors of the multi-token-prediction layers that follow the decoder
/// (`num_nextn_predict_layers`) are allowed and left unread; without the
/// declaration they are unexpected. (Here the fixture's last layer plays
/// an MTP layer of a 3-layer spec.)
#[test]
fn mtp_layers_are_allowed_and_left_unread() {
    let dir = data("deepseek_v3-tiny");
    let ck = Checkpoint::open(&dir).unwrap();
    let mut spec =
        fathom_model::family::read_spec::<fathom_model::deepseek_v3::DeepseekV3>(&dir).unwrap();
    assert!(check_tensors(&spec, &ck).is_empty());
    spec.num_layers = 3;
    spec.num_nextn_predict_layers = 1;
    assert_eq!(check_tensors(&spec, &ck), Vec::<String>::new());
    spec.num_nextn_predict_layers = 0;
    let problems = check_tensors(&spec, &ck);
    assert!(!problems.is_empty());
    assert!(
        problems
            .iter()
            .all(|p| p.starts_with("unexpected tensor model.layers.3.")),
        "{problems:?}"
    );
}
