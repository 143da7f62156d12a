//! `fathom batch`: many prompts decoded together through the step engine.
//!
//! Each line of the prompts file is one JSON object: `{"prompt": "..."}` or
//! `{"prompt_ids": [..]}`, optionally with its own `max_new`, `temperature`,
//! `top_k`, `top_p`, `min_p`, `repetition_penalty`, `presence_penalty`,
//! `frequency_penalty`, `seed`, `stop` (a string or a list). The command's
//! flags give the defaults. Every sequence gets exactly the tokens it gets
//! alone (`fathom run` with the same settings).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_engine::report::{BatchReport, BatchResult, BatchStats, IoStats};
use fathom_engine::{Engine, EngineOptions, Event, Finished, Request, SamplingParams};
use serde::Deserialize;

use crate::commands::run::{setup, with_bos};
use crate::common::{SamplingArgs, SpineArg, announce_spine, check_vocab, decoder, tokenizer};
use crate::load::{MemoryArgs, check_context, load_model_with};

/// Most lines a prompts file may hold.
const MAX_LINES: usize = 100_000;

/// Decode the prompts of a JSON-lines file together (continuous batching).
#[derive(Args)]
pub struct BatchArgs {
    /// Model directory, or ORG/NAME[@REV] pulled by `fathom pull` (config.json + safetensors shards).
    #[arg(long, value_parser = fathom_hub::resolve_model)]
    model: PathBuf,
    /// JSON lines: {"prompt": "..."} or {"prompt_ids": [..]}, with optional
    /// max_new, temperature, top_k, top_p, min_p, seed, stop, penalties.
    #[arg(long)]
    prompts: PathBuf,
    /// Tokens to generate at most per prompt (a line's max_new wins).
    #[arg(long, default_value_t = 32, value_parser = crate::common::parse_max_new)]
    max_new: usize,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Do not put a BOS token before "prompt" texts.
    #[arg(long)]
    no_bos: bool,
    /// Most new positions per step over all sequences (prompts are chunked to fit).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_step_tokens: u32,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print exactly one JSON object: {"results": [...], "stats": {...}}.
    #[arg(long)]
    json: bool,
    /// Precision of the resident spine matrices (int8 is lossy).
    #[arg(long, value_enum, default_value_t = SpineArg::Bf16)]
    spine: SpineArg,
    #[command(flatten)]
    mem: MemoryArgs,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stops {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    max_new: Option<usize>,
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stops>,
}

impl Line {
    fn sampling(&self, base: &SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_k: self.top_k.unwrap_or(base.top_k),
            top_p: self.top_p.unwrap_or(base.top_p),
            min_p: self.min_p.unwrap_or(base.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(base.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(base.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(base.frequency_penalty),
            seed: self.seed.unwrap_or(base.seed),
            logprobs: base.logprobs,
        }
    }
}

/// Reads and checks the prompts file (cheap, before the model loads).
fn read_lines(a: &BatchArgs, base: &SamplingParams) -> Result<Vec<(Line, SamplingParams)>> {
    let path = &a.prompts;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --prompts {}", path.display()))?;
    let mut out = Vec::new();
    for (i, raw) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = || format!("{} line {}", path.display(), i + 1);
        if out.len() >= MAX_LINES {
            bail!("{}: more than {MAX_LINES} prompts", path.display());
        }
        let line: Line = serde_json::from_str(raw)
            .with_context(|| format!("{}: not a valid prompt object", at()))?;
        if line.prompt.is_some() == line.prompt_ids.is_some() {
            bail!(
                "{}: give exactly one of \"prompt\" and \"prompt_ids\"",
                at()
            );
        }
        if line.prompt_ids.as_ref().is_some_and(Vec::is_empty) {
            bail!("{}: empty \"prompt_ids\"", at());
        }
        if line.max_new == Some(0) {
            bail!(
                "{}: \"max_new\": 0 generates nothing: give at least 1",
                at()
            );
        }
        let sp = line.sampling(base);
        sp.validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", at()))?;
        out.push((line, sp));
    }
    if out.is_empty() {
        bail!("{} holds no prompts", path.display());
    }
    Ok(out)
}

pub fn run(a: BatchArgs) -> Result<()> {
    let base = a.sampling.params()?;
    let lines = read_lines(&a, &base)?;
    let tok = tokenizer(&a.model)?;
    let spine = a.spine.spine();
    let longest = lines
        .iter()
        .map(|(l, _)| l.prompt_ids.as_ref().map_or(0, Vec::len))
        .max();
    let positions = (a.max_step_tokens as usize).max(longest.unwrap_or(0).min(4096));
    // Every prompt's state fits the one budget.
    let mut req = a.mem.request().with_sequences(lines.len() - 1);
    req.records_heat = true;
    let (model, info) = load_model_with(&a.model, &req, positions, spine)?;
    if !a.json {
        announce_spine(spine);
        if let Some(line) = info.plan_line() {
            eprintln!("{line}");
        }
    }
    let eos = model.info().eos_token_ids.clone();
    let limit = info.context;
    let opts = EngineOptions {
        max_step_tokens: a.max_step_tokens as usize,
        ..Default::default()
    };
    let mut engine = Engine::new(model.clone(), opts, decoder(tok.as_ref()));
    let mut ids = Vec::with_capacity(lines.len());
    let mut prompts = Vec::with_capacity(lines.len());
    for (i, (line, sp)) in lines.iter().enumerate() {
        let prompt = match (&line.prompt, &line.prompt_ids) {
            (Some(t), _) => {
                let Some(tk) = tok.as_ref() else {
                    bail!(
                        "line {}: {} ships no tokenizer: use \"prompt_ids\"",
                        i + 1,
                        a.model.display()
                    );
                };
                with_bos(tk.encode(t), &a.model, model.as_ref(), true, a.no_bos)
            }
            (None, Some(p)) => p.clone(),
            (None, None) => unreachable!("checked when read"),
        };
        check_vocab(&prompt, model.info().vocab_size).with_context(|| format!("line {}", i + 1))?;
        let stop_strings = match &line.stop {
            Some(Stops::One(s)) => vec![s.clone()],
            Some(Stops::Many(v)) => v.clone(),
            None => a.sampling.stop.clone(),
        };
        if !stop_strings.is_empty() && tok.is_none() {
            bail!(
                "line {}: \"stop\" needs a tokenizer (the text is matched)",
                i + 1
            );
        }
        let max_new = line.max_new.unwrap_or(a.max_new);
        check_context(limit, prompt.len(), max_new, &format!("line {}", i + 1))?;
        prompts.push(prompt.clone());
        let mut req = Request::new(prompt, max_new);
        req.sampling = sp.clone();
        req.stop_strings = stop_strings;
        if !a.ignore_eos {
            req.stop_ids = eos.clone();
        }
        ids.push(engine.submit(req)?);
    }
    let before = model.expert_stats();
    let spine0 = model.spine_reads();
    let kv0 = model.kv_stats();
    let device0 = info.device_snapshot();
    let mut done: Vec<Option<Finished>> = (0..ids.len()).map(|_| None).collect();
    let mut started = vec![false; ids.len()];
    let mut steady: Option<Steady> = None;
    while !engine.is_idle() {
        let events = engine.step();
        if let Some(s) = steady.as_mut() {
            s.steps += 1;
        }
        for ev in events {
            let (seq, finished) = match ev {
                Event::Token { seq, .. } => (seq, None),
                Event::Finished { seq, done: f } => (seq, Some(f)),
                _ => continue,
            };
            let i = ids
                .iter()
                .position(|&x| x == seq)
                .expect("a submitted sequence");
            started[i] = true;
            if let Some(f) = finished {
                done[i] = Some(*f);
            }
        }
        if steady.is_none() && started.iter().all(|&s| s) {
            steady = Some(Steady::now(&info));
        }
    }
    // The steady steps' device work and wall time, read as the loop ends
    // (as the engine's own clock); none when no step followed the last
    // first token.
    let steady = steady.filter(|s| s.steps > 0).map(|s| {
        let gpu = info.device_since(&s.device);
        (gpu, s.steps, s.at.elapsed().as_secs_f64())
    });
    let es = engine.stats();
    let io = IoStats::from_experts(&model.expert_stats().since(&before), es.wall_s)
        .with_kv(&model.kv_stats(), &kv0)
        .with_spine(&model.spine_reads().since(&spine0), None);
    let results: Vec<BatchResult> = done
        .into_iter()
        .zip(prompts)
        .map(|(f, prompt_ids)| (f.expect("every sequence finishes"), prompt_ids))
        .map(|(f, prompt_ids)| BatchResult {
            prompt_ids,
            output_ids: f.output_ids,
            text: f.text,
            finish_reason: f.reason.name().into(),
            stats: f.stats,
        })
        .collect();
    let positions: usize = results
        .iter()
        .map(|r| r.prompt_ids.len() + r.output_ids.len())
        .sum();
    info.heat.record(positions as u64)?;
    let mut stats = BatchStats {
        experts_per_step: es.experts.requested as f64 / es.steps.max(1) as f64,
        expert_bytes: model.info().expert_bytes,
        spine_bytes: model.info().spine_bytes,
        io,
        setup: setup(&info, spine),
        gpu: info.device_since(&device0),
        ..Default::default()
    };
    if let Some((gpu, steps, wall)) = steady {
        (stats.gpu_decode, stats.decode_steps, stats.decode_wall_s) = (gpu, steps, wall);
    }
    if spine.lossy() {
        stats.spine_bytes /= 2;
    }
    report(a.json, results, &es, stats)
}

/// The batch from the step after every sequence's first token on: no
/// prefill left, the spine's first copies to a device made.
struct Steady {
    device: fathom_kernels::backend::BackendStats,
    at: std::time::Instant,
    steps: u64,
}

impl Steady {
    fn now(info: &crate::load::LoadInfo) -> Self {
        Steady {
            device: info.device_snapshot(),
            at: std::time::Instant::now(),
            steps: 0,
        }
    }
}

fn report(
    json: bool,
    results: Vec<BatchResult>,
    es: &fathom_engine::report::EngineStats,
    base: BatchStats,
) -> Result<()> {
    let generated: usize = results.iter().map(|r| r.output_ids.len()).sum();
    let stats = BatchStats {
        aggregate_tok_s: generated as f64 / es.wall_s.max(1e-9),
        generated_tokens: generated,
        prompt_tokens: results.iter().map(|r| r.stats.prompt_tokens).sum(),
        steps: es.steps,
        mean_batch_size: es.mean_batch_size(),
        wall_s: es.wall_s,
        ..base
    };
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(
            out,
            "{}",
            serde_json::to_string(&BatchReport { results, stats })?
        )?;
        return Ok(());
    }
    for (i, r) in results.iter().enumerate() {
        match &r.text {
            Some(t) => writeln!(out, "[{i}] {t:?} ({})", r.finish_reason)?,
            None => writeln!(out, "[{i}] {:?} ({})", r.output_ids, r.finish_reason)?,
        }
    }
    eprintln!(
        "{} prompts, {} tokens generated in {:.2}s: {:.2} tok/s aggregate, {} steps, mean batch {:.2}, experts read {:.1} MB",
        results.len(),
        generated,
        stats.wall_s,
        stats.aggregate_tok_s,
        stats.steps,
        stats.mean_batch_size,
        stats.io.expert_bytes_read as f64 / 1e6
    );
    Ok(())
}
