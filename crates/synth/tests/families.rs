//! Every non-K3 preset, shrunk with the user's overrides (`--hidden`,
//! `--layers`, `--experts`, `--vocab`): the written checkpoint loads with
//! its family's loader (which checks every tensor against the family's
//! table), the forward pass is healthy (finite logits with clear top-1
//! margins, hidden states O(1), routing spread over the experts), the
//! released precision is what got loaded, and the bytes are a function of
//! the seed alone.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use fathom_model::experts::ExpertFormat;
use fathom_model::moe::Route;
use fathom_model::{DeepseekV3Model, GptOssModel, KimiLinearModel, Logits, Qwen3MoeModel, Tracer};
use fathom_synth::{Model, Overrides, Plan, Preset, WriteOptions, resolve, write_model};

fn out_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("synth-families")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Each preset at test size: (preset, hidden, layers, experts).
const CASES: [(&str, usize, usize, usize); 8] = [
    // 3 dense layers as released, then 2 MoE layers of 8 groups (top-4 groups).
    ("deepseek-v3", 128, 5, 16),
    ("kimi-k2", 128, 3, 64),
    ("kimi-k2-thinking", 128, 3, 16),
    ("qwen3-235b", 128, 2, 64),
    ("qwen3-30b", 256, 2, 16),
    ("gpt-oss-120b", 128, 2, 32),
    ("gpt-oss-20b", 64, 3, 8),
    // KDA, KDA, KDA, MLA; the first layer dense.
    ("kimi-linear", 128, 4, 16),
];

fn small(preset: &str, hidden: usize, layers: usize, experts: usize) -> Model {
    let o = Overrides {
        hidden: Some(hidden),
        layers: Some(layers),
        experts: Some(experts),
        vocab: Some(1280),
        ..Default::default()
    };
    resolve(Preset::from_name(preset).unwrap(), &o)
        .unwrap()
        .model
}

fn write(dir: &Path, model: &Model, seed: u64) {
    let plan = Plan::new(model, seed, fathom_synth::DEFAULT_SHARD_SIZE).unwrap();
    write_model(&plan, dir, &WriteOptions::default(), &|_| {}).unwrap();
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect()
}

/// RMS of every row of every layer's output, and the experts each MoE layer used.
#[derive(Default)]
struct Stats {
    hidden: usize,
    rms: BTreeMap<usize, Vec<f32>>,
    used: BTreeMap<usize, HashSet<u32>>,
}

impl Tracer for Stats {
    fn tensor(&mut self, layer: usize, name: &str, rows: &[f32]) {
        if name == "layer_out" {
            for r in rows.chunks(self.hidden) {
                let ms = r.iter().map(|x| x * x).sum::<f32>() / r.len() as f32;
                self.rms.entry(layer).or_default().push(ms.sqrt());
            }
        }
    }
    fn routes(&mut self, layer: usize, routes: &[Route]) {
        let used = self.used.entry(layer).or_default();
        routes.iter().for_each(|r| used.extend(&r.ids));
    }
}

/// Top-1 minus top-2 of a logit row, and the top-1 id.
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

/// Loads `dir` with the family's own model type and runs a traced prefill
/// then greedy steps: the logit rows of every pass and the expert format.
macro_rules! run_family {
    ($ty:ty, $dir:expr, $prompt:expr, $stats:expr) => {{
        let m = <$ty>::load($dir).unwrap();
        let format = m.expert_table.format;
        // Whether every expert is one read: its tensors adjacent (INT4's
        // 8-byte `weight_shape`s are the only gaps).
        let one_read = m
            .expert_table
            .layers
            .iter()
            .flatten()
            .all(|e| e.span().is_some_and(|(_, _, len)| len - e.bytes() <= 16));
        let mut st = m.new_state();
        let mut rows = vec![
            m.forward_traced(&mut st, $prompt, Logits::Last, Some($stats))
                .unwrap(),
        ];
        for _ in 0..8 {
            let (tok, _) = margin(rows.last().unwrap());
            rows.push(
                m.forward_traced(&mut st, &[tok], Logits::Last, None)
                    .unwrap(),
            );
        }
        (rows, format, one_read)
    }};
}

fn check_health(preset: &str, model: &Model, dir: &Path) {
    let n = (model.vocab_size() - 256) as u32;
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 389 + 7) % n).collect();
    let mut stats = Stats {
        hidden: model.hidden_size(),
        ..Default::default()
    };
    let s = &mut stats;
    let (rows, format, one_read) = match model {
        Model::DeepseekV3(_) => run_family!(DeepseekV3Model, dir, &prompt, s),
        Model::Qwen3Moe(_) => run_family!(Qwen3MoeModel, dir, &prompt, s),
        Model::GptOss(_) => run_family!(GptOssModel, dir, &prompt, s),
        Model::KimiLinear(_) => run_family!(KimiLinearModel, dir, &prompt, s),
        Model::K3(_) => unreachable!("K3 is covered by roundtrip.rs"),
    };
    // The released precision is what the loader found.
    let want = match preset {
        "deepseek-v3" | "kimi-k2" => ExpertFormat::Fp8 { block: [128, 128] },
        "kimi-k2-thinking" => ExpertFormat::Int4 { group: 32 },
        p if p.starts_with("gpt-oss") => ExpertFormat::Mxfp4Bias,
        _ => ExpertFormat::Bf16,
    };
    assert_eq!(format, want, "{preset}");
    // gpt-oss stacks each layer's experts: an expert is slices of several
    // tensors, as released.
    assert_eq!(one_read, !preset.starts_with("gpt-oss"), "{preset}");
    let all: Vec<f32> = stats.rms.values().flatten().copied().collect();
    let (lo, hi) = all
        .iter()
        .fold((f32::INFINITY, 0f32), |(a, b), &x| (a.min(x), b.max(x)));
    assert!(
        lo > 0.2 && hi < 30.0,
        "{preset}: layer output RMS {lo}..{hi}"
    );
    assert_eq!(stats.rms.len(), model.num_layers(), "{preset}");
    for (layer, used) in &stats.used {
        let frac = used.len() as f32 / model.num_experts() as f32;
        assert!(
            frac >= 0.75,
            "{preset}: layer {layer} used {frac:.2} of the experts"
        );
    }
    assert!(!stats.used.is_empty(), "{preset}: no MoE layer ran");
    let mut margins = Vec::new();
    for row in &rows {
        assert!(
            row.iter().all(|x| x.is_finite()),
            "{preset}: non-finite logit"
        );
        let mean = row.iter().sum::<f32>() / row.len() as f32;
        let sd = (row.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / row.len() as f32).sqrt();
        assert!(sd > 0.5, "{preset}: logits nearly equal (sd {sd})");
        let (_, m) = margin(row);
        assert!(m > 1e-3, "{preset}: top-1 margin {m}");
        margins.push(m);
    }
    eprintln!(
        "{preset}: layer RMS {lo:.2}..{hi:.2}, experts used per layer {:?}, margins {margins:.3?}",
        stats.used.values().map(HashSet::len).collect::<Vec<_>>()
    );
}

#[test]
fn every_family_loads_runs_healthy_and_is_reproducible() {
    for (preset, hidden, layers, experts) in CASES {
        let model = small(preset, hidden, layers, experts);
        let (a, b) = (
            out_dir(&format!("{preset}-a")),
            out_dir(&format!("{preset}-b")),
        );
        write(&a, &model, 7);
        check_health(preset, &model, &a);
        // Same seed, byte-identical files; the tokenizer loads.
        write(&b, &model, 7);
        let (fa, fb) = (files(&a), files(&b));
        // Shards, index, configs, tokenizer files and module, manifest.
        assert_eq!(fa.len(), 9, "{preset}: {:?}", fa.keys());
        assert!(fa == fb, "{preset}: same seed must give identical bytes");
        let tok = fathom_tokenizer::load_from_dir(&a).unwrap().unwrap();
        assert_eq!(tok.vocab_size(), 1280);
        for d in [a, b] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}

#[test]
fn another_seed_changes_the_weights_not_the_layout() {
    let model = small("kimi-k2-thinking", 64, 2, 8);
    let (a, b) = (out_dir("seed-a"), out_dir("seed-b"));
    write(&a, &model, 1);
    write(&b, &model, 2);
    let (fa, fb) = (files(&a), files(&b));
    assert_eq!(fa["config.json"], fb["config.json"]);
    assert_eq!(
        fa["model.safetensors.index.json"],
        fb["model.safetensors.index.json"]
    );
    let shard = "model-00002-of-000002.safetensors";
    assert_ne!(fa[shard], fb[shard]);
    // Headers equal: the first 8 bytes give the header length.
    let n = 8 + u64::from_le_bytes(fa[shard][..8].try_into().unwrap()) as usize;
    assert_eq!(fa[shard][..n], fb[shard][..n]);
}
