//! Shared helpers for the integration tests: data paths and the parity corpus.

#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;

pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

pub fn k3_dir() -> PathBuf {
    data_dir().join("k3-code-small")
}

pub fn hf_dir() -> PathBuf {
    data_dir().join("hf-tiny")
}

/// One parity case: name, text, reference ids.
pub struct Case {
    pub name: String,
    pub text: String,
    pub ids: Vec<u32>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn text_of(entry: &Value) -> String {
    if let Some(t) = entry.get("text").and_then(Value::as_str) {
        return t.to_string();
    }
    let spec = &entry["spec"];
    let unit = spec["repeat"].as_str().expect("repeat");
    let count = spec["count"].as_u64().expect("count") as usize;
    format!(
        "{}{}{}",
        spec["prefix"].as_str().expect("prefix"),
        unit.repeat(count),
        spec["suffix"].as_str().expect("suffix")
    )
}

/// Cases of one section (`tiktoken` or `hf`) of `parity.json`.
pub fn parity_cases(section: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(data_dir().join("parity.json")).expect("parity.json");
    let root: Value = serde_json::from_str(&text).expect("parity.json is JSON");
    root[section]
        .as_array()
        .expect("section")
        .iter()
        .map(|e| Case {
            name: e["name"].as_str().expect("name").to_string(),
            text: text_of(e),
            ids: ids(&e["ids"]),
        })
        .collect()
}
