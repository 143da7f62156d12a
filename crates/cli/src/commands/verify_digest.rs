//! `fathom verify --digest`: SHA-256 of every file, compared with a
//! manifest. Symlinks are followed (the Hugging Face cache keeps shards as
//! links to `blobs/<sha256>`). A file with nothing to compare with is
//! reported `unverified`, never `ok`; a mismatch is an error.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use super::synth::byte_bar;

const MANIFEST: &str = "SHA256SUMS";

/// `sha256  name` lines (sha256sum's format; `*name` for binary mode too).
fn parse_manifest(text: &str, path: &Path) -> Result<HashMap<String, String>> {
    let mut m = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let (sum, name) = line
            .split_once(char::is_whitespace)
            .with_context(|| format!("{}:{}: expected `sha256  file`", path.display(), i + 1))?;
        let sum = sum.to_ascii_lowercase();
        if sum.len() != 64 || !sum.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!("{}:{}: {sum:?} is not a SHA-256", path.display(), i + 1);
        }
        let name = name
            .trim_start()
            .trim_start_matches('*')
            .trim_start_matches("./");
        m.insert(name.to_string(), sum);
    }
    Ok(m)
}

/// The digest a Hugging Face cache link names (`…/blobs/<64 hex>`).
fn blob_digest(path: &Path) -> Option<String> {
    let target = std::fs::read_link(path).ok()?;
    let name = target.file_name()?.to_str()?;
    (name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| name.to_ascii_lowercase())
}

fn sha256(path: &Path, bar: &crate::progress::ByteProgress) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("{}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 8 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("{}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bar.inc(n as u64);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Hashes every file, prints `digest  name  verdict` lines, returns how
/// many were verified and how many had nothing to compare with; a mismatch
/// is an error naming the files.
pub fn verify(dir: &Path, manifest: Option<&Path>) -> Result<(usize, usize)> {
    let mut files: Vec<(PathBuf, u64)> = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name == MANIFEST {
            continue;
        }
        // metadata() follows links: a link to a regular file counts.
        let meta =
            std::fs::metadata(e.path()).with_context(|| format!("{}", e.path().display()))?;
        if meta.is_file() {
            files.push((e.path(), meta.len()));
        }
    }
    files.sort();
    let expected = match manifest {
        Some(p) => parse_manifest(
            &std::fs::read_to_string(p).with_context(|| format!("{}", p.display()))?,
            p,
        )?,
        None if dir.join(MANIFEST).is_file() => {
            let p = dir.join(MANIFEST);
            parse_manifest(&std::fs::read_to_string(&p)?, &p)?
        }
        None => HashMap::new(),
    };
    let bar = byte_bar(files.iter().map(|f| f.1).sum(), "sha256");
    let sums: Vec<Result<String>> = files.par_iter().map(|(p, _)| sha256(p, &bar)).collect();
    bar.finish_and_clear();
    let (mut ok, mut unverified, mut bad) = (0, 0, Vec::new());
    for ((path, _), sum) in files.iter().zip(sums) {
        let sum = sum?;
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let want = expected.get(&name).cloned().or_else(|| blob_digest(path));
        let verdict = match want {
            Some(w) if w == sum => {
                ok += 1;
                "ok"
            }
            Some(_) => {
                bad.push(name.clone());
                "MISMATCH"
            }
            None => {
                unverified += 1;
                "unverified"
            }
        };
        println!("{sum}  {name}  {verdict}");
    }
    if !bad.is_empty() {
        bail!(
            "SHA-256 mismatch (the file changed since the manifest was made): {}",
            bad.join(", ")
        );
    }
    Ok((ok, unverified))
}
