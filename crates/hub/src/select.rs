//! Which files a pull takes: everything, or the spine (all but the shards
//! that hold nothing but routed experts).

use std::collections::{BTreeMap, BTreeSet};

use crate::api::{Listing, RemoteFile};
use crate::error::{HubError, Result};

/// The sharded checkpoint's index.
pub const INDEX: &str = "model.safetensors.index.json";

/// What `fathom pull --include` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Include {
    /// Every file of the revision.
    All,
    /// Every file that is not a weight file, the index, and every shard
    /// the index names for at least one tensor that is not a routed
    /// expert's ([`is_routed_expert`]). Other weight files (another
    /// format's copy, `.bin`, `.gguf`, …) are left out.
    Spine,
}

/// Whether tensor `name` belongs to a routed expert: it has a component
/// `experts` (`….mlp.experts.7.up_proj.weight` in Qwen3-MoE and
/// DeepSeek-V3, `….block_sparse_moe.experts.7.w1.weight` in Kimi K3 and
/// Kimi-Linear, the stacked `….mlp.experts.gate_up_proj` in gpt-oss).
/// Shared experts (`shared_experts`), routers (`gate`) and everything
/// else are the spine. fathom-synth's `expert_of` reads the same marker.
pub fn is_routed_expert(name: &str) -> bool {
    name.contains(".experts.")
}

/// Whether a path is a weight file by its extension.
pub fn is_weight_file(path: &str) -> bool {
    const EXT: [&str; 10] = [
        ".safetensors",
        ".bin",
        ".pt",
        ".pth",
        ".gguf",
        ".ckpt",
        ".h5",
        ".msgpack",
        ".onnx",
        ".npz",
    ];
    let lower = path.to_ascii_lowercase();
    EXT.iter().any(|e| lower.ends_with(e))
}

#[derive(serde::Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

/// The index's shards: those holding any spine tensor, and the rest
/// (routed experts only).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ShardSplit {
    pub spine: BTreeSet<String>,
    pub experts_only: BTreeSet<String>,
}

/// Reads `model.safetensors.index.json` and splits its shards.
pub fn split_shards(index_json: &[u8]) -> Result<ShardSplit> {
    let index: Index = serde_json::from_slice(index_json)
        .map_err(|e| HubError::protocol(INDEX, format!("no weight_map: {e}")))?;
    let mut all = BTreeSet::new();
    let mut spine = BTreeSet::new();
    for (tensor, shard) in &index.weight_map {
        all.insert(shard.clone());
        if !is_routed_expert(tensor) {
            spine.insert(shard.clone());
        }
    }
    let experts_only = all.difference(&spine).cloned().collect();
    Ok(ShardSplit {
        spine,
        experts_only,
    })
}

/// The files of `listing` that `include` takes; `index` is the index's
/// bytes (needed for [`Include::Spine`] when the listing has one).
pub fn select(
    listing: &Listing,
    include: Include,
    index: Option<&[u8]>,
) -> Result<Vec<RemoteFile>> {
    if include == Include::All {
        return Ok(listing.files.clone());
    }
    let split = match (listing.file(INDEX), index) {
        (None, _) => None,
        (Some(_), Some(bytes)) => Some(split_shards(bytes)?),
        (Some(_), None) => {
            return Err(HubError::Store(format!(
                "--include spine needs the bytes of {INDEX}"
            )));
        }
    };
    if let Some(s) = &split
        && let Some(missing) = s
            .spine
            .iter()
            .chain(&s.experts_only)
            .find(|p| listing.file(p).is_none())
    {
        return Err(HubError::protocol(
            INDEX,
            format!("names shard {missing:?}, which the revision does not have"),
        ));
    }
    Ok(listing
        .files
        .iter()
        .filter(|f| match &split {
            _ if !is_weight_file(&f.path) => true,
            Some(s) => s.spine.contains(&f.path),
            // No index: a single model.safetensors holds the spine.
            None => f.path == "model.safetensors",
        })
        .cloned()
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str) -> RemoteFile {
        RemoteFile {
            path: path.into(),
            size: 1,
            sha256: None,
            blob_id: None,
        }
    }

    #[test]
    fn spine_leaves_out_expert_only_shards_and_other_formats() {
        let listing = Listing {
            repo: "o/n".into(),
            commit: "1".repeat(40),
            files: [
                "config.json",
                INDEX,
                "model-00001-of-000003.safetensors",
                "model-00002-of-000003.safetensors",
                "model-00003-of-000003.safetensors",
                "tiktoken.model",
                "original/consolidated.pth",
            ]
            .map(file)
            .to_vec(),
        };
        let index = br#"{"metadata":{},"weight_map":{
            "model.embed_tokens.weight":"model-00001-of-000003.safetensors",
            "model.layers.1.block_sparse_moe.experts.0.w1.weight":"model-00002-of-000003.safetensors",
            "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight":"model-00003-of-000003.safetensors",
            "model.layers.2.mlp.experts.gate_up_proj":"model-00003-of-000003.safetensors"}}"#;
        let got: Vec<String> = select(&listing, Include::Spine, Some(index))
            .unwrap()
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(
            got,
            [
                "config.json",
                INDEX,
                "model-00001-of-000003.safetensors",
                "model-00003-of-000003.safetensors",
                "tiktoken.model"
            ]
        );
        let split = split_shards(index).unwrap();
        assert_eq!(
            split.experts_only.into_iter().collect::<Vec<_>>(),
            ["model-00002-of-000003.safetensors"]
        );
        assert_eq!(select(&listing, Include::All, None).unwrap().len(), 7);
    }

    #[test]
    fn expert_names_of_every_family() {
        for n in [
            "model.layers.3.mlp.experts.17.down_proj.weight",
            "model.layers.3.mlp.experts.17.down_proj.weight_scale_inv",
            "model.layers.3.block_sparse_moe.experts.5.w2.weight_packed",
            "model.layers.3.mlp.experts.gate_up_proj_bias",
        ] {
            assert!(is_routed_expert(n), "{n}");
        }
        for n in [
            "model.layers.3.mlp.shared_experts.down_proj.weight",
            "model.layers.3.block_sparse_moe.gate.weight",
            "model.layers.3.mlp.router.weight",
            "lm_head.weight",
        ] {
            assert!(!is_routed_expert(n), "{n}");
        }
    }
}
