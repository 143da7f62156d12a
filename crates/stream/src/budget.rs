//! The RAM ledger: decided before loading, from the config alone.
//!
//! ```text
//! budget = resident spine (as stored, or int8 after `--spine int8`):
//!          globals (embedding, final norm, head) + resident layers
//!        + spine ring (layer buffers of the layers read for every pass)
//!        + sequence state (for the admitted context)
//!        + scratch (activations, logits, process baseline)
//!        + I/O buffers (reads in flight + the layer being computed + freed
//!          read buffers kept for reuse)
//!        + expert cache (whatever is left, in whole experts)
//! ```
//! The spine's decoder layers come before the expert cache (each is read
//! every pass, an expert only when routed to): as many layers stay
//! resident as fit beside the state, scratch and buffers, the others are
//! read for every pass through a ring of layer buffers ([`SpineTiers`]).
//! If the globals, the ring, state, scratch and buffers alone exceed the
//! budget the plan fails and says what budget would work. This is the one home of these
//! formulas: the loader sizes the expert cache with them and `fathom
//! inspect --ram-budget` prints them.

use fathom_model::Spine;
use fathom_model::kv::{BLOCK_ROWS, KvDtype};
use fathom_model::memory::MemoryFacts;
use fathom_weights::IO_ALIGN;
use fathom_weights::units::format_bytes;

use fathom_platform::{memory, unified_memory};

pub use crate::spine_tiers::{MAX_RING, SpineTiers, ring_layers};

/// Fixed allowance for the process itself (binary, allocator, thread stacks).
const BASELINE: u64 = 64 << 20;

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Ledger {
    pub budget: u64,
    /// Precision the spine is counted at: `"bf16"` (as stored) or `"int8"`.
    pub spine_repr: &'static str,
    /// The resident spine: globals and resident layers.
    pub spine: u64,
    /// Where the spine's layers are: resident, or read for every pass.
    pub tiers: SpineTiers,
    /// The most held while loading: the spine as stored plus scratch. An
    /// int8 spine is quantised from it before any expert is loaded, so it
    /// is not added to the expert cache.
    pub load_peak: u64,
    pub state: u64,
    pub scratch: u64,
    pub io_buffers: u64,
    pub cache: u64,
    pub cache_experts: usize,
    /// Bytes one expert occupies in RAM (its span, rounded up to 4 KiB blocks).
    pub expert_bytes: u64,
    pub context: usize,
    /// The latent cache: what `context` needs, what of it stays in RAM
    /// (counted in `state`) and what spills to disk.
    pub kv: KvPlan,
}

/// Where the attention cache of the admitted context lives.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct KvPlan {
    pub dtype: KvDtype,
    /// Sequences whose context is admitted at once.
    pub sequences: usize,
    /// Bytes the admitted context needs (whole blocks).
    pub need: u64,
    /// Bytes kept in RAM (the pool's share, `--kv-ram`).
    pub ram: u64,
    /// Bytes that spill to `--kv-dir` at full context.
    pub disk: u64,
    /// Whether the RAM share is the default (a quarter of the budget), so a
    /// larger budget keeps more of the cache in RAM.
    pub default_share: bool,
}

impl KvPlan {
    /// `sequences` sequences of `context` tokens in `dtype`, RAM share
    /// `share` (default: a quarter of `budget`); nothing beyond what is
    /// needed is kept.
    pub fn new(
        spec: &MemoryFacts,
        context: usize,
        sequences: usize,
        dtype: KvDtype,
        share: Option<u64>,
        budget: u64,
    ) -> Self {
        let need = kv_bytes(spec, context, dtype).saturating_mul(sequences.max(1) as u64);
        let ram = share.unwrap_or(budget / 4).min(need);
        KvPlan {
            dtype,
            sequences: sequences.max(1),
            need,
            ram,
            disk: need - ram,
            default_share: share.is_none(),
        }
    }
}

/// Attention-cache rows of one sequence for `context` tokens stored as
/// `dtype`, in whole cache blocks, over every layer that keeps a cache.
pub fn kv_bytes(spec: &MemoryFacts, context: usize, dtype: KvDtype) -> u64 {
    let rows = (context as u64).div_ceil(BLOCK_ROWS as u64) * BLOCK_ROWS as u64;
    spec.cache_floats_per_token
        .saturating_mul(dtype.bytes() as u64)
        .saturating_mul(rows)
}

/// The least `m` with `m ≥ base + min(⌊m/4⌋, need)`: below `4·need`, with
/// `m = 4q + r` (`r < 4`), that is `3q + r ≥ base`, whose least solution is
/// `⌊(4·base − 1)/3⌋` (0 for base 0); from `4·need` on it is `base + need`.
fn least_with_quarter_share(base: u64, need: u64) -> u64 {
    if base > need.saturating_mul(3) {
        base.saturating_add(need)
    } else {
        base.saturating_mul(4).saturating_sub(1) / 3
    }
}

/// Bytes of the resident spine as loaded (stored precision).
pub fn spine_bytes(spec: &MemoryFacts) -> u64 {
    spec.spine_bytes
}

/// Bytes of the resident spine in representation `repr`.
pub fn spine_bytes_for(spec: &MemoryFacts, repr: Spine) -> u64 {
    match repr {
        Spine::Bf16 => spec.spine_bytes,
        Spine::Int8 => spec.spine_int8_bytes,
    }
}

/// Per-sequence state that does not grow with the context (K3: KDA
/// recurrent state and conv windows), twice: the state and the undo mark
/// of a step (a copy the sequence keeps, reused from step to step).
pub fn kda_state_bytes(spec: &MemoryFacts) -> u64 {
    2 * spec.fixed_state_bytes
}

/// Working memory for passes of `positions` tokens: the process baseline,
/// fp32 logits for every position, 64 hidden-sized fp32 rows per position
/// (a dozen per decoder block: generous and simple) and, per position,
/// `top_k` experts' fp32 intermediates (K3: `2·F + L` each).
pub fn scratch_bytes(spec: &MemoryFacts, positions: usize) -> u64 {
    let (p, d) = (positions as u64, spec.hidden_size as u64);
    let expert = (spec.top_k * spec.expert_scratch_floats) as u64;
    BASELINE + 4 * p * (spec.vocab_size as u64 + 64 * d) + 4 * p * expert
}

/// Expert reads in flight plus the experts of the layer being computed
/// (`top_k` per position, at most the layer's `num_experts` distinct ones:
/// a pass asks for each expert once), each [`expert_ram_bytes`], and the
/// read-buffer pool ([`read_pool_bytes`]).
pub fn io_buffer_bytes(spec: &MemoryFacts, positions: usize, max_inflight: usize) -> u64 {
    let layer = spec.top_k.saturating_mul(positions).min(spec.num_experts);
    (max_inflight + layer) as u64 * expert_ram_bytes(spec) + read_pool_bytes(spec)
}

/// The most that freed expert read buffers kept for reuse can hold
/// (`fathom_weights::pool`: at most `POOL_MAX` buffers and `POOL_BYTES` in
/// all; only buffers of at least `MMAP_MIN` bytes are kept, and none is
/// longer than one expert's RAM, whether the expert is read whole or
/// tensor by tensor).
pub fn read_pool_bytes(spec: &MemoryFacts) -> u64 {
    use fathom_weights::buf::MMAP_MIN;
    use fathom_weights::pool::{POOL_BYTES, POOL_MAX};
    let e = expert_ram_bytes(spec);
    if e < MMAP_MIN as u64 {
        return 0;
    }
    (POOL_BYTES as u64).min(POOL_MAX as u64 * e)
}

/// RAM for one streamed expert: its bytes plus up to two 4 KiB blocks of
/// alignment slack from the direct read.
pub fn expert_ram_bytes(spec: &MemoryFacts) -> u64 {
    spec.expert_bytes.div_ceil(IO_ALIGN as u64) * IO_ALIGN as u64 + IO_ALIGN as u64
}

/// The least a head read in row blocks must free to be read so: its
/// reader's thread and read buffers are not in the plan, so a head of a
/// few MB is kept (a 300 MB demo model's run went ~2 % over its budget
/// reading one).
pub const HEAD_BLOCKS_SAVE: u64 = 64 << 20;

impl Ledger {
    /// Plans a budget for up to `context` tokens of state and `positions`
    /// tokens per pass, with `max_inflight` reads in flight, the spine
    /// counted as stored.
    pub fn plan(
        spec: &MemoryFacts,
        budget: u64,
        context: usize,
        positions: usize,
        max_inflight: usize,
    ) -> Result<Self, String> {
        Self::plan_for(spec, Spine::Bf16, budget, context, positions, max_inflight)
    }

    /// [`Ledger::plan`] with the spine counted in representation `spine`.
    pub fn plan_for(
        spec: &MemoryFacts,
        spine: Spine,
        budget: u64,
        context: usize,
        positions: usize,
        max_inflight: usize,
    ) -> Result<Self, String> {
        let kv = KvPlan::new(spec, context, 1, KvDtype::F32, None, budget);
        Self::minimum(spec, spine, context, kv, positions, max_inflight).with_budget(spec, budget)
    }

    /// [`Ledger::plan_for`] with the latent cache placed by `kv`.
    pub fn plan_kv(
        spec: &MemoryFacts,
        spine: Spine,
        budget: u64,
        context: usize,
        kv: KvPlan,
        positions: usize,
        max_inflight: usize,
    ) -> Result<Self, String> {
        Self::minimum(spec, spine, context, kv, positions, max_inflight).with_budget(spec, budget)
    }

    /// The fixed parts alone, with an empty expert cache: `budget` is their
    /// sum, the least budget that works.
    pub fn minimum(
        spec: &MemoryFacts,
        spine: Spine,
        context: usize,
        kv: KvPlan,
        positions: usize,
        max_inflight: usize,
    ) -> Self {
        let tiers = SpineTiers::new(spec, spine == Spine::Int8, usize::MAX);
        let mut l = Ledger {
            budget: 0,
            spine_repr: spine.name(),
            spine: spine_bytes_for(spec, spine),
            tiers,
            load_peak: 0,
            state: kda_state_bytes(spec).saturating_mul(kv.sequences as u64) + kv.ram,
            scratch: scratch_bytes(spec, positions),
            io_buffers: io_buffer_bytes(spec, positions, max_inflight),
            cache: 0,
            cache_experts: 0,
            expert_bytes: expert_ram_bytes(spec),
            context,
            kv,
        };
        l.load_peak = l.peak_while_loading(spec);
        l.budget = l.fixed();
        l
    }

    /// This plan with the spine's layers placed as `tiers`.
    fn with_tiers(mut self, spec: &MemoryFacts, tiers: SpineTiers) -> Self {
        self.spine = tiers.resident_spine();
        self.tiers = tiers;
        self.load_peak = self.peak_while_loading(spec);
        self
    }

    /// At most `resident` decoder layers resident (tests and benchmarks
    /// of a streamed spine; the budget may keep fewer).
    /// At 0, the head is read in row blocks too: nothing of the spine but
    /// its norms and mixing vectors stays in RAM.
    pub fn cap_resident_layers(self, spec: &MemoryFacts, resident: usize) -> Self {
        if resident >= self.tiers.resident_layers && (resident > 0 || self.tiers.head_on_disk) {
            return self;
        }
        let mut t = SpineTiers::new(spec, self.int8(), resident);
        if resident == 0 {
            t = t.with_head_on_disk(spec, self.int8());
        }
        self.with_tiers(spec, t)
    }

    /// The smallest plan: every layer read for every pass, and the head
    /// too when reading it in blocks holds at least [`HEAD_BLOCKS_SAVE`]
    /// less than keeping it.
    pub fn all_streamed(self, spec: &MemoryFacts) -> Self {
        let t = SpineTiers::new(spec, self.int8(), 0).with_embedding_on_disk(spec);
        let kept = self.clone().with_tiers(spec, t.clone());
        let read = self.with_tiers(spec, t.with_head_on_disk(spec, kept.int8()));
        let need = |l: &Ledger| l.fixed().max(l.load_peak);
        if need(&read) + HEAD_BLOCKS_SAVE <= need(&kept) {
            read
        } else {
            kept
        }
    }

    /// This plan with the layers it reads for every pass held on the
    /// device as far as `room` bytes of VRAM go
    /// ([`SpineTiers::with_device`]), the expert cache resized to what the
    /// budget then leaves; unchanged when none is held or the layers'
    /// RAM parts would not fit.
    pub fn with_device(self, spec: &MemoryFacts, room: u64) -> Self {
        let t = self.tiers.clone().with_device(spec, room, self.int8());
        if t.device_layers == 0 {
            return self;
        }
        let budget = self.budget;
        let l = self.clone().with_tiers(spec, t);
        l.with_placed_budget(spec, budget).unwrap_or(self)
    }

    fn int8(&self) -> bool {
        self.spine_repr == Spine::Int8.name()
    }

    /// The most held while loading: the resident spine, the ring, scratch,
    /// and for an int8 spine one piece loaded as stored before it is
    /// quantised (the largest resident layer, or the globals' stored
    /// excess: the head; the ring counts its own layer read as stored).
    fn peak_while_loading(&self, spec: &MemoryFacts) -> u64 {
        let transient = if self.int8() {
            let keep = &self.tiers.keep;
            let layer = spec
                .layers
                .iter()
                .zip(keep)
                .filter(|(_, k)| **k)
                .map(|(l, _)| l.stored)
                .max()
                .unwrap_or(0);
            // The head loaded whole as stored, unless it is read in blocks
            // (the ring counts a block as stored).
            let head = if self.tiers.head_on_disk {
                0
            } else {
                spec.global_bytes(false) - spec.global_bytes(true)
            };
            layer.max(head)
        } else {
            0
        };
        self.spine + self.tiers.ring_bytes + self.scratch + transient
    }

    /// Spine (resident and its ring), state, scratch and I/O buffers:
    /// everything but the cache.
    pub fn fixed(&self) -> u64 {
        self.spine + self.tiers.ring_bytes + self.state + self.scratch + self.io_buffers
    }

    /// The plan with as many spine layers resident as `budget` holds beside
    /// the other fixed parts (at least none, all streamed).
    /// The embedding goes first (a pass reads only its tokens' rows), then
    /// layers one by one.
    fn fit_layers(self, spec: &MemoryFacts, budget: u64) -> Self {
        // Every candidate has the embedding on disk (fewer layers than all
        // put it there anyway), from the most layers resident down.
        let mut r = self.tiers.resident_layers.min(self.tiers.layers);
        loop {
            if r == 0 {
                // A head already read in blocks (every layer asked to
                // stream) stays so.
                return if self.tiers.head_on_disk {
                    self
                } else {
                    self.all_streamed(spec)
                };
            }
            let t = SpineTiers::new(spec, self.int8(), r).with_embedding_on_disk(spec);
            let l = self.clone().with_tiers(spec, t);
            if l.fixed() <= budget && l.load_peak <= budget {
                return l;
            }
            r -= 1;
        }
    }

    /// The least budget whose own plan fits the fixed parts. With the
    /// default latent-cache share (a quarter of the budget, at most what
    /// the context needs) the share grows with the budget, so it is the
    /// least `m` with `m ≥ base + min(m/4, need)`.
    pub fn least_budget(&self) -> u64 {
        if !self.kv.default_share {
            return self.fixed();
        }
        least_with_quarter_share(self.fixed() - self.kv.ram, self.kv.need)
    }

    /// Gives what `budget` leaves after the fixed parts to the expert cache,
    /// in whole experts (at most every expert of the model); fails naming
    /// the parts when they alone exceed it.
    pub fn with_budget(self, spec: &MemoryFacts, budget: u64) -> Result<Self, String> {
        let this = if self.fixed().max(self.load_peak) > budget {
            self.fit_layers(spec, budget)
        } else {
            self
        };
        this.with_placed_budget(spec, budget)
    }

    fn with_placed_budget(self, spec: &MemoryFacts, budget: u64) -> Result<Self, String> {
        let fixed = self.fixed();
        if fixed > budget {
            return Err(format!(
                "a RAM budget of {} is too small: the resident spine ({}) needs {}{}, state for {} sequence{} of {} tokens {} (recurrent state {}{}; latent cache in RAM {}: lower it with --kv-ram, the rest spills to --kv-dir), scratch {}, I/O buffers {} — give at least --ram-budget {}MB (no expert cache then)",
                format_bytes(budget),
                self.spine_repr,
                format_bytes(self.spine),
                if self.tiers.streamed_layers > 0 {
                    format!(
                        " ({}; {} of {} layers read for every pass through a ring of {} layers, {})",
                        if self.tiers.head_on_disk {
                            "norms; the embedding's rows read as asked, the head in blocks"
                        } else if self.tiers.embedding_on_disk {
                            "norm and head, the embedding's rows read as asked"
                        } else {
                            "embedding, norm and head"
                        },
                        self.tiers.streamed_layers,
                        self.tiers.layers,
                        self.tiers.ring,
                        format_bytes(self.tiers.ring_bytes)
                    )
                } else {
                    String::new()
                },
                self.kv.sequences,
                if self.kv.sequences == 1 { "" } else { "s" },
                self.context,
                format_bytes(self.state),
                format_bytes(self.state - self.kv.ram),
                if self.kv.sequences > 1 {
                    ", fewer with a lower --max-seqs"
                } else {
                    ""
                },
                format_bytes(self.kv.ram),
                format_bytes(self.scratch),
                format_bytes(self.io_buffers),
                self.least_budget().div_ceil(1_000_000)
            ));
        }
        if self.load_peak > budget {
            return Err(format!(
                "a RAM budget of {} is too small to load: the spine is read a piece at a time as stored ({} at most with the rest) before it is quantised to {} — give at least --ram-budget {}MB",
                format_bytes(budget),
                format_bytes(self.load_peak),
                self.spine_repr,
                self.load_peak.div_ceil(1_000_000)
            ));
        }
        let total_experts = spec.total_experts();
        let cache_experts = (((budget - fixed) / self.expert_bytes) as usize).min(total_experts);
        Ok(Ledger {
            budget,
            cache: cache_experts as u64 * self.expert_bytes,
            cache_experts,
            ..self
        })
    }

    /// The most RAM the plan holds at any time: loading (the stored spine)
    /// or running (everything counted, the expert cache full).
    pub fn peak(&self) -> u64 {
        self.load_peak.max(self.fixed() + self.cache)
    }

    /// Whether every expert fits in the cache (streaming would only warm it).
    pub fn holds_every_expert(&self, spec: &MemoryFacts) -> bool {
        self.cache_experts >= spec.total_experts()
    }

    /// A few lines for humans.
    pub fn describe(&self) -> String {
        let t = &self.tiers;
        let device = if t.device_layers > 0 || t.head_on_device {
            format!(
                "; {} layers{} held on the device ({}, not in RAM)",
                t.device_layers,
                if t.head_on_device {
                    " and the head"
                } else {
                    ""
                },
                format_bytes(t.device_bytes)
            )
        } else {
            String::new()
        };
        let tiers = if t.streamed_layers > 0 {
            format!(
                "; {} of {} layers resident, {} read for every pass ({} read) through a ring of {} layers ({}){}",
                t.resident_layers,
                t.layers,
                t.streamed_layers,
                format_bytes(t.read_bytes),
                t.ring,
                format_bytes(t.ring_bytes),
                match (t.embedding_on_disk, t.head_on_disk) {
                    (_, true) => ", the embedding's rows read as asked, the head in row blocks",
                    (true, false) => ", the embedding's rows read as asked",
                    _ => "",
                }
            )
        } else if t.embedding_on_disk {
            "; the embedding's rows read as asked".to_string()
        } else {
            String::new()
        } + &device;
        format!(
            "RAM budget {}: spine {} ({}{tiers}), state {} ({} tokens × {} sequences; latent cache {} {} in RAM, {} on disk at full context), scratch {}, I/O buffers {}, expert cache {} ({} experts of {})",
            format_bytes(self.budget),
            format_bytes(self.spine),
            self.spine_repr,
            format_bytes(self.state),
            self.context,
            self.kv.sequences,
            self.kv.dtype.name(),
            format_bytes(self.kv.ram),
            format_bytes(self.kv.disk),
            format_bytes(self.scratch),
            format_bytes(self.io_buffers),
            format_bytes(self.cache),
            self.cache_experts,
            format_bytes(self.expert_bytes)
        )
    }
}

/// The most memory this process may have: the memory-cgroup limit or the
/// physical memory, whichever is smaller (with where the figure came from).
pub fn memory_ceiling() -> (u64, &'static str) {
    let total = memory::total().unwrap_or(u64::MAX);
    match memory::limit() {
        Some(c) if c < total => (c, "memory-cgroup limit"),
        _ if unified_memory() => (total, "unified memory (the CPU's and the GPU's)"),
        _ => (total, "physical memory"),
    }
}

/// A budget asked for: refused when above what the machine or the cgroup
/// can give (it would end in an OOM kill, not in a clear error).
pub fn check_budget(asked: u64) -> Result<u64, String> {
    let (ceiling, src) = memory_ceiling();
    if asked > ceiling {
        return Err(format!(
            "--ram-budget {} is more than the {src} ({}): give at most that, or leave --ram-budget out for the default ({})",
            format_bytes(asked),
            format_bytes(ceiling),
            format_bytes(default_budget().0)
        ));
    }
    Ok(asked)
}

/// The default budget: the memory-cgroup limit or the available memory,
/// whichever is smaller, minus a margin of 10 % (at least 256 MiB, at most a
/// quarter of a small limit) for the
/// rest of the system. Returns (budget, where the figure came from). On
/// unified memory (Apple Silicon) the available memory is the whole
/// machine's, the GPU's included: the budget is all fathom takes, with no
/// separate device memory beside it and no page-locked tier.
pub fn default_budget() -> (u64, String) {
    let avail = memory::available().unwrap_or(8 << 30);
    let (limit, src) = match memory::limit() {
        Some(c) if c < avail => (c, "memory-cgroup limit"),
        _ if unified_memory() => (avail, "available unified memory"),
        _ => (avail, "available memory"),
    };
    // 10 %, at least 256 MiB — but never more than a quarter of a small limit.
    let margin = (limit / 10).max((256u64 << 20).min(limit / 4));
    (
        limit.saturating_sub(margin),
        format!(
            "{src} {} minus a {} margin",
            format_bytes(limit),
            format_bytes(margin)
        ),
    )
}

#[cfg(test)]
mod tests;
