//! `fathom bench`: arms of `fathom run` (and peer engines) measured in fresh
//! processes against this machine's storage and memory ceilings, in one run.
//! The work is in `fathom-bench`; this file parses flags and writes outputs.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{ArgGroup, Args};
use fathom_bench::arm::{Arm, Prompt, parse_ids, parse_prompts_file};
use fathom_bench::ceiling::Limits;
use fathom_bench::{BenchConfig, render_table, run_bench};
use fathom_weights::units::parse_size;

/// Benchmark arms of `fathom run` flags (and peer engines) in fresh processes,
/// interleaved rep by rep, against the storage and memory ceilings measured in
/// the same run. Prints a table; an arm whose output ids differ from the
/// reference is rejected.
#[derive(Args)]
#[command(group(ArgGroup::new("input").required(false).args(["prompt", "prompt_ids", "prompts"])))]
pub struct BenchArgs {
    /// Model directory, or ORG/NAME[@REV] pulled by `fathom pull` (config.json + safetensors shards).
    #[arg(long, value_parser = fathom_hub::resolve_model)]
    model: PathBuf,
    /// Prompt as text (needs the model's tokenizer; peers get it as {prompt}).
    #[arg(long)]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. 1,591,25.
    #[arg(long)]
    prompt_ids: Option<String>,
    /// File of prompts, one per line: text, or `ids: 1,2,3`; `#` lines and blank lines skipped.
    #[arg(long, value_name = "FILE")]
    prompts: Option<PathBuf>,
    /// Run a fixed prompt set instead ("standard": two factual prompts, a
    /// code continuation, a chat turn, a long-context prompt) and print a
    /// result card (Markdown); with --json card.json the card is also
    /// written as JSON there, as Markdown to card.md and as SVG to card.svg.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["prompt", "prompt_ids", "prompts", "expect_ids", "depth", "batch_sizes"])]
    suite: Option<String>,
    /// Tokens each run generates (greedy; EOS may end a run earlier).
    #[arg(long, default_value_t = 16, value_parser = crate::common::parse_max_new)]
    max_new: usize,
    /// Measured reps per arm (and per prompt); the summaries are over these.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Extra reps run first and discarded (outputs are still checked).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// An arm: a name and the extra `fathom run` flags, e.g.
    /// --arm stream="--experts stream --ram-budget 3.8GB". Repeatable; the
    /// first arm's first output is the reference. Default: one arm default="".
    #[arg(long = "arm", value_name = "NAME=FLAGS")]
    arms: Vec<String>,
    /// A peer engine: a name and a command template, run without a shell, with
    /// {prompt}, {prompt_ids}, {max_new}, {model} and {threads} substituted,
    /// e.g. --peer llama="llama-cli -m k3.gguf -p {prompt} -n {max_new} -no-cnv".
    /// Its tok/s is read from its output (llama.cpp's perf lines, llama-bench's
    /// table or JSON; see docs/bench.md). Repeatable.
    #[arg(long = "peer", value_name = "NAME=COMMAND")]
    peers: Vec<String>,
    /// The expected output ids (else the first arm's first output).
    #[arg(long, value_name = "IDS")]
    expect_ids: Option<String>,
    /// Write the full report (every raw sample, ceilings, machine) as JSON here.
    #[arg(long, value_name = "OUT")]
    json: Option<PathBuf>,
    /// Write an SVG bar chart of median decode tok/s with min–max whiskers and ceilings.
    #[arg(long, value_name = "OUT.svg")]
    plot: Option<PathBuf>,
    /// Run every measured process in its own memory cgroup with this limit
    /// (page cache charged), e.g. 4GB; created under fathom's own cgroup and
    /// removed afterwards. Needs write access to the cgroup filesystem.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    memory_cap: Option<u64>,
    /// Time limit of each ceiling measurement, in seconds.
    #[arg(long, default_value_t = 5.0, value_name = "S")]
    ceiling_secs: f64,
    /// Most bytes the storage ceiling reads.
    #[arg(long, default_value = "2GB", value_name = "SIZE", value_parser = parse_size)]
    ceiling_bytes: u64,
    /// Parallel reads for the storage ceiling (the engine's default I/O threads).
    #[arg(long, default_value_t = 16, value_name = "N")]
    ceiling_io_threads: usize,
    /// Time limit of each measured process, in seconds (then it is killed and the arm fails).
    #[arg(long, default_value_t = 1800.0, value_name = "S")]
    timeout: f64,
    /// Sweep batch sizes instead (e.g. 1,2,4,8,16): `fathom batch` on the
    /// first B lines of --prompts (JSON lines, cycled), plus the largest
    /// batch's prompts one after another, beside the step bound; the first
    /// --arm's flags apply to every run.
    #[arg(long, value_name = "B,B,..", value_delimiter = ',')]
    batch_sizes: Vec<usize>,
    /// Measure the decode step at these context depths instead (e.g.
    /// 1024,32768,131072), in this process, with the first --arm's memory
    /// flags; no prompt needed.
    #[arg(long, value_name = "D,D,..", value_delimiter = ',')]
    depth: Vec<usize>,
    /// How the cache is filled before timing: a real prefill, or synthetic
    /// latent rows and recurrent state (labelled so in the report).
    #[arg(long, value_enum, default_value_t = DepthFillArg::Synthetic)]
    depth_fill: DepthFillArg,
    /// Decode steps timed at each depth (after one untimed).
    #[arg(long, default_value_t = 8)]
    depth_steps: usize,
    /// Prompt tokens per pass when --depth-fill prefill fills the cache.
    #[arg(long, default_value_t = 512, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=65536))]
    depth_chunk: usize,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DepthFillArg {
    Prefill,
    Synthetic,
}

/// The memory flags of an arm, parsed as `run` parses them.
#[derive(clap::Parser)]
struct ArmMemory {
    #[command(flatten)]
    mem: crate::load::MemoryArgs,
}

fn run_depth(a: &BenchArgs) -> Result<()> {
    use clap::Parser;
    use fathom_bench::depth::{DepthFill, DepthReport, render_depths, run_depths};
    if a.depth.iter().any(|&d| d == 0 || d > 1 << 24) {
        bail!("--depth: each depth must be in 1..=16777216 tokens");
    }
    let flags: Vec<String> = a
        .arms
        .first()
        .map(|arm| {
            arm.split_once('=')
                .map_or("", |(_, f)| f)
                .split_whitespace()
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let mut mem = ArmMemory::try_parse_from(std::iter::once("arm".to_string()).chain(flags))
        .map_err(|e| anyhow::anyhow!("--arm flags for --depth: {e}"))?
        .mem
        .request();
    // The ledger reserves state for the deepest depth plus the timed steps.
    let deepest = a.depth.iter().copied().max().unwrap_or(1);
    mem.context = Some(mem.context.unwrap_or(0).max(deepest + a.depth_steps + 1));
    let how = match a.depth_fill {
        DepthFillArg::Prefill => DepthFill::Prefill,
        DepthFillArg::Synthetic => DepthFill::Synthetic,
    };
    // Planned as `fathom inspect` plans a decode step; a real prefill adds its chunk.
    let pass = fathom_bench::depth::pass_tokens(how, a.depth_chunk, super::inspect::positions());
    let (lm, info) = crate::load::load_model_with(&a.model, &mem, pass, fathom_model::Spine::Bf16)?;
    if let Some(line) = info.plan_line() {
        eprintln!("{line}");
    }
    let depths = run_depths(&lm, &a.depth, how, a.depth_steps, a.depth_chunk, |l| {
        eprintln!("{l}")
    })?;
    let report = DepthReport {
        model: a.model.display().to_string(),
        threads: rayon::current_num_threads(),
        steps: a.depth_steps,
        depths,
    };
    print!("{}", render_depths(&report));
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

fn prompts(a: &BenchArgs) -> Result<Vec<Prompt>> {
    if let Some(name) = &a.suite {
        return Ok(fathom_bench::suite::suite(name)?
            .into_iter()
            .map(|p| p.prompt)
            .collect());
    }
    if let Some(t) = &a.prompt {
        if t.is_empty() {
            bail!("--prompt is empty");
        }
        return Ok(vec![Prompt::Text(t.clone())]);
    }
    if let Some(ids) = &a.prompt_ids {
        return Ok(vec![Prompt::Ids(parse_ids(ids).context("--prompt-ids")?)]);
    }
    let path = a
        .prompts
        .as_ref()
        .context("give --prompt, --prompt-ids or --prompts")?;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_prompts_file(&text).with_context(|| format!("{}", path.display()))
}

fn config(a: &BenchArgs) -> Result<BenchConfig> {
    for (flag, v) in [("--ceiling-secs", a.ceiling_secs), ("--timeout", a.timeout)] {
        if !(v.is_finite() && v > 0.0) {
            bail!("{flag} must be a positive number of seconds");
        }
    }
    let mut arms = a
        .arms
        .iter()
        .map(|s| Arm::parse_fathom(s))
        .collect::<Result<Vec<_>>>()?;
    if arms.is_empty() {
        arms.push(Arm::parse_fathom("default=")?);
    }
    for p in &a.peers {
        arms.push(Arm::parse_peer(p)?);
    }
    Ok(BenchConfig {
        exe: std::env::current_exe().context("locating the fathom executable")?,
        model: a.model.clone(),
        prompts: prompts(a)?,
        max_new: a.max_new,
        reps: a.reps,
        warmup: a.warmup,
        arms,
        expect_ids: a
            .expect_ids
            .as_deref()
            .map(|s| parse_ids(s).context("--expect-ids"))
            .transpose()?,
        memory_cap: a.memory_cap,
        limits: Limits {
            storage_bytes: a.ceiling_bytes,
            seconds: a.ceiling_secs,
            io_threads: a.ceiling_io_threads.max(1),
        },
        timeout: Duration::from_secs_f64(a.timeout),
        threads: rayon::current_num_threads(),
        argv: std::env::args().collect(),
        version: env!("CARGO_PKG_VERSION").to_string(),
    })
}

fn run_sweep(a: &BenchArgs) -> Result<()> {
    use fathom_bench::batch::{
        BatchBenchConfig, read_prompt_lines, render_batch_table, run_batch_bench,
    };
    if a.batch_sizes.iter().any(|&b| b == 0 || b > 4096) {
        bail!("--batch-sizes: each size must be in 1..=4096");
    }
    let path = a
        .prompts
        .as_ref()
        .context("--batch-sizes needs --prompts FILE (JSON lines)")?;
    let flags = match a.arms.first() {
        Some(arm) => arm
            .split_once('=')
            .map_or("", |(_, f)| f)
            .split_whitespace()
            .map(str::to_string)
            .collect(),
        None => Vec::new(),
    };
    let work_dir = std::env::temp_dir().join(format!("fathom-batch-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work_dir)?;
    let cfg = BatchBenchConfig {
        exe: std::env::current_exe().context("locating the fathom executable")?,
        model: a.model.clone(),
        prompt_lines: read_prompt_lines(path)?,
        sizes: a.batch_sizes.clone(),
        max_new: a.max_new,
        reps: a.reps,
        flags,
        limits: Limits {
            storage_bytes: a.ceiling_bytes,
            seconds: a.ceiling_secs,
            io_threads: a.ceiling_io_threads.max(1),
        },
        work_dir: work_dir.clone(),
    };
    let report = run_batch_bench(&cfg, |line| eprintln!("{line}"));
    let _ = std::fs::remove_dir_all(&work_dir);
    let report = report?;
    print!("{}", render_batch_table(&report));
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

pub fn run(a: BenchArgs) -> Result<()> {
    if !a.depth.is_empty() {
        return run_depth(&a);
    }
    if !a.batch_sizes.is_empty() {
        return run_sweep(&a);
    }
    if let Some(name) = &a.suite {
        return run_suite(&a, name);
    }
    if a.prompt.is_none() && a.prompt_ids.is_none() && a.prompts.is_none() {
        bail!(
            "give --prompt, --prompt-ids, --prompts or --suite standard (or --depth for the context-depth sweep)"
        );
    }
    let cfg = config(&a)?;
    let report = run_bench(&cfg, |line| eprintln!("{line}"))?;
    print!("{}", render_table(&report));
    if let Some(p) = &a.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(p, text + "\n").with_context(|| format!("writing {}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    if let Some(p) = &a.plot {
        std::fs::write(p, fathom_bench::svg::render(&report))
            .with_context(|| format!("writing {}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

/// `--suite NAME`: the fixed prompts through every arm, then the result card.
fn run_suite(a: &BenchArgs, name: &str) -> Result<()> {
    use fathom_bench::suite;
    let mut set = suite::suite(name)?;
    // Text and chat prompts need the model's tokenizer: say so before measuring.
    let Some(tok) = crate::common::tokenizer(&a.model)? else {
        bail!(
            "--suite {name} gives text prompts and {} has no tokenizer (tiktoken.model or tokenizer.json)",
            a.model.display()
        );
    };
    let mut skipped = Vec::new();
    if fathom_chat::ChatFormat::detect(&a.model, tok.as_ref())?.is_none() {
        set.retain(|p| !matches!(p.prompt, Prompt::Chat(_)));
        skipped.push("chat: the model has no chat format (no chat template)".to_string());
        tracing::warn!(
            "{}: no chat format, the suite's chat turn is skipped",
            a.model.display()
        );
    }
    // A prompt that cannot fit the context with --max-new is skipped, and said so.
    let context = fathom_model::ModelConfig::read(&a.model)?
        .declared_context()
        .unwrap_or(crate::load::ASSUMED_CONTEXT);
    set.retain(|p| {
        let n = p.prompt.text().map_or(0, |t| tok.encode(t).len());
        let fits = n + a.max_new + 1 <= context;
        if !fits {
            skipped.push(format!(
                "{}: {n} prompt tokens plus --max-new {} exceed the model's context of {context} tokens",
                p.name, a.max_new
            ));
        }
        fits
    });
    if set.is_empty() {
        bail!(
            "--suite {name}: no prompt of the suite fits this model ({})",
            skipped.join("; ")
        );
    }
    if let Some(p) = &a.json
        && matches!(p.extension().and_then(|e| e.to_str()), Some("md" | "svg"))
    {
        bail!(
            "--json {}: the card's Markdown and SVG go beside it as .md and .svg: name it .json",
            p.display()
        );
    }
    let id = suite::model_id(&a.model)?;
    let mut cfg = config(a)?;
    cfg.prompts = set.iter().map(|p| p.prompt.clone()).collect();
    let report = run_bench(&cfg, |line| eprintln!("{line}"))?;
    let mut card = suite::card(&report, name, &set, id);
    card.skipped = skipped;
    let md = suite::markdown(&card);
    print!("{md}");
    if let Some(p) = &a.json {
        let write = |path: PathBuf, text: String| {
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote {}", path.display());
            anyhow::Ok(())
        };
        write(p.clone(), serde_json::to_string_pretty(&card)? + "\n")?;
        write(p.with_extension("md"), md)?;
        write(p.with_extension("svg"), suite::svg(&card))?;
    }
    Ok(())
}
