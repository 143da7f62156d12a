//! `--draft mtp`: the checkpoint's own multi-token-prediction layer as a
//! drafter (DeepSeek-V3 / Kimi K2).
//!
//! The fixtures carry no MTP layer, so the tests write one into a copy of
//! deepseek_v3-tiny (layer 3's weights under index 4, plus `enorm`,
//! `hnorm`, `eh_proj` and the shared head):
//! * wiring: with `eh_proj = [0 | I]` and the layer's outputs zeroed, the
//!   layer passes `hnorm(h_j)` through, so its guess is the decoder's own
//!   argmax at `j` — the drafter must propose the committed token again;
//!   with `eh_proj = [I | 0]` (the embedding half) it must not;
//! * exactness: with a working layer, drafted output equals plain decoding,
//!   greedy and sampled, resident and streamed through an empty cache.

#[path = "../../model/tests/qcommon/mod.rs"]
mod qcommon;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fathom_engine::{DraftOptions, Drafter, MtpDrafter, Request, SamplingParams, generate};
use fathom_model::{CausalLm, LoadOptions, Logits};
use fathom_stream::{StreamConfig, StreamedExperts};
use qcommon::{Mix, with_mtp};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/deepseek_v3-tiny")
}

fn load(dir: &Path, mtp: bool, stream: bool) -> Arc<dyn CausalLm> {
    let mut opts = LoadOptions {
        mtp,
        ..Default::default()
    };
    if stream {
        opts.experts = Some(Box::new(|ck, table| {
            let cfg = StreamConfig::new(table.top_k, 0);
            Ok(Arc::new(StreamedExperts::new(ck, table, &cfg)?))
        }));
    }
    fathom_model::load(dir, opts).unwrap()
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

const PROMPT: [u32; 7] = [1, 5, 9, 2, 7, 3, 8];

/// The drafter's proposals after the prompt and its greedy next token.
fn proposals(m: &Arc<dyn CausalLm>, k: usize) -> (u32, Vec<u32>) {
    let mut st = m.new_state();
    let logits = m.forward(st.as_mut(), &PROMPT, Logits::Last).unwrap();
    let next = argmax(&logits);
    let mut ctx = PROMPT.to_vec();
    ctx.push(next);
    let mut d = MtpDrafter::new(m.clone()).unwrap();
    (next, d.propose(&ctx, k, st.as_ref()).unwrap())
}

#[test]
fn the_layer_reads_the_heads_rows_and_the_next_token() {
    let hidden = with_mtp(&fixture(), "hidden", Mix::Hidden);
    let (next, p) = proposals(&load(&hidden, true, false), 3);
    assert_eq!(
        p,
        vec![next; 3],
        "hnorm(h_j) passed through guesses the decoder's token"
    );
    let emb = with_mtp(&fixture(), "embedding", Mix::Embedding);
    let (_, q) = proposals(&load(&emb, true, false), 3);
    assert_ne!(
        q, p,
        "the embedding half must not give the hidden half's guess"
    );
    let _ = (
        std::fs::remove_dir_all(&hidden),
        std::fs::remove_dir_all(&emb),
    );
}

fn run(m: &Arc<dyn CausalLm>, n: usize, sp: &SamplingParams, k: Option<usize>) -> Vec<u32> {
    run_on(m, &PROMPT, n, sp, k)
}

fn run_on(
    m: &Arc<dyn CausalLm>,
    prompt: &[u32],
    n: usize,
    sp: &SamplingParams,
    k: Option<usize>,
) -> Vec<u32> {
    let mut req = Request::new(prompt.to_vec(), n);
    req.sampling = sp.clone();
    if let Some(k) = k {
        req.drafter = Some(Box::new(MtpDrafter::new(m.clone()).unwrap()) as Box<dyn Drafter>);
        req.draft = DraftOptions {
            max_k: k,
            adaptive: false,
        };
    }
    let f = generate(m, req, None, |_| ControlFlow::Continue(())).unwrap();
    assert_eq!(f.draft.is_some(), k.is_some());
    if let Some(s) = &f.draft {
        assert_eq!(s.drafter, "mtp");
        assert!(s.proposed > 0, "the drafter proposed nothing: {s:?}");
    }
    f.output_ids
}

#[test]
fn drafting_with_the_mtp_layer_never_changes_the_output() {
    let dir = with_mtp(&fixture(), "working", Mix::Working);
    let plain_model = load(&dir, false, false);
    let greedy = SamplingParams::default();
    let sampled = SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: 11,
        ..Default::default()
    };
    for sp in [&greedy, &sampled] {
        let want = run(&plain_model, 16, sp, None);
        for stream in [false, true] {
            let m = load(&dir, true, stream);
            for k in [1, 2, 4] {
                assert_eq!(run(&m, 16, sp, Some(k)), want, "k {k}, streamed {stream}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn families_and_checkpoints_without_the_layer_are_refused() {
    let plain = fixture();
    let opts = LoadOptions {
        mtp: true,
        ..Default::default()
    };
    let e = fathom_model::load(&plain, opts).err().unwrap().to_string();
    assert!(
        e.contains("num_nextn_predict_layers") && e.contains("--draft ngram"),
        "{e}"
    );
    let k3 =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/k3-tiny/checkpoint");
    let opts = LoadOptions {
        mtp: true,
        ..Default::default()
    };
    let e = fathom_model::load(&k3, opts).err().unwrap().to_string();
    assert!(e.contains("--draft mtp") && e.contains("Kimi K3"), "{e}");
    let e = MtpDrafter::new(load(&plain, false, false))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("without a multi-token-prediction layer"), "{e}");
}

/// A prompt longer than the hidden rows a state keeps (`TAP_ROWS`): the
/// drafter starts from the rows it has, and the output is still exact.
#[test]
fn a_prompt_longer_than_the_tap_is_exact() {
    let dir = with_mtp(&fixture(), "long", Mix::Working);
    let prompt: Vec<u32> = (0..fathom_model::deepseek_v3::mtp::TAP_ROWS as u32 + 90)
        .map(|i| (i * 37 + 11) % 4000)
        .collect();
    let greedy = SamplingParams::default();
    let want = run_on(&load(&dir, false, false), &prompt, 10, &greedy, None);
    let got = run_on(&load(&dir, true, false), &prompt, 10, &greedy, Some(3));
    assert_eq!(got, want);
    let _ = std::fs::remove_dir_all(&dir);
}
