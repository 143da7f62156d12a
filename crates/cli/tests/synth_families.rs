//! `fathom synth --preset` for every non-K3 family, end to end through the
//! CLI: a shrunk copy of each released shape (in its released precision)
//! runs with `fathom run`, and streamed through an expert cache of two
//! experts it gives the same ids and the same logprobs, bit for bit, as
//! fully resident; the same seed writes the same bytes; full-size plans
//! print their released sizes; bad flags are clear errors.

mod common;

use std::path::{Path, PathBuf};

use common::{fails_quietly, fathom, run_json};
use serde_json::Value;

fn tmp(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("cli-synth-families")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Each preset at test size: (preset, --hidden, --layers, --experts).
/// Enough experts that a megabyte of budget holds fewer than all of them.
const CASES: [(&str, &str, &str, &str); 8] = [
    ("deepseek-v3", "128", "5", "64"),
    ("kimi-k2", "128", "3", "64"),
    ("kimi-k2-thinking", "128", "3", "64"),
    ("qwen3-235b", "128", "2", "64"),
    ("qwen3-30b", "256", "2", "16"),
    ("gpt-oss-120b", "128", "2", "32"),
    ("gpt-oss-20b", "256", "2", "32"),
    ("kimi-linear", "128", "4", "32"),
];

fn synth(dir: &Path, (preset, hidden, layers, experts): (&str, &str, &str, &str)) {
    let d = dir.to_str().unwrap();
    let args = [
        "synth",
        "--preset",
        preset,
        "--hidden",
        hidden,
        "--layers",
        layers,
        "--experts",
        experts,
        "--vocab",
        "1280",
        "--seed",
        "3",
        "--out",
        d,
    ];
    let o = fathom(&args);
    assert!(o.status.success(), "{args:?}: {}", text(&o));
}

/// `fathom run` of a fixed prompt for `n` tokens: (output ids, logprobs, stats).
fn run(dir: &Path, n: &str, extra: &[&str]) -> (Vec<u64>, Value, Value) {
    let d = dir.to_str().unwrap();
    let mut args = vec![
        "run",
        "--model",
        d,
        "--prompt-ids",
        "5,300,17,900,44,1000",
        "--max-new",
        n,
        "--ignore-eos",
        "--logprobs",
        "3",
        "--context",
        "64",
        "--json",
    ];
    args.extend_from_slice(extra);
    let r = run_json(&args);
    let ids = r["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    (ids, r["logprobs"].clone(), r["stats"].clone())
}

/// The smallest `--ram-budget` the streamed run accepts, in whole MB, from
/// its own refusal of a 1 MB budget.
fn min_budget_mb(dir: &Path) -> u64 {
    let d = dir.to_str().unwrap();
    let args = [
        "run",
        "--model",
        d,
        "--prompt-ids",
        "5,300,17,900,44,1000",
        "--max-new",
        "1",
        "--context",
        "64",
        "--experts",
        "stream",
        "--ram-budget",
        "1MB",
    ];
    let o = fails_quietly(&args, "give at least --ram-budget");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let at = err.find("give at least --ram-budget ").unwrap() + 27;
    err[at..].split("MB").next().unwrap().parse().unwrap()
}

#[test]
fn every_family_streams_through_two_experts_exactly() {
    for case in CASES {
        let name = case.0;
        let dir = tmp(name);
        synth(&dir, case);
        let d = dir.to_str().unwrap();
        let facts = run_json(&["inspect", d, "--json", "--context", "64"]);
        let eram = facts["expert_ram_bytes"].as_u64().unwrap();
        let total = facts["experts_total"].as_u64().unwrap();

        let (want, want_lp, _) = run(&dir, "8", &["--experts", "resident"]);
        assert_eq!(want.len(), 8, "{name}");
        assert!(want.iter().all(|&t| t < 1280), "{name}: {want:?}");
        // Finite logprobs (JSON has no NaN) with a clear best choice.
        for step in want_lp.as_array().unwrap() {
            let top = step["top"].as_array().unwrap();
            let lp = |i: usize| top[i][1].as_f64().unwrap();
            assert!(lp(0).is_finite() && lp(0) > lp(1), "{name}: {step}");
        }

        // A budget leaving room for exactly two cached experts: the cache
        // a whole-MB budget gets, less all but two of its experts.
        let mb = min_budget_mb(&dir) * 1_000_000;
        let (_, _, probe) = run(
            &dir,
            "1",
            &["--experts", "stream", "--ram-budget", &mb.to_string()],
        );
        let slots = probe["expert_cache_slots"].as_u64().unwrap();
        assert!(
            slots < total,
            "{name}: {slots} of {total} experts fit in 1 MB"
        );
        let budget = (mb - slots * eram + 2 * eram).to_string();
        let (got, got_lp, stats) =
            run(&dir, "8", &["--experts", "stream", "--ram-budget", &budget]);
        assert_eq!(stats["expert_cache_slots"], 2, "{name}");
        assert!(stats["expert_cache_misses"].as_u64().unwrap() > 0, "{name}");
        assert_eq!(got, want, "{name}: streamed ids differ");
        assert_eq!(got_lp, want_lp, "{name}: streamed logprobs differ");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn same_seed_same_bytes() {
    for case in [CASES[2], CASES[5]] {
        let (a, b) = (tmp(&format!("{}-a", case.0)), tmp(&format!("{}-b", case.0)));
        synth(&a, case);
        synth(&b, case);
        let mut names: Vec<_> = std::fs::read_dir(&a)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        // Shards, index, configs, tokenizer files and module, manifest.
        assert_eq!(names.len(), 9, "{}: {names:?}", case.0);
        for n in names {
            let read = |d: &Path| std::fs::read(d.join(&n)).unwrap();
            assert!(read(&a) == read(&b), "{}: {n:?} differs", case.0);
        }
        for d in [a, b] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}

#[test]
fn full_size_plans_state_the_released_shapes() {
    let dir = tmp("dry");
    let d = dir.to_str().unwrap();
    for (preset, shape, size) in [
        (
            "deepseek-v3",
            "61 layers, hidden 7168, 256 experts top-8, vocab 129280",
            "687 GB",
        ),
        (
            "kimi-k2",
            "61 layers, hidden 7168, 384 experts top-8",
            "1.03 TB",
        ),
        ("kimi-k2-thinking", "384 experts top-8", "594 GB"),
        (
            "qwen3-235b",
            "94 layers, hidden 4096, 128 experts top-8",
            "470 GB",
        ),
        (
            "qwen3-30b",
            "48 layers, hidden 2048, 128 experts top-8",
            "61.1 GB",
        ),
        (
            "gpt-oss-120b",
            "36 layers, hidden 2880, 128 experts top-4",
            "65.2 GB",
        ),
        (
            "gpt-oss-20b",
            "24 layers, hidden 2880, 32 experts top-4",
            "13.8 GB",
        ),
        (
            "kimi-linear",
            "27 layers, hidden 2304, 256 experts top-8",
            "98.2 GB",
        ),
    ] {
        let o = fathom(&["synth", "--preset", preset, "--dry-run", "--out", d]);
        let t = text(&o);
        assert!(o.status.success(), "{t}");
        assert!(
            t.contains(shape) && t.contains(&format!(" {size} in ")),
            "{t}"
        );
    }
    assert!(!dir.exists(), "--dry-run writes nothing");
    // --target-size picks the layer count; below the fewest layers with a
    // MoE layer (3 dense + 1 for DeepSeek-V3) it shrinks the experts.
    let o = fathom(&[
        "synth",
        "--preset",
        "qwen3-30b",
        "--target-size",
        "5GB",
        "--dry-run",
        "--out",
        d,
    ]);
    assert!(text(&o).contains("chose 3 layers"), "{}", text(&o));
    let o = fathom(&[
        "synth",
        "--preset",
        "deepseek-v3",
        "--target-size",
        "10GB",
        "--dry-run",
        "--out",
        d,
    ]);
    assert!(
        text(&o).contains("4 layers (the fewest with a MoE layer) and"),
        "{}",
        text(&o)
    );
    // --config-only: a full-size config that inspect plans from alone.
    let o = fathom(&[
        "synth",
        "--preset",
        "gpt-oss-120b",
        "--config-only",
        "--out",
        d,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let r = run_json(&[
        "inspect",
        d,
        "--json",
        "--ram-budget",
        "8GB",
        "--context",
        "1000",
    ]);
    assert_eq!(r["experts_total"], 36 * 128);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_flags_name_the_flag_and_the_fix() {
    let dir = tmp("bad");
    let d = dir.to_str().unwrap();
    for (args, needle) in [
        (
            &["--preset", "deepseek-v3", "--layers", "3"][..],
            "give --layers 4 or more",
        ),
        (
            &["--preset", "kimi-k2", "--hidden", "100"][..],
            "--hidden 100: must be a multiple of 32",
        ),
        (
            &["--preset", "k3", "--hidden", "256"][..],
            "use tiny (hidden 128) or k3-mini",
        ),
        (
            &["--preset", "qwen3-30b", "--top-k", "20", "--experts", "16"][..],
            "--top-k 20 exceeds",
        ),
        (
            &["--preset", "gpt-oss-20b", "--vocab", "300"][..],
            "--vocab 300",
        ),
        (&["--preset", "llama"][..], "invalid value 'llama'"),
    ] {
        let mut a = vec!["synth", "--dry-run", "--out", d];
        a.extend_from_slice(args);
        fails_quietly(&a, needle);
    }
}
