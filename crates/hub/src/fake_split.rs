//! A checkpoint rewritten for tests of remote experts: the spine in one
//! shard and the routed experts in others, as large released checkpoints
//! are laid out, so `pull --include spine` leaves expert-only shards
//! behind.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::select::{INDEX, is_routed_expert};

/// One tensor of a source shard.
struct Tensor {
    name: String,
    dtype: Value,
    shape: Value,
    bytes: Vec<u8>,
}

/// Writes `src` (a sharded safetensors checkpoint) to `dst` with every
/// tensor that is not a routed expert's in `model-spine.safetensors` and
/// the routed experts, in their original order, cut between experts into
/// `expert_shards` files `model-experts-0000N.safetensors`; other files
/// are copied. Panics on a malformed source (test support).
pub fn split_experts(src: &Path, dst: &Path, expert_shards: usize) {
    std::fs::create_dir_all(dst).expect("create the split model's folder");
    let index: Value = serde_json::from_slice(&std::fs::read(src.join(INDEX)).expect("index"))
        .expect("index JSON");
    let mut files: Vec<String> = index["weight_map"]
        .as_object()
        .expect("weight_map")
        .values()
        .map(|v| v.as_str().expect("shard name").to_string())
        .collect();
    files.sort();
    files.dedup();
    let mut spine = Vec::new();
    let mut experts = Vec::new();
    for f in &files {
        for t in read_shard(&src.join(f)) {
            if is_routed_expert(&t.name) {
                experts.push(t);
            } else {
                spine.push(t);
            }
        }
    }
    for e in std::fs::read_dir(src).expect("source folder").flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_file() && name != INDEX && !files.contains(&name) {
            std::fs::copy(e.path(), dst.join(&name)).expect("copy");
        }
    }
    let mut weight_map = Map::new();
    let mut total = 0u64;
    let mut write = |name: String, ts: &[Tensor]| {
        for t in ts {
            weight_map.insert(t.name.clone(), Value::String(name.clone()));
            total += t.bytes.len() as u64;
        }
        write_shard(&dst.join(name), ts);
    };
    write("model-spine.safetensors".into(), &spine);
    let bytes: usize = experts.iter().map(|t| t.bytes.len()).sum();
    let per = bytes.div_ceil(expert_shards.max(1));
    let mut start = 0;
    let mut n = 0;
    let mut acc = 0;
    for i in 0..experts.len() {
        acc += experts[i].bytes.len();
        let last = i + 1 == experts.len();
        if last || (acc >= per && expert_of(&experts[i].name) != expert_of(&experts[i + 1].name)) {
            n += 1;
            write(
                format!("model-experts-{n:05}.safetensors"),
                &experts[start..=i],
            );
            start = i + 1;
            acc = 0;
        }
    }
    let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    std::fs::write(dst.join(INDEX), serde_json::to_vec_pretty(&index).unwrap()).expect("index");
}

/// `…experts.7.` of a routed expert's tensor name (its expert).
fn expert_of(name: &str) -> &str {
    let i = name.find(".experts.").map_or(0, |i| i + ".experts.".len());
    let j = name[i..].find('.').map_or(name.len(), |j| i + j);
    &name[..j]
}

/// A shard's tensors in file order.
fn read_shard(path: &Path) -> Vec<Tensor> {
    let b = std::fs::read(path).expect("shard");
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let header: Map<String, Value> = serde_json::from_slice(&b[8..8 + n]).expect("header");
    let data = &b[8 + n..];
    let mut out: Vec<(u64, Tensor)> = header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(name, v)| {
            let o = &v["data_offsets"];
            let (a, z) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
            let t = Tensor {
                name,
                dtype: v["dtype"].clone(),
                shape: v["shape"].clone(),
                bytes: data[a as usize..z as usize].to_vec(),
            };
            (a, t)
        })
        .collect();
    out.sort_by_key(|(a, _)| *a);
    out.into_iter().map(|(_, t)| t).collect()
}

/// Writes `ts` contiguously in this order, the header padded with spaces
/// to a multiple of 8 as the reference writer does.
fn write_shard(path: &Path, ts: &[Tensor]) {
    let mut header = Map::new();
    let mut at = 0u64;
    for t in ts {
        let end = at + t.bytes.len() as u64;
        header.insert(
            t.name.clone(),
            json!({ "dtype": t.dtype, "shape": t.shape, "data_offsets": [at, end] }),
        );
        at = end;
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    for t in ts {
        out.extend(&t.bytes);
    }
    std::fs::write(path, out).expect("write shard");
}
