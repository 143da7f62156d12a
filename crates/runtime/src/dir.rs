//! What a model directory is, checked before anything is read, and its
//! identity for heat files.

use std::path::Path;

use anyhow::{Result, bail};

/// Checks that `dir` looks like a model directory, and says what it is
/// instead when it is something else (a GGUF file, a Hugging Face cache
/// repository root).
pub fn check_model_dir(dir: &Path) -> Result<()> {
    if let Some(why) = not_a_model_dir(dir) {
        bail!("{why}");
    }
    if !dir.is_dir() {
        bail!("model directory {} does not exist", dir.display());
    }
    if !dir.join("config.json").is_file() {
        bail!(
            "{} is not a model directory: it has no config.json",
            dir.display()
        );
    }
    Ok(())
}

/// What `dir` is when it is recognisably not a model directory (a GGUF
/// file, a Hugging Face cache repository root, a folder of GGUF files).
pub fn not_a_model_dir(dir: &Path) -> Option<String> {
    if is_gguf(dir) {
        return Some(format!(
            "{} is a GGUF file: fathom reads safetensors checkpoints as Hugging Face ships them \
             (a directory with config.json and *.safetensors shards)",
            dir.display()
        ));
    }
    if dir.is_dir() && !dir.join("config.json").is_file() {
        let snaps = dir.join("snapshots");
        if snaps.is_dir() && dir.join("blobs").is_dir() {
            let revs: Vec<String> = std::fs::read_dir(&snaps)
                .map(|r| {
                    r.filter_map(|e| e.ok())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            return Some(format!(
                "{} is a Hugging Face cache repository, not a model directory: point --model at {}/<revision> ({})",
                dir.display(),
                snaps.display(),
                if revs.is_empty() {
                    "none downloaded yet".to_string()
                } else {
                    format!("found: {}", revs.join(", "))
                }
            ));
        }
        let gguf: Vec<String> = std::fs::read_dir(dir)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| is_gguf(p))
                    .map(|p| p.display().to_string())
                    .collect()
            })
            .unwrap_or_default();
        if !gguf.is_empty() {
            return Some(format!(
                "{} holds GGUF files ({}) and no config.json: fathom reads safetensors checkpoints as Hugging Face ships them",
                dir.display(),
                gguf.join(", ")
            ));
        }
    }
    None
}

/// A regular file starting with the GGUF magic.
fn is_gguf(p: &Path) -> bool {
    use std::io::Read;
    if !std::fs::metadata(p).is_ok_and(|m| m.is_file()) {
        return false;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}
