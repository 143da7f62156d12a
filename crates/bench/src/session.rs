//! One bench run: ceilings first, then every arm in fresh processes,
//! interleaved rep-major (rep 0 of every arm, then rep 1, …) so a drift of
//! the machine — another job starting, the disk warming — lands on all arms
//! alike instead of on whichever ran last.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};

use crate::arm::{Arm, ArmKind, PeerVars, Prompt, substitute};
use crate::ceiling::{self, Limits};
use crate::cgroup;
use crate::peer::parse_peer_output;
use crate::report::{Ceilings, Config, Report, summarize_arms};
use crate::runner::{Finished, Launch, launch};
use crate::sample::{Sample, fathom_metrics, parse_run_json, peer_metrics};

/// Everything a bench run needs, resolved by the command line.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// The fathom binary that runs the fathom arms (`run --json …`).
    pub exe: PathBuf,
    pub model: PathBuf,
    pub prompts: Vec<Prompt>,
    pub max_new: usize,
    pub reps: usize,
    pub warmup: usize,
    pub arms: Vec<Arm>,
    pub expect_ids: Option<Vec<u32>>,
    pub memory_cap: Option<u64>,
    pub limits: Limits,
    pub timeout: Duration,
    /// Threads a peer is told to use (`{threads}`).
    pub threads: usize,
    /// The command line, for the report.
    pub argv: Vec<String>,
    pub version: String,
}

impl BenchConfig {
    fn validate(&self) -> Result<()> {
        if self.reps == 0 {
            bail!("--reps must be at least 1");
        }
        if self.max_new == 0 {
            bail!("--max-new must be at least 1 (decode speed needs generated tokens)");
        }
        if self.expect_ids.is_some() && self.prompts.len() > 1 {
            bail!(
                "--expect-ids applies to a single prompt; with --prompts the first arm's outputs are the reference"
            );
        }
        if !self.arms.iter().any(|a| !a.is_peer()) {
            bail!("no fathom arm to measure");
        }
        if let Some(cap) = self.memory_cap
            && cap < 16 << 20
        {
            bail!("--memory-cap {cap} bytes is too small to start a process (at least 16 MiB)");
        }
        crate::arm::check_unique(&self.arms)
    }
}

/// Runs the bench; `progress` gets one line per step (for stderr).
pub fn run_bench(cfg: &BenchConfig, mut progress: impl FnMut(&str)) -> Result<Report> {
    cfg.validate()?;
    crate::load_check(&cfg.model)?;
    let machine = crate::machine::describe(&cfg.model);
    let started = crate::machine::utc_now();
    let cap_parent = match cfg.memory_cap {
        Some(_) => Some(cgroup::own()?),
        None => None,
    };
    let ceilings = measure_ceilings(cfg, &mut progress)?;

    let mut samples = Vec::new();
    let total = cfg.warmup + cfg.reps;
    for rep in 0..total {
        let warm = rep < cfg.warmup;
        for (pi, prompt) in cfg.prompts.iter().enumerate() {
            for arm in &cfg.arms {
                let s = run_one(cfg, arm, prompt, pi, rep, warm, cap_parent.as_ref())?;
                progress(&progress_line(&s, rep, total, warm));
                samples.push(s);
            }
        }
    }
    let arms = summarize_arms(cfg, &samples, &ceilings);
    Ok(Report {
        schema: "fathom-bench/1",
        date_utc: started,
        fathom: crate::report::FathomInfo {
            version: cfg.version.clone(),
            exe: cfg.exe.display().to_string(),
            argv: cfg.argv.clone(),
        },
        machine,
        config: Config::from(cfg),
        ceilings,
        arms,
        samples,
    })
}

fn measure_ceilings(cfg: &BenchConfig, progress: &mut impl FnMut(&str)) -> Result<Ceilings> {
    let (facts, ck) = ceiling::open_model(&cfg.model)?;
    let spans = ceiling::expert_spans(&cfg.model, &ck)?;
    progress(&format!(
        "ceiling: reading random expert spans with {} threads (≤ {:.1} GB or {:.1} s)",
        cfg.limits.io_threads,
        cfg.limits.storage_bytes as f64 / 1e9,
        cfg.limits.seconds
    ));
    let storage = ceiling::measure_storage(&ck, &spans, cfg.limits)?;
    progress("ceiling: memory triad");
    let memory = ceiling::measure_memory(ceiling::triad_array_bytes(), cfg.limits.seconds.min(2.0));
    Ok(Ceilings {
        storage,
        memory,
        spine_bytes_per_token: ceiling::spine_bytes_per_token(&facts, false),
        spine_bytes_per_token_int8: ceiling::spine_bytes_per_token(&facts, true),
        expert_bytes: facts.expert_bytes,
    })
}

fn run_one(
    cfg: &BenchConfig,
    arm: &Arm,
    prompt: &Prompt,
    pi: usize,
    rep: usize,
    warmup: bool,
    cap_parent: Option<&cgroup::Place>,
) -> Result<Sample> {
    let cap = cap_parent.zip(cfg.memory_cap);
    let (program, args) = match &arm.kind {
        ArmKind::Fathom { flags } => {
            let mut a: Vec<String> = vec![
                "run".into(),
                "--model".into(),
                cfg.model.display().to_string(),
            ];
            a.extend(prompt.run_flags());
            a.extend(["--max-new".into(), cfg.max_new.to_string(), "--json".into()]);
            a.extend(flags.iter().cloned());
            (cfg.exe.clone(), a)
        }
        ArmKind::Peer { template } => {
            let model = cfg.model.display().to_string();
            let vars = PeerVars {
                prompt,
                max_new: cfg.max_new,
                model: &model,
                threads: cfg.threads,
            };
            let mut argv = substitute(template, &vars)
                .map_err(|e| anyhow::anyhow!("--peer {}: {e}", arm.name))?;
            let program = PathBuf::from(argv.remove(0));
            (program, argv)
        }
    };
    let mut s = Sample {
        arm: arm.name.clone(),
        rep,
        warmup,
        prompt: pi,
        ok: false,
        error: None,
        output_ids: None,
        wall_s: 0.0,
        exit_code: None,
        cgroup_peak_bytes: None,
        oom_kills: None,
        raw: serde_json::Value::Null,
        metrics: [None; 11],
    };
    // `fathom --threads N bench` reaches the arms through the environment (an
    // arm's own --threads flag still wins); peers get {threads} instead.
    let env = match arm.kind {
        ArmKind::Fathom { .. } => vec![("FATHOM_THREADS".to_string(), cfg.threads.to_string())],
        ArmKind::Peer { .. } => vec![],
    };
    // Every rep starts cold: the model's files (and a peer's file
    // arguments) leave the page cache first.
    let mut files = crate::evict::files_of(&cfg.model);
    if matches!(arm.kind, ArmKind::Peer { .. }) {
        files.extend(crate::evict::files_in_args(&args));
    }
    crate::evict::evict(&files);
    let launched = launch(&Launch {
        program,
        args,
        env,
        cap,
        timeout: cfg.timeout,
    });
    let f: Finished = match launched {
        Ok(f) => f,
        // A cgroup that cannot be made fails the whole run: every arm would fail alike.
        Err(e) if cap.is_some() && e.to_string().contains("--memory-cap") => return Err(e),
        Err(e) => {
            s.error = Some(format!("{e:#}"));
            return Ok(s);
        }
    };
    s.wall_s = f.wall_s;
    s.exit_code = f.code;
    s.cgroup_peak_bytes = f.cgroup.and_then(|c| c.peak_bytes);
    s.oom_kills = f.cgroup.and_then(|c| c.oom_kills);
    if !f.success() {
        s.error = Some(f.failure());
        return Ok(s);
    }
    match &arm.kind {
        ArmKind::Fathom { .. } => match parse_run_json(&f.stdout) {
            Ok((ids, stats)) => {
                s.metrics = fathom_metrics(&stats, s.cgroup_peak_bytes);
                s.output_ids = Some(ids);
                s.raw = stats;
                s.ok = true;
            }
            Err(e) => s.error = Some(e),
        },
        ArmKind::Peer { .. } => match parse_peer_output(&f.stdout, &f.stderr) {
            Ok(r) => {
                s.metrics = peer_metrics(&r, s.cgroup_peak_bytes);
                s.raw = serde_json::to_value(&r).unwrap_or_default();
                s.ok = true;
            }
            Err(e) => s.error = Some(format!("{e:#}")),
        },
    }
    Ok(s)
}

fn progress_line(s: &Sample, rep: usize, total: usize, warm: bool) -> String {
    let tag = if warm { " warmup" } else { "" };
    let what = if s.ok {
        let d = s.metrics[crate::sample::Metric::DecodeTokS as usize];
        format!(
            "decode {}",
            d.map_or("n/a".into(), |d| format!("{d:.2} tok/s"))
        )
    } else {
        format!("FAILED: {}", s.error.as_deref().unwrap_or("?"))
    };
    format!(
        "[rep {}/{}{tag}] prompt {} arm {}: {what} ({:.2} s)",
        rep + 1,
        total,
        s.prompt,
        s.arm,
        s.wall_s
    )
}
