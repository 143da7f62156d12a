//! `fathom eval-quant`: how far a lossy option (the int8 spine, the bf16
//! latent cache) is from the exact model (bf16 weights, fp32 compute and
//! cache), on teacher-forced positions.
//!
//! Each prompt is extended by `--tokens` greedy tokens of the exact model;
//! the whole sequence is then run through both models and every position's
//! next-token distribution is compared: top-1 agreement, mean
//! KL(exact ‖ lossy) and max |Δlogit|. Both models load under the one RAM
//! budget (half each).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use fathom_model::eval::{Agreement, argmax, compare};
use fathom_model::{CausalLm, Logits, Spine};

use crate::common::parse_ids;
use crate::load::{MemoryArgs, load_model_with};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Variant {
    /// `--spine int8` against the stored spine.
    SpineInt8,
    /// `--kv-dtype bf16` against the fp32 latent cache.
    KvBf16,
}

/// Measure the quality of a lossy option against the exact model.
#[derive(Args)]
pub struct EvalQuantArgs {
    /// Model directory, or ORG/NAME[@REV] pulled by `fathom pull` (config.json + safetensors shards).
    #[arg(long, value_parser = fathom_hub::resolve_model)]
    model: PathBuf,
    /// Which lossy option to measure.
    #[arg(long, value_enum, default_value_t = Variant::SpineInt8)]
    variant: Variant,
    /// A prompt as comma-separated token ids (repeatable). Default: the
    /// prompts of golden.json in the model directory or its parent.
    #[arg(long)]
    prompt_ids: Vec<String>,
    /// Greedy tokens of the exact model appended to each prompt.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    mem: MemoryArgs,
}
/// The `input_ids` of every prompt in a golden.json next to the model.
fn golden_prompts(dir: &Path) -> Result<Vec<Vec<u32>>> {
    let path = [dir.join("golden.json"), dir.join("../golden.json")]
        .into_iter()
        .find(|p| p.is_file());
    let Some(path) = path else {
        bail!(
            "no --prompt-ids given and no golden.json in {}",
            dir.display()
        );
    };
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)
        .with_context(|| format!("{} is not JSON", path.display()))?;
    let prompts = v["prompts"].as_array().map(|ps| {
        ps.iter()
            .filter_map(|p| p["input_ids"].as_array())
            .map(|ids| {
                ids.iter()
                    .filter_map(|i| i.as_u64())
                    .map(|i| i as u32)
                    .collect()
            })
            .collect::<Vec<Vec<u32>>>()
    });
    match prompts {
        Some(p) if !p.is_empty() => Ok(p),
        _ => bail!("{} has no prompts[].input_ids", path.display()),
    }
}

/// `prompt` followed by `n` greedy tokens of `model`.
fn extend_greedy(model: &dyn CausalLm, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    let mut seq = prompt.to_vec();
    let mut st = model.new_state();
    let mut logits = model.forward(st.as_mut(), prompt, Logits::Last)?;
    for _ in 0..n {
        let next = argmax(&logits) as u32;
        seq.push(next);
        logits = model.forward(st.as_mut(), &[next], Logits::Last)?;
    }
    Ok(seq)
}

pub fn run(a: EvalQuantArgs) -> Result<()> {
    let prompts = if a.prompt_ids.is_empty() {
        golden_prompts(&a.model)?
    } else {
        a.prompt_ids
            .iter()
            .map(|s| parse_ids(s))
            .collect::<Result<_>>()?
    };
    // Two models under one budget: half each.
    let mut half = a.mem.request();
    half.ram_budget = Some(half.budget()?.0 / 2);
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1) + a.tokens;
    let mut lossy_mem = half.clone();
    let (spine, what) = match a.variant {
        Variant::SpineInt8 => (Spine::Int8, "spine int8 (lossy) with bf16 (exact)"),
        Variant::KvBf16 => {
            lossy_mem.kv_dtype = fathom_model::KvDtype::Bf16;
            (Spine::Bf16, "latent cache bf16 (lossy) with f32 (exact)")
        }
    };
    let (exact, exact_info) = load_model_with(&a.model, &half, longest, Spine::Bf16)?;
    let (lossy, lossy_info) = load_model_with(&a.model, &lossy_mem, longest, spine)?;
    tracing::info!("comparing {what} on {} prompts", prompts.len());
    let mut total = Agreement::default();
    for p in &prompts {
        let seq = extend_greedy(exact.as_ref(), p, a.tokens)?;
        let agg = compare(exact.as_ref(), lossy.as_ref(), &seq)?;
        total.positions += agg.positions;
        total.top1_agree += agg.top1_agree;
        total.kl_sum += agg.kl_sum;
        total.max_abs_dlogit = total.max_abs_dlogit.max(agg.max_abs_dlogit);
    }
    let spine_bytes = |i: &crate::load::LoadInfo| i.ledger.as_ref().map(|l| l.spine);
    let kv_dtype = |m: &crate::load::LoadRequest| m.kv_dtype.name();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "positions": total.positions,
                "top1_agreement": total.top1_rate(),
                "mean_kl": total.mean_kl(),
                "max_abs_dlogit": total.max_abs_dlogit,
                "variant": format!("{:?}", a.variant),
                "spine_bytes": {"exact": spine_bytes(&exact_info), "lossy": spine_bytes(&lossy_info)},
                "kv_dtype": {"exact": kv_dtype(&half), "lossy": kv_dtype(&lossy_mem)},
            })
        );
    } else {
        println!("positions        {}", total.positions);
        println!(
            "top-1 agreement  {:.4} ({}/{})",
            total.top1_rate(),
            total.top1_agree,
            total.positions
        );
        println!("mean KL          {:.3e} nats", total.mean_kl());
        println!("max |Δlogit|     {:.4}", total.max_abs_dlogit);
        if let (Some(e), Some(l)) = (spine_bytes(&exact_info), spine_bytes(&lossy_info)) {
            println!("resident spine   {e} → {l} bytes");
        }
        println!(
            "latent cache     {} → {}",
            kv_dtype(&half),
            kv_dtype(&lossy_mem)
        );
    }
    Ok(())
}
