//! The byte layout of a synthetic checkpoint, decided before anything is
//! written: which tensors go to which shard, in which order, at which
//! offsets, and the exact header and index bytes.
//!
//! Order is the family's tensor table (for K3, docs/k3-model.md §7.1 names):
//! the embedding, then layer by layer (norms, attention, router, shared
//! experts, then the routed experts one after another, each expert's
//! tensors adjacent — K3's w1 packed, w1 scale, w2 packed, … — so a
//! streaming reader fetches one expert with one read), then the final
//! norm and head. Shards are cut only between units (an expert's tensors
//! are one unit) so no expert straddles two files. Tensors are contiguous
//! with no gaps, as the safetensors format requires.

use std::io::Write;

use fathom_weights::Dtype;

use crate::error::Result;
use crate::init::Stream;
use crate::model::{Model, SynthTensor};

/// Models below this size are split into two shards, like k3-tiny, so that
/// multi-shard code paths are exercised even by tiny models.
const SMALL_MODEL: u64 = 1 << 30;

/// One tensor's place in its shard.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    pub tensor: SynthTensor,
    pub stream: Stream,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
}

/// One shard file.
#[derive(Debug, Clone)]
pub struct ShardPlan {
    pub file_name: String,
    /// The 8-byte length prefix and the JSON header (space-padded to a
    /// multiple of 8, as the safetensors reference writer does).
    pub header: Vec<u8>,
    pub tensors: Vec<PlannedTensor>,
    /// Total file length.
    pub len: u64,
}

/// Everything needed to write the model.
#[derive(Debug, Clone)]
pub struct Plan {
    pub model: Model,
    pub seed: u64,
    pub shards: Vec<ShardPlan>,
    /// Sum of tensor bytes (the index's `metadata.total_size`).
    pub data_bytes: u64,
}

/// safetensors dtype spelling.
fn dtype_name(d: Dtype) -> String {
    match d {
        Dtype::BF16 => "BF16".into(),
        Dtype::F32 => "F32".into(),
        Dtype::U8 => "U8".into(),
        Dtype::I32 => "I32".into(),
        Dtype::F8_E4M3 => "F8_E4M3".into(),
        other => format!("{other:?}"),
    }
}

/// Shard name as released: 5-digit index, 6-digit total.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:06}.safetensors", i + 1, n)
}

/// Splits the tensors into units: one routed expert's tensors, or one tensor.
fn units(tensors: Vec<SynthTensor>) -> Vec<Vec<SynthTensor>> {
    let mut out: Vec<Vec<SynthTensor>> = Vec::new();
    for t in tensors {
        match out.last_mut() {
            Some(u) if t.expert.is_some() && u[0].expert == t.expert => u.push(t),
            _ => out.push(vec![t]),
        }
    }
    out
}

impl Plan {
    /// Lays out `model` (a [`Model`], or K3 [`crate::Dims`]) in shards of
    /// about `shard_size` bytes.
    pub fn new(model: impl Into<Model>, seed: u64, shard_size: u64) -> Result<Plan> {
        let model = model.into();
        let table = model.tensors()?;
        let total: u64 = table.iter().map(SynthTensor::bytes).sum();
        let units = units(table);
        let want = if total < SMALL_MODEL {
            2
        } else {
            total.div_ceil(shard_size.max(1))
        }
        .clamp(1, units.len() as u64);

        // Cut after the unit that crosses each boundary j·total/want.
        let mut groups: Vec<Vec<SynthTensor>> = vec![Vec::new()];
        let mut cum = 0u64;
        let mut j = 1u64;
        for u in units {
            cum += u.iter().map(|t| t.bytes()).sum::<u64>();
            groups.last_mut().unwrap().extend(u);
            if j < want && cum * want >= j * total {
                groups.push(Vec::new());
                j += 1;
            }
        }
        groups.retain(|g| !g.is_empty());
        let n = groups.len();
        let shards: Vec<ShardPlan> = groups
            .into_iter()
            .enumerate()
            .map(|(i, g)| shard_plan(seed, shard_name(i, n), g))
            .collect();
        // Every reader (fathom's too) caps the header; a model it could
        // not open is refused before any byte is written.
        if let Some(s) = shards
            .iter()
            .find(|s| s.header.len() as u64 > fathom_weights::MAX_HEADER)
        {
            return Err(crate::error::SynthError::Invalid(format!(
                "{}: its header would be {} MB ({} layers × {} experts), over the {} MB readers accept: \
                 use fewer layers or experts, or wider tensors (for K3: k3-mini)",
                s.file_name,
                s.header.len() >> 20,
                model.num_layers(),
                model.num_experts(),
                fathom_weights::MAX_HEADER >> 20
            )));
        }
        Ok(Plan {
            model,
            seed,
            shards,
            data_bytes: total,
        })
    }

    /// Bytes of all shard files.
    pub fn file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.len).sum()
    }

    pub fn num_tensors(&self) -> usize {
        self.shards.iter().map(|s| s.tensors.len()).sum()
    }

    /// `model.safetensors.index.json`, as serde_json's pretty printer
    /// writes it with a final newline: total size and name → shard, names
    /// sorted. Written straight into bytes (a model of 500k tensors would
    /// hold several times its index as JSON values).
    pub fn index_bytes(&self) -> Vec<u8> {
        let mut names: Vec<(&str, &str)> = self
            .shards
            .iter()
            .flat_map(|s| {
                s.tensors
                    .iter()
                    .map(move |t| (t.tensor.name.as_str(), s.file_name.as_str()))
            })
            .collect();
        names.sort_unstable();
        debug_assert!(
            names.windows(2).all(|w| w[0].0 != w[1].0),
            "a tensor name is planned twice"
        );
        let mut out = Vec::with_capacity(names.iter().map(|(n, f)| n.len() + f.len() + 12).sum());
        let _ = write!(
            out,
            "{{\n  \"metadata\": {{\n    \"total_size\": {}\n  }},\n  \"weight_map\": {{",
            self.data_bytes
        );
        for (i, (name, file)) in names.iter().enumerate() {
            out.extend_from_slice(if i == 0 { b"\n    " } else { b",\n    " });
            json_string(&mut out, name);
            out.extend_from_slice(b": ");
            json_string(&mut out, file);
        }
        out.extend_from_slice(if names.is_empty() {
            b"}\n}\n"
        } else {
            b"\n  }\n}\n"
        });
        out
    }
}

/// Appends `s` as a JSON string (quoted and escaped by serde_json).
fn json_string(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(&mut *out, s).expect("a string serialises into memory");
}

fn shard_plan(seed: u64, file_name: String, group: Vec<SynthTensor>) -> ShardPlan {
    let mut rel = Vec::with_capacity(group.len());
    let mut pos = 0u64;
    for t in &group {
        rel.push(pos);
        pos += t.bytes();
    }
    let json = header_json(&group, &rel);
    let mut bytes = Vec::with_capacity(8 + json.len());
    bytes.extend_from_slice(&(json.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    let base = bytes.len() as u64;
    let tensors = group
        .into_iter()
        .zip(rel)
        .map(|(t, r)| PlannedTensor {
            stream: Stream::new(seed, &t),
            tensor: t,
            offset: base + r,
        })
        .collect();
    ShardPlan {
        file_name,
        header: bytes,
        tensors,
        len: base + pos,
    }
}

/// A shard's JSON header as serde_json writes it (the workspace keeps maps
/// in insertion order; no spaces), space-padded to a multiple of 8:
/// `__metadata__`, then each tensor in file order with its `dtype`, `shape`
/// and `data_offsets`. Written straight into bytes: JSON values of a
/// shard's ~250k entries would be several times the header.
fn header_json(group: &[SynthTensor], rel: &[u64]) -> Vec<u8> {
    let mut json = Vec::with_capacity(group.iter().map(|t| t.name.len() + 64).sum::<usize>() + 40);
    json.extend_from_slice(br#"{"__metadata__":{"format":"pt"}"#);
    for (t, &r) in group.iter().zip(rel) {
        json.push(b',');
        json_string(&mut json, &t.name);
        json.extend_from_slice(br#":{"dtype":"#);
        json_string(&mut json, &dtype_name(t.dtype));
        json.extend_from_slice(br#","shape":["#);
        for (d, n) in t.shape.iter().enumerate() {
            let _ = write!(json, "{}{n}", if d == 0 { "" } else { "," });
        }
        let _ = write!(json, r#"],"data_offsets":[{},{}]}}"#, r, r + t.bytes());
    }
    json.push(b'}');
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    json
}

impl ShardPlan {
    /// Writes the file's bytes `start .. start + out.len()` into `out`:
    /// header bytes and tensor streams, whichever the range covers.
    pub fn fill(&self, start: u64, out: &mut [u8]) {
        let end = start + out.len() as u64;
        let hlen = self.header.len() as u64;
        if start < hlen {
            let n = (hlen.min(end) - start) as usize;
            out[..n].copy_from_slice(&self.header[start as usize..start as usize + n]);
        }
        // First tensor whose end lies after `start`.
        let first = self
            .tensors
            .partition_point(|t| t.offset + t.tensor.bytes() <= start);
        for t in &self.tensors[first..] {
            if t.offset >= end {
                break;
            }
            let t_end = t.offset + t.tensor.bytes();
            let lo = t.offset.max(start);
            let hi = t_end.min(end);
            let dst = &mut out[(lo - start) as usize..(hi - start) as usize];
            t.stream.fill(lo - t.offset, dst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset::Preset;
    use serde_json::{Map, Value, json};

    /// The header and index as JSON values serialised by serde_json: the
    /// bytes the direct writers must give.
    fn by_values(p: &Plan) -> (Vec<Vec<u8>>, Vec<u8>) {
        let headers = p
            .shards
            .iter()
            .map(|s| {
                let mut m = Map::new();
                m.insert("__metadata__".into(), json!({"format": "pt"}));
                let base = s.header.len() as u64;
                for t in &s.tensors {
                    let (b, e) = (t.offset - base, t.offset - base + t.tensor.bytes());
                    m.insert(
                        t.tensor.name.clone(),
                        json!({"dtype": dtype_name(t.tensor.dtype), "shape": t.tensor.shape, "data_offsets": [b, e]}),
                    );
                }
                let mut j = serde_json::to_vec(&Value::Object(m)).unwrap();
                while j.len() % 8 != 0 {
                    j.push(b' ');
                }
                let mut out = (j.len() as u64).to_le_bytes().to_vec();
                out.extend(j);
                out
            })
            .collect();
        let map: std::collections::BTreeMap<&str, &str> = p
            .shards
            .iter()
            .flat_map(|s| {
                s.tensors
                    .iter()
                    .map(move |t| (t.tensor.name.as_str(), s.file_name.as_str()))
            })
            .collect();
        let mut index = serde_json::to_vec_pretty(&json!({
            "metadata": {"total_size": p.data_bytes},
            "weight_map": map,
        }))
        .unwrap();
        index.push(b'\n');
        (headers, index)
    }

    #[test]
    fn headers_and_index_are_serde_jsons_bytes() {
        for preset in [Preset::Tiny, Preset::K3Mini] {
            let p = Plan::new(preset.model(), 1, 4 << 30).unwrap();
            let (headers, index) = by_values(&p);
            for (s, h) in p.shards.iter().zip(&headers) {
                assert_eq!(s.header, *h, "{}", s.file_name);
            }
            assert_eq!(p.index_bytes(), index);
        }
    }

    #[test]
    fn an_empty_shard_header_is_the_metadata_alone() {
        let h = header_json(&[], &[]);
        assert_eq!(
            std::str::from_utf8(&h).unwrap(),
            r#"{"__metadata__":{"format":"pt"}}"#
        );
    }

    #[test]
    fn tiny_is_two_contiguous_shards_with_whole_experts() {
        let p = Plan::new(Preset::Tiny.model(), 1, 4 << 30).unwrap();
        assert_eq!(p.shards.len(), 2);
        assert_eq!(p.shards[1].file_name, "model-00002-of-000002.safetensors");
        for s in &p.shards {
            assert_eq!(s.header.len() % 8, 0);
            let mut pos = s.header.len() as u64;
            for t in &s.tensors {
                assert_eq!(t.offset, pos, "{}", t.tensor.name);
                pos += t.tensor.bytes();
            }
            assert_eq!(pos, s.len);
            assert!(!s.tensors[0].tensor.name.contains(".w2."));
            let last = &s.tensors.last().unwrap().tensor.name;
            assert!(
                !last.contains(".experts.") || last.ends_with(".w3.weight_scale"),
                "{last}"
            );
        }
    }
}
