//! Every family runs through the same commands: `fathom run` on the
//! Qwen3-MoE, Kimi-Linear, DeepSeek-V3, Kimi K2 and GPT-OSS fixtures gives
//! the reference's greedy ids, resident, streamed, drafted, and in a batch.

mod common;

use std::path::PathBuf;

use common::fathom;
use serde_json::Value;

/// Every family's tiny fixture, with the reference's outputs.
const FIXTURES: [&str; 5] = [
    "qwen3_moe-tiny",
    "kimi_linear-tiny",
    "deepseek_v3-tiny",
    "kimi_k2-tiny",
    "gpt_oss-tiny",
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data")
        .join(name)
}

/// (input ids, greedy ids) of every golden prompt.
fn golden(dir: &std::path::Path) -> Vec<(Vec<u64>, Vec<u64>)> {
    let g: Value =
        serde_json::from_slice(&std::fs::read(dir.join("golden.json")).unwrap()).unwrap();
    let ids = |v: &Value| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    g["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (ids(&p["input_ids"]), ids(&p["greedy_ids"])))
        .collect()
}

fn csv(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

fn run(args: &[&str]) -> Value {
    let out = fathom(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[test]
fn run_gives_the_reference_greedy_ids_for_every_family() {
    for name in FIXTURES {
        let dir = fixture(name);
        let d = dir.to_str().unwrap();
        for (i, (prompt, want)) in golden(&dir).iter().enumerate() {
            let (p, n) = (csv(prompt), want.len().to_string());
            let base = [
                "run",
                "--model",
                d,
                "--prompt-ids",
                &p,
                "--max-new",
                &n,
                "--json",
            ];
            for extra in [
                &[][..],
                &["--experts", "stream"][..],
                &["--draft", "ngram", "--draft-max", "4"][..],
            ] {
                let mut args = base.to_vec();
                args.extend_from_slice(extra);
                let r = run(&args);
                let got: Vec<u64> = r["output_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .collect();
                assert_eq!(&got, want, "{name} prompt {i} {extra:?}");
            }
        }
    }
}

#[test]
fn batch_runs_every_family_exactly() {
    for name in FIXTURES {
        let dir = fixture(name);
        let cases = golden(&dir);
        let lines: String = cases
            .iter()
            .map(|(p, g)| {
                serde_json::json!({"prompt_ids": p, "max_new": g.len()}).to_string() + "\n"
            })
            .collect();
        let file =
            std::env::temp_dir().join(format!("fathom-fam-{name}-{}.jsonl", std::process::id()));
        std::fs::write(&file, lines).unwrap();
        let r = run(&[
            "batch",
            "--model",
            dir.to_str().unwrap(),
            "--prompts",
            file.to_str().unwrap(),
            "--json",
        ]);
        for (i, (res, (_, want))) in r["results"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&cases)
            .enumerate()
        {
            let got: Vec<u64> = res["output_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            assert_eq!(&got, want, "{name} line {i}");
        }
        let _ = std::fs::remove_file(file);
    }
}
