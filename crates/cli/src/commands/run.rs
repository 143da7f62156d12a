//! `fathom run`: one sequence from a prompt, greedy or sampled, through the
//! step engine.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use fathom_chat::{ChatFormat, ChatOptions, ChatPrompt, Message, ReplyDelta, ReplyParser};
use fathom_engine::report::{IoStats, RunSetup, TokenLogprob};
use fathom_engine::{
    DraftOptions, EngineOptions, Request, RunReport, RunStats, TokenEvent, generate_with,
};
use fathom_model::CausalLm;
use fathom_tokenizer::Tokenizer;

use crate::common::{
    SamplingArgs, SpineArg, announce_spine, check_vocab, decoder, prompt_ids, tokenizer, wants_bos,
};
use crate::load::{LoadInfo, MemoryArgs, check_context, load_model_config};
pub use fathom_runtime::draft::{DraftChoice, draft_bytes, make_drafter, parse_draft};

/// Generate from a prompt: greedy by default, sampled with --temperature.
#[derive(Args)]
pub struct RunArgs {
    /// Model directory, or ORG/NAME[@REV] pulled by `fathom pull` (config.json + safetensors shards).
    #[arg(help_heading = "Model and prompt", long, value_parser = fathom_hub::resolve_model)]
    model: PathBuf,
    /// Prompt as comma-separated token ids, e.g. 1,591,25 (used as given).
    #[arg(
        help_heading = "Model and prompt",
        long,
        conflicts_with = "prompt",
        required_unless_present = "prompt"
    )]
    prompt_ids: Option<String>,
    /// Prompt as text (needs a tokenizer in the model directory). A BOS token
    /// is put first when tokenizer_config.json sets add_bos_token, or, when
    /// it does not say, when config.json names a bos_token_id.
    #[arg(help_heading = "Model and prompt", long)]
    prompt: Option<String>,
    /// Do not put a BOS token before a --prompt text.
    #[arg(help_heading = "Model and prompt", long)]
    no_bos: bool,
    /// Send --prompt as one user message in the model's chat format (as
    /// `fathom serve`'s chat endpoint renders it; no BOS).
    #[arg(help_heading = "Model and prompt", long, requires = "prompt")]
    chat: bool,
    /// With --chat: answer without the thinking channel.
    #[arg(help_heading = "Model and prompt", long, requires = "chat")]
    no_thinking: bool,
    /// Tokens to generate at most.
    #[arg(help_heading = "Model and prompt", long, default_value_t = 32, value_parser = crate::common::parse_max_new)]
    max_new: usize,
    /// Keep generating past the end-of-sequence token.
    #[arg(help_heading = "Model and prompt", long)]
    ignore_eos: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print exactly one JSON object on stdout: prompt_ids, output_ids, text,
    /// finish_reason, logprobs (with --logprobs), stats.
    #[arg(help_heading = "Output", long)]
    json: bool,
    /// Per-token expert I/O statistics on stderr.
    #[arg(help_heading = "Output", long)]
    stats: bool,
    /// Precision of the resident spine matrices (int8 is lossy).
    #[arg(help_heading = "Memory and placement", long, value_enum, default_value_t = SpineArg::Bf16)]
    spine: SpineArg,
    /// Draft source for speculative decoding: `ngram` (prompt lookup, no
    /// extra model), `mtp` (the checkpoint's own multi-token-prediction
    /// layer of a DeepSeek-V3 / R1 checkpoint), `model:DIR` (a small checkpoint with
    /// the same tokenizer), or `off`. The full model decides every token (a draft is
    /// kept only where it equals the token the model samples there), so
    /// output is identical to `off`; drafting adapts its length and switches
    /// itself off when it does not pay.
    #[arg(help_heading = "Drafting", long, default_value = "ngram")]
    draft: String,
    /// Prompt tokens per prefill pass (the scratch is sized by it, not by
    /// the prompt); output does not depend on it.
    #[arg(help_heading = "Memory and placement", long, default_value_t = PREFILL_CHUNK, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    prefill_chunk: u32,
    /// Most tokens proposed per verification pass.
    #[arg(help_heading = "Drafting", long, default_value_t = DRAFT_MAX, value_parser = clap::value_parser!(u32).range(1..=32))]
    draft_max: u32,
    #[command(flatten)]
    mem: MemoryArgs,
}

/// Adds the BOS token before a text prompt where the model wants one.
pub fn with_bos(
    mut ids: Vec<u32>,
    dir: &Path,
    lm: &dyn CausalLm,
    text: bool,
    no_bos: bool,
) -> Vec<u32> {
    if text && !no_bos {
        if let Some(b) = wants_bos(dir, lm.info().bos_token_id) {
            if ids.first() != Some(&b) {
                ids.insert(0, b);
            }
        }
    }
    ids
}

/// `--prefill-chunk`'s default.
const PREFILL_CHUNK: u32 = 512;
/// `--draft-max`'s default.
const DRAFT_MAX: u32 = 8;

/// The pass a run with default flags and a short prompt plans for.
pub fn default_pass() -> usize {
    pass_positions(
        1,
        PREFILL_CHUNK as usize,
        &DraftChoice::Ngram,
        DRAFT_MAX as usize,
    )
}

/// Tokens of the largest pass a run makes, the one its scratch and I/O
/// buffers are planned for: the prompt's prefill (in chunks of `chunk`)
/// or, with a drafter, a verification of `draft_max` drafted tokens.
pub fn pass_positions(prompt: usize, chunk: usize, draft: &DraftChoice, draft_max: usize) -> usize {
    let verify = match draft {
        DraftChoice::Off => 1,
        _ => draft_max + 1,
    };
    (prompt + 1).max(verify).min(chunk.max(verify))
}

/// How the model was set up, for the report.
pub fn setup(info: &LoadInfo, spine: fathom_model::Spine) -> RunSetup {
    let placed = fathom_weights::numa::placement();
    RunSetup {
        load_s: info.load_s,
        threads: rayon::current_num_threads(),
        pinned_threads: placed.pinned,
        numa_nodes: placed.nodes,
        numa_interleaved: placed.interleaved,
        experts: info.experts.into(),
        spine: spine.name().into(),
        spine_lossy: spine.lossy(),
        direct_io: info.direct_io,
        ram_budget_bytes: info.ledger.as_ref().map(|l| l.budget),
        expert_cache_slots: info.ledger.as_ref().map(|l| l.cache_experts),
        spine_streamed_layers: info.ledger.as_ref().map(|l| l.tiers.streamed_layers),
        spine_streamed_bytes: info.ledger.as_ref().map(|l| l.tiers.read_bytes),
        spine_device_layers: info
            .ledger
            .as_ref()
            .map(|l| l.tiers.device_layers)
            .filter(|&n| n > 0),
        spine_device_bytes: info
            .ledger
            .as_ref()
            .map(|l| l.tiers.device_bytes)
            .filter(|&n| n > 0),
        device: info.device.clone(),
        heat_warmed_experts: info.heat.warmed.map(|w| w.0),
        heat_pinned_experts: info.heat.warmed.map(|w| w.1),
        heat_warm_bytes: info.heat.warmed.map(|w| w.2),
    }
}

pub fn run(a: RunArgs) -> Result<()> {
    let sampling = a.sampling.params()?;
    let draft = parse_draft(&a.draft)?;
    let tok = tokenizer(&a.model)?;
    if !a.sampling.stop.is_empty() && tok.is_none() {
        bail!(
            "--stop needs a tokenizer in {} (the text is matched)",
            a.model.display()
        );
    }
    let chat = match (&tok, a.chat) {
        (Some(t), true) => Some(chat_prompt(&a, t.as_ref())?),
        (None, true) => bail!("--chat needs a tokenizer in {}", a.model.display()),
        _ => None,
    };
    let prompt = match &chat {
        Some((_, p)) => p.ids.clone(),
        None => prompt_ids(
            a.prompt_ids.as_deref(),
            a.prompt.as_deref(),
            tok.as_deref(),
            &a.model,
        )?,
    };
    let spine = a.spine.spine();
    let config = fathom_runtime::read_config(&a.model)?;
    let req = a.mem.request();
    let chunk = a.prefill_chunk as usize;
    let positions = pass_positions(prompt.len(), chunk, &draft, a.draft_max as usize);
    // The draft model (if any) comes out of the same budget, checked before loading.
    let fix = "use --draft ngram or a larger --ram-budget";
    let mut mem = req.set_aside(draft_bytes(&draft, &config)?, "the draft model", fix)?;
    mem.mtp = matches!(draft, DraftChoice::Mtp);
    mem.records_heat = true;
    // Cheap first: the budget rule and the context bound before loading
    // (BOS may add one more token; checked again after).
    let plan = crate::load::plan(&config, &mem, positions, spine)?;
    check_context(plan.context, prompt.len(), a.max_new, "run")?;
    let (model, info) = load_model_config(config, &mem, positions, spine)?;
    let prompt = with_bos(
        prompt,
        &a.model,
        model.as_ref(),
        a.prompt.is_some() && !a.chat,
        a.no_bos,
    );
    check_vocab(&prompt, model.info().vocab_size)?;
    check_context(info.context, prompt.len(), a.max_new, "run")?;
    if !a.json || a.stats {
        announce_spine(spine);
        if let Some(line) = info.plan_line() {
            eprintln!("{line}");
        }
    }
    let mut req = Request::new(prompt.clone(), a.max_new);
    req.sampling = sampling;
    req.stop_strings = a.sampling.stop.clone();
    if !a.ignore_eos {
        let eos = &model.info().eos_token_ids;
        // A chat reply also ends at its format's closing tokens (harmony's
        // `<|return|>` and `<|call|>`).
        req.stop_ids = match (&chat, &tok) {
            (Some((format, _)), Some(t)) => format.stop_ids(t.as_ref(), eos),
            _ => eos.clone(),
        };
    }
    req.drafter = make_drafter(&draft, &model)?;
    req.draft = DraftOptions {
        max_k: a.draft_max as usize,
        adaptive: true,
    };

    let mut stdout = std::io::stdout().lock();
    let start_stats = model.expert_stats();
    let spine0 = model.spine_reads();
    // The spine's reads when the first token is out: what follows is decode.
    let mut spine1: Option<fathom_model::SpineReads> = None;
    let device0 = info.device_snapshot();
    let gpu_on = info.backend().is_some();
    // The backend's counts when the first token is out: what follows is decode.
    let mut decode0: Option<fathom_kernels::backend::BackendStats> = None;
    let mut phases0: Option<fathom_model::phase::PhaseMs> = None;
    let kv0 = model.kv_stats();
    let mut meter = TokenMeter::new(&*model, a.stats);
    let mut logprobs = Vec::new();
    let json = a.json;
    // SIGINT ends the generation at the next token: the summary of what
    // was generated is printed and the process exits 130.
    let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || flag.store(true, std::sync::atomic::Ordering::SeqCst))?;
    }
    let on_token = |ev: &TokenEvent| {
        meter.tick(&*model);
        if phases0.is_none() {
            phases0 = Some(fathom_model::phase::snapshot());
            spine1 = Some(model.spine_reads());
        }
        if gpu_on && decode0.is_none() {
            decode0 = Some(info.device_snapshot());
        }
        if a.sampling.logprobs.is_some() {
            logprobs.push(TokenLogprob {
                token: ev.sampled.token,
                // Computed whenever --logprobs is given (as here).
                logprob: ev.sampled.logprob.unwrap_or(f32::NAN),
                top: ev.sampled.top.clone(),
            });
        }
        if !json {
            let piece = if tok.is_some() {
                ev.text.clone()
            } else {
                format!("{} ", ev.sampled.token)
            };
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
        if interrupted.load(std::sync::atomic::Ordering::SeqCst) {
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    };
    let opts = EngineOptions {
        max_step_tokens: chunk.max(a.draft_max as usize + 1),
        ..EngineOptions::default()
    };
    let f = generate_with(&model, req, opts, decoder(tok.as_ref()), on_token)?;
    let total = model.expert_stats().since(&start_stats);
    let spine_now = model.spine_reads();
    let positions = (f.stats.prompt_tokens + f.stats.generated_tokens) as u64;
    let wall = f.stats.prefill_s + f.stats.decode_s;
    let stats = RunStats {
        seq: f.stats.clone(),
        io: IoStats::from_experts(&total, wall)
            .with_kv(&model.kv_stats(), &kv0)
            .with_spine(
                &spine_now.since(&spine0),
                spine1.map(|s| spine_now.since(&s)).as_ref(),
            ),
        setup: setup(&info, spine),
        finish_reason: f.reason.name().into(),
        draft: f.draft.clone(),
        gpu: info.device_since(&device0),
        gpu_decode: decode0.as_ref().and_then(|d| info.device_since(d)),
        decode_phases_ms: phases0
            .map(|p0| fathom_model::phase::snapshot().since(&p0))
            .filter(|p| p.total() > 0.0),
    };
    let (content, reasoning_content) = match (&chat, &f.text) {
        (Some((format, p)), Some(text)) => {
            let (c, r) = split_reply(format.reply_parser(p.thinking).as_mut(), text);
            (Some(c), r)
        }
        _ => (None, None),
    };
    if json {
        let report = RunReport {
            content,
            reasoning_content,
            prompt_ids: prompt,
            output_ids: f.output_ids,
            text: f.text,
            finish_reason: f.reason.name().into(),
            logprobs: a.sampling.logprobs.map(|_| logprobs),
            stats,
        };
        writeln!(stdout, "{}", serde_json::to_string(&report)?)?;
        info.heat.record(positions)?;
        return exit_if_interrupted(&interrupted, &mut stdout);
    }
    stdout.write_all(f.text_tail.as_bytes())?;
    writeln!(stdout)?;
    let s = &stats.seq;
    eprintln!(
        "{} prompt tokens, {} generated ({}); load {:.2}s, prefill {:.1} tok/s, first token {:.3}s, decode {:.2} tok/s, experts read {:.1} MB, hit rate {}, peak RSS {:.1} MiB",
        s.prompt_tokens,
        s.generated_tokens,
        f.reason.name(),
        info.load_s,
        s.prefill_tok_s,
        s.first_token_s,
        s.decode_tok_s,
        total.bytes_read as f64 / 1e6,
        stats
            .io
            .expert_hit_rate
            .map_or("-".into(), |r| format!("{r:.2}")),
        s.peak_rss_bytes as f64 / (1 << 20) as f64
    );
    if let Some(d) = &stats.gpu {
        eprintln!(
            "device {}: {} products on it, {} on the CPU, {:.1} ms inside device calls, {:.1} MB host→device, expert VRAM hits {}/{}{}",
            stats.setup.device,
            d.device_products,
            d.cpu_products,
            d.gpu_ms,
            d.h2d_bytes as f64 / 1e6,
            d.vram_expert_hits,
            d.vram_expert_hits + d.vram_expert_misses,
            d.last_error.as_ref().map_or(String::new(), |e| format!(
                "; {} device errors, last: {e}",
                d.device_errors
            ))
        );
    }
    info.heat.record(positions)?;
    exit_if_interrupted(&interrupted, &mut stdout)
}

/// After SIGINT (the summary printed): exit 130, as a shell expects of an
/// interrupted command.
fn exit_if_interrupted(flag: &std::sync::atomic::AtomicBool, out: &mut impl Write) -> Result<()> {
    if flag.load(std::sync::atomic::Ordering::SeqCst) {
        out.flush()?;
        eprintln!("interrupted (SIGINT): stopped after the tokens above");
        std::process::exit(130);
    }
    Ok(())
}

/// `--chat`: the prompt as one user message in the model's chat format.
fn chat_prompt(a: &RunArgs, tok: &dyn Tokenizer) -> Result<(ChatFormat, ChatPrompt)> {
    let Some(format) = ChatFormat::detect(&a.model, tok)? else {
        bail!(
            "{} has no chat format (no chat template): drop --chat",
            a.model.display()
        );
    };
    let opts = ChatOptions {
        thinking: Some(!a.no_thinking),
        ..ChatOptions::default()
    };
    let text = a.prompt.as_deref().unwrap_or_default();
    let p = format.prompt(tok, &[Message::new("user", text)], &opts)?;
    Ok((format, p))
}

/// A reply's answer and (if any) thinking text.
fn split_reply(p: &mut dyn ReplyParser, text: &str) -> (String, Option<String>) {
    let (mut content, mut reasoning) = (String::new(), None::<String>);
    let mut deltas = p.push(text);
    deltas.extend(p.finish());
    for d in deltas {
        match d {
            ReplyDelta::Content(t) => content.push_str(&t),
            ReplyDelta::Reasoning(t) => reasoning.get_or_insert_default().push_str(&t),
            ReplyDelta::ToolCall { .. } => {}
        }
    }
    (content, reasoning)
}

/// `--stats`: expert I/O per token on stderr.
struct TokenMeter {
    on: bool,
    last: (fathom_model::experts::ExpertStats, Instant),
    index: usize,
}

fn pct(a: u64, b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.0}%", 100.0 * a as f64 / b as f64)
    }
}

impl TokenMeter {
    fn new(model: &dyn CausalLm, on: bool) -> Self {
        TokenMeter {
            on,
            last: (model.expert_stats(), Instant::now()),
            index: 0,
        }
    }

    fn tick(&mut self, model: &dyn CausalLm) {
        if !self.on {
            return;
        }
        let now = (model.expert_stats(), Instant::now());
        let d = now.0.since(&self.last.0);
        let wall = now.1.duration_since(self.last.1).as_secs_f64();
        let what = if self.index == 0 { "prefill" } else { "token" };
        eprintln!(
            "[{what} {}] {:.3}s, experts read {:.1} MB ({} hit / {} miss, hit rate {}), {:.0} MB/s, I/O wait {:.3}s (the layer thread blocked on reads) vs not waiting {:.3}s, prefetch precision {} recall {}",
            self.index,
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
        self.last = now;
        self.index += 1;
    }
}
