//! The one budget rule, decided from `config.json` and the request before
//! anything is read or written: the context a sequence gets, where routed
//! experts live and the RAM ledger over the budget. A plan that cannot
//! hold the budget is refused here, naming the least budget that works;
//! [`crate::load_config`] loads only what [`plan`] accepted.

use anyhow::{Result, bail};
use fathom_model::memory::MemoryFacts;
use fathom_model::{ModelConfig, Spine};
use fathom_stream::budget::{KvPlan, Ledger, kv_bytes};
use fathom_weights::units::format_bytes;

use crate::options::{ASSUMED_CONTEXT, ExpertMode, LoadRequest};

/// Tokens per cache block: a context the budget picks is a whole number of them.
const BLOCK: usize = fathom_model::kv::BLOCK_ROWS;

/// What a load will hold.
#[derive(Clone, Debug)]
pub struct LoadPlan {
    pub facts: MemoryFacts,
    pub budget: u64,
    /// Where `budget` came from (`--ram-budget`, or the default's source).
    pub budget_source: String,
    /// Tokens of context a sequence may use.
    pub context: usize,
    /// Why `context` (for the plan line).
    pub context_source: String,
    /// The ledger over the budget less `index_ram`.
    pub ledger: Ledger,
    /// RAM set aside for the parsed tensor headers and index.
    pub index_ram: u64,
    /// Routed experts are read from the shards as the router asks.
    pub stream: bool,
    /// Expert reads in flight the ledger counts.
    pub max_inflight: usize,
}

impl LoadPlan {
    /// The plan line: the ledger, where the budget came from, the
    /// context's reason and where the experts live.
    pub fn describe(&self) -> String {
        format!(
            "{}, tensor index {} ({}); context {} tokens ({}); experts {}",
            self.ledger.describe(),
            format_bytes(self.index_ram),
            self.budget_source,
            self.context,
            self.context_source,
            if self.stream { "streamed" } else { "resident" }
        )
    }
}

/// Expert reads in flight for `req` (twice top-k with prefetch).
fn inflight(req: &LoadRequest, facts: &MemoryFacts) -> usize {
    if req.prefetch {
        2 * facts.top_k
    } else {
        facts.top_k
    }
}

/// The context of `req` for `facts` under `budget`: `--context` within
/// the declared maximum; else the largest whole number of cache blocks
/// whose attention cache (for every admitted sequence) fits its RAM share
/// (`--kv-ram`, default a quarter of the budget), at least
/// [`ASSUMED_CONTEXT`] and at most the declared maximum.
pub fn context_for(req: &LoadRequest, facts: &MemoryFacts, budget: u64) -> (usize, String) {
    let declared = facts.max_position_embeddings;
    if let Some(c) = req.context {
        return match declared {
            Some(d) if c > d => (
                d,
                format!("--context, capped at max_position_embeddings {d}"),
            ),
            _ => (c, "--context".into()),
        };
    }
    let most = declared.unwrap_or(ASSUMED_CONTEXT);
    let share = req.kv_ram.unwrap_or(budget / 4);
    let block = kv_bytes(facts, BLOCK, req.kv_dtype).saturating_mul(req.sequences.max(1) as u64);
    let held = if block == 0 {
        usize::MAX
    } else {
        usize::try_from(share / block)
            .unwrap_or(usize::MAX)
            .saturating_mul(BLOCK)
    };
    let floor = ASSUMED_CONTEXT.min(most);
    let share_name = if req.kv_ram.is_some() {
        "--kv-ram".to_string()
    } else {
        format!("a quarter of the budget, {}", format_bytes(share))
    };
    let said = if declared.is_some() {
        "max_position_embeddings"
    } else {
        "config.json declares no max_position_embeddings; assumed"
    };
    if held >= most {
        (
            most,
            format!("the model's {said} {most}; its cache fits {share_name}"),
        )
    } else if held >= floor {
        (
            held,
            format!(
                "the most whose attention cache fits {share_name}; the model allows {most}: set --context for more, spilled to --kv-dir"
            ),
        )
    } else {
        (
            floor,
            format!("at least {floor}: its attention cache beyond {share_name} spills to --kv-dir"),
        )
    }
}

/// The default context `picked` lowered, when the plan does not fit with
/// it, to the most whole cache blocks that `fits` (at least
/// [`ASSUMED_CONTEXT`] or the declared maximum if less: below that the
/// plan is refused). A `--context` given is kept.
fn fit_context(
    req: &LoadRequest,
    facts: &MemoryFacts,
    picked: (usize, String),
    fits: impl Fn(usize) -> bool,
) -> (usize, String) {
    let floor = ASSUMED_CONTEXT.min(facts.max_position_embeddings.unwrap_or(ASSUMED_CONTEXT));
    if req.context.is_some() || picked.0 <= floor || fits(picked.0) {
        return picked;
    }
    if !fits(floor) {
        return (floor, format!("at least {floor}"));
    }
    // `lo` blocks fit (or are the floor), `hi` do not.
    let (mut lo, mut hi) = (floor / BLOCK, picked.0 / BLOCK);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits((mid * BLOCK).max(floor)) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    (
        (lo * BLOCK).max(floor),
        format!(
            "the most the budget holds beside the spine, state, scratch and I/O buffers; the model allows {}: set --context for more, spilled to --kv-dir",
            facts.max_position_embeddings.unwrap_or(ASSUMED_CONTEXT)
        ),
    )
}

/// Plans loading the model of `config` under `req` for passes of up to
/// `positions` tokens with the spine in `spine` precision. Refuses, naming
/// the least `--ram-budget` that works, a plan whose fixed parts exceed the
/// budget, and `--experts resident` when the budget does not hold every
/// expert.
pub fn plan(
    config: &ModelConfig,
    req: &LoadRequest,
    positions: usize,
    spine: Spine,
) -> Result<LoadPlan> {
    let mut facts = config
        .memory_facts()
        .map_err(|e| anyhow::anyhow!("cannot load the model in {}: {e}", config.dir().display()))?;
    if req.mtp {
        facts = facts.with_mtp();
    }
    if spine == Spine::Int8
        && config
            .dir()
            .join(fathom_weights::int8_spine::FILE_NAME)
            .is_file()
    {
        facts = facts.with_int8_file();
    }
    let (budget, budget_source) = req.budget()?;
    let index = index_bytes(config.dir());
    plan_facts(facts, req, (budget, budget_source), index, positions, spine)
}

/// Bytes of the checkpoint's tensor directory: the shards' safetensors
/// headers (their 8-byte length prefixes, read without the headers) and
/// `model.safetensors.index.json`. 0 for what cannot be read (the load
/// then names it).
pub fn index_bytes(dir: &std::path::Path) -> u64 {
    use std::io::Read;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut total = 0u64;
    for e in entries.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == "model.safetensors.index.json" {
            total += e.metadata().map_or(0, |m| m.len());
        } else if name.ends_with(".safetensors") && e.file_type().is_ok_and(|t| t.is_file()) {
            let mut len = [0u8; 8];
            if std::fs::File::open(e.path())
                .and_then(|mut f| f.read_exact(&mut len))
                .is_ok()
            {
                // Bounded by the shard's own length (a corrupt prefix is refused at load).
                let shard = e.metadata().map_or(0, |m| m.len());
                total += u64::from_le_bytes(len).min(shard);
            }
        }
    }
    total
}

/// RAM the parsed tensor directory holds while loading: names, shapes,
/// offsets and the expert table, per byte of headers and index. Measured:
/// `fathom demo --preset tiny --ram-budget 300MB` (498,884 tensors, 72.6 MB
/// of headers and a 60.1 MB index) peaked 411 MB above its ledger, 3.1×.
const INDEX_RAM_PER_BYTE: u64 = 4;

/// The RAM set aside for a checkpoint whose headers and index are
/// `index_bytes` long.
pub fn index_ram(index_bytes: u64) -> u64 {
    index_bytes.saturating_mul(INDEX_RAM_PER_BYTE)
}

/// [`plan`] from the family's memory facts, a budget already checked (with
/// where it came from) and the bytes of the checkpoint's tensor headers and
/// index ([`index_bytes`]; [`index_ram`] of the budget is set aside for them).
pub fn plan_facts(
    facts: MemoryFacts,
    req: &LoadRequest,
    (budget, budget_source): (u64, String),
    index: u64,
    positions: usize,
    spine: Spine,
) -> Result<LoadPlan> {
    let index = index_ram(index);
    let max_inflight = inflight(req, &facts);
    let ledger_with = |b: u64, context: usize| {
        let b = b.saturating_sub(index);
        let kv = KvPlan::new(&facts, context, req.sequences, req.kv_dtype, req.kv_ram, b);
        let least = Ledger::minimum(&facts, spine, context, kv, positions.max(1), max_inflight);
        match req.resident_layers {
            Some(r) => least.cap_resident_layers(&facts, r),
            None => least,
        }
        .with_budget(&facts, b)
    };
    // The context's share is of what the ledger sees: the budget less the
    // index; a default context the rest of the plan leaves no room for is
    // lowered until it fits.
    let picked = context_for(req, &facts, budget.saturating_sub(index));
    let (context, context_source) =
        fit_context(req, &facts, picked, |c| ledger_with(budget, c).is_ok());
    let ledger_at = |b: u64| ledger_with(b, context);
    // What was set aside before this plan (a draft model) is said beside
    // the budget and added back to the least named.
    let (said, aside) = match &req.aside {
        Some((what, b)) => (
            format!(
                "{} ({} less {what}'s {})",
                format_bytes(budget),
                format_bytes(budget + b),
                format_bytes(*b)
            ),
            *b,
        ),
        None => (format_bytes(budget), 0),
    };
    let ledger = ledger_at(budget).map_err(|e| {
        let least = least_budget(budget, |b| ledger_at(b).is_ok());
        // The ledger saw the budget less the tensor index and named its
        // own least: both are said for the whole budget here.
        let head = e.split(" — give at least").next().unwrap_or(&e);
        let parts = head.split_once(" is too small").map_or(head, |(_, p)| p);
        anyhow::anyhow!(
            "a RAM budget of {said} is too small{parts}, the checkpoint's tensor index {} — give at least --ram-budget {}MB",
            format_bytes(index),
            (least + aside).div_ceil(1_000_000)
        )
    })?;
    // Said for the whole budget; the tensor index is named beside it.
    let ledger = Ledger { budget, ..ledger };
    let holds_all = ledger.holds_every_expert(&facts);
    let stream = match req.experts {
        ExpertMode::Stream | ExpertMode::Remote => true,
        ExpertMode::Auto => !holds_all,
        ExpertMode::Resident => {
            if !holds_all {
                let least = least_budget(budget, |b| {
                    ledger_at(b).is_ok_and(|l| l.holds_every_expert(&facts))
                });
                bail!(
                    "--experts resident: a RAM budget of {said} holds {} of the model's {} routed experts ({} each) beside the spine, state, scratch, I/O buffers and tensor index ({}) — give at least --ram-budget {}MB, or leave --experts out to stream the rest from disk",
                    ledger.cache_experts,
                    facts.total_experts(),
                    format_bytes(ledger.expert_bytes),
                    format_bytes(ledger.fixed() + index),
                    (least + aside).div_ceil(1_000_000)
                );
            }
            false
        }
    };
    Ok(LoadPlan {
        facts,
        budget,
        budget_source,
        context,
        context_source,
        ledger,
        index_ram: index,
        stream,
        max_inflight,
    })
}

/// The least budget above `known_bad` for which `fits` holds (`fits` is
/// monotone in the budget), to the byte: a doubling search, then bisection.
pub fn least_budget(known_bad: u64, fits: impl Fn(u64) -> bool) -> u64 {
    let (mut lo, mut hi) = (known_bad, known_bad.max(1 << 20).saturating_mul(2));
    while !fits(hi) {
        if hi == u64::MAX {
            return hi;
        }
        lo = hi;
        hi = hi.saturating_mul(2);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> MemoryFacts {
        fathom_model::registry::memory_facts(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../model/tests/data/k3-tiny/checkpoint"),
        )
        .unwrap()
    }

    fn req(budget: u64) -> LoadRequest {
        LoadRequest {
            ram_budget: Some(budget),
            ..LoadRequest::default()
        }
    }

    #[test]
    fn resident_over_the_budget_is_refused_naming_a_budget_that_works() {
        let f = tiny();
        let mut r = req(76_000_000);
        r.experts = ExpertMode::Resident;
        let e = plan_facts(
            f.clone(),
            &r,
            (76_000_000, "--ram-budget".into()),
            0,
            1,
            Spine::Bf16,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("--experts resident: a RAM budget of 76.0 MB holds "),
            "{e}"
        );
        let mb: u64 = e
            .split("--ram-budget ")
            .nth(1)
            .unwrap()
            .split("MB")
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let ok = plan_facts(
            f.clone(),
            &r,
            (mb * 1_000_000, String::new()),
            0,
            1,
            Spine::Bf16,
        )
        .unwrap();
        assert!(!ok.stream && ok.ledger.holds_every_expert(&f));
        // Within a megabyte of the least.
        assert!(
            plan_facts(
                f.clone(),
                &r,
                ((mb - 1) * 1_000_000, String::new()),
                0,
                1,
                Spine::Bf16
            )
            .is_err()
        );
        // Auto streams instead.
        r.experts = ExpertMode::Auto;
        assert!(
            plan_facts(f, &r, (76_000_000, String::new()), 0, 1, Spine::Bf16)
                .unwrap()
                .stream
        );
    }

    #[test]
    fn the_default_context_is_the_most_the_share_holds_within_the_declared_maximum() {
        let mut f = tiny();
        // k3-tiny: 3 MLA layers of 56 f32 per token: 172,032 bytes a block.
        let block = kv_bytes(&f, BLOCK, fathom_model::KvDtype::F32);
        assert_eq!(block, 3 * 56 * 4 * 256);
        let r = req(0);
        assert_eq!(context_for(&r, &f, 1 << 30).0, 4096);
        f.max_position_embeddings = Some(1 << 20);
        // A quarter of 100 MiB holds 152 blocks.
        let (c, why) = context_for(&r, &f, 100 << 20);
        assert_eq!(c, (25 << 20) / block as usize * 256);
        assert_eq!(c, 38_912);
        assert!(
            why.starts_with("the most whose attention cache fits a quarter of the budget"),
            "{why}"
        );
        // Never below 4096 tokens (spilled), never above the maximum.
        assert_eq!(context_for(&r, &f, 1 << 20).0, 4096);
        assert_eq!(context_for(&r, &f, 1 << 40).0, 1 << 20);
        // Two sequences share it.
        assert_eq!(
            context_for(&r.with_sequences(1), &f, 100 << 20).0,
            38_912 / 512 * 256
        );
        // --context is kept, within the maximum.
        let mut r = req(0);
        r.context = Some(5000);
        assert_eq!(context_for(&r, &f, 1 << 20).0, 5000);
        r.context = Some(2 << 20);
        assert_eq!(context_for(&r, &f, 1 << 20).0, 1 << 20);
    }

    #[test]
    fn a_default_context_the_plan_has_no_room_for_is_lowered_until_it_fits() {
        let mut f = tiny();
        f.max_position_embeddings = Some(1 << 20);
        let r = req(0);
        let plan = |b: u64, r: &LoadRequest| {
            plan_facts(f.clone(), r, (b, String::new()), 0, 1, Spine::Bf16)
        };
        // The least budget with a 4096-token context, and a little more:
        // a quarter of it would hold more context than the rest leaves room for.
        let mut fixed = r.clone();
        fixed.context = Some(4096);
        let least = least_budget(1, |b| plan(b, &fixed).is_ok());
        let b = least + 2_000_000;
        let quarter = context_for(&r, &f, b).0;
        let p = plan(b, &r).unwrap();
        assert!(
            p.context > 4096 && p.context < quarter,
            "{} of {quarter}",
            p.context
        );
        assert_eq!(p.context % BLOCK, 0);
        assert!(
            p.context_source.starts_with("the most the budget holds"),
            "{}",
            p.context_source
        );
        // One more block does not fit.
        fixed.context = Some(p.context + BLOCK);
        assert!(plan(b, &fixed).is_err());
        // Below the least, the refusal names the least for 4096 tokens.
        let e = plan(least - 1_000_000, &r).unwrap_err().to_string();
        assert!(
            e.contains(&format!("--ram-budget {}MB", least.div_ceil(1_000_000))),
            "{e}"
        );
    }

    #[test]
    fn the_least_budget_search_finds_the_boundary() {
        for edge in [1u64, 999_999, 5_000_000, 123_456_789_012] {
            let got = least_budget(0, |b| b >= edge);
            assert!(got >= edge && got - edge <= 1_000_000, "{edge} → {got}");
        }
    }
}
