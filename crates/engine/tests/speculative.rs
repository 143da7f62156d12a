//! Drafting never changes output: for every proposal length 1..8 and for
//! drafts that are all wrong, all right, and right-then-wrong, the tokens
//! equal plain greedy decoding's — resident and streamed under a budget that
//! caches nothing.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use fathom_engine::{
    DraftOptions, Drafter, ModelDrafter, NgramDrafter, Request, SamplingParams, generate,
};
use fathom_model::{CausalLm, LoadOptions, Result, SeqState};
use fathom_stream::{StreamConfig, StreamedExperts};

type Lm = Arc<dyn CausalLm>;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/k3-tiny/checkpoint")
}

fn load(dir: &std::path::Path) -> Lm {
    fathom_model::load(dir, LoadOptions::default()).unwrap()
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
    fn propose(&mut self, ctx: &[u32], k: usize, _: &dyn SeqState) -> Result<Vec<u32>> {
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

fn sampled(temperature: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p: 0.95,
        seed: 7,
        ..Default::default()
    }
}

fn run(
    m: &Lm,
    prompt: &[u32],
    n: usize,
    sp: &SamplingParams,
    d: Option<(Box<dyn Drafter>, DraftOptions)>,
) -> (Vec<u32>, Option<fathom_engine::DraftStats>) {
    let mut req = Request::new(prompt.to_vec(), n);
    req.sampling = sp.clone();
    if let Some((d, o)) = d {
        req.drafter = Some(d);
        req.draft = o;
    }
    let f = generate(m, req, None, |_| ControlFlow::Continue(())).unwrap();
    (f.output_ids, f.draft)
}

fn plain(model: &Lm, prompt: &[u32], n: usize) -> Vec<u32> {
    run(model, prompt, n, &SamplingParams::default(), None).0
}

fn drafted(
    model: &Lm,
    prompt: &[u32],
    n: usize,
    d: Box<dyn Drafter>,
    k: usize,
    adaptive: bool,
) -> Vec<u32> {
    drafted_with(model, prompt, n, d, k, adaptive, &SamplingParams::default())
}

fn drafted_with(
    model: &Lm,
    prompt: &[u32],
    n: usize,
    d: Box<dyn Drafter>,
    k: usize,
    adaptive: bool,
    sp: &SamplingParams,
) -> Vec<u32> {
    let opts = DraftOptions { max_k: k, adaptive };
    run(model, prompt, n, sp, Some((d, opts))).0
}

fn check_all_lengths(model: &Lm, prompt: &[u32], n: usize) {
    check_all_lengths_with(model, prompt, n, &SamplingParams::default());
}

/// Drafts of every length, right and wrong, under `sp`: always what
/// decoding without drafts gives for the same seed.
fn check_all_lengths_with(model: &Lm, prompt: &[u32], n: usize, sp: &SamplingParams) {
    // Truth with room for the lookahead of the last round.
    let truth = run(model, prompt, n + 8, sp, None).0;
    let want = truth[..n].to_vec();
    let vocab = model.info().vocab_size as u32;
    for k in 1..=8 {
        for right in [0, k, k / 2] {
            let d = Box::new(Scripted {
                prompt_len: prompt.len(),
                truth: truth.clone(),
                right,
                vocab,
            });
            assert_eq!(
                drafted_with(model, prompt, n, d, k, false, sp),
                want,
                "k {k}, {right} right"
            );
        }
        assert_eq!(
            drafted_with(
                model,
                prompt,
                n,
                Box::new(NgramDrafter::default()),
                k,
                false,
                sp
            ),
            want,
            "ngram k {k}"
        );
    }
    assert_eq!(
        drafted_with(
            model,
            prompt,
            n,
            Box::new(NgramDrafter::default()),
            8,
            true,
            sp
        ),
        want,
        "ngram adaptive"
    );
}

#[test]
fn k3_tiny_drafting_is_exact() {
    let m = load(&tiny());
    check_all_lengths(&m, &[1, 591, 25, 203, 739], 20);
}

#[test]
fn k3_tiny_drafting_under_sampling_gives_the_same_sample() {
    let m = load(&tiny());
    for t in [0.7, 1.0, 1.5] {
        let sp = sampled(t);
        // The seed matters (otherwise this test could not fail).
        let other = SamplingParams {
            seed: 8,
            ..sp.clone()
        };
        let prompt = [1, 591, 25, 203, 739];
        assert_ne!(
            run(&m, &prompt, 20, &sp, None).0,
            run(&m, &prompt, 20, &other, None).0
        );
        check_all_lengths_with(&m, &prompt, 16, &sp);
    }
}

#[test]
fn k3_tiny_streamed_with_no_cache_drafting_is_exact() {
    let resident = load(&tiny());
    let prompt = [1, 119, 686, 809, 842];
    let want = plain(&resident, &prompt, 16);
    let opts = LoadOptions {
        experts: Some(Box::new(|ck, table| {
            let cfg = StreamConfig::new(table.top_k, 0);
            Ok(Arc::new(StreamedExperts::new(ck, table, &cfg)?))
        })),
        ..Default::default()
    };
    let m = fathom_model::load(&tiny(), opts).unwrap();
    for k in [1, 3, 8] {
        assert_eq!(
            drafted(&m, &prompt, 16, Box::new(NgramDrafter::default()), k, false),
            want,
            "k {k}"
        );
        let truth = plain(&resident, &prompt, 24);
        let d = Box::new(Scripted {
            prompt_len: prompt.len(),
            truth,
            right: k,
            vocab: 1024,
        });
        assert_eq!(drafted(&m, &prompt, 16, d, k, false), want, "oracle k {k}");
    }
}

#[test]
fn k3_code_small_with_its_draft_model_is_exact() {
    let (Some(target), Some(draft)) = (shared("k3-code-small"), shared("k3-code-draft")) else {
        eprintln!("skipped: shared/models/k3-code-{{small,draft}} are not beside the repository");
        return;
    };
    let t = load(&target);
    let dm = load(&draft);
    let vocab = t.info().vocab_size;
    // `[BOS]while True:\n`-like code prompt from the model's tokenizer space.
    let prompt = [8192, 886, 970, 198, 886, 970];
    let want = plain(&t, &prompt, 24);
    for k in [1, 2, 4, 8] {
        let d = Box::new(ModelDrafter::new(dm.clone(), vocab).unwrap());
        assert_eq!(
            drafted(&t, &prompt, 24, d, k, false),
            want,
            "draft model k {k}"
        );
    }
    let d = Box::new(ModelDrafter::new(dm.clone(), vocab).unwrap());
    let (got, s) = run(
        &t,
        &prompt,
        24,
        &SamplingParams::default(),
        Some((d, DraftOptions::default())),
    );
    assert_eq!(got, want);
    let s = s.unwrap();
    assert!(
        s.accepted > 0,
        "the distilled draft should get some tokens right: {s:?}"
    );
    check_all_lengths(&t, &prompt, 12);
    // Sampled: the draft model proposes, the full model's sample decides.
    let sp = sampled(0.8);
    let want = run(&t, &prompt, 24, &sp, None).0;
    let d = Box::new(ModelDrafter::new(dm, vocab).unwrap());
    let opts = DraftOptions {
        max_k: 4,
        adaptive: false,
    };
    assert_eq!(run(&t, &prompt, 24, &sp, Some((d, opts))).0, want);
}

/// Fails every proposal.
struct Broken;

impl Drafter for Broken {
    fn propose(&mut self, _: &[u32], _: usize, _: &dyn SeqState) -> Result<Vec<u32>> {
        Err(fathom_model::ModelError::Unsupported(
            "broken drafter".into(),
        ))
    }
    fn name(&self) -> String {
        "broken".into()
    }
}

/// A drafter that fails costs speed, never the sequence: decoding goes on
/// without it and gives the plain tokens.
#[test]
fn a_failing_drafter_is_dropped_not_fatal() {
    let m = load(&tiny());
    let prompt = [1, 119, 686, 809, 842];
    let want = plain(&m, &prompt, 12);
    assert_eq!(drafted(&m, &prompt, 12, Box::new(Broken), 3, false), want);
}
