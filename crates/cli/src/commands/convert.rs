//! `fathom convert`: writes the int8 spine file beside a checkpoint
//! (`fathom_runtime::convert`).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use fathom_weights::units::format_bytes;

use crate::load::MemoryArgs;

/// Quantise a model's spine to int8 once, into a file beside its
/// checkpoint that every `--spine int8` load then reads (lossy, as
/// `--spine int8` is; bf16 loads never read it).
#[derive(Args)]
pub struct ConvertArgs {
    /// Model directory, or ORG/NAME[@REV] pulled by `fathom pull` (config.json + safetensors shards).
    #[arg(long, value_parser = fathom_hub::resolve_model)]
    model: PathBuf,
    /// What to write: `int8`, the spine quantised per row.
    #[arg(long, value_enum)]
    spine: ConvertSpine,
    /// Replace an existing file.
    #[arg(long)]
    force: bool,
    /// Print one JSON object of what was written.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    mem: MemoryArgs,
}

/// `--spine` of `convert`.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum ConvertSpine {
    /// Per-row int8 codes and f32 row scales.
    Int8,
}

pub fn run(a: ConvertArgs) -> Result<()> {
    let ConvertSpine::Int8 = a.spine;
    let c = fathom_runtime::convert::int8_spine(&a.model, &a.mem.request(), a.force)?;
    if a.json {
        println!("{}", serde_json::to_string(&c)?);
    } else {
        println!(
            "wrote {}: {} spine matrices, {} (from {} as stored) in {:.1} s; lossy, read by --spine int8; source digest {}",
            c.path.display(),
            c.matrices,
            format_bytes(c.bytes),
            format_bytes(c.source_bytes),
            c.seconds,
            c.source_digest
        );
    }
    Ok(())
}
