//! Memory options shared by the commands that run a model, and the loader
//! that turns them into a model whose experts are resident or streamed.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use fathom_model::kv::{KvConfig, KvDtype};
use fathom_model::{CausalLm, LoadOptions, Spine};
use fathom_stream::budget::{KvPlan, Ledger, check_budget, default_budget};
use fathom_stream::{StreamConfig, StreamedExperts};
use fathom_weights::units::parse_size;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExpertMode {
    /// Resident if every expert fits the budget's cache, else streamed.
    Auto,
    /// Read every expert into RAM at load.
    Resident,
    /// Read routed experts from the shards as the router asks for them.
    Stream,
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

/// The context assumed for a model that declares no max_position_embeddings.
pub const ASSUMED_CONTEXT: usize = 4096;

/// The default spill directory: `fathom/kv` in the user's cache directory.
pub fn default_kv_dir() -> std::path::PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("fathom").join("kv")
}

/// How much RAM fathom may use and where routed experts live.
#[derive(Args, Clone, Debug)]
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
    /// Tokens of context a sequence may use (default: the model's
    /// max_position_embeddings); a prompt plus --max-new beyond it is
    /// refused. Cache pages are taken as a sequence grows: a long maximum
    /// costs nothing until used.
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
    /// Sequences whose context the ledger admits at once (set by batch and serve).
    #[arg(skip = 1usize)]
    pub sequences: usize,
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
    /// Also load the checkpoint's multi-token-prediction layer (set by
    /// `run --draft mtp`).
    #[arg(skip = false)]
    pub mtp: bool,
    /// The command records `--heat-out` (set by run and batch).
    #[arg(skip = false)]
    pub records_heat: bool,
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

/// The streamed store's heat: what `--heat` warmed, and where `--heat-out`
/// adds this run's counts.
#[derive(Clone, Default)]
pub struct HeatHandle {
    store: Option<Arc<StreamedExperts>>,
    out: Option<std::path::PathBuf>,
    model: String,
    /// Experts read before the first step, pinned among them, bytes read.
    pub warmed: Option<(usize, usize, u64)>,
}

impl std::fmt::Debug for HeatHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeatHandle")
            .field("out", &self.out)
            .field("warmed", &self.warmed)
            .finish()
    }
}

impl HeatHandle {
    /// Adds the counts so far (from `tokens` positions) to `--heat-out`.
    pub fn record(&self, tokens: u64) -> Result<()> {
        let (Some(store), Some(out)) = (&self.store, &self.out) else {
            return Ok(());
        };
        let total = store
            .heat(&self.model, tokens)
            .merge_into(out)
            .map_err(anyhow::Error::msg)?;
        tracing::info!(
            "heat: {} now holds counts from {} positions",
            out.display(),
            total.tokens
        );
        Ok(())
    }
}

/// A model's identity for heat files: the first 16 hex digits of the
/// SHA-256 of its config.json.
pub fn config_digest(dir: &Path) -> Result<String> {
    use sha2::Digest;
    let p = dir.join("config.json");
    let bytes = std::fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?;
    let d = sha2::Sha256::digest(&bytes);
    Ok(d.iter().take(8).map(|b| format!("{b:02x}")).collect())
}

/// What loading decided, for stats and logs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoadInfo {
    pub load_s: f64,
    pub experts: &'static str,
    pub ledger: Option<Ledger>,
    pub budget_source: String,
    pub direct_io: Option<bool>,
    /// `cpu`, or the backend that computes the matrix products.
    pub device: String,
    #[serde(skip)]
    pub heat: HeatHandle,
}

impl MemoryArgs {
    /// The RAM budget and where it came from: `--ram-budget` (refused above
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

    /// The context a sequence may use: `--context` within the model's
    /// declared maximum, else that maximum (else [`ASSUMED_CONTEXT`]).
    pub fn context_for(&self, declared: Option<usize>) -> usize {
        match (self.context, declared) {
            (Some(c), Some(d)) => c.min(d),
            (Some(c), None) => c,
            (None, Some(d)) => d,
            (None, None) => ASSUMED_CONTEXT,
        }
    }

    /// These flags with `bytes` set aside from the budget for something
    /// loaded beside the model (`what`, named with `fix` when it does not fit).
    pub fn set_aside(&self, bytes: u64, what: &str, fix: &str) -> Result<MemoryArgs> {
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
        Ok(m)
    }
}

/// `mem` admitting `extra` more sequences: the ledger then counts their
/// fixed-size state and places the latent cache of every admitted
/// sequence's full context (RAM share, the rest on disk).
pub fn reserve_sequences(mem: &MemoryArgs, extra: usize) -> MemoryArgs {
    let mut m = mem.clone();
    m.sequences = mem.sequences.saturating_add(extra);
    m
}

/// The context a sequence may use: `--context`, within the model's
/// declared `max_position_embeddings`.
pub fn context_limit(mem: &MemoryArgs, info: &fathom_model::ModelInfo) -> usize {
    mem.context_for(info.max_position_embeddings)
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

/// Checks that `dir` looks like a model directory, and says what it is
/// instead when it is something else (a GGUF file, a Hugging Face cache
/// repository root).
pub fn check_model_dir(dir: &Path) -> Result<()> {
    if let Some(why) = not_a_model_dir(dir) {
        bail!("{why}");
    }
    if !dir.is_dir() {
        bail!("model directory {} does not exist", dir.display());
    }
    if !dir.join("config.json").is_file() {
        bail!(
            "{} is not a model directory: it has no config.json",
            dir.display()
        );
    }
    Ok(())
}

/// What `dir` is when it is recognisably not a model directory (a GGUF
/// file, a Hugging Face cache repository root, a folder of GGUF files).
pub fn not_a_model_dir(dir: &Path) -> Option<String> {
    if is_gguf(dir) {
        return Some(format!(
            "{} is a GGUF file: fathom reads safetensors checkpoints as Hugging Face ships them \
             (a directory with config.json and *.safetensors shards)",
            dir.display()
        ));
    }
    if dir.is_dir() && !dir.join("config.json").is_file() {
        let snaps = dir.join("snapshots");
        if snaps.is_dir() && dir.join("blobs").is_dir() {
            let revs: Vec<String> = std::fs::read_dir(&snaps)
                .map(|r| {
                    r.filter_map(|e| e.ok())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            return Some(format!(
                "{} is a Hugging Face cache repository, not a model directory: point --model at {}/<revision> ({})",
                dir.display(),
                snaps.display(),
                if revs.is_empty() {
                    "none downloaded yet".to_string()
                } else {
                    format!("found: {}", revs.join(", "))
                }
            ));
        }
        let gguf: Vec<String> = std::fs::read_dir(dir)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| is_gguf(p))
                    .map(|p| p.display().to_string())
                    .collect()
            })
            .unwrap_or_default();
        if !gguf.is_empty() {
            return Some(format!(
                "{} holds GGUF files ({}) and no config.json: fathom reads safetensors checkpoints as Hugging Face ships them",
                dir.display(),
                gguf.join(", ")
            ));
        }
    }
    None
}

/// A regular file starting with the GGUF magic.
fn is_gguf(p: &Path) -> bool {
    use std::io::Read;
    if !std::fs::metadata(p).is_ok_and(|m| m.is_file()) {
        return false;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// Shows load progress until dropped: a bar on a terminal, otherwise a
/// plain line every few seconds (logs and CI see something too).
struct LoadProgress {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LoadProgress {
    fn start(total: u64) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let base = fathom_weights::bytes_read();
        let thread = std::thread::spawn(move || {
            let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
            let bar = if tty {
                crate::commands::synth::byte_bar(total, "loading")
            } else {
                indicatif::ProgressBar::hidden()
            };
            let t0 = Instant::now();
            let mut last_line = Instant::now();
            while !s2.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let done = fathom_weights::bytes_read() - base;
                bar.set_position(done.min(total));
                if !tty && last_line.elapsed().as_secs() >= 5 {
                    last_line = Instant::now();
                    eprintln!(
                        "loading: {} of {} read ({:.0} s)",
                        fathom_weights::units::format_bytes(done),
                        fathom_weights::units::format_bytes(total),
                        t0.elapsed().as_secs_f64()
                    );
                }
            }
            bar.finish_and_clear();
        });
        LoadProgress {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for LoadProgress {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Loads a model under `mem`'s budget, for passes of up to `positions` tokens,
/// with the spine in `spine` precision (int8 is quantised at load; the
/// cache is sized for it — loading briefly holds the spine as stored).
/// The architecture registry picks the family from `config.json`.
pub fn load_model_with(
    dir: &Path,
    mem: &MemoryArgs,
    positions: usize,
    spine: Spine,
) -> Result<(Arc<dyn CausalLm>, LoadInfo)> {
    check_model_dir(dir)?;
    fathom_model::registry::detect(dir)
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let device = crate::device::select(
        mem.device,
        mem.vram_budget,
        mem.gpus.as_ref(),
        !mem.no_cuda_graphs,
    )?;
    // The RAM ledger reads the family's memory facts (config.json only).
    let mut spec = fathom_model::memory::memory_facts(dir)
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    if mem.mtp {
        spec = spec.with_mtp();
    }
    let (budget, budget_source) = mem.budget()?;
    let max_inflight = if mem.no_prefetch {
        spec.top_k
    } else {
        2 * spec.top_k
    };
    let context = mem.context_for(spec.max_position_embeddings);
    if spec.max_position_embeddings.is_none() && mem.context.is_none() {
        tracing::info!(
            "config.json declares no max_position_embeddings: assuming a context of {ASSUMED_CONTEXT} tokens (set --context)"
        );
    }
    let kv = KvPlan::new(
        &spec,
        context,
        mem.sequences,
        mem.kv_dtype.into(),
        mem.kv_ram,
        budget,
    );
    let ledger = Ledger::plan_kv(
        &spec,
        spine,
        budget,
        context,
        kv,
        positions.max(1),
        max_inflight,
    );
    let kv_cfg = kv_config(mem, &kv)?;
    let stream = match mem.experts {
        ExpertMode::Resident => false,
        ExpertMode::Stream => true,
        ExpertMode::Auto => !matches!(&ledger, Ok(l) if l.holds_every_expert(&spec)),
    };
    let (heat_model, heat_in) = heat_precheck(dir, mem, stream)?;
    let t0 = Instant::now();
    let on_disk: u64 = std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0);
    let total = if stream {
        ledger.as_ref().map_or(on_disk, |l| l.spine)
    } else {
        on_disk
    };
    let _progress = LoadProgress::start(total);
    if !stream {
        let opts = LoadOptions {
            spine,
            experts: None,
            kv: kv_cfg,
            mtp: mem.mtp,
        };
        let model = fathom_model::load(dir, opts)
            .with_context(|| format!("cannot load the model in {}", dir.display()))?;
        let info = LoadInfo {
            load_s: t0.elapsed().as_secs_f64(),
            experts: "resident",
            ledger: ledger.ok(),
            budget_source,
            direct_io: None,
            device,
            heat: HeatHandle::default(),
        };
        return Ok((model, info));
    }
    let ledger = ledger.map_err(anyhow::Error::msg)?;
    let cfg = StreamConfig {
        io_threads: mem.io_threads.max(1),
        direct: !mem.buffered_io,
        prefetch: !mem.no_prefetch,
        max_inflight,
        prefetch_depth: mem.prefetch_depth.unwrap_or(spec.top_k),
        ..StreamConfig::new(spec.top_k, ledger.cache_experts)
    };
    let direct = Arc::new(std::sync::OnceLock::new());
    let d2 = direct.clone();
    let store = Arc::new(std::sync::OnceLock::new());
    let s2 = store.clone();
    let opts = LoadOptions {
        spine,
        experts: Some(Box::new(move |ck, table| {
            let s = Arc::new(StreamedExperts::new(ck, table, &cfg)?);
            let _ = d2.set(s.direct_io());
            let _ = s2.set(s.clone());
            Ok(s)
        })),
        kv: kv_cfg,
        mtp: mem.mtp,
    };
    let model = fathom_model::load(dir, opts)
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let direct = direct.get().copied();
    let heat = warm_from_heat(mem, store.get().cloned(), heat_model, heat_in)?;
    let info = LoadInfo {
        load_s: t0.elapsed().as_secs_f64(),
        experts: "streamed",
        ledger: Some(ledger),
        budget_source,
        direct_io: direct,
        device,
        heat,
    };
    Ok((model, info))
}

/// Checks --heat / --heat-out before loading: they need streamed experts,
/// and their files must be this model's. Returns the model's digest (when
/// heat is used) and the --heat file.
fn heat_precheck(
    dir: &Path,
    mem: &MemoryArgs,
    stream: bool,
) -> Result<(String, Option<fathom_stream::Heat>)> {
    if mem.heat.is_none() && mem.heat_out.is_none() {
        return Ok((String::new(), None));
    }
    if mem.heat_out.is_some() && !mem.records_heat {
        bail!("--heat-out is recorded by `fathom run` and `fathom batch` only");
    }
    if !stream {
        if mem.experts == ExpertMode::Resident {
            bail!(
                "--heat and --heat-out keep and record what a streamed expert cache holds: \
                 with --experts resident every expert is in RAM; use --experts stream"
            );
        }
        tracing::warn!(
            "every expert fits the budget and is resident: --heat/--heat-out do nothing"
        );
        return Ok((String::new(), None));
    }
    let model = config_digest(dir)?;
    // An existing --heat-out file must be this model's: checked now, not
    // after the run.
    if let Some(p) = mem.heat_out.as_ref().filter(|p| p.exists()) {
        fathom_stream::Heat::read(p, &model, None)
            .map_err(|e| anyhow::anyhow!("{}", e.replacen("--heat ", "--heat-out ", 1)))?;
    }
    let heat = mem
        .heat
        .as_ref()
        .map(|p| fathom_stream::Heat::read(p, &model, None).map_err(anyhow::Error::msg))
        .transpose()?;
    Ok((model, heat))
}

/// Reads the hottest experts of `heat` into the store's cache (pinning the
/// --heat-pin share) and sets up --heat-out.
fn warm_from_heat(
    mem: &MemoryArgs,
    store: Option<Arc<StreamedExperts>>,
    model: String,
    heat: Option<fathom_stream::Heat>,
) -> Result<HeatHandle> {
    let Some(store) = store else {
        return Ok(HeatHandle::default());
    };
    let mut warmed = None;
    if let (Some(h), Some(p)) = (heat, &mem.heat) {
        h.check_shape(p, &store.experts_per_layer())
            .map_err(anyhow::Error::msg)?;
        let keys = h.ranked();
        let cap = store.cache_capacity();
        let pin = (cap as f64 * mem.heat_pin).floor() as usize;
        let n = keys.len().min(cap);
        let bytes = store.warm(&keys, pin)?;
        let pinned = store.pinned();
        tracing::info!(
            "heat: read {n} of {cap} cache places ({}) before the first step, {pinned} pinned",
            fathom_weights::units::format_bytes(bytes)
        );
        warmed = Some((n, pinned, bytes));
    }
    Ok(HeatHandle {
        store: Some(store),
        out: mem.heat_out.clone(),
        model,
        warmed,
    })
}

/// The latent-cache pool for `kv`: RAM share, row format and (when the
/// admitted context can outgrow the share) the spill file under --kv-dir,
/// made only when a block first spills.
fn kv_config(mem: &MemoryArgs, kv: &KvPlan) -> Result<KvConfig> {
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
