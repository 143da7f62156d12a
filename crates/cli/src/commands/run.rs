//! `fathom run`: greedy generation from a prompt.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use fathom_engine::{DraftOptions, ModelDrafter, NgramDrafter, greedy, speculative};
use fathom_model::K3Model;
use fathom_model::experts::ExpertStats;
use fathom_tokenizer::StreamDecoder;

use crate::common::{SpineArg, apply_spine, check_vocab, prompt_ids, tokenizer};
use crate::load::{MemoryArgs, load_model_with};

/// Generate text greedily (argmax at every step) from a prompt.
#[derive(Args)]
pub struct RunArgs {
    /// Model directory (config.json + safetensors shards).
    #[arg(long)]
    model: PathBuf,
    /// Prompt as comma-separated token ids, e.g. 1,591,25.
    #[arg(long, conflicts_with = "prompt", required_unless_present = "prompt")]
    prompt_ids: Option<String>,
    /// Prompt as text (needs a tokenizer in the model directory).
    #[arg(long)]
    prompt: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 32)]
    max_new: usize,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Print exactly one JSON object on stdout: prompt_ids, output_ids, text, stats.
    #[arg(long)]
    json: bool,
    /// Per-token expert I/O statistics on stderr.
    #[arg(long)]
    stats: bool,
    /// Precision of the resident spine matrices (int8 is lossy).
    #[arg(long, value_enum, default_value_t = SpineArg::Bf16)]
    spine: SpineArg,
    /// Draft source for speculative decoding: `ngram` (prompt lookup, no
    /// extra model), `model:DIR` (a small checkpoint with the same
    /// tokenizer), or `off`. The full model verifies every proposed token, so
    /// output is identical to plain greedy decoding; drafting adapts its
    /// length and switches itself off when it does not pay.
    #[arg(long, default_value = "ngram")]
    draft: String,
    /// Most tokens proposed per verification pass.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=32))]
    draft_max: u32,
    #[command(flatten)]
    mem: MemoryArgs,
}

/// Where drafts come from.
enum DraftChoice {
    Off,
    Ngram,
    Model(PathBuf),
}

fn parse_draft(s: &str) -> Result<DraftChoice> {
    Ok(match s {
        "off" | "none" => DraftChoice::Off,
        "ngram" => DraftChoice::Ngram,
        _ => match s.strip_prefix("model:") {
            Some(dir) if !dir.is_empty() => DraftChoice::Model(PathBuf::from(dir)),
            _ => anyhow::bail!("--draft {s:?}: expected ngram, model:DIR or off"),
        },
    })
}

/// `a / b` as a percentage for humans, or `-` when nothing was counted.
fn pct(a: u64, b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.0}%", 100.0 * a as f64 / b as f64)
    }
}

/// Fraction `a / b`, or null when nothing was counted.
fn ratio(a: u64, b: u64) -> serde_json::Value {
    if b == 0 {
        serde_json::Value::Null
    } else {
        (a as f64 / b as f64).into()
    }
}

/// Prefetch and I/O figures for an interval of expert statistics.
fn io_summary(s: &ExpertStats, wall_s: f64) -> serde_json::Value {
    serde_json::json!({
        "expert_bytes_read": s.bytes_read,
        "expert_cache_hits": s.hits,
        "expert_cache_misses": s.misses,
        "expert_hit_rate": ratio(s.hits, s.requested),
        "prefetch_precision": ratio(s.hinted_used, s.hinted),
        "prefetch_recall": ratio(s.hinted_used, s.requested),
        "read_bandwidth_bytes_s": if s.read_s > 0.0 { (s.bytes_read as f64 / wall_s.max(1e-9)).into() } else { serde_json::Value::Null },
        "io_wait_s": s.wait_s,
        "compute_s": (wall_s - s.wait_s).max(0.0),
    })
}

pub fn run(a: RunArgs) -> Result<()> {
    let tok = tokenizer(&a.model)?;
    let prompt = prompt_ids(
        a.prompt_ids.as_deref(),
        a.prompt.as_deref(),
        tok.as_deref(),
        &a.model,
    )?;
    let (mut model, info) = load_model_with(&a.model, &a.mem, prompt.len(), a.spine.spine())?;
    let spine = apply_spine(&mut model, a.spine);
    check_vocab(&prompt, model.spec.vocab_size)?;
    if !a.json || a.stats {
        if let Some(l) = &info.ledger {
            eprintln!(
                "{} ({}); experts {}",
                l.describe(),
                info.budget_source,
                info.experts
            );
        }
    }
    let stop: Vec<u32> = if a.ignore_eos {
        vec![]
    } else {
        model.spec.eos_token_id.into_iter().collect()
    };

    let mut stdout = std::io::stdout().lock();
    let mut stream = tok.as_deref().map(StreamDecoder::new);
    let json = a.json;
    let start_stats = model.experts.stats();
    let mut last = (start_stats, Instant::now());
    let mut index = 0usize;
    let draft = parse_draft(&a.draft)?;
    let draft_model = match &draft {
        DraftChoice::Model(dir) => Some(
            K3Model::load(dir)
                .with_context(|| format!("cannot load the draft model in {}", dir.display()))?,
        ),
        _ => None,
    };
    let opts = DraftOptions {
        max_k: a.draft_max as usize,
        adaptive: true,
    };
    let on_token = |id| {
        if a.stats {
            let now = (model.experts.stats(), Instant::now());
            let d = now.0.since(&last.0);
            let wall = now.1.duration_since(last.1).as_secs_f64();
            let what = if index == 0 { "prefill" } else { "token" };
            eprintln!(
                "[{what} {index}] {:.3}s, experts read {:.1} MB ({} hit / {} miss, hit rate {}), {:.0} MB/s, I/O wait {:.3}s vs compute {:.3}s, prefetch precision {} recall {}",
                wall,
                d.bytes_read as f64 / 1e6,
                d.hits,
                d.misses,
                pct(d.hits, d.requested),
                d.bytes_read as f64 / 1e6 / wall.max(1e-9),
                d.wait_s,
                (wall - d.wait_s).max(0.0),
                pct(d.hinted_used, d.hinted),
                pct(d.hinted_used, d.requested)
            );
            last = now;
            index += 1;
        }
        if !json {
            let piece = match stream.as_mut() {
                Some(s) => s.push(id),
                None => format!("{id} "),
            };
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
        ControlFlow::Continue(())
    };
    let (generation, draft_stats) = match (&draft, &draft_model) {
        (DraftChoice::Model(_), Some(dm)) => {
            let mut d = ModelDrafter::new(dm, model.spec.vocab_size)?;
            let (g, s) = speculative(&model, &prompt, a.max_new, &stop, &mut d, opts, on_token)?;
            (g, Some(s))
        }
        (DraftChoice::Ngram, _) => {
            let mut d = NgramDrafter::default();
            let (g, s) = speculative(&model, &prompt, a.max_new, &stop, &mut d, opts, on_token)?;
            (g, Some(s))
        }
        _ => (greedy(&model, &prompt, a.max_new, &stop, on_token)?, None),
    };
    let text = tok.as_deref().map(|t| t.decode(&generation.output_ids));
    let total = model.experts.stats().since(&start_stats);
    let wall = generation.stats.prefill_s + generation.stats.decode_s;
    let mut stats = serde_json::to_value(&generation.stats)?;
    if let (Some(o), Some(io)) = (stats.as_object_mut(), io_summary(&total, wall).as_object()) {
        o.extend(io.clone());
    }
    stats["load_s"] = info.load_s.into();
    stats["stop"] = serde_json::to_value(generation.stop)?;
    stats["threads"] = rayon::current_num_threads().into();
    stats["experts"] = info.experts.into();
    stats["draft"] = serde_json::to_value(&draft_stats)?;
    stats["spine"] = spine.name().into();
    stats["spine_lossy"] = spine.lossy().into();
    stats["direct_io"] = serde_json::to_value(info.direct_io)?;
    stats["ram_budget_bytes"] = serde_json::to_value(info.ledger.as_ref().map(|l| l.budget))?;
    stats["expert_cache_slots"] =
        serde_json::to_value(info.ledger.as_ref().map(|l| l.cache_experts))?;
    if json {
        let mut obj = serde_json::json!({
            "prompt_ids": prompt,
            "output_ids": generation.output_ids,
        });
        if let Some(t) = text {
            obj["text"] = t.into();
        }
        obj["stats"] = stats;
        writeln!(stdout, "{obj}")?;
    } else {
        if let Some(s) = stream.as_mut() {
            let _ = stdout.write_all(s.finish().as_bytes());
        }
        writeln!(stdout)?;
        let s = &generation.stats;
        eprintln!(
            "{} prompt tokens, {} generated ({:?}); load {:.2}s, prefill {:.1} tok/s, first token {:.3}s, decode {:.2} tok/s, experts read {:.1} MB, hit rate {}, peak RSS {:.1} MiB",
            s.prompt_tokens,
            s.generated_tokens,
            generation.stop,
            info.load_s,
            s.prefill_tok_s,
            s.first_token_s,
            s.decode_tok_s,
            total.bytes_read as f64 / 1e6,
            ratio(total.hits, total.requested),
            s.peak_rss_bytes as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}
