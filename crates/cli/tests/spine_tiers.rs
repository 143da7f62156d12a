//! A spine deeper than the RAM budget: `run` reads the layers that do not
//! fit for every pass and gives the resident run's tokens; `inspect` plans
//! the full Kimi K3's spine tiers at 64 GB, 128 GB and 32 GB + a 24 GB GPU.

mod common;

use common::{code_draft, code_small, fathom, k3_config};
use serde_json::Value;

fn ok(args: &[&str]) -> (Value, String) {
    let out = fathom(args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{args:?}: {err}");
    (serde_json::from_slice(&out.stdout).expect("JSON"), err)
}

fn ids(v: &Value) -> Vec<u64> {
    v["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn a_spine_larger_than_the_budget_gives_the_resident_tokens() {
    let Some(m) = code_small() else {
        eprintln!("skipped: shared/models/k3-code-small is not beside the repository");
        return;
    };
    let m = m.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec![
            "run",
            "--model",
            m,
            "--prompt",
            "def fibonacci(n):",
            "--max-new",
            "12",
            "--json",
            "--stats",
        ];
        a.extend_from_slice(extra);
        ok(&a)
    };
    let (resident, err) = run(&[]);
    assert!(!err.contains("read for every pass"), "{err}");
    let want = ids(&resident);
    assert_eq!(want.len(), 12);
    let n = |v: &Value, k: &str| v["stats"][k].as_u64().unwrap_or_else(|| panic!("{k}: {v}"));
    assert_eq!(n(&resident, "spine_passes"), 0);
    assert_eq!(n(&resident, "spine_bytes_read"), 0);
    // k3-code-small's spine is ~62 MB: at 110 MB some layers stream.
    let (tight, err) = run(&["--ram-budget", "110MB"]);
    assert!(err.contains("read for every pass"), "{err}");
    assert_eq!(ids(&tight), want, "110 MB budget");
    // Every layer read for every pass.
    let (none, err) = run(&["--ram-budget", "110MB", "--spine-resident-layers", "0"]);
    assert!(err.contains(" 0 of "), "{err}");
    assert!(err.contains("the head in row blocks"), "{err}");
    assert_eq!(ids(&none), want, "no layer resident");
    // Verifying drafted tokens through the streamed layers and head.
    if let Some(d) = code_draft() {
        let draft = format!("model:{}", d.display());
        let (drafted, _) = run(&[
            "--ram-budget",
            "130MB",
            "--spine-resident-layers",
            "0",
            "--draft",
            &draft,
        ]);
        assert_eq!(ids(&drafted), want, "drafting on a streamed spine");
        assert!(
            drafted["stats"]["draft"]["verify_passes"].as_u64().unwrap() > 0,
            "{drafted}"
        );
    } else {
        eprintln!("drafting skipped: shared/models/k3-code-draft is not beside the repository");
    }
    // Every pass read every layer once: about the plan's streamed bytes a
    // pass (which counts the layers as held in RAM: a few small tensors
    // are widened to f32 there), plus at most the ring's read-ahead past
    // the last pass.
    let per_pass = n(&none, "spine_streamed_bytes") as f64;
    assert_eq!(n(&none, "spine_streamed_layers"), 12);
    let (passes, bytes) = (n(&none, "spine_passes"), n(&none, "spine_bytes_read"));
    assert!(passes >= 2, "{none}");
    let per = bytes as f64 / passes as f64;
    assert!(
        per >= 0.98 * per_pass && per <= (1.0 + 1.0 / passes as f64) * per_pass,
        "{bytes} bytes in {passes} passes of {per_pass}"
    );
    // Reads of 64 KiB and more (all but ~6 % of these layers' bytes: norms
    // and small projections) bypass the page cache where the filesystem
    // allows, so each pass's bytes come from storage.
    let direct = n(&none, "spine_direct_bytes_read");
    if direct == 0 {
        eprintln!("the model's filesystem refuses uncached reads: every spine read was buffered");
    } else {
        assert!(
            direct as f64 >= 0.9 * bytes as f64 && direct <= bytes,
            "{direct} of {bytes} bytes uncached"
        );
    }
    // Decode alone: the passes after the first token.
    let (dp, db) = (
        n(&none, "spine_decode_passes"),
        n(&none, "spine_decode_bytes_read"),
    );
    assert!(dp > 0 && dp < passes, "{none}");
    assert!(db as f64 >= 0.98 * per_pass * dp as f64, "{none}");
}

#[test]
fn a_budget_below_a_streamed_pass_names_the_least_that_works() {
    let Some(m) = code_small() else {
        eprintln!("skipped: shared/models/k3-code-small is not beside the repository");
        return;
    };
    let m = m.to_str().unwrap();
    let out = fathom(&[
        "run",
        "--model",
        m,
        "--prompt",
        "x",
        "--max-new",
        "1",
        "--ram-budget",
        "20MB",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let mb: u64 = err
        .split("--ram-budget ")
        .nth(1)
        .and_then(|r| r.split("MB").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no least budget named: {err}"));
    let at = |mb: u64| {
        fathom(&[
            "run",
            "--model",
            m,
            "--prompt",
            "x",
            "--max-new",
            "1",
            "--ram-budget",
            &format!("{mb}MB"),
        ])
        .status
        .success()
    };
    assert!(at(mb), "{mb} MB (named by: {err}) is refused");
    assert!(!at(mb - 1), "{} MB is accepted", mb - 1);
}

/// `inspect`'s plan of the full K3 config (written once) at `args`.
fn k3_plan(args: &[&str]) -> Value {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| k3_config("plain"));
    plan_of(dir, args)
}

/// `inspect DIR --context 4096 --json` with `args`.
fn plan_of(dir: &std::path::Path, args: &[&str]) -> Value {
    let mut a = vec![
        "inspect",
        dir.to_str().unwrap(),
        "--context",
        "4096",
        "--json",
    ];
    a.extend_from_slice(args);
    ok(&a).0
}

/// The figures every plan must satisfy: the tiers (and the embedding,
/// when its rows are read as asked) add up to the spine, the fixed parts
/// and the cache fit the budget.
fn check(l: &Value, spine: u64, budget: u64) -> &Value {
    let t = &l["tiers"];
    let u = |v: &Value| v.as_u64().unwrap();
    // K3's embedding: 163,840 × 7,168 bf16.
    let embedding = if t["embedding_on_disk"] == true {
        2_348_810_240
    } else {
        0
    };
    assert_eq!(
        u(&t["global_bytes"])
            + embedding
            + u(&t["resident_bytes"])
            + u(&t["device_bytes"])
            + u(&t["streamed_bytes"]),
        spine
    );
    assert_eq!(
        u(&l["spine_bytes"]),
        u(&t["global_bytes"]) + u(&t["resident_bytes"])
    );
    assert_eq!(
        u(&t["resident_layers"]) + u(&t["device_layers"]) + u(&t["streamed_layers"]),
        u(&t["layers"])
    );
    assert_eq!(u(&t["layers"]), 93);
    let fixed = u(&l["spine_bytes"])
        + u(&t["ring_bytes"])
        + u(&l["state_bytes"])
        + u(&l["scratch_bytes"])
        + u(&l["io_buffers_bytes"]);
    assert!(fixed + u(&l["cache_bytes"]) <= budget);
    assert_eq!(l["fits"], true);
    t
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap()
}

/// The full K3 at 64 GB, planned for a run's 9-token verification pass:
/// the bf16 spine leaves the embedding's rows on disk, keeps 40 of 93
/// layers (the largest) and reads the other 53 (57.0 GB) each pass through
/// a ring of 4; the int8 spine is resident whole.
#[test]
fn inspect_plans_the_full_k3_at_64_gb() {
    let r = k3_plan(&["--ram-budget", "64GB"]);
    let (bf16, int8) = (&r["ledger"]["bf16"], &r["ledger"]["int8"]);
    let spine = |k: &str| u(&r["spine"][format!("{k}_bytes")]);
    let t = check(bf16, spine("bf16"), 64_000_000_000);
    assert_eq!((u(&t["resident_layers"]), u(&t["ring"])), (40, 4));
    assert_eq!(u(&t["streamed_bytes"]), 57_028_638_208);
    assert_eq!(u(&t["ring_bytes"]), 4_647_568_384);
    // Seconds a pass reads at the default 7 GB/s: the streamed layers,
    // then the missed experts.
    let p = &bf16["projected"];
    assert_eq!(u(&p["disk_bw"]), 7_000_000_000);
    let spine_s = p["spine_read_s"].as_f64().unwrap();
    assert!((spine_s - 57_028_638_208.0 / 7e9).abs() < 1e-9, "{spine_s}");
    let t = check(int8, spine("int8"), 64_000_000_000);
    assert_eq!(
        (u(&t["resident_layers"]), u(&t["streamed_layers"])),
        (93, 0)
    );
    assert_eq!(int8["projected"]["spine_read_s"], 0.0);
    // The least budget: every layer, the embedding and the head (2.35 GB,
    // two 67.1 MB blocks held) read for every pass (with the I/O buffers of
    // a 9-token pass, 3.16 GB).
    assert_eq!(u(&bf16["min_budget_bytes"]), 8_150_247_936);
    // The int8 least holds the largest layer (the dense first, 2.34 GB)
    // as stored while it is read and quantised.
    assert_eq!(u(&int8["min_budget_bytes"]), 8_695_144_264);
    // Beside a 24 GB GPU, 16 of the 53 streamed layers are held there.
    let r = k3_plan(&["--ram-budget", "64GB", "--vram-budget", "24GB"]);
    let t = check(&r["ledger"]["bf16"], spine("bf16"), 64_000_000_000);
    assert_eq!(layer_tiers(t), (40, 16, 37));
    assert_eq!(u(&t["read_bytes"]), 36_744_730_112);
}

/// At 128 GB both spines are resident whole.
#[test]
fn inspect_plans_the_full_k3_at_128_gb() {
    let r = k3_plan(&["--ram-budget", "128GB"]);
    for k in ["bf16", "int8"] {
        let t = check(
            &r["ledger"][k],
            u(&r["spine"][format!("{k}_bytes")]),
            128_000_000_000,
        );
        assert_eq!(
            (u(&t["resident_layers"]), u(&t["ring_bytes"])),
            (93, 0),
            "{k}"
        );
    }
    assert_eq!(u(&r["ledger"]["bf16"]["spine_bytes"]), 113_509_540_864);
}

/// 32 GB of RAM beside a 24 GB GPU: the RAM plan keeps 16 bf16 or 35
/// int8 layers resident; of the rest, as many as the VRAM budget less an
/// eighth holds (the state, 1.4 GB, needs less) go to the device (their
/// matrices there, their norms in RAM) and the others are read for every
/// pass. Without the int8
/// spine file an int8 layer is quantised in RAM, so none is held.
#[test]
fn inspect_plans_the_full_k3_at_32_gb_with_a_24_gb_gpu() {
    let r = k3_plan(&["--ram-budget", "32GB", "--vram-budget", "24GB"]);
    let b = check(
        &r["ledger"]["bf16"],
        u(&r["spine"]["bf16_bytes"]),
        32_000_000_000,
    );
    assert_eq!((u(&b["resident_layers"]), u(&b["ring"])), (16, 3));
    assert_eq!(
        (u(&b["device_layers"]), u(&b["device_bytes"])),
        (16, 20_272_578_560)
    );
    assert!(u(&b["device_bytes"]) <= 24_000_000_000 / 8 * 7);
    assert_eq!(u(&b["streamed_layers"]), 61);
    assert_eq!(u(&b["streamed_bytes"]), 67_170_592_256);
    let i = check(
        &r["ledger"]["int8"],
        u(&r["spine"]["int8_bytes"]),
        32_000_000_000,
    );
    assert_eq!((u(&i["resident_layers"]), u(&i["ring"])), (35, 3));
    assert_eq!(u(&i["device_layers"]), 0);
    assert_eq!(u(&i["streamed_bytes"]), 32_092_490_496);
    // A pass reads them as stored (bf16) and quantises each after its
    // read: about twice what they hold in RAM, and the projection counts
    // what is read.
    assert_eq!(u(&b["read_bytes"]), u(&b["streamed_bytes"]));
    assert_eq!(u(&i["read_bytes"]), 63_367_359_488);
    let s = r["ledger"]["int8"]["projected"]["spine_read_s"]
        .as_f64()
        .unwrap();
    assert!((s - 63_367_359_488.0 / 7e9).abs() < 1e-9, "{s}");
    assert_eq!(u(&r["vram"]["budget_bytes"]), 24_000_000_000);
    // Beside the int8 spine file, the int8 layers' codes and scales are
    // held as they are stored: 32 on the device, 26 read for every pass.
    let dir = k3_config("int8file");
    std::fs::write(dir.join("spine-int8.fathom"), b"").unwrap();
    let r8 = plan_of(&dir, &["--ram-budget", "32GB", "--vram-budget", "24GB"]);
    let l = &r8["ledger"]["int8"];
    let t = &l["tiers"];
    assert_eq!(layer_tiers(t), (35, 32, 26));
    assert_eq!(u(&t["device_bytes"]), 20_491_235_328);
    assert_eq!(u(&t["read_bytes"]), 11_578_596_096);
    let s = l["projected"]["spine_read_s"].as_f64().unwrap();
    assert!((s - 11_578_596_096.0 / 7e9).abs() < 1e-9, "{s}");
    std::fs::remove_dir_all(&dir).unwrap();
    // Below the least budget the plan is refused and names it.
    let r = k3_plan(&["--ram-budget", "8GB"]);
    assert_eq!(r["ledger"]["bf16"]["fits"], false);
    assert_eq!(u(&r["ledger"]["bf16"]["min_budget_bytes"]), 8_150_247_936);
}

/// A plan's layers resident, held on the device and streamed.
fn layer_tiers(t: &Value) -> (u64, u64, u64) {
    let n = |k: &str| u(&t[k]);
    (
        n("resident_layers"),
        n("device_layers"),
        n("streamed_layers"),
    )
}
