//! `fathom bench` end to end on k3-tiny: two arms, identical ids, the JSON
//! report's schema, the SVG, rejection of a differing output, bad input, and
//! a memory cap where cgroups are writable. Ceilings are bounded to half a
//! second so the whole file runs in seconds.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn tiny() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data/k3-tiny/checkpoint")
        .display()
        .to_string()
}

/// The smoke command with `reps` reps; ceilings bounded to 0.3 s / 32 MB.
fn bench(reps: &str, extra: &[&str]) -> Output {
    bench_on(&tiny(), reps, extra)
}

fn bench_on(model: &str, reps: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "bench",
        "--model",
        model,
        "--prompt-ids",
        "1,591,25",
        "--max-new",
        "4",
        "--reps",
        reps,
        "--warmup",
        "0",
        "--ceiling-bytes",
        "32MB",
    ];
    if !extra.iter().any(|a| a.starts_with("--ceiling-secs")) {
        args.extend(["--ceiling-secs", "0.3"]);
    }
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args(&args)
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
    let d = std::env::temp_dir().join(format!("fathom-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn two_arms_identical_ids_json_and_svg() {
    let (json, svg) = (tmp("two.json"), tmp("two.svg"));
    let o = bench(
        "2",
        &[
            "--arm",
            "a=",
            "--arm",
            "b=--experts stream --ram-budget 100MB",
            "--json",
            json.to_str().unwrap(),
            "--plot",
            svg.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("ceilings (this run): storage") && out.contains("÷ ceiling"),
        "{out}"
    );

    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["schema"], "fathom-bench/1");
    for k in [
        "date_utc", "fathom", "machine", "config", "ceilings", "arms", "samples",
    ] {
        assert!(r.get(k).is_some(), "missing {k}");
    }
    assert!(r["date_utc"].as_str().unwrap().ends_with('Z'));
    assert!(r["fathom"]["version"].is_string() && r["fathom"]["argv"].is_array());
    let m = &r["machine"];
    assert!(m["logical_cpus"].as_u64().unwrap() >= 1);
    assert!(m["kernel"].is_string() && m["disk"].is_object());
    let c = &r["ceilings"];
    assert!(c["storage"]["bytes_per_s"].as_f64().unwrap() > 0.0);
    assert!(c["storage"]["direct"].is_boolean());
    assert!(c["memory"]["bytes_per_s"].as_f64().unwrap() > 0.0);
    assert!(c["spine_bytes_per_token"].as_u64().unwrap() > 0);

    let arms = r["arms"].as_array().unwrap();
    assert_eq!(arms.len(), 2);
    for a in arms {
        assert_eq!(a["status"], "accepted", "{a}");
        assert_eq!(a["samples"], 2);
        let d = &a["summary"]["decode_tok_s"];
        for k in ["min", "median", "max"] {
            assert!(d[k].as_f64().unwrap() > 0.0, "{a}");
        }
        assert!(
            d["min"].as_f64() <= d["median"].as_f64() && d["median"].as_f64() <= d["max"].as_f64()
        );
        assert!(a["ceiling_tok_s"].as_f64().unwrap() > 0.0);
        assert!(a["decode_vs_ceiling"].as_f64().unwrap() > 0.0);
        assert!(a["bound"].is_string());
    }
    // The streamed arm reads experts; the resident one does not.
    assert!(
        arms[1]["summary"]["expert_bytes_per_token"]["median"]
            .as_f64()
            .unwrap()
            > 0.0
    );

    let samples = r["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 4);
    // Rep-major interleaving: a, b, a, b.
    let order: Vec<&str> = samples.iter().map(|s| s["arm"].as_str().unwrap()).collect();
    assert_eq!(order, ["a", "b", "a", "b"]);
    let ids0 = &samples[0]["output_ids"];
    assert_eq!(ids0.as_array().unwrap().len(), 4);
    for s in samples {
        assert_eq!(&s["output_ids"], ids0);
        assert!(s["raw"].is_object() && s["metrics"].is_object() && s["wall_s"].is_f64());
    }

    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains(">a</text>") && svg.contains(">b</text>") && svg.contains("ceiling"));
}

#[test]
fn differing_output_is_rejected_not_averaged() {
    let json = tmp("reject.json");
    let o = bench(
        "1",
        &["--expect-ids", "1,2,3,4", "--json", json.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("REJECTED: output ids differ"));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let a = &r["arms"][0];
    assert_eq!(a["name"], "default");
    assert_eq!(a["status"], "rejected");
    assert!(a["decode_vs_ceiling"].is_null());
}

#[test]
fn peer_rates_are_parsed_and_compared() {
    let json = tmp("peer.json");
    // A stand-in peer printing llama.cpp's perf summary; {max_new} is substituted.
    let peer = "fake=sh -c 'echo \"llama_perf_context_print:        eval time =  100.00 ms / $0 runs   (   25.00 ms per token,    40.00 tokens per second)\" >&2' {max_new}";
    let o = bench("1", &["--peer", peer, "--json", json.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let (ours, fake) = (&r["arms"][0], &r["arms"][1]);
    assert_eq!(
        (fake["kind"].as_str(), fake["status"].as_str()),
        (Some("peer"), Some("accepted"))
    );
    assert_eq!(fake["summary"]["decode_tok_s"]["median"], 40.0);
    assert_eq!(r["samples"][1]["raw"]["decode_tokens"], 4);
    let ratio = ours["vs_peers"]["fake"].as_f64().unwrap();
    let d = ours["summary"]["decode_tok_s"]["median"].as_f64().unwrap();
    assert!((ratio - d / 40.0).abs() < 1e-9);
}

#[test]
fn a_prefill_only_peer_is_compared_on_prefill() {
    let json = tmp("peer-pp.json");
    // A stand-in for `llama-bench -p N -n 0 -o json`: a pp row and no tg row.
    let peer = r#"pp=echo '[{"n_prompt":3,"n_gen":0,"avg_ts":50.0}]'"#;
    let o = bench("1", &["--peer", peer, "--json", json.to_str().unwrap()]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let (ours, pp) = (&r["arms"][0], &r["arms"][1]);
    assert_eq!(pp["status"].as_str(), Some("accepted"), "{out}");
    assert_eq!(pp["summary"]["prefill_tok_s"]["median"], 50.0);
    assert!(pp["summary"].get("decode_tok_s").is_none());
    assert!(ours["vs_peers"].get("pp").is_none(), "no decode to compare");
    let ratio = ours["vs_peers_prefill"]["pp"].as_f64().unwrap();
    let p = ours["summary"]["prefill_tok_s"]["median"].as_f64().unwrap();
    assert!((ratio - p / 50.0).abs() < 1e-9);
    assert!(out.contains("÷ peer (prefill)"), "{out}");
}

#[test]
fn bad_input_is_one_error_line() {
    for (args, want) in [
        (&["--arm", "noequals"][..], "NAME="),
        (&["--arm", "x=--max-new 3"][..], "set by the bench"),
        (&["--arm", "x='open"][..], "unterminated"),
        (&["--ceiling-secs=-1"][..], "--ceiling-secs"),
        (
            &["--peer", "p=nonexistent-engine {prompt}"][..],
            "prompt is token ids",
        ),
    ] {
        let o = bench("1", args);
        assert!(!o.status.success(), "{args:?} should fail");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains("error:") && e.contains(want), "{args:?}: {e}");
    }
    let o = bench("0", &[]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--reps must be at least 1"));
    let o = Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args(["bench", "--model", "/nonexistent", "--prompt-ids", "1"])
        .output()
        .unwrap();
    // A path that does not exist says so (before any model is looked for).
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("no such directory: /nonexistent"), "{e}");
}

#[test]
fn memory_cap_runs_each_process_in_a_capped_cgroup() {
    if let Err(e) = fathom_bench::cgroup::own()
        .and_then(|p| fathom_bench::cgroup::Child::create(&p, 64 << 20))
        .and_then(|c| c.remove())
    {
        eprintln!("skipped: cgroups are not writable here: {e:#}");
        return;
    }
    let json = tmp("cap.json");
    let o = bench(
        "1",
        &[
            "--memory-cap",
            "200MB",
            "--arm",
            "capped=--ram-budget 100MB",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["config"]["memory_cap_bytes"], 200_000_000);
    let s = &r["samples"][0];
    let peak = s["cgroup_peak_bytes"].as_u64().expect("cgroup peak read");
    assert!(peak > 0 && peak <= 200_000_000, "{peak}");
    assert!(
        r["arms"][0]["summary"]["cgroup_peak_bytes"]["median"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

/// Every family is benchmarked the same way, resident and streamed: its
/// experts are located for the storage ceiling, its spine for the memory
/// ceiling, and both arms give the same ids.
#[test]
fn other_families_bench_resident_and_streamed() {
    for name in [
        "qwen3_moe-tiny",
        "deepseek_v3-tiny",
        "gpt_oss-tiny",
        "kimi_linear-tiny",
    ] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../model/tests/data")
            .join(name);
        let json = tmp(&format!("{name}.json"));
        let o = bench_on(
            dir.to_str().unwrap(),
            "1",
            &[
                "--arm",
                "r=--experts resident",
                "--arm",
                "s=--experts stream --ram-budget 100MB",
                "--json",
                json.to_str().unwrap(),
            ],
        );
        assert!(o.status.success(), "{name}: {}", text(&o));
        let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert!(
            r["ceilings"]["storage"]["spans"].as_u64().unwrap() > 0,
            "{name}"
        );
        assert!(
            r["ceilings"]["spine_bytes_per_token"].as_u64().unwrap() > 0,
            "{name}"
        );
        let arms = r["arms"].as_array().unwrap();
        assert!(
            arms.iter().all(|a| a["status"] == "accepted"),
            "{name}: {arms:?}"
        );
        let s = r["samples"].as_array().unwrap();
        assert_eq!(s[0]["output_ids"], s[1]["output_ids"], "{name}");
    }
}

/// `--suite standard` on a synth with a tokenizer: every fixed prompt runs,
/// each figure sits beside its ceiling, and the card names the machine and
/// the model by digest (JSON, Markdown and SVG).
#[test]
fn the_standard_suite_writes_a_card() {
    use sha2::Digest;
    let dir = tmp("suite-model");
    let _ = std::fs::remove_dir_all(&dir);
    let o = Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args([
            "synth",
            "--preset",
            "tiny",
            "--seed",
            "3",
            "--out",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let card_path = tmp("card.json");
    let mut args = vec![
        "bench",
        "--model",
        dir.to_str().unwrap(),
        "--suite",
        "standard",
        "--max-new",
        "3",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--ceiling-bytes",
        "16MB",
        "--ceiling-secs",
        "0.2",
    ];
    args.extend(["--json", card_path.to_str().unwrap()]);
    let o = Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args(&args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let card: Value = serde_json::from_slice(&std::fs::read(&card_path).unwrap()).unwrap();
    assert_eq!(card["schema"], "fathom-suite/1");
    let cfg = std::fs::read(dir.join("config.json")).unwrap();
    let cfg_sha: String = sha2::Sha256::digest(&cfg)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(card["model"]["config_sha256"], cfg_sha.as_str());
    assert_eq!(
        card["model"]["checkpoint_digest"].as_str().unwrap().len(),
        64
    );
    assert!(card["memory_bytes_per_s"].as_f64().unwrap() > 0.0);
    assert!(card["machine"]["logical_cpus"].as_u64().unwrap() >= 1);
    let arm = &card["arms"][0];
    assert_eq!(arm["status"], "accepted", "{arm}");
    let prompts = arm["prompts"].as_array().unwrap();
    let ran: Vec<&str> = prompts
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    let skipped: Vec<&str> = card["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().split(':').next().unwrap())
        .collect();
    let want: Vec<&str> = ["capital", "planet", "code", "chat", "long"]
        .into_iter()
        .filter(|p| !skipped.contains(p))
        .collect();
    assert_eq!(ran, want, "skipped {skipped:?}");
    assert!(
        !skipped.contains(&"long"),
        "the tiny synth's context holds the long prompt"
    );
    assert_eq!(prompts[0]["prompt"]["text"], "The capital of France is");
    for p in prompts {
        assert!(p["decode_tok_s"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["decode_ceiling_tok_s"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["decode_vs_ceiling"].as_f64().unwrap() > 0.0, "{p}");
    }
    let long = prompts.iter().find(|p| p["name"] == "long").unwrap();
    assert!(long["prompt_tokens"].as_f64().unwrap() > 500.0, "{long}");
    let md = std::fs::read_to_string(card_path.with_extension("md")).unwrap();
    assert!(
        md.contains("| capital | factual |") && md.contains(&cfg_sha[..16]),
        "{md}"
    );
    let svg = std::fs::read_to_string(card_path.with_extension("svg")).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("default · long"),
        "{svg}"
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout), md);
    let _ = std::fs::remove_dir_all(&dir);
}
