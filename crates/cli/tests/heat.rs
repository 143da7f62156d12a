//! Expert heat across runs: `--heat-out` records request counts, `--heat`
//! warms and pins the cache from them, and neither changes a token.

mod common;

use common::{fails_with, run_json, tiny, tiny_copy};

fn tmp(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("fathom-heat-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

#[test]
fn heat_is_recorded_warms_the_cache_and_changes_no_token() {
    let ck = tiny().join("checkpoint");
    let ck = ck.to_str().unwrap();
    let heat = tmp("rec.json");
    let h = heat.to_str().unwrap();
    let run = |prompt: &str, extra: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            ck,
            "--prompt-ids",
            prompt,
            "--max-new",
            "10",
            "--experts",
            "stream",
            "--context",
            "256",
            // A cache of about half the 256 experts: eviction happens.
            "--ram-budget",
            "77MB",
            "--json",
        ];
        args.extend(extra);
        run_json(&args)
    };
    // Two recording runs add up.
    let a = run("1,2,3,4,5", &["--heat-out", h]);
    let b = run("9,8,7", &["--heat-out", h]);
    let rec: serde_json::Value = serde_json::from_slice(&std::fs::read(&heat).unwrap()).unwrap();
    let positions = |r: &serde_json::Value| {
        r["prompt_ids"].as_array().unwrap().len() + r["output_ids"].as_array().unwrap().len()
    };
    assert_eq!(
        rec["tokens"].as_u64().unwrap() as usize,
        positions(&a) + positions(&b)
    );
    let counted: u64 = rec["counts"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|l| l.as_array().unwrap())
        .map(|c| c.as_u64().unwrap())
        .sum();
    assert!(counted > 0);
    // A held-out prompt: the same ids cold, warmed, and warmed with a pinned tier.
    let cold = run("4,4,2,7,1,3", &[]);
    let warm = run("4,4,2,7,1,3", &["--heat", h, "--heat-pin", "0"]);
    let pinned = run("4,4,2,7,1,3", &["--heat", h, "--heat-pin", "0.5"]);
    let default = run("4,4,2,7,1,3", &["--heat", h]);
    assert_eq!(cold["output_ids"], default["output_ids"]);
    assert_eq!(cold["output_ids"], warm["output_ids"]);
    assert_eq!(cold["output_ids"], pinned["output_ids"]);
    let s = &pinned["stats"];
    let slots = s["expert_cache_slots"].as_u64().unwrap();
    assert!(slots > 16 && slots < 256, "{s}");
    assert!(s["heat_pinned_experts"].as_u64().unwrap() > 0, "{s}");
    assert!(cold["stats"]["expert_hit_rate"].as_f64().unwrap() < 1.0);
    assert!(s["heat_warmed_experts"].as_u64().unwrap() > 0, "{s}");
    assert!(s["heat_warm_bytes"].as_u64().unwrap() > 0, "{s}");
    assert!(
        s["heat_pinned_experts"].as_u64().unwrap() <= slots / 2,
        "{s}"
    );
    assert!(
        warm["stats"]["heat_pinned_experts"] == 0,
        "{}",
        warm["stats"]
    );
    let d = &default["stats"];
    assert!(
        d["heat_pinned_experts"].as_u64().unwrap() <= slots * 3 / 4,
        "{d}"
    );
    assert!(cold["stats"].get("heat_warmed_experts").is_none());
    let _ = std::fs::remove_file(&heat);
}

#[test]
fn heat_from_another_model_or_without_streaming_is_refused() {
    let ck = tiny().join("checkpoint");
    let ck = ck.to_str().unwrap();
    let heat = tmp("other.json");
    let h = heat.to_str().unwrap();
    let other = tiny_copy("heat-other");
    // Another config.json: another model.
    let cfg = other.join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, format!("{text}\n")).unwrap();
    let base = |m: &str, extra: &[&str]| {
        let mut v: Vec<String> = ["run", "--model", m, "--prompt-ids", "1,2", "--max-new", "2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let args = base(
        other.to_str().unwrap(),
        &["--experts", "stream", "--heat-out", h, "--json"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_json(&args);
    let args = base(ck, &["--experts", "stream", "--heat", h]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails_with(&args, "recorded for another model");
    let args = base(ck, &["--experts", "resident", "--heat", h]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails_with(&args, "--experts stream");
    // A --heat-out file of another model is refused before the run.
    let args = base(ck, &["--experts", "stream", "--heat-out", h]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails_with(&args, "--heat-out");
    let o = common::fathom(&[
        "logits",
        "--model",
        ck,
        "--prompt-ids",
        "1,2",
        "--experts",
        "stream",
        "--heat-out",
        "x.json",
    ]);
    assert!(
        !o.status.success()
            && String::from_utf8_lossy(&o.stderr).contains("run` and `fathom batch` only")
    );
    let args = base(ck, &["--experts", "stream", "--heat-pin", "2"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails_with(&args, "0..=0.9");
    let _ = std::fs::remove_file(&heat);
    let _ = std::fs::remove_dir_all(&other);
}
