//! Streaming never changes output: identical tokens and bit-identical logits
//! to the fully resident model, for cache sizes down to zero (every expert
//! re-read on every use), with and without prefetch, any I/O thread count.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fathom_engine::greedy;
use fathom_model::kimi_k3::tensors::expert_bytes;
use fathom_model::{CausalLm, K3Model, Logits};
use fathom_stream::{StreamConfig, StreamedExperts};

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/k3-tiny/checkpoint")
}

fn code_small() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/k3-code-small");
    p.join("config.json").is_file().then_some(p)
}

fn streamed(dir: &Path, cache: usize, prefetch: bool, threads: usize) -> Arc<K3Model> {
    let make: fathom_model::registry::MakeSource = Box::new(move |ck, table| {
        let mut cfg = StreamConfig::new(table.top_k, cache);
        cfg.prefetch = prefetch;
        cfg.io_threads = threads;
        Ok(Arc::new(StreamedExperts::new(ck, table, &cfg)?))
    });
    Arc::new(K3Model::load_with(dir, make).unwrap())
}

fn run(model: &Arc<K3Model>, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let lm: Arc<dyn CausalLm> = model.clone();
    let out = greedy(&lm, prompt, n, &[]).unwrap();
    let mut st = model.new_state();
    let mut seq = prompt.to_vec();
    seq.extend(&out);
    let logits = model.forward(&mut st, &seq, Logits::All).unwrap();
    (out, logits)
}

fn check(dir: &Path, prompt: &[u32], n: usize, caches: &[usize]) {
    let resident = Arc::new(K3Model::load(dir).unwrap());
    let want = run(&resident, prompt, n);
    for &cache in caches {
        for (prefetch, threads) in [(false, 1), (true, 4)] {
            let m = streamed(dir, cache, prefetch, threads);
            let got = run(&m, prompt, n);
            assert_eq!(
                got.0, want.0,
                "tokens differ: cache {cache}, prefetch {prefetch}, {threads} threads"
            );
            assert!(
                got.1 == want.1,
                "logits differ: cache {cache}, prefetch {prefetch}, {threads} threads"
            );
            let s = m.experts.stats();
            assert_eq!(s.hits + s.misses, s.requested);
            if cache == 0 {
                assert_eq!(s.hits, 0, "a zero cache cannot hit");
                // Every request was a read of at least one expert's bytes.
                assert!(s.bytes_read >= s.misses * expert_bytes(&m.spec));
            }
        }
    }
}

#[test]
fn k3_tiny_streamed_equals_resident() {
    // 8 MoE layers × 32 experts = 256: 0 (minimum), 3 (< top-k), 40, all.
    check(&tiny(), &[1, 591, 25, 203, 739], 12, &[0, 3, 40, 256]);
}

#[test]
fn k3_code_small_streamed_equals_resident() {
    let Some(dir) = code_small() else {
        eprintln!("skipped: shared/models/k3-code-small is not beside the repository");
        return;
    };
    // `[BOS]import os\n` is one of the model's golden prompts.
    let prompt = [8192, 886, 970, 198];
    check(&dir, &prompt, 8, &[0, 50]);
}

#[test]
fn each_expert_is_one_read() {
    for dir in [Some(tiny()), code_small()].into_iter().flatten() {
        let m = K3Model::load(&dir).unwrap();
        for l in m.spec.moe_layers() {
            for (e, loc) in m.expert_table.layers[l].iter().enumerate() {
                let (_, _, len) = loc
                    .span()
                    .unwrap_or_else(|| panic!("layer {l} expert {e}: tensors not adjacent"));
                assert_eq!(
                    len,
                    loc.bytes(),
                    "layer {l} expert {e}: gap inside the span"
                );
            }
        }
    }
}

#[test]
fn cache_hits_on_repeat_and_prefetch_is_scored() {
    let slot = Arc::new(std::sync::OnceLock::new());
    let s2 = slot.clone();
    let m = K3Model::load_with(
        &tiny(),
        Box::new(move |ck, table| {
            let s = Arc::new(StreamedExperts::new(
                ck,
                table,
                &StreamConfig::new(table.top_k, 256),
            )?);
            let _ = s2.set(s.clone());
            Ok(s)
        }),
    )
    .unwrap();
    let m = Arc::new(m);
    let store = slot.get().unwrap().clone();
    let prompt = [1, 591, 25, 203, 739];
    run(&m, &prompt, 4);
    // Let the first run's last prefetches land before taking the baseline.
    store.drain();
    let first = m.experts.stats();
    run(&m, &prompt, 4);
    store.drain();
    let second = m.experts.stats().since(&first);
    assert_eq!(second.misses, 0, "everything is cached the second time");
    assert_eq!(second.hits, second.requested);
    // Reads in the second run can only be prefetches of wrong guesses.
    let per =
        fathom_stream::budget::expert_ram_bytes(&fathom_model::kimi_k3::memory_facts(&m.spec));
    assert!(
        second.bytes_read <= (second.hinted - second.hinted_used) * per,
        "{second:?}"
    );
    assert!(first.hinted > 0 && first.hinted_used <= first.hinted);
}

#[test]
fn synth_model_streamed_equals_resident() {
    // A synthetic model in the released layout with many experts (so a small
    // cache really evicts), written fresh for this test.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("stream-synth");
    let _ = std::fs::remove_dir_all(&dir);
    let mut dims = fathom_synth::Dims::tiny();
    dims.num_experts = 96;
    dims.top_k = 8;
    dims.num_layers = 5;
    let plan = fathom_synth::Plan::new(&dims, 11, fathom_synth::DEFAULT_SHARD_SIZE).unwrap();
    fathom_synth::write_model(&plan, &dir, &fathom_synth::WriteOptions::default(), &|_| {})
        .unwrap();
    check(&dir, &[5, 17, 400, 23, 99, 1000], 10, &[0, 12, 4 * 96]);
    std::fs::remove_dir_all(&dir).unwrap();
}
