//! The Kimi-Linear forward pass against an independent fp32 reference's
//! golden data (`tests/data/kimi_linear-tiny`: config, weights and golden
//! files copied unchanged from shared/fixtures/kimi_linear-tiny): last-position, prefill and
//! cached-decode logits, greedy continuations, per-layer routing (group
//! limited) and hidden-state norms; then batched = solo, chunked = one pass
//! (across the KDA state and the latent cache) and the state contract.

mod common;

// A K3 state is refused by its magic even where the layouts agree.
common::family_golden_tests!(
    fathom_model::kimi_linear::KimiLinear,
    "kimi_linear-tiny",
    "Kimi-Linear",
    b"K3ST",
    7
);

/// The fixture's routing depends on the group limit: without it some
/// position picks another expert set, and the logits move.
#[test]
fn negative_control_without_group_limit() {
    let mut model = load();
    let mut spec = (*model.spec).clone();
    (spec.num_expert_group, spec.topk_group) = (1, 1);
    model.spec = Arc::new(spec);
    let worst = worst(&model);
    eprintln!("no group limit: max |Δlogit| {worst}");
    assert!(worst > 1e-2, "the group limit went unnoticed: {worst}");
}
