//! The memory and placement flags shared by the commands that run a model,
//! and their translation into the library's typed load request
//! (`fathom_runtime::load` does the loading).

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use clap::{Args, ValueEnum};
use fathom_model::kv::KvDtype;
use fathom_model::{CausalLm, Spine};
use fathom_weights::units::parse_size;

pub use fathom_runtime::dir::{check_model_dir, not_a_model_dir};
pub use fathom_runtime::{ASSUMED_CONTEXT, LoadInfo, LoadRequest, check_context};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExpertMode {
    /// Resident if every expert fits the budget's cache, else streamed.
    Auto,
    /// Read every expert into RAM at load.
    Resident,
    /// Read routed experts from the shards as the router asks for them.
    Stream,
    /// Streamed; shards of a pulled model that are not on disk (`fathom
    /// pull --include spine`) are fetched from the Hub span by span as the
    /// router asks, kept within --disk-budget (the default when such
    /// shards are missing).
    Remote,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvDtypeArg {
    F32,
    Bf16,
}

impl From<KvDtypeArg> for KvDtype {
    fn from(a: KvDtypeArg) -> Self {
        match a {
            KvDtypeArg::F32 => KvDtype::F32,
            KvDtypeArg::Bf16 => KvDtype::Bf16,
        }
    }
}

/// How much RAM fathom may use and where routed experts live.
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Memory and placement")]
pub struct MemoryArgs {
    /// RAM budget, e.g. 8GB or 512MiB (default: the memory-cgroup limit or the
    /// available memory, minus a 10 % margin). The resident spine, state for
    /// --context tokens, scratch and I/O buffers come first; the expert cache
    /// gets the rest.
    #[arg(long, value_parser = parse_size)]
    pub ram_budget: Option<u64>,
    /// Where routed experts live.
    #[arg(long, value_enum, default_value_t = ExpertMode::Auto)]
    pub experts: ExpertMode,
    /// Disk for expert spans fetched from the Hub (remote experts), e.g.
    /// 200GB; the least recently used go first (default: no limit). Less
    /// than one expert is refused.
    #[arg(long, value_parser = parse_size)]
    pub disk_budget: Option<u64>,
    /// Tokens of context a sequence may use (default: the most whose
    /// attention cache fits its RAM share, --kv-ram or a quarter of the
    /// budget, at least 4096 and at most the model's
    /// max_position_embeddings; the plan line says which); a prompt plus
    /// --max-new beyond it is refused. Beyond the RAM share the cache
    /// spills to --kv-dir.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=(1 << 26)))]
    pub context: Option<usize>,
    /// RAM for the attention cache of all sequences together, e.g. 2GB
    /// (default: what the context needs, at most a quarter of the budget);
    /// blocks beyond it spill to --kv-dir.
    #[arg(long, value_parser = parse_size)]
    pub kv_ram: Option<u64>,
    /// Where attention-cache blocks beyond --kv-ram go (default: fathom/kv in
    /// the user's cache directory; one unlinked file per process).
    #[arg(long)]
    pub kv_dir: Option<std::path::PathBuf>,
    /// Attention-cache row format: f32 (exact) or bf16 (half the bytes,
    /// lossy: see docs/quality/kv-bf16.md).
    #[arg(long, value_enum, default_value_t = KvDtypeArg::F32)]
    pub kv_dtype: KvDtypeArg,
    /// Parallel expert reads (I/O threads).
    #[arg(long, default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub io_threads: usize,
    /// Do not prefetch the next layer's predicted experts.
    #[arg(long)]
    pub no_prefetch: bool,
    /// How many of the next layer's predicted experts to prefetch, most
    /// confident first (default: top-k). Wrong guesses cost read bandwidth.
    #[arg(long)]
    pub prefetch_depth: Option<usize>,
    /// Read through the page cache instead of O_DIRECT (the budget is then not honest).
    #[arg(long)]
    pub buffered_io: bool,
    /// Where matrix products run: cpu, cuda (an NVIDIA GPU; only the driver
    /// and NVRTC are needed, at run time) or auto (CUDA when present, else
    /// CPU). Output is bit-identical on either.
    #[arg(long, value_enum, default_value_t = crate::device::DeviceArg::Cpu)]
    pub device: crate::device::DeviceArg,
    /// Device memory for weights with --device cuda|auto, e.g. 40GB
    /// (default: the free device memory minus 2 GiB); matrices beyond it
    /// are computed on the CPU.
    #[arg(long, value_parser = parse_size)]
    pub vram_budget: Option<u64>,
    /// CUDA devices with --device cuda|auto: a count N (devices 0..N) or a
    /// list such as 0,2. Routed experts are split over them (each keeps its
    /// own VRAM cache and --vram-budget); the spine and the sequences'
    /// states stay on the first. A device listed twice gets two caches
    /// sharing its memory (for testing the split). Output is unchanged.
    #[arg(long, value_parser = crate::device::parse_gpus)]
    pub gpus: Option<crate::device::Gpus>,
    /// With --device cuda|auto: issue every device call's copies and
    /// kernels one by one instead of replaying a call that repeats (as a
    /// decode step's calls do) as one CUDA graph. Output is unchanged.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Expert heat recorded by earlier runs (--heat-out) of this model:
    /// streamed experts read the hottest into the cache before the first
    /// step and pin the hottest --heat-pin share of it. Output is unchanged.
    #[arg(long)]
    pub heat: Option<std::path::PathBuf>,
    /// Share of the expert cache that --heat pins (never evicted), 0 to 0.9.
    /// The default was measured on held-out text (docs/bench.md, "Expert
    /// heat"): pinning gains hit rate where warming alone barely does.
    #[arg(long, default_value_t = 0.75, value_parser = parse_pin)]
    pub heat_pin: f64,
    /// Add this run's expert request counts to FILE (made if absent), for
    /// a later --heat.
    #[arg(long)]
    pub heat_out: Option<std::path::PathBuf>,
    /// At most this many spine layers resident, the rest read for every
    /// pass (tests and benchmarks of a streamed spine; default: as many as
    /// the budget holds).
    #[arg(long, hide = true)]
    pub spine_resident_layers: Option<usize>,
}

fn parse_pin(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=0.9).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{v} is not in 0..=0.9 (the share of the cache pinned)"
        ))
    }
}

impl From<ExpertMode> for fathom_runtime::ExpertMode {
    fn from(m: ExpertMode) -> Self {
        match m {
            ExpertMode::Auto => fathom_runtime::ExpertMode::Auto,
            ExpertMode::Resident => fathom_runtime::ExpertMode::Resident,
            ExpertMode::Stream => fathom_runtime::ExpertMode::Stream,
            ExpertMode::Remote => fathom_runtime::ExpertMode::Remote,
        }
    }
}

impl MemoryArgs {
    /// The flags as the library's load request, for one sequence; a
    /// command builds it once and sets what its flags do not say (more
    /// sequences, the prediction layer, heat recording) on it.
    pub fn request(&self) -> LoadRequest {
        LoadRequest {
            ram_budget: self.ram_budget,
            experts: self.experts.into(),
            context: self.context,
            kv_ram: self.kv_ram,
            kv_dir: self.kv_dir.clone(),
            kv_dtype: self.kv_dtype.into(),
            sequences: 1,
            io_threads: self.io_threads,
            prefetch: !self.no_prefetch,
            prefetch_depth: self.prefetch_depth,
            buffered_io: self.buffered_io,
            device: self.device.into(),
            vram_budget: self.vram_budget,
            gpus: self.gpus.as_ref().map(|g| g.0.clone()),
            cuda_graphs: !self.no_cuda_graphs,
            heat: self.heat.clone(),
            heat_pin: self.heat_pin,
            heat_out: self.heat_out.clone(),
            records_heat: false,
            mtp: false,
            disk_budget: self.disk_budget,
            resident_layers: self.spine_resident_layers,
            ..Default::default()
        }
    }
}

/// The plan of loading `config` under `req` (`fathom_runtime::plan`): the
/// context, the ledger and where experts live, refused (naming the least
/// budget that works) before anything is read.
pub fn plan(
    config: &fathom_model::ModelConfig,
    req: &LoadRequest,
    positions: usize,
    spine: Spine,
) -> Result<fathom_runtime::LoadPlan> {
    fathom_runtime::plan(config, req, positions, spine)
}

/// Loads the model in `dir` with these flags (`fathom_runtime::load`),
/// saying on stderr which device `--device auto` chose.
pub fn load_model_with(
    dir: &Path,
    req: &LoadRequest,
    positions: usize,
    spine: Spine,
) -> Result<(Arc<dyn CausalLm>, LoadInfo)> {
    load_model_config(fathom_runtime::read_config(dir)?, req, positions, spine)
}

/// As [`load_model_with`], with `config.json` already read (by a command
/// that checked cheap things against it first).
pub fn load_model_config(
    config: fathom_model::ModelConfig,
    req: &LoadRequest,
    positions: usize,
    spine: Spine,
) -> Result<(Arc<dyn CausalLm>, LoadInfo)> {
    let loaded = fathom_runtime::load_config(config, req, positions, spine)?;
    if let Some(why) = &loaded.info.device_reason {
        eprintln!("--device auto: running on {} ({why})", loaded.info.device);
    }
    Ok((loaded.model, loaded.info))
}
