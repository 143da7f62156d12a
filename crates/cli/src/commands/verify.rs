//! `fathom verify`: is this directory a complete, consistent K3 checkpoint?
//!
//! Checks, in order: `config.json` parses into a valid spec; every shard
//! header is valid (offsets inside the file, byte length = dtype × shape, no
//! overlaps, index and shards agree — `Checkpoint::open`); every tensor the
//! spec needs is present with the right shape and dtype and nothing else is
//! (`check_tensors`). With `--digest`, also SHA-256 of every file.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use clap::Args;
use fathom_model::kimi_k3::config::K3Spec;
use fathom_model::kimi_k3::weights::check_tensors;
use fathom_weights::Checkpoint;
use fathom_weights::units::format_bytes;
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use super::synth::byte_bar;

/// Check a model directory: config, shard headers, every tensor's name,
/// shape and dtype. Prints one summary line; exits non-zero on failure,
/// naming the file and tensor.
#[derive(Args)]
pub struct VerifyArgs {
    /// Model directory (config.json, index, shards).
    dir: PathBuf,
    /// Also compute the SHA-256 of every file (reads all bytes; prints
    /// `digest  file` lines like sha256sum).
    #[arg(long)]
    digest: bool,
}

/// Most problems listed before the summary.
const SHOWN: usize = 20;

pub fn run(a: VerifyArgs) -> Result<()> {
    match check(&a.dir) {
        Ok((ck, n_tensors)) => {
            if a.digest {
                digest(&a.dir)?;
            }
            println!(
                "ok: {} shard{}, {} tensors, {}",
                ck.shards().len(),
                if ck.shards().len() == 1 { "" } else { "s" },
                n_tensors,
                format_bytes(ck.shards().iter().map(|s| s.len).sum())
            );
            Ok(())
        }
        Err(problems) => {
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
            bail!("{} is not a valid K3 checkpoint", a.dir.display())
        }
    }
}

/// The structural checks; on failure, every problem found, one line each.
fn check(dir: &Path) -> Result<(Checkpoint, usize), Vec<String>> {
    if !dir.is_dir() {
        return Err(vec![format!("{}: no such directory", dir.display())]);
    }
    let spec = K3Spec::from_dir(dir).map_err(|e| vec![format!("{}: {e}", dir.display())])?;
    let ck = Checkpoint::open(dir).map_err(|e| vec![e.to_string()])?;
    let problems = check_tensors(&spec, &ck);
    if !problems.is_empty() {
        return Err(problems.iter().map(|p| with_file(&ck, p)).collect());
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

/// SHA-256 of every regular file in the directory, in name order.
fn digest(dir: &Path) -> Result<()> {
    let mut files: Vec<(PathBuf, u64)> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| Ok((e.path(), e.metadata()?.len())))
        .collect::<std::io::Result<_>>()?;
    files.sort();
    let bar = byte_bar(files.iter().map(|f| f.1).sum(), "sha256");
    let sums: Vec<Result<String>> = files
        .par_iter()
        .map(|(path, _)| {
            let mut f = File::open(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let mut h = Sha256::new();
            let mut buf = vec![0u8; 8 << 20];
            loop {
                let n = f
                    .read(&mut buf)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
                bar.inc(n as u64);
            }
            Ok(format!("{:x}", h.finalize()))
        })
        .collect();
    bar.finish_and_clear();
    for ((path, _), sum) in files.iter().zip(sums) {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        println!("{}  {name}", sum?);
    }
    Ok(())
}
