//! Helpers shared by the CLI test binaries.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// k3-tiny (checkpoint and golden outputs), in the repository.
pub fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/k3-tiny")
}

/// The trained k3-code-small beside the repository, if it is there.
pub fn code_small() -> Option<PathBuf> {
    shared_model("k3-code-small")
}

/// k3-code-small's distilled draft model, when it is beside the repository.
#[allow(dead_code)]
pub fn code_draft() -> Option<PathBuf> {
    shared_model("k3-code-draft")
}

fn shared_model(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/models")
        .join(name);
    p.join("config.json").is_file().then_some(p)
}

/// A fixture copied into the repository (`crates/model/tests/data/NAME`).
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/data")
        .join(name)
}

/// `args` succeed and print one JSON object.
pub fn run_json(args: &[&str]) -> serde_json::Value {
    run_json_env(args, &[])
}

/// [`run_json`] with `env` added to the process's environment.
pub fn run_json_env(args: &[&str], env: &[(String, String)]) -> serde_json::Value {
    let out = fathom_env(args, env);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

pub fn fathom(args: &[&str]) -> Output {
    fathom_env(args, &[])
}

/// [`fathom`] with `env` added to the process's environment.
pub fn fathom_env(args: &[&str], env: &[(String, String)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fathom"))
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .expect("fathom runs")
}

/// `args` fail with `needle` on stderr and no panic.
pub fn fails_quietly(args: &[&str], needle: &str) -> Output {
    let out = fathom(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(
        err.contains(needle),
        "{args:?}: stderr {err:?} lacks {needle:?}"
    );
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    out
}

/// As [`fails_quietly`], and nothing on stdout.
pub fn fails_with(args: &[&str], needle: &str) {
    let out = fails_quietly(args, needle);
    assert!(out.stdout.is_empty(), "{args:?} wrote to stdout");
}

/// A private copy of k3-tiny's checkpoint.
pub fn tiny_copy(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fathom-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(tiny().join("checkpoint")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    dir
}

/// The full Kimi K3's config alone (`synth --preset k3 --config-only`) in
/// a fresh folder named by `tag`, for `inspect`.
pub fn k3_config(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fathom-k3cfg-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = fathom(&[
        "synth",
        "--out",
        dir.to_str().unwrap(),
        "--preset",
        "k3",
        "--config-only",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}
