//! Long context from the command line: the latent cache spills beyond
//! --kv-ram and gives the same tokens, the context defaults to what the
//! model declares, and `inspect` plans a 1M-token cache in RAM and on disk.

mod common;

use common::{fails_with, fathom, k3_config, tiny, tiny_copy};
use serde_json::Value;

fn run_json(args: &[&str]) -> Value {
    let out = fathom(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("run --json prints JSON")
}

fn prompt(n: usize) -> String {
    (0..n)
        .map(|i| ((i * 37 + 5) % 1000 + 3).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn a_spilled_cache_gives_the_same_tokens_and_leaves_no_files() {
    let ck = tiny().join("checkpoint");
    let ck = ck.to_str().unwrap();
    let ids = prompt(700);
    let base = [
        "run",
        "--model",
        ck,
        "--prompt-ids",
        &ids,
        "--max-new",
        "12",
        "--json",
    ];
    let ram = run_json(&base);
    let dir = std::env::temp_dir().join(format!("fathom-kv-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut spill = base.to_vec();
    spill.extend(["--kv-ram", "100KB", "--kv-dir", dir.to_str().unwrap()]);
    let disk = run_json(&spill);
    assert_eq!(ram["output_ids"], disk["output_ids"]);
    let s = &disk["stats"];
    assert!(s["kv_blocks_spilled"].as_u64().unwrap() > 0, "{s}");
    assert!(s["kv_bytes_read"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(ram["stats"]["kv_blocks_spilled"], 0);
    let left = std::fs::read_dir(&dir).map(|r| r.count()).unwrap_or(0);
    assert_eq!(left, 0, "the spill file is unlinked");
    let _ = std::fs::remove_dir_all(&dir);
    // bf16 rows: the run completes and says nothing is spilled.
    let mut bf = base.to_vec();
    bf.extend(["--kv-dtype", "bf16"]);
    assert_eq!(run_json(&bf)["stats"]["kv_blocks_spilled"], 0);
}

#[test]
fn the_context_defaults_to_max_position_embeddings() {
    let dir = tiny_copy("ctx-default");
    let cfg = dir.join("config.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    v["text_config"]["max_position_embeddings"] = 64.into();
    std::fs::write(&cfg, serde_json::to_vec(&v).unwrap()).unwrap();
    let d = dir.to_str().unwrap();
    let ids = prompt(60);
    fails_with(
        &["run", "--model", d, "--prompt-ids", &ids, "--max-new", "5"],
        "the prompt (60 tokens) plus --max-new (5) exceeds the context of 64 tokens",
    );
    // --context may lower it, never raise it past what the model declares.
    fails_with(
        &[
            "run",
            "--model",
            d,
            "--prompt-ids",
            &ids,
            "--max-new",
            "5",
            "--context",
            "100000",
        ],
        "exceeds the context of 64 tokens",
    );
    let ok = run_json(&[
        "run",
        "--model",
        d,
        "--prompt-ids",
        &ids,
        "--max-new",
        "4",
        "--json",
    ]);
    assert_eq!(ok["output_ids"].as_array().unwrap().len(), 4);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn inspect_plans_a_million_token_cache_in_ram_and_on_disk() {
    let dir = k3_config("long");
    let d = dir.to_str().unwrap();
    let out = fathom(&[
        "inspect",
        d,
        "--context",
        "1000000",
        "--ram-budget",
        "24GB",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    // K3: 24 MLA layers × 576 fp32 per token; 1,000,192 rows in whole blocks.
    let want = 24 * 576 * 4 * 1_000_192u64;
    assert_eq!(r["state"]["mla_bytes"], want);
    let l = &r["ledger"]["int8"];
    let (ram, disk) = (
        l["kv_ram_bytes"].as_u64().unwrap(),
        l["kv_disk_bytes"].as_u64().unwrap(),
    );
    assert_eq!(ram, 6_000_000_000, "a quarter of the budget by default");
    assert_eq!(ram + disk, want);
    // With a bf16 cache and a 2 GB share the disk part halves as well.
    let out = fathom(&[
        "inspect",
        d,
        "--context",
        "1000000",
        "--ram-budget",
        "24GB",
        "--json",
        "--kv-dtype",
        "bf16",
        "--kv-ram",
        "2GB",
    ]);
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    let l = &r["ledger"]["bf16"];
    assert_eq!(l["kv_ram_bytes"], 2_000_000_000u64);
    assert_eq!(l["kv_disk_bytes"], want / 2 - 2_000_000_000);
    let _ = std::fs::remove_dir_all(&dir);
}
