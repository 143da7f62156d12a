//! `fathom synth`, `inspect` and `verify` end to end on small models.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fathom(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args(args)
        .output()
        .expect("fathom runs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn tmp(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("cli-synth")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A tiny synthetic model written through the CLI.
fn synth_tiny(name: &str) -> PathBuf {
    let dir = tmp(name);
    let o = fathom(&[
        "synth",
        "--preset",
        "tiny",
        "--seed",
        "5",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    dir
}

const SHARD2: &str = "model-00002-of-000002.safetensors";

#[test]
fn synth_then_verify_ok_with_digest() {
    let dir = synth_tiny("ok");
    let o = fathom(&["verify", dir.to_str().unwrap(), "--digest"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    // synth writes SHA256SUMS (2 shards, tokenizer files and module, configs,
    // index); every file matches it.
    assert!(
        out.lines().any(
            |l| l.ends_with(&format!("  {SHARD2}  ok")) && l.len() == 64 + 2 + SHARD2.len() + 4
        ),
        "{out}"
    );
    assert_eq!(
        out.lines().last().unwrap(),
        "ok: 2 shards, 1770 tensors, 7.27 MB, 8 files match the manifest"
    );
    // Without --force an existing model is kept.
    let o = fathom(&["synth", "--preset", "tiny", "--out", dir.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--force"), "{}", text(&o));
}

#[test]
fn verify_names_the_file_and_tensor_of_a_truncated_shard() {
    let dir = synth_tiny("truncated");
    let shard = dir.join(SHARD2);
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let o = fathom(&["verify", dir.to_str().unwrap()]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("FAILED") && t.contains(SHARD2), "{t}");
    assert!(t.contains("tensor language_model.lm_head.weight"), "{t}");
}

#[test]
fn verify_names_a_tensor_with_a_wrong_shape() {
    let dir = synth_tiny("shape");
    // Transpose the embedding's shape in the header: same byte count, so
    // only the tensor check can catch it.
    let path = dir.join("model-00001-of-000002.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let name = "language_model.model.embed_tokens.weight";
    h[name]["shape"] = serde_json::json!([128, 1280]);
    let mut json = serde_json::to_vec(&h).unwrap();
    json.resize(n, b' ');
    let mut out = (n as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
    let o = fathom(&["verify", dir.to_str().unwrap()]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("model-00001-of-000002.safetensors"), "{t}");
    assert!(
        t.contains(&format!(
            "tensor {name}: shape [128, 1280], expected [1280, 128]"
        )),
        "{t}"
    );
}

/// The tiny preset's spine as `--spine int8` leaves it: every projection
/// matrix [r, c] becomes r·c int8 bytes + 4·r of f32 scales; the embedding,
/// routers, conv taps and vectors stay as stored.
fn tiny_int8_spine() -> u64 {
    let q = |r: u64, c: u64| r * c + 4 * r;
    // KDA (P = 4·48 = 192): q/k/v, f_a, f_b, b, g, o quantised; conv taps
    // [192, 1, 4], A_log [48], dt_bias [192], o_norm [48] f32.
    let kda = 3 * q(192, 128)
        + q(48, 128)
        + q(192, 48)
        + q(4, 128)
        + q(192, 128)
        + q(128, 192)
        + (3 * 192 * 4 + 48 + 192 + 48) * 4;
    // MLA: q_a, q_b, kv_a, kv_b, g, o quantised; two bf16 norms (64, 40).
    let mla =
        q(64, 128) + q(192, 64) + q(56, 128) + q(224, 40) + q(96, 128) + q(128, 96) + (64 + 40) * 2;
    let per_layer = 6 * 128 * 2; // two norms, two attention-residual pairs
    let dense = 2 * q(320, 128) + q(128, 320);
    // MoE: router [32, 128] bf16 + bias f32 stay; latent down/up and the
    // two shared experts (192) are quantised; the latent norm stays bf16.
    let moe =
        32 * 128 * 2 + 32 * 4 + q(64, 128) + 64 * 2 + q(128, 64) + 2 * q(192, 128) + q(128, 192);
    // Embedding bf16, final norm + output attention-residual pair, int8 head.
    let global = 1280 * 128 * 2 + 3 * 128 * 2 + q(1280, 128);
    6 * kda + 3 * mla + 9 * per_layer + dense + 8 * moe + global
}

#[test]
fn inspect_json_matches_hand_computed_numbers() {
    let dir = synth_tiny("inspect");
    let o = fathom(&[
        "inspect",
        dir.to_str().unwrap(),
        "--json",
        "--context",
        "100",
        "--ram-budget",
        "76MB",
        "--vram-budget",
        "6MB",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    let u = |v: &Value| v.as_u64().unwrap();
    assert_eq!(r["model"]["attention"], "KKKMKKKMM");
    assert_eq!(r["model"]["ffn"], "DEEEEEEEE");
    let c = &r["components"];
    // embedding and head: 1280 × 128 bf16.
    assert_eq!(
        (u(&c["embedding"]["params"]), u(&c["embedding"]["bytes"])),
        (163_840, 327_680)
    );
    assert_eq!(u(&c["head"]["bytes"]), 327_680);
    // One expert: w1, w3 [96, 64] and w2 [64, 96] at 4 bits + a scale byte per 32.
    assert_eq!(u(&r["expert_bytes"]), 3 * (96 * 64 / 2 + 96 * 64 / 32));
    // In RAM: 9792 rounded up to 4 KiB blocks (12288) + one block of slack.
    let eram = 3 * 4096 + 4096;
    assert_eq!(u(&r["expert_ram_bytes"]), eram);
    assert_eq!(u(&r["experts_total"]), 8 * 32);
    assert_eq!(u(&c["routed_experts"]["bytes"]), 256 * 9792);
    assert_eq!(u(&c["routed_experts"]["params"]), 256 * 3 * 96 * 64);
    // Attention: six KDA layers (141,344 params) and three MLA (61,288).
    assert_eq!(u(&c["attention"]["params"]), 6 * 141_344 + 3 * 61_288);
    assert_eq!(u(&c["attention"]["bytes"]), 6 * 287_872 + 3 * 122_576);
    assert_eq!(u(&c["norms_attn_res"]["params"]), 9 * 6 * 128 + 3 * 128);
    assert_eq!(u(&r["total"]["bytes"]), 7_026_800);
    let spine = 7_026_800 - 256 * 9792;
    assert_eq!(u(&r["spine"]["bf16_bytes"]), spine);
    let int8 = tiny_int8_spine();
    assert_eq!(u(&r["spine"]["int8_bytes"]), int8);
    // --device cuda's plan in 6 MB of VRAM: the spine, then 9,792-byte
    // experts in what is left (all 256 with the int8 spine).
    let v = &r["vram"];
    assert_eq!(u(&v["bf16"]["spine_bytes"]), spine);
    assert_eq!(u(&v["bf16"]["experts_in_vram"]), (6_000_000 - spine) / 9792);
    assert_eq!(
        u(&v["int8"]["experts_in_vram"]),
        ((6_000_000 - int8) / 9792).min(256)
    );
    assert_eq!(
        u(&v["bf16"]["experts_elsewhere"]),
        256 - (6_000_000 - spine) / 9792
    );
    // On three devices of 6 MB: the spine on the first, 86 experts each
    // (256 = 86 + 85 + 85), the first caching what its rest holds.
    let three = fathom(&[
        "inspect",
        dir.to_str().unwrap(),
        "--json",
        "--vram-budget",
        "6MB",
        "--gpus",
        "3",
    ]);
    assert!(three.status.success(), "{}", text(&three));
    let t: Value = serde_json::from_slice(&three.stdout).unwrap();
    let first = ((6_000_000 - spine) / 9792).min(86);
    let per: Vec<u64> = t["vram"]["bf16"]["experts_per_device"]
        .as_array()
        .unwrap()
        .iter()
        .map(u)
        .collect();
    assert_eq!(per, vec![first, 85, 85]);
    assert_eq!(u(&t["vram"]["bf16"]["experts_in_vram"]), first + 170);
    assert_eq!(u(&t["vram"]["devices"]), 3);
    // Per decode token: the spine less the embedding table plus one bf16
    // row (the embedding is never quantised); 4 experts × 8 layers.
    assert_eq!(
        u(&r["per_token"]["spine_bf16_bytes"]),
        spine - 327_680 + 256
    );
    assert_eq!(u(&r["per_token"]["spine_int8_bytes"]), int8 - 327_680 + 256);
    assert_eq!(u(&r["per_token"]["routed_expert_bytes"]), 4 * 9792 * 8);
    // State: KDA 4·48·48·4 + 3·3·192·4 per layer, twice (the state and the
    // undo mark a step keeps); MLA (40 + 16)·4 per token, in whole 256-row
    // cache blocks (100 tokens take one block).
    let state = 2 * 6 * (36_864 + 6_912) + 3 * 224 * 256;
    assert_eq!(u(&r["state"]["kda_bytes"]), 2 * 6 * (36_864 + 6_912));
    assert_eq!(u(&r["state"]["mla_bytes"]), 3 * 224 * 256);
    // Scratch for a run's default pass (a verification of 8 drafted
    // tokens, 9 positions): 64 MiB baseline and, per position, logits
    // 1280·4, 64 hidden rows 64·128·4 and 4 experts' intermediates
    // (2·96 + 64)·4.
    assert_eq!(r["pass_tokens"], 9);
    let scratch = (64 << 20) + 9 * (1280 * 4 + 64 * 128 * 4 + 4 * (2 * 96 + 64) * 4);
    assert_eq!(u(&r["scratch_bytes"]), scratch);
    // I/O buffers: 2·4 reads in flight (prefetch on) + the layer's experts
    // the pass computes, 4 per position but at most the layer's 32.
    let io = (2 * 4 + 32) * eram;
    assert_eq!(u(&r["io_buffers_bytes"]), io);
    for (k, sp) in [("bf16", spine), ("int8", int8)] {
        let l = &r["ledger"][k];
        let fixed = sp + state + scratch + io;
        assert_eq!(
            (u(&l["spine"]), u(&l["state"]), u(&l["scratch"])),
            (sp, state, scratch),
            "{k}"
        );
        assert_eq!((u(&l["io_buffers"]), u(&l["expert_bytes"])), (io, eram));
        // Loading holds the resident spine before the state, buffers and
        // cache exist; an int8 spine is quantised a layer at a time, so
        // beside it one layer as stored at most (layer 0: KDA 287,872,
        // dense MLP 3·320·128·2, norms and attention-residual pairs 1,536).
        let layer0 = 287_872 + 245_760 + 1_536;
        let load_peak = sp + scratch + if k == "int8" { layer0 } else { 0 };
        assert_eq!(u(&l["load_peak_bytes"]), load_peak, "{k}");
        assert_eq!(u(&l["tiers"]["resident_layers"]), 9, "{k}");
        // The least budget reads every layer and the embedding's rows for
        // every pass: the globals (head, three norms) and a ring of the two largest
        // neighbours, layers 0 and 1 (KDA + MoE: 287,872 + 188,672 + 1,536).
        // The parsed tensor index is set aside first, as a run does: 4× the
        // shards' header bytes.
        let index = u(&l["tensor_index_bytes"]);
        assert!(index > 0, "{k}");
        if k == "bf16" {
            let ring = layer0 + 478_080;
            // 656,128 of globals less the embedding, 1280 × 128 bf16.
            let least = 656_128 - 327_680 + ring + state + scratch + io + index;
            assert_eq!(u(&l["min_budget_bytes"]), least, "{k}");
        } else {
            assert!(u(&l["min_budget_bytes"]) < fixed + index, "{k}");
        }
        let experts = ((76_000_000 - index - fixed) / eram).min(256);
        assert_eq!(u(&l["cache_experts"]), experts, "{k}");
        assert_eq!(u(&l["cache"]), experts * eram, "{k}");
        assert_eq!(l["fits"], true);
    }
    // The int8 spine leaves room for more experts (neither holds all 256).
    let cached = |k: &str| u(&r["ledger"][k]["cache_experts"]);
    assert!(cached("bf16") < cached("int8") && cached("int8") < 256);
    assert_eq!(u(&r["files"]["shards"]), 2);
}

#[test]
fn inspect_works_from_config_alone_and_says_when_the_spine_does_not_fit() {
    let dir = tmp("config-only");
    let o = fathom(&[
        "synth",
        "--preset",
        "k3",
        "--layers",
        "3",
        "--dry-run",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("3 layers, hidden 7168, 896 experts top-16"),
        "{}",
        text(&o)
    );
    assert!(!dir.exists(), "--dry-run writes nothing");
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data/k3-tiny/checkpoint/config.json");
    std::fs::copy(cfg, dir.join("config.json")).unwrap();
    let o = fathom(&["inspect", dir.to_str().unwrap(), "--ram-budget", "1MB"]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("does not fit") && t.contains("at least"), "{t}");
    assert!(!t.contains("on disk"), "{t}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tmp("bad");
    let d = dir.to_str().unwrap();
    let o = fathom(&["synth", "--preset", "tiny", "--top-k", "64", "--out", d]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--top-k 64"), "{}", text(&o));
    let o = fathom(&[
        "synth",
        "--preset",
        "tiny",
        "--target-size",
        "12XB",
        "--out",
        d,
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("unknown unit"), "{}", text(&o));
    let o = fathom(&["inspect", d]);
    assert!(!o.status.success());
    assert!(text(&o).contains("config.json"), "{}", text(&o));
    let o = fathom(&["verify", d]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("FAILED"), "{}", text(&o));
}

/// `--tokenizer-from DIR` writes a released tokenizer's files as they are
/// (k3-code-small's trained tokenizer stands in for a release; without it,
/// another synth's), sizes the vocabulary to them, and the model runs with
/// that tokenizer; every synth writes a `generation_config.json` with the
/// config's special ids.
#[test]
fn a_released_tokenizer_is_written_as_it_is() {
    let code_small =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/k3-code-small");
    let src = if code_small.join("tiktoken.model").is_file() {
        code_small
    } else {
        eprintln!("k3-code-small is not here: another synth's tokenizer stands in for a release");
        let other = tmp("tok-source");
        let o = fathom(&[
            "synth",
            "--preset",
            "tiny",
            "--vocab",
            "2304",
            "--out",
            other.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        other
    };
    let ranks = std::fs::read_to_string(src.join("tiktoken.model"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count();
    let dir = tmp("released-tok");
    let s = src.to_str().unwrap();
    let o = fathom(&[
        "synth",
        "--preset",
        "tiny",
        "--tokenizer-from",
        s,
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    for f in ["tiktoken.model", "tokenizer_config.json"] {
        assert_eq!(
            std::fs::read(dir.join(f)).unwrap(),
            std::fs::read(src.join(f)).unwrap(),
            "{f}"
        );
    }
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        cfg["text_config"]["vocab_size"].as_u64().unwrap() as usize,
        ranks + 256
    );
    let generation: Value =
        serde_json::from_slice(&std::fs::read(dir.join("generation_config.json")).unwrap())
            .unwrap();
    assert!(generation["eos_token_id"].is_u64(), "{generation}");
    assert_eq!(generation["eos_token_id"], cfg["eos_token_id"]);
    assert_eq!(generation["bos_token_id"], cfg["bos_token_id"]);
    let sums = std::fs::read_to_string(dir.join("SHA256SUMS")).unwrap();
    assert!(
        sums.contains("  generation_config.json\n") && sums.contains("  tiktoken.model\n"),
        "{sums}"
    );
    let d = dir.to_str().unwrap();
    let words = "def add(a, b):\n    return a + b";
    let ids = |m: &str| {
        let o = fathom(&["tokenize", "--model", m, "--json", words]);
        assert!(o.status.success(), "{}", text(&o));
        serde_json::from_slice::<Value>(&o.stdout).unwrap()["ids"].clone()
    };
    assert_eq!(ids(d), ids(s));
    let o = fathom(&[
        "run",
        "--model",
        d,
        "--prompt",
        words,
        "--max-new",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // A directory without a tokenizer is named with what is missing.
    let o = fathom(&[
        "synth",
        "--preset",
        "tiny",
        "--tokenizer-from",
        d,
        "--out",
        d,
        "--force",
        "--dry-run",
    ]);
    assert!(
        o.status.success(),
        "a synth output is itself a tokenizer source: {}",
        text(&o)
    );
    let empty = tmp("no-tok");
    std::fs::create_dir_all(&empty).unwrap();
    let o = fathom(&[
        "synth",
        "--preset",
        "tiny",
        "--tokenizer-from",
        empty.to_str().unwrap(),
        "--out",
        d,
        "--force",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("--tokenizer-from") && text(&o).contains("tiktoken.model"),
        "{}",
        text(&o)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A synth ships the tokenizer module its `tokenizer_config.json` names in
/// `auto_map` (so `trust_remote_code` loaders find it), in its manifest.
/// `tests/python/test_synth_tokenizer.py` (run by CI) loads it with
/// Hugging Face and compares its ids with `fathom tokenize`.
#[test]
fn a_synth_ships_the_tokenizer_module_its_config_names() {
    let dir = synth_tiny("tok-module");
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    let named = cfg["auto_map"]["AutoTokenizer"][0].as_str().unwrap();
    let (module, class) = named.split_once('.').unwrap();
    let file = format!("{module}.py");
    let src = std::fs::read_to_string(dir.join(&file)).expect("the named module is written");
    assert!(
        src.contains(&format!("class {class}(")),
        "{file} lacks {class}"
    );
    assert!(src.contains("tiktoken.model"), "{file} reads the rank file");
    let sums = std::fs::read_to_string(dir.join("SHA256SUMS")).unwrap();
    assert!(sums.contains(&format!("  {file}\n")), "{sums}");
}
