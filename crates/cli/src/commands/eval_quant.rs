//! `fathom eval-quant`: how far the int8 spine is from the exact (bf16
//! weights, fp32 compute) spine, on teacher-forced positions.
//!
//! Each prompt is extended by `--tokens` greedy tokens of the exact model;
//! the whole sequence is then run through both models and every position's
//! next-token distribution is compared: top-1 agreement, mean
//! KL(exact ‖ int8) and max |Δlogit|.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_model::eval::{Agreement, argmax, compare};
use fathom_model::{K3Model, Logits, Spine};

use crate::common::parse_ids;

/// Measure the quality of the int8 spine against the exact spine.
#[derive(Args)]
pub struct EvalQuantArgs {
    /// Model directory (config.json + safetensors shards).
    #[arg(long)]
    model: PathBuf,
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
fn extend_greedy(model: &K3Model, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    let mut seq = prompt.to_vec();
    let mut st = model.new_state();
    let mut logits = model.forward(&mut st, prompt, Logits::Last)?;
    for _ in 0..n {
        let next = argmax(&logits) as u32;
        seq.push(next);
        logits = model.forward(&mut st, &[next], Logits::Last)?;
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
    let load = |spine| {
        K3Model::load_spine(&a.model, spine)
            .with_context(|| format!("cannot load the model in {}", a.model.display()))
    };
    let exact = load(Spine::Bf16)?;
    let int8 = load(Spine::Int8)?;
    eprintln!(
        "comparing spine int8 (lossy) with bf16 (exact) on {} prompts",
        prompts.len()
    );
    let mut total = Agreement::default();
    for p in &prompts {
        let seq = extend_greedy(&exact, p, a.tokens)?;
        let agg = compare(&exact, &int8, &seq)?;
        total.positions += agg.positions;
        total.top1_agree += agg.top1_agree;
        total.kl_sum += agg.kl_sum;
        total.max_abs_dlogit = total.max_abs_dlogit.max(agg.max_abs_dlogit);
    }
    let spine_bytes = |m: &K3Model| {
        let w = &m.weights;
        let mut b = w.lm_head.bytes();
        for l in &w.layers {
            b += layer_bytes(l);
        }
        b
    };
    let (b_exact, b_int8) = (spine_bytes(&exact), spine_bytes(&int8));
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "positions": total.positions,
                "top1_agreement": total.top1_rate(),
                "mean_kl": total.mean_kl(),
                "max_abs_dlogit": total.max_abs_dlogit,
                "spine_matrix_bytes": {"bf16": b_exact, "int8": b_int8},
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
        println!("spine matrices   {b_exact} → {b_int8} bytes");
    }
    Ok(())
}

/// Bytes of a layer's spine matrices.
fn layer_bytes(l: &fathom_model::kimi_k3::weights::LayerWeights) -> usize {
    use fathom_model::kimi_k3::weights::{AttnWeights, FfnWeights, MlpWeights};
    let mlp = |m: &MlpWeights| m.gate_proj.bytes() + m.up_proj.bytes() + m.down_proj.bytes();
    let attn = match &l.attn {
        AttnWeights::Kda(a) => [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.f_a_proj,
            &a.f_b_proj,
            &a.b_proj,
            &a.g_proj,
            &a.o_proj,
        ]
        .iter()
        .map(|m| m.bytes())
        .sum::<usize>(),
        AttnWeights::Mla(a) => [
            &a.q_a_proj,
            &a.q_b_proj,
            &a.kv_a_proj_with_mqa,
            &a.kv_b_proj.uk_t,
            &a.kv_b_proj.uv,
            &a.g_proj,
            &a.o_proj,
        ]
        .iter()
        .map(|m| m.bytes())
        .sum(),
    };
    attn + match &l.ffn {
        FfnWeights::Dense(m) => mlp(m),
        FfnWeights::Moe(m) => {
            m.gate.bytes()
                + m.routed_expert_down_proj.bytes()
                + m.routed_expert_up_proj.bytes()
                + m.shared_experts.as_ref().map_or(0, mlp)
        }
    }
}
