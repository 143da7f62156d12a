//! `fathom demo`: the first command on a fresh machine.
//!
//! Makes (once, cached) a synthetic k3-mini checkpoint — the real K3 expert
//! count and top-k, the released file layout — about three times larger than
//! the RAM budget, then decodes from it with the routed experts streamed from
//! disk, printing tokens as they come and a live line of tokens/s and I/O.
//! The weights are random, so the text is noise; the point is the machinery:
//! a model that does not fit in the budget runs anyway, exactly.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use fathom_engine::generate;
use fathom_synth::{Overrides, Plan, Preset, WriteOptions, resolve, write_model};
use fathom_tokenizer::StreamDecoder;
use fathom_weights::units::format_bytes;

use crate::common::tokenizer;
use crate::load::{LoadRequest, load_model_with};
use fathom_stream::budget::{check_budget, default_budget};

/// The demo's budget when none is given (capped by what the machine gives).
const DEFAULT_BUDGET: u64 = 3_000_000_000;

/// Make a synthetic K3-format model larger than the RAM budget (once) and
/// stream a generation from it with live statistics.
#[derive(Args)]
pub struct DemoArgs {
    /// Where the demo model is cached (default: $XDG_CACHE_HOME/fathom/demo-k3-mini
    /// or ~/.cache/fathom/demo-k3-mini).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// RAM budget the demo runs within; the model is made about 3x larger
    /// (default: 3 GB, or less when the memory cgroup or the free memory is
    /// smaller — the demo never runs over what the machine gives it).
    #[arg(long, value_parser = fathom_weights::units::parse_size)]
    ram_budget: Option<u64>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 24, value_parser = crate::common::parse_max_new)]
    max_new: usize,
    /// Synthetic preset of the demo model (k3-mini: the real expert count and
    /// top-k at smaller widths; tiny: a few MB, for a quick check).
    #[arg(long, default_value = "k3-mini")]
    preset: String,
    /// Prompt text (encoded with the synthetic tokenizer).
    #[arg(long, default_value = "def fibonacci(n):")]
    prompt: String,
}

/// Bumped when the demo model's format or recipe changes.
const DEMO_VERSION: u32 = 2;
/// Written last into a complete demo model: what it was made for.
const MARKER: &str = "fathom-demo.json";

/// One cached model per (preset, size, seed, version).
fn default_dir(preset: &str, target: u64) -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let mb = target >> 20;
    base.join("fathom")
        .join(format!("demo-{preset}-{mb}MiB-s0-v{DEMO_VERSION}"))
}

fn marker(preset: &str, target: u64) -> serde_json::Value {
    serde_json::json!({"preset": preset, "target_bytes": target, "seed": 0, "version": DEMO_VERSION})
}

/// The demo model's shape for `target` bytes of `preset`.
fn resolve_demo(preset: &str, target: u64) -> Result<fathom_synth::Model> {
    Ok(resolve(
        Preset::from_name(preset)?,
        &Overrides {
            target_size: Some(target),
            // Tiny's experts are a sliver of its bytes; give it many, so that
            // experts dominate the model as they do in K3.
            experts: (preset == "tiny").then_some(512),
            ..Default::default()
        },
    )?
    .model)
}

/// Bytes of tensor headers and index per routed expert of a synthetic K3
/// model, for planning before its headers exist (measured on the tiny
/// preset with 162 layers × 512 experts: 132.7 MB for 82,944 experts);
/// the real headers are checked once planned, before writing.
const INDEX_BYTES_PER_EXPERT: u64 = 1_600;

/// Header bytes per routed expert of a synthetic K3 shard (the same model:
/// 72.6 MB of headers).
const HEADER_BYTES_PER_EXPERT: u64 = 875;

/// Whether each shard's header of `model` (about `target` bytes in shards
/// of the default size) stays within what readers accept, estimated
/// before planning the shards (the plan checks it exactly).
fn readable(model: &fathom_synth::Model, target: u64) -> bool {
    let layers = model.num_layers() as u64;
    let experts = layers * model.num_experts() as u64;
    let shards = target.div_ceil(fathom_synth::DEFAULT_SHARD_SIZE).max(1);
    experts * HEADER_BYTES_PER_EXPERT / shards <= fathom_weights::MAX_HEADER
}

/// The budget rule for a demo model of `model` streamed within `budget`
/// (`index`: its tensor headers and index, else estimated).
fn plan_demo(
    model: &fathom_synth::Model,
    dir: &Path,
    budget: u64,
    index: Option<u64>,
    positions: usize,
) -> Result<fathom_runtime::LoadPlan> {
    let bytes = serde_json::to_vec(&model.config_json())?;
    let config = fathom_model::ModelConfig::from_bytes(dir, bytes)?;
    let facts = config.memory_facts()?;
    let index = index.unwrap_or(facts.total_experts() as u64 * INDEX_BYTES_PER_EXPERT);
    let req = demo_request(budget);
    fathom_runtime::plan::plan_facts(
        facts,
        &req,
        (budget, "--ram-budget".into()),
        index,
        positions,
        fathom_model::Spine::Bf16,
    )
}

/// The demo model's size for `budget`: three times it, or the most the
/// budget's plan holds (at least the budget itself: the point is a model
/// larger than RAM). Refused before anything is written, naming the least
/// budget that works, when even a model of the budget's size does not fit.
fn fit_target(preset: &str, dir: &Path, budget: u64, positions: usize) -> Result<u64> {
    let fits = |b: u64, target: u64| {
        resolve_demo(preset, target)
            .is_ok_and(|m| readable(&m, target) && plan_demo(&m, dir, b, None, positions).is_ok())
    };
    if fits(budget, 3 * budget) {
        return Ok(3 * budget);
    }
    if !fits(budget, budget) {
        if resolve_demo(preset, budget).is_ok_and(|m| !readable(&m, budget)) {
            anyhow::bail!(
                "demo --preset {preset}: a model larger than the budget of {} would have shard headers over the {} MB readers accept: use --preset k3-mini or a smaller --ram-budget",
                format_bytes(budget),
                fathom_weights::MAX_HEADER >> 20
            );
        }
        let why = resolve_demo(preset, budget)
            .and_then(|m| plan_demo(&m, dir, budget, None, positions).map(|_| ()))
            .err()
            .map_or(String::new(), |e| format!(" ({e})"));
        // Searched up to 16 times the budget (or what the machine gives).
        let (ceiling, _) = fathom_stream::budget::memory_ceiling();
        let top = ceiling.min(budget.saturating_mul(16));
        let least = fathom_runtime::plan::least_budget(budget, |b| b > top || fits(b, b));
        if least > top {
            anyhow::bail!(
                "demo --preset {preset}: no budget up to {} holds a model larger than itself{why}: try --preset k3-mini",
                format_bytes(top)
            );
        }
        anyhow::bail!(
            "demo --preset {preset}: a RAM budget of {} cannot stream a model larger than itself{why} — give at least --ram-budget {}MB",
            format_bytes(budget),
            least.div_ceil(1_000_000)
        );
    }
    // The largest target in [budget, 3·budget] that fits, to 5 %.
    let (mut lo, mut hi) = (budget, 3 * budget);
    while hi - lo > budget / 20 {
        let mid = lo + (hi - lo) / 2;
        if fits(budget, mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    eprintln!(
        "a model 3x the budget would not fit it (its spine, state and tensor index grow with it): making one of {} instead",
        format_bytes(lo)
    );
    Ok(lo)
}

/// Writes the demo model unless a complete one made for the same
/// (preset, size, seed, version) is already there; anything else in the
/// directory (an interrupted write, another size) is replaced. The plan of
/// running it within `budget` is checked before any byte is written.
fn ensure_model(
    dir: &Path,
    preset: &str,
    target: u64,
    budget: u64,
    positions: usize,
) -> Result<()> {
    let want = marker(preset, target);
    let found = std::fs::read_to_string(dir.join(MARKER))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    if found.as_ref() == Some(&want) {
        eprintln!("using the cached demo model in {}", dir.display());
        return Ok(());
    }
    let plan = Plan::new(
        resolve_demo(preset, target)?,
        0,
        fathom_synth::DEFAULT_SHARD_SIZE,
    )?;
    // The real headers and index, checked before a byte is written.
    let index = plan
        .shards
        .iter()
        .map(|s| s.header.len() as u64)
        .sum::<u64>()
        + plan.index_bytes().len() as u64;
    plan_demo(&plan.model, dir, budget, Some(index), positions)
        .with_context(|| format!("demo --preset {preset} within {}", format_bytes(budget)))?;
    if dir.join("config.json").is_file() {
        eprintln!(
            "{} holds a demo model made for other settings (or an interrupted one): replacing it",
            dir.display()
        );
        let _ = std::fs::remove_file(dir.join(MARKER));
    }
    eprintln!(
        "making a {} {preset} model ({} layers, {} experts, top-{}) in {} — once",
        format_bytes(plan.file_bytes()),
        plan.model.num_layers(),
        plan.model.num_experts(),
        plan.model.top_k(),
        dir.display()
    );
    let bar = crate::commands::synth::byte_bar(plan.file_bytes(), "writing");
    // Three write buffers circulate: a sixteenth of the budget each keeps
    // the writing within what the run itself will use.
    let opts = WriteOptions {
        force: true,
        buffer_size: (budget / 16).clamp(4 << 20, 64 << 20) as usize,
        ..Default::default()
    };
    write_model(&plan, dir, &opts, &|n| bar.inc(n))
        .with_context(|| format!("cannot write the demo model to {}", dir.display()))?;
    bar.finish_and_clear();
    std::fs::write(dir.join(MARKER), want.to_string())
        .with_context(|| format!("cannot write {}", dir.join(MARKER).display()))?;
    Ok(())
}

/// The demo's load request: streamed experts within `budget`, a
/// 4096-token context.
fn demo_request(budget: u64) -> LoadRequest {
    LoadRequest {
        ram_budget: Some(budget),
        experts: fathom_runtime::ExpertMode::Stream,
        context: Some(4096),
        heat_pin: 0.0,
        ..LoadRequest::default()
    }
}

pub fn run(a: DemoArgs) -> Result<()> {
    let budget = match a.ram_budget {
        Some(b) => check_budget(b).map_err(anyhow::Error::msg)?,
        None => {
            let (avail, src) = default_budget();
            if avail < DEFAULT_BUDGET {
                eprintln!("running within {} ({src})", format_bytes(avail));
            }
            avail.min(DEFAULT_BUDGET)
        }
    };
    // The synthetic tokenizer's encoding of the prompt, for the plan's pass
    // size before the model (and its tokenizer) is written: at most one
    // token per byte, plus BOS.
    let positions = a.prompt.len() + 1;
    let target = fit_target(
        &a.preset,
        a.dir.as_deref().unwrap_or(Path::new(".")),
        budget,
        positions,
    )?;
    let dir = a
        .dir
        .clone()
        .unwrap_or_else(|| default_dir(&a.preset, target));
    ensure_model(&dir, &a.preset, target, budget, positions)?;
    // Writing freed its plan and buffers; the run is measured against the
    // budget from here.
    fathom_platform::memory::release_free_heap();
    let tok = tokenizer(&dir)?.context("the demo model has no tokenizer")?;
    let prompt = tok.encode(&a.prompt);
    let mem = demo_request(budget);
    let (model, info) = load_model_with(&dir, &mem, positions, fathom_model::Spine::Bf16)?;
    let model_bytes: u64 = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    if let Some(line) = info.plan_line() {
        eprintln!(
            "model {} on disk, {:.1}x the budget; {line}",
            format_bytes(model_bytes),
            model_bytes as f64 / budget as f64,
        );
    }
    eprintln!(
        "experts are read from disk as the router asks (direct I/O: {}); random weights, so the text is noise\n",
        info.direct_io.unwrap_or(false)
    );
    let mut text = a.prompt.clone();
    let mut stream = StreamDecoder::new(tok.as_ref());
    let t0 = Instant::now();
    let base = model.expert_stats();
    let mut n = 0usize;
    let req = fathom_engine::Request::new(prompt.clone(), a.max_new);
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut last_line = Instant::now();
    let g = generate(&model, req, None, |ev: &fathom_engine::TokenEvent| {
        let id = ev.sampled.token;
        n += 1;
        text.push_str(&stream.push(id));
        let s = model.expert_stats().since(&base);
        let secs = t0.elapsed().as_secs_f64();
        // One redrawn line: the tail of the text, then the live figures.
        let tail: String = text
            .chars()
            .rev()
            .take(32)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let figures = format!(
            "{n} tokens, {:.2} tok/s, {} read at {}/s, hit rate {:.0}%, I/O wait {:.0}%",
            n as f64 / secs,
            format_bytes(s.bytes_read),
            format_bytes((s.bytes_read as f64 / secs) as u64),
            100.0 * s.hits as f64 / s.requested.max(1) as f64,
            100.0 * s.wait_s / secs.max(1e-9)
        );
        if tty {
            eprint!("\r\x1b[2K{tail:<32} | {figures}");
        } else if n == 1 || last_line.elapsed().as_secs() >= 5 {
            // Logs get plain lines: the first token, then every 5 s.
            last_line = Instant::now();
            eprintln!("{figures}");
        }
        ControlFlow::Continue(())
    })?;
    text.push_str(&stream.finish());
    if tty {
        eprintln!();
    }
    let mut out = std::io::stdout();
    writeln!(out, "{text}")?;
    eprintln!(
        "{} tokens: decode {:.2} tok/s, first token {:.2}s, peak RSS {} (budget {})",
        g.stats.generated_tokens,
        g.stats.decode_tok_s,
        g.stats.first_token_s,
        format_bytes(g.stats.peak_rss_bytes),
        format_bytes(budget)
    );
    Ok(())
}
