//! Synthetic checkpoints end to end: written, loaded by the real model,
//! numerically healthy, deterministic, and safe to interrupt.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use fathom_model::kimi_k3::moe::Route;
use fathom_model::{K3Model, Logits, Tracer};
use fathom_synth::{Dims, Plan, WriteOptions, write_model};

fn out_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("synth-tests")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn synth(dir: &Path, dims: &Dims, seed: u64, opts: &WriteOptions) {
    let plan = Plan::new(dims, seed, fathom_synth::DEFAULT_SHARD_SIZE).unwrap();
    write_model(&plan, dir, opts, &|_| {}).unwrap();
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// Per-layer RMS of the mixed hidden state entering each FFN, and routes.
#[derive(Default)]
struct Stats {
    rms: BTreeMap<usize, Vec<f32>>,
    used: BTreeMap<usize, HashSet<u32>>,
}

impl Tracer for Stats {
    fn tensor(&mut self, layer: usize, name: &str, rows: &[f32]) {
        if name == "mlp_in" {
            let ms = rows.iter().map(|x| x * x).sum::<f32>() / rows.len() as f32;
            self.rms.entry(layer).or_default().push(ms.sqrt());
        }
    }
    fn routes(&mut self, layer: usize, routes: &[Route]) {
        let used = self.used.entry(layer).or_default();
        routes.iter().for_each(|r| used.extend(&r.ids));
    }
}

/// Top-1 minus top-2 of a logit row.
fn margin(logits: &[f32]) -> (u32, f32) {
    let (mut b1, mut b2, mut id) = (f32::NEG_INFINITY, f32::NEG_INFINITY, 0);
    for (i, &v) in logits.iter().enumerate() {
        if v > b1 {
            (b2, b1, id) = (b1, v, i as u32);
        } else if v > b2 {
            b2 = v;
        }
    }
    (id, b1 - b2)
}

/// The conditioning claims of `init.rs`, checked with the real forward pass.
fn check_conditioning(dims: &Dims, name: &str) {
    let dir = out_dir(name);
    synth(&dir, dims, 42, &WriteOptions::default());
    let model = K3Model::load(&dir).unwrap();
    // 64 distinct, spread-out prompt tokens (specials excluded).
    let n = (dims.vocab_size - 256) as u32;
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 389 + 7) % n).collect();
    let mut stats = Stats::default();
    let mut state = model.new_state();
    let logits = model
        .forward_traced(&mut state, &prompt, Logits::Last, Some(&mut stats))
        .unwrap();
    let all: Vec<f32> = stats.rms.values().flatten().copied().collect();
    let lo = all.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = all.iter().copied().fold(0.0, f32::max);
    let least = stats.used.values().map(HashSet::len).min().unwrap_or(0);
    eprintln!("{name}: hidden RMS {lo:.3}..{hi:.3}, fewest experts used in a layer {least}");
    for (layer, rms) in &stats.rms {
        for r in rms {
            assert!(
                (0.2..20.0).contains(r),
                "{name}: layer {layer} hidden RMS {r}"
            );
        }
    }
    for (layer, used) in &stats.used {
        let frac = used.len() as f32 / dims.num_experts as f32;
        assert!(
            frac >= 0.75,
            "{name}: layer {layer} used {frac:.2} of the experts"
        );
    }
    assert_eq!(stats.used.len(), dims.num_layers - 1);
    // Greedy steps: never a near-tie at the top.
    let (mut tok, m) = margin(&logits);
    assert!(m > 1e-3, "{name}: prefill margin {m}");
    let mut margins = vec![m];
    for step in 0..8 {
        let l = model.forward(&mut state, &[tok], Logits::Last).unwrap();
        let (t, m) = margin(&l);
        assert!(m > 1e-3, "{name}: step {step} margin {m}");
        margins.push(m);
        tok = t;
    }
    eprintln!("{name}: top-1 margins {margins:.3?}");
}

#[test]
fn tiny_is_well_conditioned() {
    check_conditioning(&Dims::tiny(), "cond-tiny");
}

#[test]
fn more_experts_are_still_spread() {
    let mut d = Dims::tiny();
    d.num_experts = 96;
    d.top_k = 8;
    d.num_layers = 5;
    check_conditioning(&d, "cond-96");
}

#[test]
fn loads_generates_and_ships_a_working_tokenizer() {
    let dir = out_dir("roundtrip");
    let dims = Dims::tiny();
    synth(&dir, &dims, 1, &WriteOptions::default());
    let model = K3Model::load(&dir).unwrap();
    assert_eq!(model.spec.eos_token_id, Some(1026));
    let lm: std::sync::Arc<dyn fathom_model::CausalLm> = std::sync::Arc::new(model);
    let out = fathom_engine::greedy(&lm, &[5, 300, 17], 6, &[]).unwrap();
    assert_eq!(out.len(), 6);

    let tok = fathom_tokenizer::load_from_dir(&dir).unwrap().unwrap();
    assert_eq!(tok.vocab_size(), dims.vocab_size);
    assert_eq!(tok.special_id("<|end_of_msg|>"), Some(1026));
    assert_eq!(tok.special_id("[PAD]"), Some(1279));
    let text = "The model is in the state, and the people were there.";
    let ids = tok.encode(text);
    assert!(ids.len() < text.len() / 2, "merges apply: {ids:?}");
    assert_eq!(tok.decode(&ids), text);
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let dims = Dims::tiny();
    let (a, b, c) = (out_dir("det-a"), out_dir("det-b"), out_dir("det-c"));
    synth(&a, &dims, 7, &WriteOptions::default());
    // Small buffers cut tensors at other places: the bytes must not change.
    let small = WriteOptions {
        buffer_size: 1 << 16,
        ..Default::default()
    };
    synth(&b, &dims, 7, &small);
    synth(&c, &dims, 8, &WriteOptions::default());
    let (fa, fb, fc) = (files(&a), files(&b), files(&c));
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    assert!(fa == fb, "same seed must give byte-identical files");
    let shard = "model-00001-of-000002.safetensors";
    assert_ne!(fa[shard], fc[shard]);
    assert_eq!(fa["config.json"], fc["config.json"]);
}

#[test]
fn interrupted_write_leaves_nothing_that_looks_complete() {
    let dims = Dims::tiny();
    let plan = Plan::new(&dims, 3, fathom_synth::DEFAULT_SHARD_SIZE).unwrap();
    let dir = out_dir("interrupted");
    let opts = WriteOptions {
        buffer_size: 1 << 16,
        fail_after_bytes: Some(plan.file_bytes() * 3 / 4),
        ..Default::default()
    };
    let err = write_model(&plan, &dir, &opts, &|_| {}).unwrap_err();
    assert!(err.to_string().contains("injected failure"), "{err}");
    for name in files(&dir).keys() {
        assert!(
            name.starts_with('.') && name.ends_with(".partial") || name.starts_with("tok"),
            "an interrupted run left {name}"
        );
        assert!(
            !name.ends_with(".safetensors") && !name.ends_with(".json"),
            "{name}"
        );
    }
    // A re-run (no --force needed: there is no model yet) completes.
    write_model(&plan, &dir, &WriteOptions::default(), &|_| {}).unwrap();
    let fs = files(&dir);
    assert!(
        fs.keys().all(|n| !n.ends_with(".partial")),
        "{:?}",
        fs.keys()
    );
    assert!(K3Model::load(&dir).is_ok());
    // And an existing model is not overwritten without force.
    let e = write_model(&plan, &dir, &WriteOptions::default(), &|_| {}).unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    let force = WriteOptions {
        force: true,
        ..Default::default()
    };
    write_model(&plan, &dir, &force, &|_| {}).unwrap();
}
