//! `fathom convert --spine int8`: the int8 spine file beside a checkpoint.
//! A `--spine int8` load reading it gives the logits of one quantising as
//! it reads, in every family; a streamed int8 pass reads about half the
//! bytes; bf16 loads never read it; a file made from other weights, or by
//! another format, is refused naming the fix.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::{fails_quietly, fathom, fixture, run_json, tiny};
use serde_json::Value;

const FILE: &str = "spine-int8.fathom";

/// A private copy of the checkpoint in `src`.
fn copy_of(src: &Path, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fathom-convert-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
        }
    }
    dir
}

fn logits(m: &Path, spine: &str) -> Value {
    run_json(&[
        "logits",
        "--model",
        m.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3,5,8",
        "--top",
        "64",
        "--spine",
        spine,
        "--json",
    ])
}

fn convert(m: &Path, extra: &[&str]) -> Value {
    let mut a = vec!["convert", "--model", m.to_str().unwrap(), "--spine", "int8"];
    a.extend_from_slice(extra);
    a.push("--json");
    run_json(&a)
}

/// The receipt: the file header's `__metadata__`.
fn receipt(file: &Path) -> Value {
    let f = std::fs::File::open(file).unwrap();
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, 0).unwrap();
    let mut h = vec![0u8; u64::from_le_bytes(n) as usize];
    f.read_exact_at(&mut h, 8).unwrap();
    let v: Value = serde_json::from_slice(&h).unwrap();
    v["__metadata__"].clone()
}

#[test]
fn every_family_reads_its_int8_file_to_the_same_logits() {
    let dirs = [
        ("k3", tiny().join("checkpoint")),
        ("k2", fixture("kimi_k2-tiny")),
        ("kl", fixture("kimi_linear-tiny")),
        ("qw", fixture("qwen3_moe-tiny")),
        ("ds", fixture("deepseek_v3-tiny")),
        ("go", fixture("gpt_oss-tiny")),
    ];
    for (tag, src) in dirs {
        let m = copy_of(&src, tag);
        let (int8, bf16) = (logits(&m, "int8"), logits(&m, "bf16"));
        assert_ne!(int8, bf16, "{tag}: int8 should differ from bf16 somewhere");
        let c = convert(&m, &[]);
        let n = c["matrices"].as_u64().unwrap();
        assert!(n >= 10, "{tag}: {c}");
        let (bytes, stored) = (
            c["bytes"].as_u64().unwrap(),
            c["source_bytes"].as_u64().unwrap(),
        );
        assert!(m.join(FILE).is_file() && bytes > stored / 2, "{tag}: {c}");
        let r = receipt(&m.join(FILE));
        assert_eq!(r["source_digest"], c["source_digest"], "{tag}");
        assert_eq!(r["format"], "fathom int8 spine 1", "{tag}");
        assert!(
            r["lossy"].as_str().unwrap().starts_with("yes"),
            "{tag}: {r}"
        );
        assert_eq!(logits(&m, "int8"), int8, "{tag}: int8 from the file");
        assert_eq!(logits(&m, "bf16"), bf16, "{tag}: bf16 beside the file");
        // The file is what the load reads: a code changed in it (the
        // receipt covers the source, not the codes) changes the logits.
        flip_a_code(&m.join(FILE));
        assert_ne!(
            logits(&m, "int8"),
            int8,
            "{tag}: a changed code in the file"
        );
        assert_eq!(logits(&m, "bf16"), bf16, "{tag}: bf16 never reads it");
        std::fs::remove_dir_all(&m).unwrap();
    }
}

/// Adds 64 to the first code of the file's largest decoder-layer matrix
/// (every logit depends on it; a head row would move one logit only).
fn flip_a_code(file: &Path) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, 0).unwrap();
    let len = u64::from_le_bytes(n);
    let mut h = vec![0u8; len as usize];
    f.read_exact_at(&mut h, 8).unwrap();
    let v: Value = serde_json::from_slice(&h).unwrap();
    let (a, b) = v
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.ends_with("#int8") && k.contains("layers."))
        .map(|(_, e)| {
            let o = &e["data_offsets"];
            (o[0].as_u64().unwrap(), o[1].as_u64().unwrap())
        })
        .max_by_key(|(a, b)| b - a)
        .unwrap();
    assert!(b > a);
    let mut c = [0u8; 1];
    f.read_exact_at(&mut c, 8 + len + a).unwrap();
    f.write_all_at(&[c[0].wrapping_add(64)], 8 + len + a)
        .unwrap();
}

#[test]
fn a_streamed_int8_pass_reads_the_file_about_half_the_bytes() {
    let m = copy_of(&tiny().join("checkpoint"), "stream");
    let run = || {
        run_json(&[
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt-ids",
            "1,2,3,4",
            "--max-new",
            "6",
            "--spine",
            "int8",
            "--spine-resident-layers",
            "0",
            "--json",
            "--stats",
        ])
    };
    let per_pass = |v: &Value| {
        let s = &v["stats"];
        s["spine_decode_bytes_read"].as_f64().unwrap() / s["spine_decode_passes"].as_f64().unwrap()
    };
    let before = run();
    convert(&m, &[]);
    let after = run();
    assert_eq!(after["output_ids"], before["output_ids"]);
    let ratio = per_pass(&after) / per_pass(&before);
    assert!(
        (0.45..0.62).contains(&ratio),
        "a pass read {} bytes, {} before: {ratio}",
        per_pass(&after),
        per_pass(&before)
    );
    std::fs::remove_dir_all(&m).unwrap();
}

#[test]
fn a_file_from_other_weights_or_of_another_format_is_refused_naming_the_fix() {
    let m = copy_of(&tiny().join("checkpoint"), "stale");
    let ms = m.to_str().unwrap();
    let c = convert(&m, &[]);
    // Written again only when asked.
    fails_quietly(
        &["convert", "--model", ms, "--spine", "int8"],
        "exists (every --spine int8 load reads it): give --force",
    );
    assert_eq!(
        convert(&m, &["--force"])["source_digest"],
        c["source_digest"]
    );
    let int8_args = [
        "logits",
        "--model",
        ms,
        "--prompt-ids",
        "1,2",
        "--spine",
        "int8",
    ];
    let fix = format!("run `fathom convert --model {ms} --spine int8 --force` to write it again");

    // One source matrix's first byte changes: its weights are not the file's.
    let index: Value =
        serde_json::from_slice(&std::fs::read(m.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let name = "language_model.lm_head.weight";
    let shard = m.join(index["weight_map"][name].as_str().unwrap());
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&shard)
        .unwrap();
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, 0).unwrap();
    let mut h = vec![0u8; u64::from_le_bytes(n) as usize];
    f.read_exact_at(&mut h, 8).unwrap();
    let hdr: Value = serde_json::from_slice(&h).unwrap();
    let at = 8 + h.len() as u64 + hdr[name]["data_offsets"][0].as_u64().unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
    let out = fails_quietly(&int8_args, "it was made from other weights than these");
    assert!(String::from_utf8_lossy(&out.stderr).contains(&fix));
    // bf16 never reads it.
    fathom_ok(&["logits", "--model", ms, "--prompt-ids", "1,2"]);
    f.write_all_at(&b, at).unwrap();
    fathom_ok(&int8_args);

    // Another fixture's file names matrices this checkpoint has not.
    let other = copy_of(&fixture("kimi_k2-tiny"), "other");
    convert(&other, &[]);
    std::fs::copy(other.join(FILE), m.join(FILE)).unwrap();
    let out = fails_quietly(&int8_args, "which the checkpoint has not");
    assert!(String::from_utf8_lossy(&out.stderr).contains(&fix));

    // A file that is not this build's format.
    convert(&m, &["--force"]);
    let file = m.join(FILE);
    let bytes = std::fs::read(&file).unwrap();
    let text = String::from_utf8_lossy(&bytes[..4096.min(bytes.len())]).to_string();
    let i = text.find("fathom int8 spine 1").unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .write_all_at(b"fathom int8 spine 0", i as u64)
        .unwrap();
    let out = fails_quietly(&int8_args, "written as \"fathom int8 spine 0\"");
    assert!(String::from_utf8_lossy(&out.stderr).contains(&fix));
    for d in [m, other] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

fn fathom_ok(args: &[&str]) {
    let out = fathom(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
