//! The typed options of a load: budgets, placement, context.

use std::path::PathBuf;

use anyhow::{Result, bail};
use fathom_model::kv::KvDtype;
use fathom_stream::budget::{check_budget, default_budget};

use crate::device::Device;

/// Where routed experts live.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum ExpertMode {
    /// Resident if every expert fits the budget's cache, else streamed.
    #[default]
    Auto,
    /// Read every expert into RAM at load.
    Resident,
    /// Read routed experts from the shards as the router asks for them.
    Stream,
    /// Streamed, with shards that are not on disk (a model pulled with
    /// `--include spine`) fetched span by span from the Hub into a store
    /// bounded by `disk_budget` (the default when such shards are missing).
    Remote,
}

/// The context assumed for a model that declares no max_position_embeddings.
pub const ASSUMED_CONTEXT: usize = 4096;

/// The default spill directory: `fathom/kv` in the user's cache directory.
pub fn default_kv_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("fathom").join("kv")
}

/// How much RAM (and VRAM) a model may use, where its weights live, and
/// what its sequences may hold. Every field is checked when the model
/// loads; the interfaces fill it from their flags.
#[derive(Clone, Debug)]
pub struct LoadRequest {
    /// RAM budget (default: the memory-cgroup limit or the available
    /// memory, minus a margin).
    pub ram_budget: Option<u64>,
    pub experts: ExpertMode,
    /// Tokens of context a sequence may use (default: the most the budget
    /// holds, [`crate::plan::context_for`]).
    pub context: Option<usize>,
    /// RAM for the attention cache of all sequences together.
    pub kv_ram: Option<u64>,
    /// Where attention-cache blocks beyond `kv_ram` go.
    pub kv_dir: Option<PathBuf>,
    pub kv_dtype: KvDtype,
    /// Sequences whose context the ledger admits at once.
    pub sequences: usize,
    /// Parallel expert reads.
    pub io_threads: usize,
    /// Prefetch the next layer's predicted experts.
    pub prefetch: bool,
    /// How many predicted experts to prefetch (default: top-k).
    pub prefetch_depth: Option<usize>,
    /// Read through the page cache instead of direct I/O.
    pub buffered_io: bool,
    pub device: Device,
    /// Device memory for weights.
    pub vram_budget: Option<u64>,
    /// CUDA device ordinals (the first holds the spine).
    pub gpus: Option<Vec<usize>>,
    /// Replay repeated device calls as CUDA graphs.
    pub cuda_graphs: bool,
    /// Expert heat of earlier runs to warm and pin the cache from.
    pub heat: Option<PathBuf>,
    /// Share of the expert cache `heat` pins.
    pub heat_pin: f64,
    /// Where this run's expert request counts are added.
    pub heat_out: Option<PathBuf>,
    /// The caller records `heat_out` (run and batch do).
    pub records_heat: bool,
    /// Also load the checkpoint's multi-token-prediction layer.
    pub mtp: bool,
    /// Most bytes of fetched expert spans kept on disk (remote experts;
    /// default: no limit).
    pub disk_budget: Option<u64>,
    /// The Hub's address and patience for remote experts (default: from
    /// the environment, `HF_ENDPOINT`, `HF_TOKEN`).
    pub hub: Option<fathom_hub::HubConfig>,
    /// Where fetched spans live (default: `fathom/spans/…` in the user's
    /// cache directory).
    pub span_dir: Option<PathBuf>,
    /// At most this many spine layers resident, the rest read for every
    /// pass (tests and benchmarks of a streamed spine; `None`: as many as
    /// the budget holds).
    pub resident_layers: Option<usize>,
    /// What [`LoadRequest::set_aside`] took from the budget before the
    /// model's plan (what, bytes): a plan that does not fit names the least
    /// budget with it added back.
    pub aside: Option<(String, u64)>,
}

impl Default for LoadRequest {
    fn default() -> Self {
        LoadRequest {
            ram_budget: None,
            experts: ExpertMode::Auto,
            context: None,
            kv_ram: None,
            kv_dir: None,
            kv_dtype: KvDtype::F32,
            sequences: 1,
            io_threads: 16,
            prefetch: true,
            prefetch_depth: None,
            buffered_io: false,
            device: Device::Cpu,
            vram_budget: None,
            gpus: None,
            cuda_graphs: true,
            heat: None,
            heat_pin: 0.75,
            heat_out: None,
            records_heat: false,
            mtp: false,
            disk_budget: None,
            hub: None,
            span_dir: None,
            resident_layers: None,
            aside: None,
        }
    }
}

impl LoadRequest {
    /// The RAM budget and where it came from: `ram_budget` (refused above
    /// what the machine or the cgroup gives), else the default.
    pub fn budget(&self) -> Result<(u64, String)> {
        Ok(match self.ram_budget {
            Some(b) => (
                check_budget(b).map_err(anyhow::Error::msg)?,
                "--ram-budget".into(),
            ),
            None => default_budget(),
        })
    }

    /// This request with `bytes` set aside from the budget for something
    /// loaded beside the model (`what`, named with `fix` when it does not fit).
    pub fn set_aside(&self, bytes: u64, what: &str, fix: &str) -> Result<LoadRequest> {
        let mut m = self.clone();
        if bytes == 0 {
            return Ok(m);
        }
        let (budget, _) = self.budget()?;
        if bytes >= budget {
            bail!(
                "{what} ({}) leaves nothing of the RAM budget of {}: {fix}",
                fathom_weights::units::format_bytes(bytes),
                fathom_weights::units::format_bytes(budget)
            );
        }
        m.ram_budget = Some(budget - bytes);
        m.aside = Some(match &self.aside {
            Some((w, b)) => (format!("{w} and {what}"), b + bytes),
            None => (what.to_string(), bytes),
        });
        Ok(m)
    }

    /// This request admitting `extra` more sequences: the ledger then
    /// counts their fixed-size state and places the latent cache of every
    /// admitted sequence's full context (RAM share, the rest on disk).
    pub fn with_sequences(&self, extra: usize) -> LoadRequest {
        let mut m = self.clone();
        m.sequences = self.sequences.saturating_add(extra);
        m
    }
}

/// Refuses a prompt plus its completion budget beyond the context.
pub fn check_context(limit: usize, prompt: usize, max_new: usize, what: &str) -> Result<()> {
    if prompt.saturating_add(max_new) > limit {
        bail!(
            "{what}: the prompt ({prompt} tokens) plus --max-new ({max_new}) exceeds the context of {limit} tokens \
             (--context, at most the model's max_position_embeddings): shorten the prompt or lower --max-new"
        );
    }
    Ok(())
}
