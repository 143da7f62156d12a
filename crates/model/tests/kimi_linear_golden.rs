//! The Kimi-Linear forward pass against an independent fp32 reference's
//! golden data (`tests/data/kimi_linear-tiny`: config, weights and golden
//! files copied unchanged from shared/fixtures/kimi_linear-tiny): last-position, prefill and
//! cached-decode logits, greedy continuations, per-layer routing (group
//! limited) and hidden-state norms; then batched = solo, chunked = one pass
//! (across the KDA state and the latent cache) and the state contract.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use common::{FailsOnce, Golden, Record, data};
use fathom_model::experts::ResidentExperts;
use fathom_model::{CausalLm, KimiLinearModel, Logits};

const NAME: &str = "kimi_linear-tiny";

fn load() -> KimiLinearModel {
    KimiLinearModel::load(&data(NAME)).expect("kimi_linear-tiny loads")
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
    assert_eq!(model.info().family, "Kimi-Linear");
    // A K3 state is refused by its magic even where the layouts agree.
    common::assert_state_contract(model.as_ref(), &golden().input_ids(1), b"K3ST");
}

#[test]
fn failed_steps_change_nothing() {
    let model = KimiLinearModel::load_with(
        &data(NAME),
        Box::new(|ck, table| {
            Ok(Arc::new(FailsOnce {
                inner: ResidentExperts::load(ck, table)?,
                calls: AtomicUsize::new(0),
                fail_at: 7,
            }))
        }),
    )
    .unwrap();
    common::assert_failed_steps_change_nothing(&model, &golden().input_ids(0));
}

/// The fixture's routing depends on the group limit: without it some
/// position picks another expert set, and the logits move.
#[test]
fn negative_control_without_group_limit() {
    let mut model = load();
    let mut spec = (*model.spec).clone();
    (spec.num_expert_group, spec.topk_group) = (1, 1);
    model.spec = Arc::new(spec);
    let g = golden();
    let worst = common::last_logit_errors(&model, &g)
        .into_iter()
        .fold(0.0, f32::max);
    eprintln!("no group limit: max |Δlogit| {worst}");
    assert!(worst > 1e-2, "the group limit went unnoticed: {worst}");
}
