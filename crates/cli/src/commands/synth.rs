//! `fathom synth`: write a synthetic K3 checkpoint (random, well-conditioned
//! weights in the released byte layout) of a chosen shape or size.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_synth::{Overrides, Plan, Preset, WriteOptions, resolve, write_model};
use fathom_weights::units::{format_bytes, parse_size};
use indicatif::{ProgressBar, ProgressStyle};

/// Write a synthetic Kimi K3 checkpoint: the released tensor names, shapes,
/// dtypes and MXFP4 packing, seeded weights that keep the forward pass
/// healthy, a config.json and a tokenizer. Files appear under their final
/// names only when complete; config.json and the index are written last.
#[derive(Args)]
pub struct SynthArgs {
    /// Output directory (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Shape preset: `tiny` (k3-tiny shapes, 1280-token vocabulary, ~7 MB),
    /// `k3` (the released shapes: 93 layers, ~1.5 TB; use --layers 3 to
    /// check the byte layout), `k3-mini` (896 experts, top-16, hidden 2048:
    /// ~1.1 GB per MoE layer, for 10–60 GB streaming tests).
    #[arg(long, value_parser = Preset::NAMES)]
    preset: String,
    /// Seed of the weights: the same seed gives byte-identical files.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Number of layers (MLA at every 4th 1-based layer and the last, KDA elsewhere).
    #[arg(long)]
    layers: Option<usize>,
    /// Routed experts per MoE layer.
    #[arg(long)]
    experts: Option<usize>,
    /// Experts each token uses (num_experts_per_token).
    #[arg(long)]
    top_k: Option<usize>,
    /// Aim for this total size (e.g. 40GB, 512MiB) by choosing the layer
    /// count, or the expert count when even two layers are too big.
    #[arg(long, value_parser = parse_size)]
    target_size: Option<u64>,
    /// Approximate size of one shard file. Models under 1 GiB get two shards.
    #[arg(long, value_parser = parse_size, default_value = "4GB")]
    shard_size: u64,
    /// Replace a model already in --out.
    #[arg(long)]
    force: bool,
    /// Print the plan (shape, size, shards) and write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Write only config.json (for `fathom inspect` plans of shapes too big
    /// to write, e.g. the full K3 at a 1M-token context).
    #[arg(long, conflicts_with = "dry_run")]
    config_only: bool,
}

/// A byte progress bar on stderr (bytes, rate, ETA); hidden unless stderr
/// is a terminal, so logs and pipes stay clean.
pub(crate) fn byte_bar(total: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(
        "{msg} [{bar:32}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} ETA {eta}",
    )
    .expect("the template is valid")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what.to_string());
    bar
}

pub fn run(a: SynthArgs) -> Result<()> {
    let preset = Preset::from_name(&a.preset)?;
    let overrides = Overrides {
        layers: a.layers,
        experts: a.experts,
        top_k: a.top_k,
        target_size: a.target_size,
    };
    let resolved = resolve(preset, &overrides)?;
    let plan = Plan::new(&resolved.dims, a.seed, a.shard_size)?;
    let d = &plan.dims;
    println!(
        "plan: preset {}, {} layers, hidden {}, {} experts top-{}, vocab {}, seed {}",
        a.preset, d.num_layers, d.hidden_size, d.num_experts, d.top_k, d.vocab_size, a.seed
    );
    if let (Some(note), Some(t)) = (&resolved.note, a.target_size) {
        println!("      --target-size {}: chose {note}", format_bytes(t));
    }
    println!(
        "      {} tensors, {} in {} shard{}",
        plan.num_tensors(),
        format_bytes(plan.file_bytes()),
        plan.shards.len(),
        if plan.shards.len() == 1 { "" } else { "s" }
    );
    if a.dry_run {
        return Ok(());
    }
    if a.config_only {
        let path = a.out.join("config.json");
        if path.exists() && !a.force {
            bail!("{} exists: give --force to replace it", path.display());
        }
        std::fs::create_dir_all(&a.out)
            .and_then(|_| std::fs::write(&path, serde_json::to_vec_pretty(&d.config_json())?))
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("wrote {} (no tensors)", path.display());
        return Ok(());
    }
    let bar = byte_bar(plan.file_bytes(), "writing");
    let opts = WriteOptions {
        force: a.force,
        ..Default::default()
    };
    let report = write_model(&plan, &a.out, &opts, &|n| bar.inc(n))
        .with_context(|| format!("cannot write the model to {}", a.out.display()))?;
    bar.finish_and_clear();
    let rate = report.shard_bytes as f64 / report.shard_seconds.max(1e-9);
    println!(
        "wrote {}: {} in {:.1} s ({}/s, {})",
        a.out.display(),
        format_bytes(report.shard_bytes),
        report.shard_seconds,
        format_bytes(rate as u64),
        if report.direct_io {
            "direct I/O"
        } else {
            "buffered I/O"
        }
    );
    Ok(())
}
