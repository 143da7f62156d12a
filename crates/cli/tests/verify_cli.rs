//! `fathom verify`: digests against a manifest (or `unverified`), data
//! scans for non-finite values, the Hugging Face snapshot layout.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::Value;

/// Byte offset (in its shard file) of the first value of a bf16 tensor.
fn first_bf16_value(dir: &std::path::Path) -> (PathBuf, u64) {
    let shard = dir.join("model-00001-of-000002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let (_, t) = header
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, v)| *k != "__metadata__" && v["dtype"] == "BF16")
        .unwrap();
    (shard, 8 + n as u64 + t["data_offsets"][0].as_u64().unwrap())
}

#[test]
fn verify_digest_needs_a_manifest_and_detects_a_flipped_byte() {
    let dir = tiny_copy("digest");
    let d = dir.to_str().unwrap();
    let out = fathom(&["verify", d, "--digest"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.lines().last().unwrap().starts_with("unverified:"),
        "{text}"
    );
    // A manifest from those digests: now every file is verified.
    let manifest: String = text
        .lines()
        .filter(|l| l.ends_with("  unverified"))
        .map(|l| format!("{}\n", l.trim_end_matches("  unverified")))
        .collect();
    std::fs::write(dir.join("SHA256SUMS"), &manifest).unwrap();
    let out = fathom(&["verify", d, "--digest"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && text.lines().last().unwrap().starts_with("ok:"),
        "{text}"
    );
    // One flipped bit in tensor data: structure still fine, digest not.
    let (shard, at) = first_bf16_value(&dir);
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[at as usize + 1] ^= 0x01;
    std::fs::write(&shard, bytes).unwrap();
    assert!(
        fathom(&["verify", d]).status.success(),
        "headers alone cannot see it"
    );
    fails_quietly(&["verify", d, "--digest"], "SHA-256 mismatch");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn verify_data_finds_a_nan_weight() {
    let dir = tiny_copy("nan");
    let d = dir.to_str().unwrap();
    let out = fathom(&["verify", d, "--data"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (shard, at) = first_bf16_value(&dir);
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[at as usize..at as usize + 2].copy_from_slice(&0x7FC0u16.to_le_bytes());
    std::fs::write(&shard, bytes).unwrap();
    fails_quietly(
        &["verify", d, "--data"],
        "1 non-finite values, the first at element 0",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn verify_digest_follows_a_hugging_face_snapshot_layout() {
    use sha2::{Digest, Sha256};
    let src = tiny_copy("hf-src");
    let root = std::env::temp_dir().join(format!("fathom-hf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (blobs, snap) = (root.join("blobs"), root.join("snapshots/abc"));
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        let bytes = std::fs::read(&f).unwrap();
        let sum = format!("{:x}", Sha256::digest(&bytes));
        std::fs::write(blobs.join(&sum), &bytes).unwrap();
        std::os::unix::fs::symlink(
            format!("../../blobs/{sum}"),
            snap.join(f.file_name().unwrap()),
        )
        .unwrap();
    }
    let out = fathom(&["verify", snap.to_str().unwrap(), "--digest"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.lines().last().unwrap().starts_with("ok:") && text.contains("4 files match"),
        "{text}"
    );
    std::fs::remove_dir_all(&root).unwrap();
    std::fs::remove_dir_all(&src).unwrap();
}
