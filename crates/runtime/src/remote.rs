//! Routed experts fetched on demand (`--experts remote`): a pulled model
//! whose expert shards are not on disk opens its checkpoint with those
//! shards' headers from the Hub span store, and its streamed experts read
//! their spans through that store (a demand read fetches, a guess only
//! reads what is stored).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use fathom_hub::{HubConfig, RemoteExpertStore, RemoteOptions};
use fathom_model::experts::ExpertTable;
use fathom_weights::units::format_bytes;
use fathom_weights::{Checkpoint, RemoteShards};

/// The disk budget when none is given: every fetched span is kept.
pub const UNBOUNDED: u64 = u64::MAX / 4;

/// Largest index file read here (the checkpoint reader reads it again).
const MAX_INDEX: u64 = 256 << 20;

/// The span store as the checkpoint's remote source.
struct HubShards(Arc<RemoteExpertStore>);

impl RemoteShards for HubShards {
    fn size(&self, file: &str) -> Option<u64> {
        self.0.file_size(file)
    }

    fn header(&self, file: &str) -> std::result::Result<Vec<u8>, String> {
        self.0.fetch_header(file).map_err(|e| e.to_string())
    }

    fn span(
        &self,
        file: &str,
        offset: u64,
        len: u64,
        fetch: bool,
    ) -> std::result::Result<Option<Vec<u8>>, String> {
        let got = if fetch {
            self.0.fetch_span(file, offset, len).map(Some)
        } else {
            self.0.local_span(file, offset, len)
        };
        got.map_err(|e| e.to_string())
    }
}

/// Shards `dir`'s index names that are not in `dir` (none for a
/// single-file checkpoint or an unreadable index: opening reports that).
pub fn missing_shards(dir: &Path) -> Vec<String> {
    let p = dir.join("model.safetensors.index.json");
    let Ok(meta) = std::fs::metadata(&p) else {
        return Vec::new();
    };
    if meta.len() > MAX_INDEX {
        return Vec::new();
    }
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let Some(index) = std::fs::read(&p)
        .ok()
        .and_then(|b| serde_json::from_slice::<Index>(&b).ok())
    else {
        return Vec::new();
    };
    let files: BTreeSet<String> = index.weight_map.into_values().collect();
    files
        .into_iter()
        .filter(|f| !f.contains('/') && !dir.join(f).exists())
        .collect()
}

/// The span store and the checkpoint of the pulled model in `dir`.
pub struct Remote {
    pub store: Arc<RemoteExpertStore>,
    pub checkpoint: Arc<Checkpoint>,
    pub disk_budget: u64,
}

/// Opens the span store for `dir` (`hub`: the Hub's address and patience,
/// default from the environment) and the checkpoint through it.
pub fn open(
    dir: &Path,
    hub: Option<&HubConfig>,
    store_dir: Option<&PathBuf>,
    disk_budget: Option<u64>,
) -> Result<Remote> {
    let disk_budget = disk_budget.unwrap_or(UNBOUNDED);
    let store = RemoteExpertStore::open(RemoteOptions {
        config: hub.cloned().unwrap_or_else(HubConfig::from_env),
        model_dir: dir.to_path_buf(),
        store_dir: store_dir.cloned(),
        disk_budget,
    })
    .with_context(|| {
        format!(
            "--experts remote: cannot open the expert span store for {}",
            dir.display()
        )
    })?;
    let store = Arc::new(store);
    let src: Arc<dyn RemoteShards> = Arc::new(HubShards(store.clone()));
    let checkpoint = Checkpoint::open_with(dir, Some(src))
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    Ok(Remote {
        store,
        checkpoint: Arc::new(checkpoint),
        disk_budget,
    })
}

/// Refuses a disk budget that cannot hold the largest span one expert
/// read of a remote shard fetches, naming the least budget that can.
pub(crate) fn check_disk_budget(ck: &Checkpoint, table: &ExpertTable, budget: u64) -> Result<()> {
    let remote = |shard: usize| ck.shards()[shard].is_remote();
    let mut need = (0u64, 0usize, 0usize);
    for (l, layer) in table.layers.iter().enumerate() {
        for (e, loc) in layer.iter().enumerate() {
            let bytes = match loc.span() {
                Some((shard, _, len)) => len * u64::from(remote(shard)),
                None => loc
                    .tensors()
                    .filter(|t| remote(t.shard))
                    .map(|t| t.len)
                    .max()
                    .unwrap_or(0),
            };
            if bytes > need.0 {
                need = (bytes, l, e);
            }
        }
    }
    let (bytes, l, e) = need;
    if bytes > budget {
        bail!(
            "--disk-budget {} cannot hold one routed expert: layer {l} expert {e} is fetched as {} ({bytes} bytes): give at least --disk-budget {bytes}",
            format_bytes(budget),
            format_bytes(bytes)
        );
    }
    Ok(())
}
