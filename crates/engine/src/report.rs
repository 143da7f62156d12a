//! The typed run report: what `run --json`, `batch --json`, the bench and
//! the server's metrics all read and write. No JSON key is spelled twice.

use fathom_kernels::backend::BackendStats;
use fathom_model::experts::ExpertStats;
use fathom_model::{KvStats, SpineReads};
use serde::{Deserialize, Serialize};

use crate::speculative::DraftStats;

/// What one sequence's generation cost.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SeqStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Submitted → prompt read (queueing included).
    pub prefill_s: f64,
    /// Prompt tokens fed ÷ `prefill_s`.
    pub prefill_tok_s: f64,
    /// Submitted → first generated token known.
    pub first_token_s: f64,
    /// First token → last token.
    pub decode_s: f64,
    /// Tokens after the first ÷ `decode_s` (the steady state).
    pub decode_tok_s: f64,
    pub state_bytes: usize,
    pub peak_rss_bytes: u64,
}

/// Expert-source figures over an interval.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct IoStats {
    pub expert_bytes_read: u64,
    pub expert_cache_hits: u64,
    pub expert_cache_misses: u64,
    pub expert_hit_rate: Option<f64>,
    pub prefetch_precision: Option<f64>,
    pub prefetch_recall: Option<f64>,
    pub read_bandwidth_bytes_s: Option<f64>,
    /// Seconds the layer thread was blocked on expert reads (the other
    /// compute threads may be running arrived experts meanwhile).
    pub io_wait_s: f64,
    /// Wall seconds minus `io_wait_s`: time the layer thread was not
    /// blocked on reads (a lower bound of compute when reads overlap it).
    pub compute_s: f64,
    /// Attention-cache blocks in RAM and on disk at the end, blocks spilled
    /// and bytes read back from disk over the interval.
    pub kv_bytes_ram: u64,
    pub kv_bytes_disk: u64,
    pub kv_blocks_spilled: u64,
    pub kv_bytes_read: u64,
    /// Passes over the spine while some of its layers were read for every
    /// pass, the checkpoint bytes they read and the seconds passes waited
    /// for a layer (all zero when the spine is resident).
    pub spine_passes: u64,
    pub spine_bytes_read: u64,
    /// Of `spine_bytes_read`, the bytes read uncached (from storage, not
    /// the page cache).
    pub spine_direct_bytes_read: u64,
    pub spine_wait_s: f64,
    /// The same from the first generated token on (decode alone), where
    /// the caller marked that point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spine_decode_passes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spine_decode_bytes_read: Option<u64>,
}

fn ratio(a: u64, b: u64) -> Option<f64> {
    (b > 0).then(|| a as f64 / b as f64)
}

impl IoStats {
    /// The figures of `s`, an interval of `wall_s` seconds.
    pub fn from_experts(s: &ExpertStats, wall_s: f64) -> Self {
        IoStats {
            expert_bytes_read: s.bytes_read,
            expert_cache_hits: s.hits,
            expert_cache_misses: s.misses,
            expert_hit_rate: ratio(s.hits, s.requested),
            prefetch_precision: ratio(s.hinted_used, s.hinted),
            prefetch_recall: ratio(s.hinted_used, s.requested),
            read_bandwidth_bytes_s: (s.read_s > 0.0)
                .then(|| s.bytes_read as f64 / wall_s.max(1e-9)),
            io_wait_s: s.wait_s,
            compute_s: (wall_s - s.wait_s).max(0.0),
            ..IoStats::default()
        }
    }

    /// With the streamed spine's figures over the interval (`total`) and
    /// from the first generated token on (`decode`).
    pub fn with_spine(mut self, total: &SpineReads, decode: Option<&SpineReads>) -> Self {
        self.spine_passes = total.passes;
        self.spine_bytes_read = total.bytes_read;
        self.spine_direct_bytes_read = total.direct_bytes_read;
        self.spine_wait_s = total.wait_s;
        self.spine_decode_passes = decode.map(|d| d.passes);
        self.spine_decode_bytes_read = decode.map(|d| d.bytes_read);
        self
    }

    /// With the attention cache's figures: `now`, and what changed since `start`.
    pub fn with_kv(mut self, now: &KvStats, start: &KvStats) -> Self {
        self.kv_bytes_ram = now.ram_bytes;
        self.kv_bytes_disk = now.disk_bytes;
        self.kv_blocks_spilled = now.blocks_spilled.saturating_sub(start.blocks_spilled);
        self.kv_bytes_read = now.bytes_read.saturating_sub(start.bytes_read);
        self
    }
}

/// How the model was loaded and run (the same for every sequence of a process).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunSetup {
    pub load_s: f64,
    pub threads: usize,
    /// Compute threads pinned one to a CPU (`--pin-threads`).
    #[serde(default)]
    pub pinned_threads: bool,
    /// NUMA nodes the process may use, and whether its memory is
    /// interleaved over them (`--numa`).
    #[serde(default)]
    pub numa_nodes: usize,
    #[serde(default)]
    pub numa_interleaved: bool,
    /// `resident` or `streamed`.
    pub experts: String,
    pub spine: String,
    pub spine_lossy: bool,
    pub direct_io: Option<bool>,
    pub ram_budget_bytes: Option<u64>,
    pub expert_cache_slots: Option<usize>,
    /// Spine layers the plan reads for every pass, and the bytes a pass
    /// reads of them (as stored, whatever the spine's precision in RAM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spine_streamed_layers: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spine_streamed_bytes: Option<u64>,
    /// Spine layers held on the device instead of read for every pass
    /// (their matrices mapped from the checkpoint, copied up once), and
    /// those matrices' bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spine_device_layers: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spine_device_bytes: Option<u64>,
    /// `cpu` or the device backend's name.
    pub device: String,
    /// Experts `--heat` read into the cache before the first step (their
    /// bytes are not in the run's expert reads), and how many it pinned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heat_warmed_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heat_pinned_experts: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heat_warm_bytes: Option<u64>,
}

/// `stats` of `fathom run --json`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunStats {
    #[serde(flatten)]
    pub seq: SeqStats,
    #[serde(flatten)]
    pub io: IoStats,
    #[serde(flatten)]
    pub setup: RunSetup,
    /// `stop`, `length`, `cancelled` or `error`.
    pub finish_reason: String,
    pub draft: Option<DraftStats>,
    /// What the device backend did (absent when products run on the CPU;
    /// `device` names it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<BackendStats>,
    /// The same over the decode steps alone (after the first token): the
    /// bench's device bounds divide these bytes by the decoded tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_decode: Option<BackendStats>,
    /// Wall time of the decode steps (after the first token) by part of the
    /// layer, for families whose step reports it (absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_phases_ms: Option<fathom_model::phase::PhaseMs>,
}

/// One position's log-probabilities (of the raw model distribution).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens, best first: `[id, logprob]`.
    pub top: Vec<(u32, f32)>,
}

/// `fathom run --json`: exactly this object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    /// Null when the model ships no tokenizer.
    pub text: Option<String>,
    pub finish_reason: String,
    /// Per generated token, with `--logprobs N`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// With `--chat`: the reply's answer and thinking, split as the server splits them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    pub stats: RunStats,
}

/// Counters of the step engine.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EngineStats {
    /// Model steps run.
    pub steps: u64,
    /// Sequences summed over steps (÷ steps = mean batch size).
    pub batch_sum: u64,
    /// New positions fed, summed over steps.
    pub rows: u64,
    /// First step → now.
    pub wall_s: f64,
    #[serde(skip)]
    pub experts: ExpertStats,
}

impl EngineStats {
    pub fn mean_batch_size(&self) -> f64 {
        self.batch_sum as f64 / self.steps.max(1) as f64
    }
}

/// One line of `fathom batch --json`'s `results`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchResult {
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub text: Option<String>,
    pub finish_reason: String,
    pub stats: SeqStats,
}

/// `stats` of `fathom batch --json`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BatchStats {
    /// Generated tokens of all sequences ÷ wall time of the steps (prefill
    /// included, load excluded).
    pub aggregate_tok_s: f64,
    pub generated_tokens: usize,
    pub prompt_tokens: usize,
    pub steps: u64,
    pub mean_batch_size: f64,
    pub wall_s: f64,
    /// Routed experts fetched per step (the union over the step's rows,
    /// summed over MoE layers), bytes of one expert, and spine bytes read
    /// per step: what the step bound is made of.
    pub experts_per_step: f64,
    pub expert_bytes: u64,
    pub spine_bytes: u64,
    #[serde(flatten)]
    pub io: IoStats,
    #[serde(flatten)]
    pub setup: RunSetup,
    /// What the device backend did over the steps (absent when products
    /// run on the CPU; `device` names it), as in a run's stats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<BackendStats>,
    /// The same over the steps after every sequence's first token (no
    /// prefill, the spine's first copies up made): `decode_steps` of them
    /// in `decode_wall_s`, what a steady batch step costs on the device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_decode: Option<BackendStats>,
    pub decode_steps: u64,
    pub decode_wall_s: f64,
}

/// `fathom batch --json`: exactly this object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchReport {
    pub results: Vec<BatchResult>,
    pub stats: BatchStats,
}
