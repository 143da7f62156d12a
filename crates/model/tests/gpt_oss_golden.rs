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

common::family_golden_tests!(
    fathom_model::gpt_oss::GptOss,
    "gpt_oss-tiny",
    "GPT-OSS",
    b"Q3ST",
    6
);

/// Past two cache blocks the sliding layers start reading mid-cache: still
/// the one-pass bits however the prompt is chunked.
#[test]
fn long_chunked_prefill_equals_one_pass_bitwise() {
    let prompt: Vec<u32> = (0..600u32).map(|i| (i * 7919 + 11) % 4096).collect();
    common::assert_chunked_equals_one_pass(&load(), &prompt);
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
    for (_, l) in model.weights.layers.resident_mut() {
        l.self_attn.sinks.iter_mut().for_each(|s| *s = -1e30);
    }
    let w = worst(&model);
    eprintln!("no sinks: max |Δlogit| {w}");
    assert!(w > 1e-2, "the sinks went unnoticed: {w}");
}
