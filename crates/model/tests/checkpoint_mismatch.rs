//! A checkpoint that does not match its config is rejected, listing every
//! missing, unexpected and mis-shaped tensor by name.

use std::path::PathBuf;

use fathom_model::K3Model;
use fathom_model::kimi_k3::weights::check_tensors;
use fathom_weights::Checkpoint;
use serde_json::Value;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3-tiny/checkpoint")
}

/// Copies k3-tiny, renames one tensor and reshapes another in shard 2's
/// header (same byte length), keeping the index consistent.
fn edited_copy() -> PathBuf {
    let d = std::env::temp_dir().join(format!("fathom-mismatch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for f in std::fs::read_dir(tiny()).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, d.join(f.file_name().unwrap())).unwrap();
    }
    let shard = d.join("model-00002-of-000002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let norm = h.remove("language_model.model.norm.weight").unwrap();
    h.insert("language_model.model.norm2.weight".into(), norm);
    h["language_model.lm_head.weight"]["shape"] = serde_json::json!([512, 256]);
    let mut new = serde_json::to_vec(&h).unwrap();
    assert!(new.len() <= n, "edited header must fit in place");
    new.resize(n, b' ');
    let mut out = bytes[..8].to_vec();
    out.extend(new);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&shard, out).unwrap();
    let ip = d.join("model.safetensors.index.json");
    let mut idx: Value = serde_json::from_str(&std::fs::read_to_string(&ip).unwrap()).unwrap();
    let wm = idx["weight_map"].as_object_mut().unwrap();
    let f = wm.remove("language_model.model.norm.weight").unwrap();
    wm.insert("language_model.model.norm2.weight".into(), f);
    std::fs::write(&ip, idx.to_string()).unwrap();
    d
}

#[test]
fn every_problem_is_named() {
    let d = edited_copy();
    let spec = fathom_model::family::read_spec::<fathom_model::kimi_k3::KimiK3>(&d).unwrap();
    let ck = Checkpoint::open(&d).unwrap();
    let mut problems = check_tensors(&spec, &ck);
    problems.sort();
    assert_eq!(
        problems,
        vec![
            "missing tensor language_model.model.norm.weight".to_string(),
            "tensor language_model.lm_head.weight: shape [512, 256], expected [1024, 128]"
                .to_string(),
            "unexpected tensor language_model.model.norm2.weight".to_string(),
        ]
    );
    let e = K3Model::load(&d)
        .err()
        .expect("mismatched checkpoint must not load")
        .to_string();
    assert!(
        e.contains("norm2.weight") && e.contains("lm_head.weight"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_pristine_fixture_has_no_problems() {
    let spec = fathom_model::family::read_spec::<fathom_model::kimi_k3::KimiK3>(&tiny()).unwrap();
    let ck = Checkpoint::open(&tiny()).unwrap();
    assert_eq!(check_tensors(&spec, &ck), Vec::<String>::new());
}
