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
use crate::load::{ExpertMode, MemoryArgs, load_model_with};
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
    #[arg(long, default_value_t = 24)]
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

/// Writes the demo model unless a complete one made for the same
/// (preset, size, seed, version) is already there; anything else in the
/// directory (an interrupted write, another size) is replaced.
fn ensure_model(dir: &Path, preset: &str, target: u64) -> Result<()> {
    let want = marker(preset, target);
    let found = std::fs::read_to_string(dir.join(MARKER))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    if found.as_ref() == Some(&want) {
        eprintln!("using the cached demo model in {}", dir.display());
        return Ok(());
    }
    if dir.join("config.json").is_file() {
        eprintln!(
            "{} holds a demo model made for other settings (or an interrupted one): replacing it",
            dir.display()
        );
        let _ = std::fs::remove_file(dir.join(MARKER));
    }
    let resolved = resolve(
        Preset::from_name(preset)?,
        &Overrides {
            target_size: Some(target),
            // Tiny's experts are a sliver of its bytes; give it many, so that
            // experts dominate the model as they do in K3.
            experts: (preset == "tiny").then_some(512),
            ..Default::default()
        },
    )?;
    let plan = Plan::new(&resolved.model, 0, fathom_synth::DEFAULT_SHARD_SIZE)?;
    eprintln!(
        "making a {} {preset} model ({} layers, {} experts, top-{}) in {} — once",
        format_bytes(plan.file_bytes()),
        plan.model.num_layers(),
        plan.model.num_experts(),
        plan.model.top_k(),
        dir.display()
    );
    let bar = crate::commands::synth::byte_bar(plan.file_bytes(), "writing");
    let opts = WriteOptions {
        force: true,
        ..Default::default()
    };
    write_model(&plan, dir, &opts, &|n| bar.inc(n))
        .with_context(|| format!("cannot write the demo model to {}", dir.display()))?;
    bar.finish_and_clear();
    std::fs::write(dir.join(MARKER), want.to_string())
        .with_context(|| format!("cannot write {}", dir.join(MARKER).display()))?;
    Ok(())
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
    let dir = a
        .dir
        .clone()
        .unwrap_or_else(|| default_dir(&a.preset, 3 * budget));
    ensure_model(&dir, &a.preset, 3 * budget)?;
    let tok = tokenizer(&dir)?.context("the demo model has no tokenizer")?;
    let prompt = tok.encode(&a.prompt);
    let mem = MemoryArgs {
        ram_budget: Some(budget),
        experts: ExpertMode::Stream,
        context: Some(4096),
        kv_ram: None,
        kv_dir: None,
        kv_dtype: crate::load::KvDtypeArg::F32,
        sequences: 1,
        io_threads: 16,
        no_prefetch: false,
        prefetch_depth: None,
        buffered_io: false,
        device: crate::device::DeviceArg::Cpu,
        vram_budget: None,
        gpus: None,
        no_cuda_graphs: false,
        heat: None,
        heat_pin: 0.0,
        heat_out: None,
        mtp: false,
        records_heat: false,
        spine_resident_layers: None,
    };
    let (model, info) = load_model_with(&dir, &mem, prompt.len(), fathom_model::Spine::Bf16)?;
    let model_bytes: u64 = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    if let Some(l) = &info.ledger {
        eprintln!(
            "model {} on disk, {:.1}x the budget; {}",
            format_bytes(model_bytes),
            model_bytes as f64 / budget as f64,
            l.describe()
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
        eprint!(
            "\r\x1b[2K{tail:<32} | {n} tokens, {:.2} tok/s, {} read at {}/s, hit rate {:.0}%, I/O wait {:.0}%",
            n as f64 / secs,
            format_bytes(s.bytes_read),
            format_bytes((s.bytes_read as f64 / secs) as u64),
            100.0 * s.hits as f64 / s.requested.max(1) as f64,
            100.0 * s.wait_s / secs.max(1e-9)
        );
        ControlFlow::Continue(())
    })?;
    text.push_str(&stream.finish());
    eprintln!();
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
