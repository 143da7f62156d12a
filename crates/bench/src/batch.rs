//! Batch-size sweep: `fathom batch` on the first B prompts (cycled) for each
//! B, in fresh processes, interleaved over reps; beside it the same prompts
//! one after another with B = 1, and the step bound from this machine's
//! ceilings measured in the same run.
//!
//! Step bound: a decode step of B sequences reads the spine once and the
//! union of the experts its rows route to, so it takes at least
//! `(spine + experts_per_step · expert_bytes) ÷ bandwidth`, with memory
//! bandwidth (triad) when experts are resident and the storage ceiling
//! (fathom's O_DIRECT reader on the expert spans) for the expert part when
//! they are streamed. Bound tok/s = B ÷ that time.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use fathom_engine::report::BatchReport;

use crate::ceiling::{
    Limits, expert_spans, measure_memory, measure_storage, open_model, triad_array_bytes,
};
use crate::stats::{Summary, summarize};

/// What to sweep.
pub struct BatchBenchConfig {
    pub exe: PathBuf,
    pub model: PathBuf,
    /// JSON lines as `fathom batch --prompts` reads them.
    pub prompt_lines: Vec<String>,
    pub sizes: Vec<usize>,
    pub max_new: usize,
    pub reps: usize,
    /// Extra flags for every `fathom batch` (memory mode, spine, …).
    pub flags: Vec<String>,
    pub limits: Limits,
    pub work_dir: PathBuf,
}

/// One batch size's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BatchRow {
    /// `B`, or 0 for "the first B_max prompts one after another".
    pub size: usize,
    pub aggregate_tok_s: Summary,
    pub per_seq_decode_tok_s: Summary,
    pub mean_batch_size: f64,
    pub experts_per_step: f64,
    pub bound_tok_s: f64,
    pub achieved_over_bound: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct BatchBenchReport {
    pub streamed: bool,
    pub memory_bytes_s: f64,
    pub storage_bytes_s: Option<f64>,
    pub rows: Vec<BatchRow>,
    /// Aggregate of B = 8 ÷ aggregate of B = 1 (medians), where both ran.
    pub b8_over_b1: Option<f64>,
    /// Aggregate of B = 8 ÷ the same 8 prompts one after another.
    pub b8_over_sequential: Option<f64>,
}

fn run_batch(cfg: &BatchBenchConfig, lines: &[String], tag: &str) -> Result<BatchReport> {
    let file = cfg.work_dir.join(format!("batch-{tag}.jsonl"));
    std::fs::write(&file, lines.join("\n"))?;
    let out = Command::new(&cfg.exe)
        .arg("batch")
        .arg("--model")
        .arg(&cfg.model)
        .arg("--prompts")
        .arg(&file)
        .args([
            "--max-new",
            &cfg.max_new.to_string(),
            "--ignore-eos",
            "--json",
        ])
        .args(&cfg.flags)
        .output()
        .context("running fathom batch")?;
    if !out.status.success() {
        bail!(
            "fathom batch failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("reading fathom batch --json")
}

fn lines_for(cfg: &BatchBenchConfig, b: usize) -> Vec<String> {
    (0..b)
        .map(|i| cfg.prompt_lines[i % cfg.prompt_lines.len()].clone())
        .collect()
}

/// One sample: (aggregate tok/s, mean per-sequence decode tok/s, report).
fn sample(cfg: &BatchBenchConfig, b: usize) -> Result<(f64, f64, BatchReport)> {
    if b > 0 {
        let r = run_batch(cfg, &lines_for(cfg, b), &b.to_string())?;
        let per = r.results.iter().map(|x| x.stats.decode_tok_s).sum::<f64>() / b as f64;
        return Ok((r.stats.aggregate_tok_s, per, r));
    }
    // The largest batch's prompts, one process each, one after another.
    let n = *cfg.sizes.iter().max().unwrap_or(&1);
    let (mut tokens, mut wall, mut per, mut last) = (0usize, 0.0, 0.0, None);
    for l in lines_for(cfg, n) {
        let r = run_batch(cfg, &[l], "seq")?;
        tokens += r.stats.generated_tokens;
        wall += r.stats.wall_s;
        per += r.results[0].stats.decode_tok_s;
        last = Some(r);
    }
    Ok((
        tokens as f64 / wall.max(1e-9),
        per / n as f64,
        last.expect("n ≥ 1"),
    ))
}

/// Runs the sweep; `log` gets progress lines.
pub fn run_batch_bench(
    cfg: &BatchBenchConfig,
    mut log: impl FnMut(String),
) -> Result<BatchBenchReport> {
    let streamed = cfg.flags.iter().any(|f| f == "stream");
    log("measuring the memory ceiling (triad)".into());
    let mem = measure_memory(triad_array_bytes(), cfg.limits.seconds);
    let storage = if streamed {
        log("measuring the storage ceiling (O_DIRECT expert spans)".into());
        let (_, ck) = open_model(&cfg.model)?;
        let spans = expert_spans(&cfg.model, &ck)?;
        Some(measure_storage(&ck, &spans, cfg.limits)?.bytes_per_s)
    } else {
        None
    };
    let mut sizes = cfg.sizes.clone();
    sizes.push(0);
    let mut samples: Vec<Vec<(f64, f64, BatchReport)>> = vec![Vec::new(); sizes.len()];
    for rep in 0..cfg.reps.max(1) {
        for (i, &b) in sizes.iter().enumerate() {
            log(format!(
                "rep {rep}: B = {}",
                if b == 0 {
                    "sequential".into()
                } else {
                    b.to_string()
                }
            ));
            samples[i].push(sample(cfg, b)?);
        }
    }
    let rows: Vec<BatchRow> = sizes
        .iter()
        .zip(&samples)
        .map(|(&b, s)| row(b, s, mem.bytes_per_s, storage))
        .collect();
    let med = |b: usize| {
        rows.iter()
            .find(|r| r.size == b)
            .map(|r| r.aggregate_tok_s.median)
    };
    let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(x, y)| x / y.max(1e-9));
    Ok(BatchBenchReport {
        streamed,
        memory_bytes_s: mem.bytes_per_s,
        storage_bytes_s: storage,
        b8_over_b1: ratio(med(8), med(1)),
        b8_over_sequential: ratio(med(8), med(0)),
        rows,
    })
}

fn row(b: usize, s: &[(f64, f64, BatchReport)], mem_bw: f64, storage_bw: Option<f64>) -> BatchRow {
    let agg: Vec<f64> = s.iter().map(|x| x.0).collect();
    let per: Vec<f64> = s.iter().map(|x| x.1).collect();
    let st = &s[0].2.stats;
    let eps = s.iter().map(|x| x.2.stats.experts_per_step).sum::<f64>() / s.len() as f64;
    let expert_step = eps * st.expert_bytes as f64;
    let step_s = st.spine_bytes as f64 / mem_bw + expert_step / storage_bw.unwrap_or(mem_bw);
    let seqs = if b == 0 { 1.0 } else { b as f64 };
    let bound = seqs / step_s.max(1e-12);
    let empty = Summary {
        min: 0.0,
        median: 0.0,
        max: 0.0,
        n: 0,
    };
    let aggregate = summarize(&agg).unwrap_or(empty.clone());
    BatchRow {
        size: b,
        achieved_over_bound: aggregate.median / bound,
        aggregate_tok_s: aggregate,
        per_seq_decode_tok_s: summarize(&per).unwrap_or(empty),
        mean_batch_size: st.mean_batch_size,
        experts_per_step: eps,
        bound_tok_s: bound,
    }
}

/// The sweep as a table.
pub fn render_batch_table(r: &BatchBenchReport) -> String {
    let mut s = format!(
        "experts {}; memory {:.1} GB/s{}\n| B | aggregate tok/s median [min–max] | per-seq decode tok/s | experts/step | step bound tok/s | achieved ÷ bound |\n|---|---|---|---|---|---|\n",
        if r.streamed { "streamed" } else { "resident" },
        r.memory_bytes_s / 1e9,
        r.storage_bytes_s
            .map_or(String::new(), |b| format!(", storage {:.2} GB/s", b / 1e9))
    );
    for row in &r.rows {
        let a = &row.aggregate_tok_s;
        let name = if row.size == 0 {
            "seq".to_string()
        } else {
            row.size.to_string()
        };
        s += &format!(
            "| {name} | {:.1} [{:.1}–{:.1}] | {:.1} | {:.0} | {:.1} | {:.2} |\n",
            a.median,
            a.min,
            a.max,
            row.per_seq_decode_tok_s.median,
            row.experts_per_step,
            row.bound_tok_s,
            row.achieved_over_bound
        );
    }
    if let Some(x) = r.b8_over_b1 {
        s += &format!("B=8 aggregate ÷ B=1: {x:.2}\n");
    }
    if let Some(x) = r.b8_over_sequential {
        s += &format!("B=8 aggregate ÷ the same 8 prompts one after another: {x:.2}\n");
    }
    s
}

/// Reads a prompts file for the sweep (non-empty lines).
pub fn read_prompt_lines(path: &Path) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let lines: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    if lines.is_empty() {
        bail!("{} holds no prompts", path.display());
    }
    Ok(lines)
}
