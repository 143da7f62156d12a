//! `fathom synth`: write a synthetic checkpoint of any supported family
//! (random, well-conditioned weights in the released byte layout and
//! precision) of a chosen shape or size.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_synth::{Overrides, Plan, Preset, WriteOptions, resolve, write_model};
use fathom_weights::units::{format_bytes, parse_size};

/// Write a synthetic checkpoint of a released MoE model (Kimi K3,
/// DeepSeek-V3, Kimi K2 / K2 Thinking, Qwen3-MoE, gpt-oss, Kimi-Linear):
/// the released tensor names, shapes, dtypes and quantized formats, seeded
/// weights that keep the forward pass healthy, a config.json and a
/// tokenizer. Files appear under their final names only when complete;
/// config.json and the index are written last.
#[derive(Args)]
pub struct SynthArgs {
    /// Output directory (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Shape preset, in the released precision (full sizes; shrink them
    /// with --layers, --experts, --hidden, --target-size). Kimi K3: `tiny`
    /// (k3-tiny shapes, 1280-token vocabulary, ~7 MB), `k3` (93 layers,
    /// ~1.56 TB), `k3-mini` (896 experts, top-16, hidden 2048: ~1.1 GB per
    /// MoE layer). Others: `deepseek-v3` (61 layers, 256 experts top-8,
    /// FP8 128×128 blocks, ~687 GB with its MTP layer), `kimi-k2` (61 layers, 384 experts,
    /// FP8, ~1.03 TB), `kimi-k2-thinking` (K2 with INT4 group-32 experts,
    /// ~594 GB), `qwen3-235b` (94 layers, 128 experts top-8, bf16, ~470 GB),
    /// `qwen3-30b` (48 layers, bf16, ~61 GB), `gpt-oss-120b` (36 layers,
    /// 128 experts top-4, MXFP4 experts, ~65 GB), `gpt-oss-20b` (24 layers,
    /// 32 experts, ~14 GB), `kimi-linear` (27 layers KDA/MLA, 256 experts
    /// top-8, bf16, ~98 GB).
    #[arg(long, value_parser = Preset::NAMES)]
    preset: String,
    /// Seed of the weights: the same seed gives byte-identical files.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Number of layers (K3, Kimi-Linear: MLA at every 4th 1-based layer
    /// and the last, KDA elsewhere; gpt-oss: sliding and full alternate;
    /// the dense first layers stay as released).
    #[arg(long)]
    layers: Option<usize>,
    /// Routed experts per MoE layer.
    #[arg(long)]
    experts: Option<usize>,
    /// Experts each token uses (num_experts_per_token).
    #[arg(long)]
    top_k: Option<usize>,
    /// Hidden size, a multiple of 32 (not for the K3 presets): head counts,
    /// LoRA ranks and intermediate sizes scale with it, head dims stay. For
    /// small models of a released architecture, e.g. --hidden 64 in tests.
    #[arg(long)]
    hidden: Option<usize>,
    /// Vocabulary size (the synthetic tokenizer's ranks plus 256 specials;
    /// default: the released size). Small values make small test models.
    #[arg(long)]
    vocab: Option<usize>,
    /// Aim for this total size (e.g. 40GB, 512MiB) by choosing the layer
    /// count, or the expert count when even the fewest layers with a MoE
    /// layer are too big.
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
    /// Use a released tokenizer instead of the synthetic one: DIR's
    /// tiktoken.model, tokenizer_config.json and the tokenizer module
    /// (tokenization_*.py) and chat_template.jinja beside them are written
    /// as they are, and the
    /// vocabulary is sized to them (ranks + 256 specials). With a released
    /// Kimi tokenizer, converters that check the tokenizer (llama.cpp's
    /// convert_hf_to_gguf.py) accept the synthetic checkpoint.
    #[arg(long, value_name = "DIR", conflicts_with = "vocab")]
    tokenizer_from: Option<PathBuf>,
    /// Write only config.json (for `fathom inspect` plans of shapes too big
    /// to write, e.g. the full K3 or DeepSeek-V3 at a long context).
    #[arg(long, conflicts_with = "dry_run")]
    config_only: bool,
}

/// Byte progress (a bar on a terminal, plain lines elsewhere).
pub(crate) fn byte_bar(total: u64, what: &str) -> crate::progress::ByteProgress {
    crate::progress::ByteProgress::new(total, what)
}

pub fn run(a: SynthArgs) -> Result<()> {
    let preset = Preset::from_name(&a.preset)?;
    let released = a
        .tokenizer_from
        .as_deref()
        .map(fathom_synth::tokenizer::released_files)
        .transpose()?;
    let overrides = Overrides {
        layers: a.layers,
        experts: a.experts,
        top_k: a.top_k,
        hidden: a.hidden,
        vocab: released.as_ref().map(|r| r.vocab).or(a.vocab),
        target_size: a.target_size,
    };
    let resolved = resolve(preset, &overrides)?;
    let plan = Plan::new(&resolved.model, a.seed, a.shard_size)?;
    let m = &plan.model;
    println!(
        "plan: preset {}, {} layers, hidden {}, {} experts top-{}, vocab {}, seed {}",
        a.preset,
        m.num_layers(),
        m.hidden_size(),
        m.num_experts(),
        m.top_k(),
        m.vocab_size(),
        a.seed
    );
    println!("      {}: {}", m.shape().family(), m.shape().precision());
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
            .and_then(|_| std::fs::write(&path, serde_json::to_vec_pretty(&m.config_json())?))
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("wrote {} (no tensors)", path.display());
        return Ok(());
    }
    let bar = byte_bar(plan.file_bytes(), "writing");
    let opts = WriteOptions {
        force: a.force,
        tokenizer: released.map(|r| r.files),
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
