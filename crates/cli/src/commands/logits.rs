//! `fathom logits`: the last position's logits for a prompt.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use fathom_model::Logits;

use crate::common::{SpineArg, check_vocab, parse_ids};
use crate::load::{MemoryArgs, load_model_with};

/// Print the top logits at the last position of a prompt.
#[derive(Args)]
pub struct LogitsArgs {
    /// Model directory, or ORG/NAME[@REV] pulled by `fathom pull` (config.json + safetensors shards).
    #[arg(long, value_parser = fathom_hub::resolve_model)]
    model: PathBuf,
    /// Prompt as comma-separated token ids.
    #[arg(long)]
    prompt_ids: String,
    /// How many of the largest logits to print.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Print one JSON object {"top": [[id, logit], ...]} in descending order.
    #[arg(long)]
    json: bool,
    /// Precision of the resident spine matrices (int8 is lossy).
    #[arg(long, value_enum, default_value_t = SpineArg::Bf16)]
    spine: SpineArg,
    #[command(flatten)]
    mem: MemoryArgs,
}

pub fn run(a: LogitsArgs) -> Result<()> {
    let prompt = parse_ids(&a.prompt_ids)?;
    let (model, info) = load_model_with(&a.model, &a.mem.request(), prompt.len(), a.spine.spine())?;
    if let Some(line) = info.plan_line() {
        eprintln!("{line}");
    }
    check_vocab(&prompt, model.info().vocab_size)?;
    let mut state = model.new_state();
    let logits = model.forward(state.as_mut(), &prompt, Logits::Last)?;
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]).then(x.cmp(&y)));
    let top: Vec<(usize, f32)> = order.iter().take(a.top).map(|&i| (i, logits[i])).collect();
    if a.json {
        println!("{}", serde_json::json!({ "top": top }));
    } else {
        println!("{:>8}  {:>12}", "id", "logit");
        for (i, l) in top {
            println!("{i:>8}  {l:>12.6}");
        }
    }
    Ok(())
}
