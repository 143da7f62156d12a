//! `--spine int8` frees the stored spine before the experts load: the
//! ledger (`inspect --json`) plans a lower peak than for bf16, and a
//! resident run of k3-code-small measures it (peak RSS ≤ 0.9× the bf16 run).

mod common;

use common::{code_small, run_json};

#[test]
fn int8_spine_lowers_the_planned_and_the_measured_peak() {
    let Some(dir) = code_small() else {
        eprintln!("skipped: k3-code-small is not beside the repository");
        return;
    };
    let d = dir.to_str().unwrap();
    let plan = run_json(&["inspect", d, "--ram-budget", "1GB", "--json"]);
    let peak = |s: &str| plan["ledger"][s]["peak_bytes"].as_u64().unwrap();
    let (spine_b, spine_i) = (
        plan["ledger"]["bf16"]["spine_bytes"].as_u64().unwrap(),
        plan["ledger"]["int8"]["spine_bytes"].as_u64().unwrap(),
    );
    assert_eq!(
        peak("bf16") - peak("int8"),
        spine_b - spine_i,
        "the ledger saves the spine difference: {plan}"
    );
    let rss = |spine: &str| {
        let r = run_json(&[
            "run",
            "--model",
            d,
            "--prompt-ids",
            "1,2,3",
            "--max-new",
            "2",
            "--experts",
            "resident",
            "--spine",
            spine,
            "--json",
        ]);
        r["stats"]["peak_rss_bytes"].as_u64().unwrap() as f64
    };
    let (b, i) = (rss("bf16"), rss("int8"));
    eprintln!(
        "peak RSS bf16 {:.1} MB, int8 {:.1} MB ({:.2}×); spine {:.1} → {:.1} MB",
        b / 1e6,
        i / 1e6,
        i / b,
        spine_b as f64 / 1e6,
        spine_i as f64 / 1e6
    );
    assert!(i <= 0.9 * b, "int8 peak {i} vs bf16 {b}");
}
