//! `fathom pull`: download a model from the Hugging Face Hub into the
//! Hub cache other tools share (or a directory of its own), resumably,
//! every file checked against the Hub's digest before it is used.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::{Args, ValueEnum};
use fathom_hub::{FileState, HubConfig, Include, Plan, Progress, PullOptions, RepoRef};
use fathom_weights::units::format_bytes;
use indicatif::{ProgressBar, ProgressStyle};

/// Download a model from the Hugging Face Hub: the revision's file list
/// with each LFS file's SHA-256, parallel downloads that resume where an
/// earlier run stopped, every file hashed against the Hub's digest before
/// it is kept. Files go to the Hub cache (`HF_HUB_CACHE`, else
/// `HF_HOME/hub`) in the layout other Hub clients read; `--model ORG/NAME`
/// then finds them. `HF_TOKEN` is sent to the Hub for gated or private
/// repositories; `HF_ENDPOINT` names another Hub.
#[derive(Args)]
pub struct PullArgs {
    /// The repository: ORG/NAME, or ORG/NAME@REVISION (a branch, tag or
    /// commit; default main).
    repo: String,
    /// Put the model in this directory instead of the Hub cache (its files
    /// as links into DIR/.fathom/blobs); load it with --model DIR.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Which files: `all`, or `spine`: everything but the shards that hold
    /// only routed experts (tensors named `….experts.….`), per the index's
    /// weight_map; other weight formats (.bin, .gguf, …) are left out.
    #[arg(long, value_enum, default_value_t = IncludeArg::All)]
    include: IncludeArg,
    /// Print the files, what is already here and the disk space needed;
    /// download nothing.
    #[arg(long)]
    dry_run: bool,
    /// Files downloaded at once.
    #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=fathom_hub::MAX_JOBS as u64))]
    jobs: usize,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum IncludeArg {
    All,
    Spine,
}

pub fn run(a: PullArgs) -> Result<()> {
    let repo = RepoRef::parse(&a.repo)?;
    let cfg = HubConfig::from_env();
    let opts = PullOptions {
        repo,
        include: match a.include {
            IncludeArg::All => Include::All,
            IncludeArg::Spine => Include::Spine,
        },
        dir: a.dir.clone(),
        jobs: a.jobs,
    };
    if a.dry_run {
        let plan = fathom_hub::plan(&cfg, &opts)?;
        print_plan(&plan);
        return Ok(());
    }
    let progress = Progress::default();
    let done = AtomicBool::new(false);
    let start = Instant::now();
    let pulled = std::thread::scope(|s| {
        s.spawn(|| show(&progress, &done, start));
        let r = fathom_hub::pull(&cfg, &opts, &progress, &|p| announce(p));
        done.store(true, Ordering::Relaxed);
        r
    })?;
    let secs = start.elapsed().as_secs_f64();
    let fetched = progress.fetched.load(Ordering::Relaxed);
    eprintln!(
        "pulled {}@{} ({} files, commit {}): {} downloaded in {secs:.1} s; load it with --model {}",
        opts.repo.id(),
        opts.repo.revision,
        pulled.files,
        pulled.commit,
        format_bytes(fetched),
        match &a.dir {
            Some(d) => d.display().to_string(),
            None => a.repo.clone(),
        }
    );
    println!("{}", pulled.snapshot.display());
    Ok(())
}

/// One line on stderr when a plan is made.
fn announce(p: &Plan) {
    let fetch = p.bytes_to_fetch();
    eprintln!(
        "pulling {}@{} (commit {}): {} files, {}; {} to download",
        p.repo.id(),
        p.repo.revision,
        p.listing.commit,
        p.files.len(),
        format_bytes(p.bytes_total()),
        format_bytes(fetch)
    );
    if let Some(free) = p.free_space()
        && free < fetch
    {
        eprintln!(
            "warning: {} free on the disk of {}, {} needed",
            format_bytes(free),
            p.layout.blobs.display(),
            format_bytes(fetch)
        );
    }
}

/// `--dry-run`: a line per file, then the totals.
fn print_plan(p: &Plan) {
    println!(
        "{}@{} (commit {}) into {}",
        p.repo.id(),
        p.repo.revision,
        p.listing.commit,
        p.layout.snapshot.display()
    );
    for f in &p.files {
        let state = match f.state {
            FileState::Have => "have".to_string(),
            FileState::Partial(n) => format!("resume at {}", format_bytes(n)),
            FileState::Missing => "get".to_string(),
        };
        let digest = match &f.file.sha256 {
            Some(s) => format!("sha256:{}", &s[..12]),
            None => "git".to_string(),
        };
        println!(
            "  {:<16} {:>10}  {:<19} {}",
            state,
            format_bytes(f.file.size),
            digest,
            f.file.path
        );
    }
    let need = p.bytes_to_fetch();
    let free = p.free_space().map_or("unknown".to_string(), format_bytes);
    println!(
        "{} files, {}; to download: {}; disk needed: {} (free: {free})",
        p.files.len(),
        format_bytes(p.bytes_total()),
        format_bytes(need),
        format_bytes(need)
    );
}

/// A bar on a terminal; elsewhere a plain line every 10 s.
fn show(p: &Progress, done: &AtomicBool, start: Instant) {
    let tty = std::io::stderr().is_terminal();
    let bar = if tty {
        let bar = ProgressBar::new(0);
        let style = ProgressStyle::with_template(
            "{msg} [{bar:32}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} ETA {eta}",
        )
        .expect("the template is valid")
        .progress_chars("=> ");
        bar.set_style(style);
        Some(bar)
    } else {
        None
    };
    let mut last_line = Instant::now();
    while !done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        let (d, t) = (
            p.done.load(Ordering::Relaxed),
            p.total.load(Ordering::Relaxed),
        );
        let files = format!(
            "{}/{} files",
            p.files_done.load(Ordering::Relaxed),
            p.files_total.load(Ordering::Relaxed)
        );
        if let Some(bar) = &bar {
            bar.set_length(t);
            bar.set_position(d);
            bar.set_message(files);
        } else if last_line.elapsed() >= Duration::from_secs(10) {
            last_line = Instant::now();
            eprintln!("{}", plain_line(p, start, &files));
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
}

/// `pull: 1.20 GB of 4.00 GB (30.0 %), 45.0 MB/s, ETA 62 s, 3/9 files`.
fn plain_line(p: &Progress, start: Instant, files: &str) -> String {
    let (d, t) = (
        p.done.load(Ordering::Relaxed),
        p.total.load(Ordering::Relaxed),
    );
    let secs = start.elapsed().as_secs_f64().max(1e-3);
    let rate = p.fetched.load(Ordering::Relaxed) as f64 / secs;
    let eta = if rate > 0.0 {
        format!("{:.0} s", t.saturating_sub(d) as f64 / rate)
    } else {
        "unknown".into()
    };
    format!(
        "pull: {} of {} ({:.1} %), {}/s, ETA {eta}, {files}",
        format_bytes(d),
        format_bytes(t),
        100.0 * d as f64 / t.max(1) as f64,
        format_bytes(rate as u64)
    )
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    /// `--model` as the model commands will take it once resolved by
    /// `fathom_hub::resolve_model` in clap's value parser.
    #[derive(Parser, Debug)]
    struct ModelArg {
        #[arg(long, value_parser = fathom_hub::resolve_model)]
        model: std::path::PathBuf,
    }

    #[test]
    fn resolve_model_fits_clap_value_parser() {
        let here = env!("CARGO_MANIFEST_DIR");
        let a = ModelArg::try_parse_from(["x", "--model", here]).unwrap();
        assert_eq!(a.model, std::path::Path::new(here));
        let e = ModelArg::try_parse_from(["x", "--model", "./no/such/dir"]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "error: invalid value './no/such/dir' for '--model <MODEL>': no such directory: ./no/such/dir\n\nFor more information, try '--help'.\n"
        );
    }
}
