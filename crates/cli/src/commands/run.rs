//! `fathom run`: greedy generation from a prompt.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use fathom_engine::greedy;
use fathom_tokenizer::StreamDecoder;

use crate::common::{check_vocab, load_model, prompt_ids, tokenizer};

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
}

pub fn run(a: RunArgs) -> Result<()> {
    let tok = tokenizer(&a.model)?;
    let (model, load_s) = load_model(&a.model)?;
    let prompt = prompt_ids(
        a.prompt_ids.as_deref(),
        a.prompt.as_deref(),
        tok.as_deref(),
        &a.model,
    )?;
    check_vocab(&prompt, model.spec.vocab_size)?;
    let stop: Vec<u32> = if a.ignore_eos {
        vec![]
    } else {
        model.spec.eos_token_id.into_iter().collect()
    };

    let mut stdout = std::io::stdout().lock();
    let mut stream = tok.as_deref().map(StreamDecoder::new);
    let json = a.json;
    let generation = greedy(&model, &prompt, a.max_new, &stop, |id| {
        if !json {
            let piece = match stream.as_mut() {
                Some(s) => s.push(id),
                None => format!("{id} "),
            };
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
        ControlFlow::Continue(())
    })?;
    let text = tok.as_deref().map(|t| t.decode(&generation.output_ids));
    let mut stats = serde_json::to_value(&generation.stats)?;
    stats["load_s"] = load_s.into();
    stats["stop"] = serde_json::to_value(generation.stop)?;
    stats["threads"] = rayon::current_num_threads().into();
    stats["experts"] = "resident".into();
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
            "{} prompt tokens, {} generated ({:?}); load {:.2}s, prefill {:.1} tok/s, first token {:.3}s, decode {:.2} tok/s, peak RSS {:.1} MiB",
            s.prompt_tokens,
            s.generated_tokens,
            generation.stop,
            load_s,
            s.prefill_tok_s,
            s.first_token_s,
            s.decode_tok_s,
            s.peak_rss_bytes as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}
