//! The RAM ledger: decided before loading, from the config alone.
//!
//! ```text
//! budget = resident spine + sequence state (for the admitted context)
//!        + scratch (activations, logits, process baseline)
//!        + I/O buffers (reads in flight + the layer being computed)
//!        + expert cache (whatever is left, in whole experts)
//! ```
//! If the spine, state, scratch and buffers alone exceed the budget the plan
//! fails and says what budget would work.

use fathom_model::kimi_k3::config::{AttnKind, K3Spec};
use fathom_model::kimi_k3::tensors::{expert_bytes, tensor_table};
use fathom_weights::IO_ALIGN;

/// Fixed allowance for the process itself (binary, allocator, thread stacks).
const BASELINE: u64 = 64 << 20;

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Ledger {
    pub budget: u64,
    pub spine: u64,
    pub state: u64,
    pub scratch: u64,
    pub io_buffers: u64,
    pub cache: u64,
    pub cache_experts: usize,
    /// Bytes one expert occupies in RAM (its span, rounded up to 4 KiB blocks).
    pub expert_bytes: u64,
    pub context: usize,
}

/// Bytes of the resident spine as loaded (stored precision).
pub fn spine_bytes(spec: &K3Spec) -> u64 {
    tensor_table(spec)
        .iter()
        .filter(|t| t.role.is_spine())
        .map(|t| t.bytes())
        .sum()
}

/// Sequence state for `context` tokens: KDA matrices + conv windows, MLA latent rows.
pub fn state_bytes(spec: &K3Spec, context: usize) -> u64 {
    spec.attn_kinds
        .iter()
        .map(|k| match k {
            AttnKind::Kda => {
                4 * (spec.kda_heads * spec.kda_head_dim * spec.kda_head_dim
                    + 3 * (spec.conv_kernel - 1) * spec.kda_width()) as u64
            }
            AttnKind::Mla => 4 * (spec.mla_cache_width() * context) as u64,
        })
        .sum()
}

/// RAM for one streamed expert: its bytes plus up to two 4 KiB blocks of
/// alignment slack from the direct read.
pub fn expert_ram_bytes(spec: &K3Spec) -> u64 {
    (expert_bytes(spec)).div_ceil(IO_ALIGN as u64) * IO_ALIGN as u64 + IO_ALIGN as u64
}

impl Ledger {
    /// Plans a budget for up to `context` tokens of state and `positions`
    /// tokens per pass, with `max_inflight` reads in flight.
    pub fn plan(
        spec: &K3Spec,
        budget: u64,
        context: usize,
        positions: usize,
        max_inflight: usize,
    ) -> Result<Self, String> {
        let spine = spine_bytes(spec);
        let state = state_bytes(spec, context);
        let d = spec.hidden_size as u64;
        // Logits for every position, a dozen hidden-sized rows per position per
        // block of the decoder, expert intermediates: generous and simple.
        let scratch = BASELINE
            + 4 * positions as u64 * (spec.vocab_size as u64 + 64 * d)
            + 4 * positions as u64
                * (spec.top_k * (2 * spec.moe_intermediate_size + spec.latent_size)) as u64;
        let per = expert_ram_bytes(spec);
        let io_buffers = (max_inflight + spec.top_k * positions) as u64 * per;
        let fixed = spine + state + scratch + io_buffers;
        if fixed > budget {
            return Err(format!(
                "a RAM budget of {} is too small: the resident spine needs {}, state for {context} tokens {}, scratch {}, I/O buffers {} — at least {} (with no expert cache)",
                human(budget),
                human(spine),
                human(state),
                human(scratch),
                human(io_buffers),
                human(fixed)
            ));
        }
        let cache_experts = ((budget - fixed) / per) as usize;
        let total_experts = spec.moe_layers().count() * spec.num_experts;
        let cache_experts = cache_experts.min(total_experts);
        Ok(Ledger {
            budget,
            spine,
            state,
            scratch,
            io_buffers,
            cache: cache_experts as u64 * per,
            cache_experts,
            expert_bytes: per,
            context,
        })
    }

    /// Whether every expert fits in the cache (streaming would only warm it).
    pub fn holds_every_expert(&self, spec: &K3Spec) -> bool {
        self.cache_experts >= spec.moe_layers().count() * spec.num_experts
    }

    /// A few lines for humans.
    pub fn describe(&self) -> String {
        format!(
            "RAM budget {}: spine {}, state {} ({} tokens), scratch {}, I/O buffers {}, expert cache {} ({} experts of {})",
            human(self.budget),
            human(self.spine),
            human(self.state),
            self.context,
            human(self.scratch),
            human(self.io_buffers),
            human(self.cache),
            self.cache_experts,
            human(self.expert_bytes)
        )
    }
}

fn human(b: u64) -> String {
    let g = b as f64 / 1e9;
    if g >= 1.0 {
        format!("{g:.2} GB")
    } else {
        format!("{:.1} MB", b as f64 / 1e6)
    }
}

/// The default budget: the memory-cgroup limit or the available memory,
/// whichever is smaller, minus a margin of 10 % (at least 256 MiB) for the
/// rest of the system. Returns (budget, where the figure came from).
pub fn default_budget() -> (u64, String) {
    let avail = meminfo("MemAvailable:").unwrap_or(8 << 30);
    let (limit, src) = match cgroup_limit() {
        Some(c) if c < avail => (c, "memory-cgroup limit"),
        _ => (avail, "available memory"),
    };
    let margin = (limit / 10).max(256 << 20);
    (
        limit.saturating_sub(margin),
        format!("{src} {} minus a {} margin", human(limit), human(margin)),
    )
}

fn meminfo(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let l = s.lines().find(|l| l.starts_with(key))?;
    Some(
        l[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()?
            * 1024,
    )
}

/// This process's memory-cgroup limit (v2 `memory.max`, or v1
/// `memory.limit_in_bytes`), if one is set.
pub fn cgroup_limit() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in cg.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let file = if controllers.is_empty() {
            format!("/sys/fs/cgroup{path}/memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes")
        } else {
            continue;
        };
        if let Ok(v) = std::fs::read_to_string(&file) {
            if let Ok(n) = v.trim().parse::<u64>() {
                // v1 reports "no limit" as a huge page-rounded number.
                if n < 1 << 60 {
                    return Some(n);
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> K3Spec {
        K3Spec::from_dir(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../model/tests/data/k3-tiny/checkpoint"),
        )
        .unwrap()
    }

    #[test]
    fn ledger_adds_up_and_refuses_too_small() {
        let s = tiny();
        let l = Ledger::plan(&s, 200 << 20, 4096, 1, 8).unwrap();
        assert_eq!(
            l.spine + l.state + l.scratch + l.io_buffers + l.cache <= l.budget,
            true
        );
        assert_eq!(l.cache, l.cache_experts as u64 * l.expert_bytes);
        // k3-tiny: 8 MoE layers × 32 experts, all fit in 200 MiB.
        assert_eq!(l.cache_experts, 8 * 32);
        let e = Ledger::plan(&s, 10 << 20, 4096, 1, 8).unwrap_err();
        assert!(e.contains("too small") && e.contains("spine"), "{e}");
    }

    #[test]
    fn state_counts_kda_and_mla() {
        let s = tiny();
        // 6 KDA layers: 4·(4·48·48 + 3·3·192); 3 MLA layers: 4·56 per token.
        let kda = 6 * 4 * (4 * 48 * 48 + 3 * 3 * 192) as u64;
        assert_eq!(state_bytes(&s, 0), kda);
        assert_eq!(state_bytes(&s, 10), kda + 3 * 4 * 56 * 10);
    }
}
