//! The `fathom` binary end to end on k3-tiny: output contracts and errors.

mod common;

use std::process::Command;

use common::*;
use serde_json::Value;

fn golden_prompt(i: usize) -> (String, Vec<u64>, Vec<Value>) {
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(tiny().join("golden.json")).unwrap())
            .unwrap();
    let p = &g["prompts"][i];
    let ids: Vec<String> = p["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let greedy = p["greedy_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    (
        ids.join(","),
        greedy,
        p["last_logits_top20"].as_array().unwrap().clone(),
    )
}

/// `output_ids` of a `run --json` report.
fn output_ids(v: &Value) -> Vec<u64> {
    v["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn run_json_is_one_object_with_the_golden_tokens() {
    let ck = tiny().join("checkpoint");
    let (ids, greedy, _) = golden_prompt(2);
    let out = fathom(&[
        "run",
        "--model",
        ck.to_str().unwrap(),
        "--prompt-ids",
        &ids,
        "--max-new",
        "16",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        stdout.trim().lines().count(),
        1,
        "stdout must be exactly one JSON object: {stdout}"
    );
    let v: Value = serde_json::from_str(stdout.trim()).unwrap();
    let got = output_ids(&v);
    assert_eq!(got, greedy);
    assert_eq!(
        v["prompt_ids"].as_array().unwrap().len(),
        ids.split(',').count()
    );
    for key in [
        "decode_tok_s",
        "prefill_tok_s",
        "peak_rss_bytes",
        "expert_bytes_read",
        "expert_cache_hits",
        "expert_cache_misses",
    ] {
        assert!(v["stats"][key].is_number(), "stats.{key} missing");
    }
    assert!(v["text"].is_null(), "k3-tiny has no tokenizer, so no text");
    assert_eq!(v["finish_reason"], "length");
}

#[test]
fn logits_json_top_is_descending_and_matches_golden() {
    let ck = tiny().join("checkpoint");
    let (ids, _, top20) = golden_prompt(0);
    let out = fathom(&[
        "logits",
        "--model",
        ck.to_str().unwrap(),
        "--prompt-ids",
        &ids,
        "--top",
        "5",
        "--json",
    ]);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let top = v["top"].as_array().unwrap();
    assert_eq!(top.len(), 5);
    for (got, want) in top.iter().zip(&top20) {
        assert_eq!(got[0].as_u64(), want["id"].as_u64());
        assert!((got[1].as_f64().unwrap() - want["logit"].as_f64().unwrap()).abs() < 1e-3);
    }
    let l: Vec<f64> = top.iter().map(|p| p[1].as_f64().unwrap()).collect();
    assert!(l.windows(2).all(|w| w[0] >= w[1]));
}

#[test]
fn bad_inputs_give_clear_errors() {
    let ck = tiny().join("checkpoint");
    let ck = ck.to_str().unwrap();
    fails_with(
        &[
            "run",
            "--model",
            "/definitely/not/here",
            "--prompt-ids",
            "1",
        ],
        "no such directory: /definitely/not/here",
    );
    fails_with(
        &[
            "run",
            "--model",
            tiny().to_str().unwrap(),
            "--prompt-ids",
            "1",
        ],
        "has no config.json",
    );
    fails_with(
        &["run", "--model", ck, "--prompt-ids", "1,5000"],
        "token id 5000 is outside",
    );
    fails_with(&["run", "--model", ck, "--prompt-ids", ""], "empty prompt");
    // Prompt plus --max-new beyond --context: one error naming both and the context.
    fails_with(
        &[
            "run",
            "--model",
            ck,
            "--prompt-ids",
            "1,2,3,4",
            "--max-new",
            "7",
            "--context",
            "10",
        ],
        "the prompt (4 tokens) plus --max-new (7) exceeds the context of 10 tokens",
    );
    fails_with(
        &[
            "run",
            "--model",
            ck,
            "--prompt-ids",
            "1",
            "--max-new",
            "1000000000000",
        ],
        "exceeds the context",
    );
    fails_with(
        &["run", "--model", ck, "--prompt-ids", "1,x"],
        "\"x\" is not a token id",
    );
    fails_with(
        &[
            "logits",
            "--model",
            ck,
            "--prompt-ids",
            "1,2",
            "--top",
            "3",
            "--json",
            "--bogus",
        ],
        "--bogus",
    );
}

#[test]
fn tokenize_json_and_text_prompt_round_trip() {
    let Some(m) = code_small() else {
        eprintln!("skipped: shared/models/k3-code-small is not beside the repository");
        return;
    };
    let m = m.to_str().unwrap();
    let out = fathom(&["tokenize", "--model", m, "--json", "import os\n"]);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u64> = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert!(!ids.is_empty());
    // The same text through `run --prompt` gives the same prompt ids and decoded text.
    let out = fathom(&[
        "run",
        "--model",
        m,
        "--prompt",
        "import os\n",
        "--max-new",
        "4",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let p: Vec<u64> = r["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    // k3-code-small's config names bos_token_id 8192 and its tokenizer
    // config does not say otherwise: `--prompt` puts BOS first.
    assert_eq!(p[0], 8192);
    assert_eq!(p[1..], ids[..]);
    assert!(r["text"].is_string());
    let out = fathom(&[
        "run",
        "--model",
        m,
        "--prompt",
        "import os\n",
        "--max-new",
        "1",
        "--json",
        "--no-bos",
    ]);
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["prompt_ids"].as_array().unwrap().len(), ids.len());
}

#[test]
fn bad_sampling_values_give_one_clear_error() {
    let ck = tiny().join("checkpoint");
    let m = ck.to_str().unwrap();
    for (flag, value, needle) in [
        ("--temperature", "-1", "--temperature must be"),
        ("--top-p", "0", "--top-p must be"),
        ("--top-p", "1.5", "--top-p must be"),
        ("--min-p", "2", "--min-p must be"),
        ("--repetition-penalty", "0", "--repetition-penalty must be"),
        ("--presence-penalty", "3", "--presence-penalty must be"),
        ("--logprobs", "21", "--logprobs must be"),
    ] {
        fails_with(
            &["run", "--model", m, "--prompt-ids", "1,2", flag, value],
            needle,
        );
    }
    // --stop needs a tokenizer to match text; k3-tiny has none.
    fails_with(
        &["run", "--model", m, "--prompt-ids", "1,2", "--stop", "x"],
        "--stop needs a tokenizer",
    );
}

/// `fathom batch` gives every line exactly what `fathom run` gives alone.
#[test]
fn batch_equals_run_per_prompt() {
    let Some(m) = code_small() else {
        eprintln!("skipped: shared/models/k3-code-small is not beside the repository");
        return;
    };
    let m = m.to_str().unwrap();
    let dir = std::env::temp_dir().join(format!("fathom-batch-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("p.jsonl");
    let lines = [
        r#"{"prompt": "def fibonacci(n):"}"#,
        r#"{"prompt": "import numpy as np\n", "max_new": 5}"#,
        r#"{"prompt": "class Stack:", "temperature": 0.8, "seed": 3}"#,
        r#"{"prompt_ids": [8192, 886, 970, 198], "temperature": 1.2, "top_k": 20, "seed": 9}"#,
        r#"{"prompt": "for i in range(10):", "stop": ["\n"]}"#,
    ];
    std::fs::write(&file, lines.join("\n")).unwrap();
    let out = fathom(&[
        "batch",
        "--model",
        m,
        "--prompts",
        file.to_str().unwrap(),
        "--max-new",
        "12",
        "--max-step-tokens",
        "6",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let b: Value = serde_json::from_slice(&out.stdout).unwrap();
    let results = b["results"].as_array().unwrap();
    assert_eq!(results.len(), lines.len());
    assert!(b["stats"]["aggregate_tok_s"].as_f64().unwrap() > 0.0);
    assert!(b["stats"]["mean_batch_size"].as_f64().unwrap() > 1.0);
    let runs: [&[&str]; 5] = [
        &["--prompt", "def fibonacci(n):"],
        &["--prompt", "import numpy as np\n", "--max-new", "5"],
        &[
            "--prompt",
            "class Stack:",
            "--temperature",
            "0.8",
            "--seed",
            "3",
        ],
        &[
            "--prompt-ids",
            "8192,886,970,198",
            "--temperature",
            "1.2",
            "--top-k",
            "20",
            "--seed",
            "9",
        ],
        &["--prompt", "for i in range(10):", "--stop", "\n"],
    ];
    for (i, extra) in runs.iter().enumerate() {
        let mut args = vec!["run", "--model", m, "--json"];
        if !extra.contains(&"--max-new") {
            args.extend_from_slice(&["--max-new", "12"]);
        }
        args.extend_from_slice(extra);
        let out = fathom(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        for key in ["prompt_ids", "output_ids", "text", "finish_reason"] {
            assert_eq!(r[key], results[i][key], "line {i}: {key}");
        }
    }
    if results[4]["finish_reason"] == "stop" {
        assert!(!results[4]["text"].as_str().unwrap().contains('\n'));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn chat_works_on_a_synth_model() {
    use std::io::Write;
    use std::process::Stdio;
    let dir = std::env::temp_dir().join(format!("fathom-chat-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    let out = fathom(&["synth", "--out", d, "--preset", "tiny", "--seed", "3"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args([
            "chat",
            "--model",
            d,
            "--max-new",
            "5",
            "--system",
            "be brief",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Two turns: the second reuses the state of the first where the prompt extends it.
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"hello there\nand again\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(err.matches(" tokens, ").count(), 2, "two replies: {err}");
    assert!(!err.contains("panicked"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prefill_chunk_does_not_change_the_golden_tokens() {
    let ck = tiny().join("checkpoint");
    let (ids, greedy, _) = golden_prompt(2);
    for chunk in ["1", "3", "512"] {
        let out = fathom(&[
            "run",
            "--model",
            ck.to_str().unwrap(),
            "--prompt-ids",
            &ids,
            "--max-new",
            "16",
            "--json",
            "--draft",
            "off",
            "--prefill-chunk",
            chunk,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let got = output_ids(&v);
        assert_eq!(got, greedy[..got.len()], "--prefill-chunk {chunk}");
        assert_eq!(got.len(), 16.min(greedy.len()));
    }
}

/// Thread placement changes where the work runs, never its result: pinned
/// threads (1, 2 and 3 of them), with NUMA interleaving on and off, give the
/// golden tokens, and the run report says what was decided.
#[test]
fn pinned_threads_and_numa_placement_keep_the_golden_tokens() {
    let ck = tiny().join("checkpoint");
    let (ids, greedy, _) = golden_prompt(2);
    for (threads, numa) in [("1", "auto"), ("2", "off"), ("3", "auto")] {
        let v = run_json(&[
            "run",
            "--model",
            ck.to_str().unwrap(),
            "--prompt-ids",
            &ids,
            "--max-new",
            "16",
            "--json",
            "--pin-threads",
            "--threads",
            threads,
            "--numa",
            numa,
        ]);
        let got = output_ids(&v);
        assert_eq!(
            got,
            greedy[..got.len()],
            "--threads {threads} --numa {numa}"
        );
        let s = &v["stats"];
        assert_eq!(s["pinned_threads"], true);
        assert_eq!(s["threads"].as_u64().unwrap().to_string(), threads);
        assert!(s["numa_nodes"].as_u64().unwrap() >= 1, "{s}");
        if numa == "off" {
            assert_eq!(s["numa_interleaved"], false);
        }
    }
    fails_with(
        &[
            "run",
            "--model",
            ck.to_str().unwrap(),
            "--prompt-ids",
            "1",
            "--numa",
            "spread",
        ],
        "invalid value 'spread' for '--numa",
    );
}
