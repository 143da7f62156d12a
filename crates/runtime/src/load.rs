//! The one load call: the RAM ledger's plan, the device, the expert source
//! (resident, streamed, or streamed with missing shards fetched from the
//! Hub), heat and the attention cache's placement.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use fathom_kernels::backend::{Backend, BackendStats};
use fathom_model::kv::KvConfig;
use fathom_model::{CausalLm, LayerPlan, LoadOptions, ModelConfig, Spine};
use fathom_stream::budget::{KvPlan, Ledger};
use fathom_stream::{StreamConfig, StreamedExperts};

use crate::dir::check_model_dir;
use crate::heat::{HeatHandle, heat_precheck, warm_from_heat};
use crate::options::{ASSUMED_CONTEXT, ExpertMode, LoadRequest, default_kv_dir};
use crate::progress::LoadProgress;

/// What loading decided, for stats and logs.
#[derive(Clone, serde::Serialize)]
pub struct LoadInfo {
    pub load_s: f64,
    pub experts: &'static str,
    pub ledger: Option<Ledger>,
    pub budget_source: String,
    pub direct_io: Option<bool>,
    /// `cpu`, or the backend that computes the matrix products.
    pub device: String,
    /// Why `--device auto` chose `device` (`None` for an explicit choice).
    pub device_reason: Option<String>,
    /// The context a sequence may use.
    pub context: usize,
    /// Why that context (the plan line says it).
    pub context_source: String,
    /// RAM set aside for the parsed tensor headers and index.
    pub index_ram: u64,
    #[serde(skip)]
    pub heat: HeatHandle,
    #[serde(skip)]
    backend: Option<Arc<dyn Backend>>,
    /// The span store of `--experts remote`.
    #[serde(skip)]
    remote: Option<Arc<fathom_hub::RemoteExpertStore>>,
}

impl std::fmt::Debug for LoadInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadInfo")
            .field("experts", &self.experts)
            .field("device", &self.device)
            .field("context", &self.context)
            .finish()
    }
}

impl LoadInfo {
    /// The backend's cumulative counters (`None` on the CPU).
    pub fn device_stats(&self) -> Option<BackendStats> {
        self.backend.as_ref().map(|b| b.stats())
    }

    /// The backend's counters now (zeros on the CPU), to measure from.
    pub fn device_snapshot(&self) -> BackendStats {
        self.device_stats().unwrap_or_default()
    }

    /// The backend's figures since `start` (a [`Self::device_snapshot`]);
    /// `None` on the CPU.
    pub fn device_since(&self, start: &BackendStats) -> Option<BackendStats> {
        self.device_stats().map(|s| s.since(start))
    }

    /// The plan line: the ledger, where the budget came from, the context
    /// and why, where the experts live.
    pub fn plan_line(&self) -> Option<String> {
        self.ledger.as_ref().map(|l| {
            format!(
                "{}, tensor index {} ({}); context {} tokens ({}); experts {}",
                l.describe(),
                fathom_weights::units::format_bytes(self.index_ram),
                self.budget_source,
                self.context,
                self.context_source,
                self.experts
            )
        })
    }

    /// The backend the model's products run on (`None` on the CPU).
    pub fn backend(&self) -> Option<&Arc<dyn Backend>> {
        self.backend.as_ref()
    }

    /// The span store's counters with `--experts remote`.
    pub fn remote_stats(&self) -> Option<fathom_hub::StoreStats> {
        self.remote.as_ref().map(|s| s.stats())
    }
}

/// A loaded model, its configuration and what loading decided.
pub struct Loaded {
    pub model: Arc<dyn CausalLm>,
    pub config: ModelConfig,
    pub info: LoadInfo,
}

/// Loads the model in `dir` under `req`, for passes of up to `positions`
/// tokens, with the spine in `spine` precision (int8 is quantised at load;
/// the cache is sized for it — loading briefly holds the spine as stored).
/// `config.json` is read once; the registry picks the family from it.
pub fn load(dir: &Path, req: &LoadRequest, positions: usize, spine: Spine) -> Result<Loaded> {
    load_config(read_config(dir)?, req, positions, spine)
}

/// Checks `dir` is a model directory and reads its `config.json` (for a
/// caller that checks cheap things against it before [`load_config`]).
pub fn read_config(dir: &Path) -> Result<ModelConfig> {
    check_model_dir(dir)?;
    ModelConfig::read(dir).with_context(|| format!("cannot load the model in {}", dir.display()))
}

/// As [`load`], with the configuration already read.
pub fn load_config(
    config: ModelConfig,
    req: &LoadRequest,
    positions: usize,
    spine: Spine,
) -> Result<Loaded> {
    let dir = config.dir().to_path_buf();
    let dir = dir.as_path();
    // The one budget rule (config.json only): refused before anything is read.
    let plan = crate::plan::plan(&config, req, positions, spine)?;
    if plan.facts.max_position_embeddings.is_none() && req.context.is_none() {
        tracing::info!(
            "config.json declares no max_position_embeddings: assuming a context of {ASSUMED_CONTEXT} tokens (set --context)"
        );
    }
    let crate::plan::LoadPlan {
        facts: spec,
        context,
        ledger,
        stream,
        budget_source,
        context_source,
        index_ram,
        max_inflight,
        ..
    } = plan;
    let kv_cfg = kv_config(req, &ledger.kv)?;
    let selected = crate::device::select(
        req.device,
        req.vram_budget,
        req.gpus.as_deref(),
        req.cuda_graphs,
    )?;
    let ledger = match selected.vram {
        Some(v) => {
            let room = device_room(v, ledger.state);
            ledger.with_device(&spec, room)
        }
        None => ledger,
    };
    let layers = ledger.tiers.plan();
    let t = &ledger.tiers;
    if t.resident_layers < t.layers {
        tracing::info!(
            "spine: {} of {} layers resident, {} held on the device, {} read for every pass",
            t.resident_layers,
            t.layers,
            t.device_layers,
            t.streamed_layers
        );
    }
    let remote = remote_mode(dir, req.experts)?;
    let stream = stream || remote.is_some();
    let (heat_model, heat_in) = heat_precheck(&config, req, stream)?;
    let t0 = Instant::now();
    let total = if stream {
        ledger.spine
    } else {
        shard_bytes(dir)
    };
    let _progress = LoadProgress::start(total);
    let mut info = LoadInfo {
        load_s: 0.0,
        experts: match (remote, stream) {
            (Some(why), _) => why,
            (None, true) => "streamed",
            (None, false) => "resident",
        },
        ledger: None,
        budget_source,
        direct_io: None,
        device: selected.name,
        device_reason: selected.reason,
        context,
        context_source,
        index_ram,
        heat: HeatHandle::default(),
        backend: selected.backend,
        remote: None,
    };
    let model = if !stream {
        info.ledger = Some(ledger);
        let opts = LoadOptions {
            spine,
            experts: None,
            kv: kv_cfg,
            mtp: req.mtp,
            checkpoint: None,
            layers,
        };
        fathom_model::load_config(&config, opts)
            .with_context(|| format!("cannot load the model in {}", dir.display()))?
    } else {
        let remote = match remote {
            Some(_) => Some(crate::remote::open(
                dir,
                req.hub.as_ref(),
                req.span_dir.as_ref(),
                req.disk_budget,
            )?),
            None => None,
        };
        info.remote = remote.as_ref().map(|r| r.store.clone());
        let (model, store) = load_streamed(
            &config,
            req,
            (&ledger, max_inflight),
            &spec,
            (spine, layers),
            kv_cfg,
            remote,
        )?;
        info.direct_io = Some(store.direct_io());
        info.heat = warm_from_heat(req, Some(store), heat_model, heat_in)?;
        info.ledger = Some(ledger);
        model
    };
    warn_unheld(&info);
    info.load_s = t0.elapsed().as_secs_f64();
    Ok(Loaded {
        model,
        config,
        info,
    })
}

/// Says so when the layers the plan holds on the device were read into
/// RAM instead (their shards would not map: not on disk, or a system that
/// refuses the map): the run then holds more RAM than its plan.
fn warn_unheld(info: &LoadInfo) {
    let Some(t) = info.ledger.as_ref().map(|l| &l.tiers) else {
        return;
    };
    let held = fathom_weights::mapped::held_bytes();
    if t.device_layers > 0 && held.saturating_mul(4) < t.device_bytes.saturating_mul(3) {
        tracing::warn!(
            "spine: {} of the {} planned for the device's {} layers could be mapped from the checkpoint; the rest was read into RAM, beyond the plan (lower --ram-budget by the difference)",
            fathom_weights::units::format_bytes(held),
            fathom_weights::units::format_bytes(t.device_bytes),
            t.device_layers
        );
    }
}

/// VRAM the device tier may give spine layers that would otherwise be
/// read for every pass: the device's weight budget less what sequences'
/// state and caches' blocks may take there — an eighth of the budget, or
/// the state the RAM plan counts (`state`) and 256 MiB where that is more
/// (state that does not fit pushes held layers out; the CPU then computes
/// them from the mapped checkpoint).
pub fn device_room(vram_budget: u64, state: u64) -> u64 {
    let reserve = (vram_budget / 8).max(state.saturating_add(256 << 20));
    vram_budget.saturating_sub(reserve)
}

/// The model with its routed experts read from the shards as the router
/// asks for them (at most `max_inflight` reads in flight, as the ledger
/// planned its I/O buffers), and the streamed store.
fn load_streamed(
    config: &ModelConfig,
    req: &LoadRequest,
    (ledger, max_inflight): (&Ledger, usize),
    spec: &fathom_model::memory::MemoryFacts,
    (spine, layers): (Spine, LayerPlan),
    kv: KvConfig,
    remote: Option<crate::remote::Remote>,
) -> Result<(Arc<dyn CausalLm>, Arc<StreamedExperts>)> {
    let cfg = StreamConfig {
        io_threads: req.io_threads.max(1),
        direct: !req.buffered_io,
        prefetch: req.prefetch,
        max_inflight,
        prefetch_depth: req.prefetch_depth.unwrap_or(spec.top_k),
        ..StreamConfig::new(spec.top_k, ledger.cache_experts)
    };
    let store = Arc::new(std::sync::OnceLock::new());
    let s2 = store.clone();
    let disk_budget = remote.as_ref().map(|r| r.disk_budget);
    let opts = LoadOptions {
        spine,
        experts: Some(Box::new(move |ck, table| {
            if let Some(b) = disk_budget {
                crate::remote::check_disk_budget(ck, table, b)
                    .map_err(|e| fathom_model::ModelError::Experts(e.to_string()))?;
            }
            let s = Arc::new(StreamedExperts::new(ck, table, &cfg)?);
            let _ = s2.set(s.clone());
            Ok(s)
        })),
        kv,
        mtp: req.mtp,
        checkpoint: remote.map(|r| r.checkpoint),
        layers,
    };
    let model = fathom_model::load_config(config, opts)
        .with_context(|| format!("cannot load the model in {}", config.dir().display()))?;
    let store = store
        .get()
        .cloned()
        .context("the streamed expert source was not made")?;
    Ok((model, store))
}

/// Whether routed experts come through the Hub span store, and the plan
/// line's word for it: with `--experts remote`, or by default when shards
/// of a pulled model are not on disk. Other modes refuse missing shards.
fn remote_mode(dir: &Path, mode: ExpertMode) -> Result<Option<&'static str>> {
    if mode == ExpertMode::Remote {
        return Ok(Some("remote"));
    }
    let missing = crate::remote::missing_shards(dir);
    let Some(first) = missing.first() else {
        return Ok(None);
    };
    if mode == ExpertMode::Auto && fathom_hub::source_of(dir).is_ok() {
        return Ok(Some("remote (expert shards are not on disk)"));
    }
    anyhow::bail!(
        "{}: {} of the shards the index names are not on disk ({first}…): pull them (`fathom pull REPO --include all`), or, for a pulled model, fetch routed experts on demand with --experts remote",
        dir.display(),
        missing.len()
    )
}

/// Bytes of the directory's safetensors shards (what a resident load reads).
fn shard_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// The latent-cache pool for `kv`: RAM share, row format and (when the
/// admitted context can outgrow the share) the spill file under --kv-dir,
/// made only when a block first spills.
fn kv_config(mem: &LoadRequest, kv: &KvPlan) -> Result<KvConfig> {
    let dir = mem.kv_dir.clone().unwrap_or_else(default_kv_dir);
    let spill: Arc<dyn fathom_model::KvSpill> = if kv.disk > 0 {
        let s = fathom_stream::FileSpill::create(&dir, !mem.buffered_io).with_context(|| {
            format!(
                "--kv-dir {}: the attention cache needs {} beyond its RAM share of {} and this directory is not usable: \
                 give a writable --kv-dir, raise --kv-ram or lower --context",
                dir.display(),
                fathom_weights::units::format_bytes(kv.disk),
                fathom_weights::units::format_bytes(kv.ram)
            )
        })?;
        tracing::info!(
            "attention cache: {} in RAM, up to {} spilled to {}",
            fathom_weights::units::format_bytes(kv.ram),
            fathom_weights::units::format_bytes(kv.disk),
            dir.display()
        );
        Arc::new(s)
    } else {
        // Blocks beyond the share (forks held by a prefix cache) still have
        // somewhere to go; the file is made only if one does.
        Arc::new(fathom_stream::FileSpill::lazy(&dir, !mem.buffered_io))
    };
    Ok(KvConfig {
        ram_limit: Some(kv.ram),
        dtype: kv.dtype,
        spill: Some(spill),
    })
}

#[cfg(test)]
mod tests {
    use super::device_room;

    #[test]
    fn the_device_tier_leaves_an_eighth_or_the_state_whichever_is_more() {
        let gb = 1_000_000_000u64;
        assert_eq!(device_room(24 * gb, gb), 21 * gb);
        // Eight sequences' state (9.3 GB): it is left, with 256 MiB.
        assert_eq!(
            device_room(24 * gb, 9_300_000_000),
            24 * gb - 9_300_000_000 - (256 << 20)
        );
        assert_eq!(device_room(gb, 2 * gb), 0, "no room at all");
    }
}
