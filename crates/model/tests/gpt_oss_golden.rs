//! The GPT-OSS forward pass against an independent fp32 reference's golden
//! data (`tests/data/gpt_oss-tiny`: config, weights and golden files
//! copied unchanged from shared/fixtures/gpt_oss-tiny, whose tokenizer is
//! the tokenizer crate's `tests/data/hf-tiny`; sliding window 8 on layers
//! 0 and 2, sinks, YaRN, biased attention and stacked biased experts):
//! last-position, prefill and cached-decode logits, greedy continuations,
//! per-layer routing and hidden-state norms; then batched = solo, chunked
//! = one pass (also over several cache blocks, where the window starts
//! mid-cache) and the sequence-state contract; negative controls show the
//! window and the sinks matter.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use common::{FailsOnce, Golden, Record, data};
use fathom_model::experts::ResidentExperts;
use fathom_model::{CausalLm, GptOssModel, Logits};

const NAME: &str = "gpt_oss-tiny";

fn load() -> GptOssModel {
    GptOssModel::load(&data(NAME)).expect("gpt_oss-tiny loads")
}

fn golden() -> Golden {
    Golden::load(&data(NAME))
}

fn within(what: &str, errs: &[f32]) {
    eprintln!("{what} max |Δlogit| per prompt: {errs:?}");
    assert_eq!(errs.len(), 3);
    for (i, e) in errs.iter().enumerate() {
        assert!(*e < 1e-3, "prompt {i}: {what} logit error {e}");
    }
}

#[test]
fn last_logits_match_golden() {
    within("last", &common::last_logit_errors(&load(), &golden()));
}

#[test]
fn prefill_logits_match_golden() {
    within("prefill", &common::prefill_logit_errors(&load(), &golden()));
}

#[test]
fn greedy_decode_and_step_logits_match_golden() {
    within(
        "decode-step",
        &common::greedy_step_errors(&load(), &golden()),
    );
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

/// Past two cache blocks the sliding layers start reading mid-cache: still
/// the one-pass bits however the prompt is chunked.
#[test]
fn long_chunked_prefill_equals_one_pass_bitwise() {
    let prompt: Vec<u32> = (0..600u32).map(|i| (i * 7919 + 11) % 4096).collect();
    common::assert_chunked_equals_one_pass(&load(), &prompt);
}

#[test]
fn state_contract() {
    let model: Arc<dyn CausalLm> = fathom_model::load(&data(NAME), Default::default()).unwrap();
    assert_eq!(model.info().family, "GPT-OSS");
    // A Qwen3-MoE state has the same layout: refused by its magic.
    common::assert_state_contract(model.as_ref(), &golden().input_ids(1), b"Q3ST");
}

#[test]
fn failed_steps_change_nothing() {
    let model = GptOssModel::load_with(
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

fn worst(model: &GptOssModel) -> f32 {
    common::last_logit_errors(model, &golden())
        .into_iter()
        .fold(0.0, f32::max)
}

/// Attending to every position on the sliding layers moves the logits
/// well past the tolerance: the window is checked.
#[test]
fn negative_control_without_sliding_window() {
    let mut model = load();
    let mut spec = (*model.spec).clone();
    spec.sliding_window = 1 << 20;
    model.spec = Arc::new(spec);
    let w = worst(&model);
    eprintln!("no sliding window: max |Δlogit| {w}");
    assert!(w > 1e-2, "the sliding window went unnoticed: {w}");
}

/// So does dropping the sinks.
#[test]
fn negative_control_without_sinks() {
    let mut model = load();
    for l in &mut model.weights.layers {
        l.self_attn.sinks.iter_mut().for_each(|s| *s = -1e30);
    }
    let w = worst(&model);
    eprintln!("no sinks: max |Δlogit| {w}");
    assert!(w > 1e-2, "the sinks went unnoticed: {w}");
}
