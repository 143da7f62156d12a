//! `fathom verify`: is this directory a complete, consistent checkpoint of
//! the family its `config.json` names?
//!
//! Checks, in order: `config.json` parses into a valid spec; every shard
//! header is valid (offsets inside the file, byte length = dtype × shape, no
//! overlaps, index and shards agree — `Checkpoint::open`); every tensor the
//! spec needs is present with the right shape and dtype and nothing else is
//! (the family's `check_tensors`). With `--digest`, also SHA-256 of every file.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::Args;
use fathom_weights::Checkpoint;
use fathom_weights::units::format_bytes;

use super::synth::byte_bar;

/// Check a model directory: config, shard headers, every tensor's name,
/// shape and dtype. Prints one summary line; exits non-zero on failure,
/// naming the file and tensor.
#[derive(Args)]
pub struct VerifyArgs {
    /// Model directory (config.json, index, shards).
    dir: PathBuf,
    /// Also compute the SHA-256 of every file, following symlinks (the
    /// Hugging Face cache layout), and compare with a manifest: `--digest-file`,
    /// else `SHA256SUMS` in the directory, else the blob names of a Hugging
    /// Face cache. With nothing to compare with, says `unverified`.
    #[arg(long)]
    digest: bool,
    /// A manifest of `sha256  file` lines (as sha256sum writes) to compare with.
    #[arg(long, value_name = "FILE", requires = "digest")]
    digest_file: Option<PathBuf>,
    /// Also read every tensor and refuse non-finite values and NaN scales.
    #[arg(long)]
    data: bool,
}

/// Most problems listed before the summary.
const SHOWN: usize = 20;

pub fn run(a: VerifyArgs) -> Result<()> {
    match check(&a.dir) {
        Ok((ck, n_tensors)) => {
            if a.data {
                let bar = byte_bar(ck.data_bytes(), "values");
                let problems = super::verify_data::check_values(&ck, &bar)?;
                bar.finish_and_clear();
                if !problems.is_empty() {
                    for p in problems.iter().take(SHOWN) {
                        eprintln!("{p}");
                    }
                    println!("FAILED: {}", problems[0]);
                    bail!(
                        "{} holds non-finite weights ({} tensors)",
                        a.dir.display(),
                        problems.len()
                    );
                }
            }
            let (verdict, digests) = if a.digest {
                match super::verify_digest::verify(&a.dir, a.digest_file.as_deref())? {
                    (n, 0) => ("ok", format!(", {n} files match the manifest")),
                    (n, u) => (
                        "unverified",
                        format!(
                            ", {n} files match a manifest, {u} have none to compare with (give --digest-file or a SHA256SUMS)"
                        ),
                    ),
                }
            } else {
                ("ok", String::new())
            };
            println!(
                "{verdict}: {} shard{}, {} tensors, {}{}{digests}",
                ck.shards().len(),
                if ck.shards().len() == 1 { "" } else { "s" },
                n_tensors,
                format_bytes(ck.shards().iter().map(|s| s.len).sum()),
                if a.data { ", every value finite" } else { "" }
            );
            Ok(())
        }
        Err((what, problems)) => {
            for p in problems.iter().take(SHOWN) {
                eprintln!("{p}");
            }
            let more = problems.len().saturating_sub(SHOWN);
            let tail = if more > 0 {
                format!(" (and {more} more)")
            } else {
                String::new()
            };
            println!("FAILED: {}{tail}", problems[0]);
            bail!("{} is not a valid {what}", a.dir.display())
        }
    }
}

/// The structural checks; on failure, what the directory was checked as
/// and every problem found, one line each.
fn check(dir: &Path) -> Result<(Checkpoint, usize), (String, Vec<String>)> {
    let model = || "model directory".to_string();
    if !dir.is_dir() {
        return Err((
            model(),
            vec![format!("{}: no such directory", dir.display())],
        ));
    }
    let config = fathom_model::ModelConfig::read(dir)
        .map_err(|e| (model(), vec![format!("{}: {e}", dir.display())]))?;
    let what = format!("{} checkpoint", config.family());
    let fail = |problems: Vec<String>| (what.clone(), problems);
    let ck = Checkpoint::open(dir).map_err(|e| fail(vec![e.to_string()]))?;
    let problems = config
        .check_tensors(&ck)
        .map_err(|e| fail(vec![format!("{}: {e}", dir.display())]))?;
    if !problems.is_empty() {
        return Err(fail(problems.iter().map(|p| with_file(&ck, p)).collect()));
    }
    let n = ck.tensors().count();
    Ok((ck, n))
}

/// Prefixes a `check_tensors` line with the shard holding its tensor.
fn with_file(ck: &Checkpoint, problem: &str) -> String {
    let name = problem
        .split_once("tensor ")
        .map(|(_, rest)| rest.split(':').next().unwrap_or(rest).trim());
    match name.and_then(|n| ck.get(n)) {
        Some(loc) => format!("{}: {problem}", ck.shards()[loc.shard].path.display()),
        None => format!("{}: {problem}", ck.dir().display()),
    }
}
