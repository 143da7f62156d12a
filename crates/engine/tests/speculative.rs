//! Drafting never changes output: for every proposal length 1..8 and for
//! drafts that are all wrong, all right, and right-then-wrong, the tokens
//! equal plain greedy decoding's — resident and streamed under a budget that
//! caches nothing.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use fathom_engine::{DraftOptions, Drafter, ModelDrafter, NgramDrafter, greedy, speculative};
use fathom_model::{K3Model, Result};
use fathom_stream::{StreamConfig, StreamedExperts};

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/k3-tiny/checkpoint")
}

fn shared(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/models")
        .join(name);
    p.join("config.json").is_file().then_some(p)
}

/// Proposes the true greedy continuation, corrupted from position `right` on.
struct Scripted {
    prompt_len: usize,
    truth: Vec<u32>,
    right: usize,
    vocab: u32,
}

impl Drafter for Scripted {
    fn propose(&mut self, ctx: &[u32], k: usize) -> Result<Vec<u32>> {
        let done = ctx.len() - self.prompt_len;
        Ok((0..k)
            .filter_map(|i| {
                self.truth.get(done + i).map(|&t| {
                    if i < self.right {
                        t
                    } else {
                        (t + 1 + i as u32) % self.vocab
                    }
                })
            })
            .collect())
    }
    fn name(&self) -> String {
        format!("scripted({} right)", self.right)
    }
}

fn plain(model: &K3Model, prompt: &[u32], n: usize) -> Vec<u32> {
    greedy(model, prompt, n, &[], |_| ControlFlow::Continue(()))
        .unwrap()
        .output_ids
}

fn drafted(
    model: &K3Model,
    prompt: &[u32],
    n: usize,
    d: &mut dyn Drafter,
    k: usize,
    adaptive: bool,
) -> Vec<u32> {
    let opts = DraftOptions { max_k: k, adaptive };
    speculative(
        model,
        prompt,
        n,
        &[],
        d,
        opts,
        |_| ControlFlow::Continue(()),
    )
    .unwrap()
    .0
    .output_ids
}

fn check_all_lengths(model: &K3Model, prompt: &[u32], n: usize) {
    // Truth with room for the lookahead of the last round.
    let truth = plain(model, prompt, n + 8);
    let want = truth[..n].to_vec();
    let vocab = model.spec.vocab_size as u32;
    for k in 1..=8 {
        for right in [0, k, k / 2] {
            let mut d = Scripted {
                prompt_len: prompt.len(),
                truth: truth.clone(),
                right,
                vocab,
            };
            assert_eq!(
                drafted(model, prompt, n, &mut d, k, false),
                want,
                "k {k}, {right} right"
            );
        }
        assert_eq!(
            drafted(model, prompt, n, &mut NgramDrafter::default(), k, false),
            want,
            "ngram k {k}"
        );
    }
    assert_eq!(
        drafted(model, prompt, n, &mut NgramDrafter::default(), 8, true),
        want,
        "ngram adaptive"
    );
}

#[test]
fn k3_tiny_drafting_is_exact() {
    let m = K3Model::load(&tiny()).unwrap();
    check_all_lengths(&m, &[1, 591, 25, 203, 739], 20);
}

#[test]
fn k3_tiny_streamed_with_no_cache_drafting_is_exact() {
    let resident = K3Model::load(&tiny()).unwrap();
    let prompt = [1, 119, 686, 809, 842];
    let want = plain(&resident, &prompt, 16);
    let m = K3Model::load_with(&tiny(), |spec, ck, table| {
        Ok(Arc::new(StreamedExperts::new(
            spec,
            ck,
            table,
            &StreamConfig::new(spec, 0),
        )?))
    })
    .unwrap();
    for k in [1, 3, 8] {
        assert_eq!(
            drafted(&m, &prompt, 16, &mut NgramDrafter::default(), k, false),
            want,
            "k {k}"
        );
        let truth = plain(&resident, &prompt, 24);
        let mut d = Scripted {
            prompt_len: prompt.len(),
            truth,
            right: k,
            vocab: 1024,
        };
        assert_eq!(
            drafted(&m, &prompt, 16, &mut d, k, false),
            want,
            "oracle k {k}"
        );
    }
}

#[test]
fn k3_code_small_with_its_draft_model_is_exact() {
    let (Some(target), Some(draft)) = (shared("k3-code-small"), shared("k3-code-draft")) else {
        eprintln!("skipped: shared/models/k3-code-{{small,draft}} are not beside the repository");
        return;
    };
    let t = K3Model::load(&target).unwrap();
    let dm = K3Model::load(&draft).unwrap();
    // `[BOS]while True:\n`-like code prompt from the model's tokenizer space.
    let prompt = [8192, 886, 970, 198, 886, 970];
    let want = plain(&t, &prompt, 24);
    for k in [1, 2, 4, 8] {
        let mut d = ModelDrafter::new(&dm, t.spec.vocab_size).unwrap();
        assert_eq!(
            drafted(&t, &prompt, 24, &mut d, k, false),
            want,
            "draft model k {k}"
        );
    }
    let mut d = ModelDrafter::new(&dm, t.spec.vocab_size).unwrap();
    let (g, s) = speculative(
        &t,
        &prompt,
        24,
        &[],
        &mut d,
        DraftOptions::default(),
        |_| ControlFlow::Continue(()),
    )
    .unwrap();
    assert_eq!(g.output_ids, want);
    assert!(
        s.accepted > 0,
        "the distilled draft should get some tokens right: {s:?}"
    );
    check_all_lengths(&t, &prompt, 12);
}
