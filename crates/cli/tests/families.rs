//! Every family runs through the same commands: `fathom run` on the
//! Qwen3-MoE, Kimi-Linear, DeepSeek-V3, Kimi K2 and GPT-OSS fixtures gives
//! the reference's greedy ids, resident, streamed, drafted, and in a batch.

mod common;

use common::{fathom, fixture, run_json};
use serde_json::Value;

/// Every family's tiny fixture, with the reference's outputs.
const FIXTURES: [&str; 5] = [
    "qwen3_moe-tiny",
    "kimi_linear-tiny",
    "deepseek_v3-tiny",
    "kimi_k2-tiny",
    "gpt_oss-tiny",
];

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
                let r = run_json(&args);
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
        let r = run_json(&[
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

/// Bytes of every tensor in a safetensors file's header, split into routed
/// experts (names with `.experts.`) and the rest.
fn header_bytes(file: &std::path::Path) -> (u64, u64) {
    let raw = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&raw[8..8 + n]).unwrap();
    let (mut experts, mut rest) = (0, 0);
    for (name, t) in h.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        let o = t["data_offsets"].as_array().unwrap();
        let len = o[1].as_u64().unwrap() - o[0].as_u64().unwrap();
        if name.contains(".experts.") {
            experts += len;
        } else {
            rest += len;
        }
    }
    (experts, rest)
}

#[test]
fn inspect_states_every_familys_bytes_from_its_config() {
    for name in FIXTURES {
        let dir = fixture(name);
        let out = fathom(&[
            "inspect",
            dir.to_str().unwrap(),
            "--ram-budget",
            "1GB",
            "--context",
            "1000",
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: Value = serde_json::from_slice(&out.stdout).unwrap();
        // The config-only figures equal what the checkpoint holds.
        let (experts, rest) = header_bytes(&dir.join("model.safetensors"));
        assert_eq!(
            r["spine"]["bf16_bytes"].as_u64().unwrap(),
            rest,
            "{name} spine"
        );
        let each = r["expert_bytes"].as_u64().unwrap();
        assert_eq!(
            each * r["experts_total"].as_u64().unwrap(),
            experts,
            "{name} experts"
        );
        let m = &r["model"];
        let per_token = m["top_k"].as_u64().unwrap() * m["moe_layers"].as_u64().unwrap() * each;
        assert_eq!(
            r["per_token"]["routed_expert_bytes"].as_u64().unwrap(),
            per_token
        );
        assert_eq!(r["ledger"]["bf16"]["fits"], true, "{name}");
    }
}

#[test]
fn verify_checks_every_familys_tensors() {
    for (name, family) in FIXTURES.iter().zip([
        "Qwen3-MoE",
        "Kimi-Linear",
        "DeepSeek-V3",
        "DeepSeek-V3",
        "GPT-OSS",
    ]) {
        let dir = fixture(name);
        let out = fathom(&["verify", dir.to_str().unwrap()]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{name}: {text}");
        assert!(text.starts_with("ok: 1 shard, "), "{name}: {text}");
        // A vocabulary one token larger than the checkpoint's embedding.
        let bad = std::env::temp_dir().join(format!("fathom-verify-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&bad);
        std::fs::create_dir_all(&bad).unwrap();
        let mut config: Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
        let vocab = config["vocab_size"].as_u64().unwrap();
        config["vocab_size"] = (vocab + 1).into();
        std::fs::write(bad.join("config.json"), config.to_string()).unwrap();
        std::fs::copy(dir.join("model.safetensors"), bad.join("model.safetensors")).unwrap();
        let out = fathom(&["verify", bad.to_str().unwrap()]);
        let (text, err) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(!out.status.success(), "{name}: {text}");
        assert!(
            text.starts_with("FAILED: ") && text.contains("embed_tokens"),
            "{name}: {text}"
        );
        assert!(
            err.contains(&format!("is not a valid {family} checkpoint")),
            "{name}: {err}"
        );
        let _ = std::fs::remove_dir_all(&bad);
    }
}
