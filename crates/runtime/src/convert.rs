//! `fathom convert --spine int8`: the int8 spine file
//! (`fathom_weights::int8_spine`), written once beside the checkpoint so
//! that `--spine int8` loads read each spine matrix's codes and scales
//! instead of reading the stored matrix and quantising it.
//!
//! The model is loaded with an int8 spine under `req` (its budget, so a
//! spine larger than RAM is streamed as a run streams it) while the
//! quantised matrices are recorded (`fathom_model::int8_record`), then one
//! one-token pass quantises every streamed layer. What is written is what
//! a load quantises, bit for bit, so a run reading the file gives the
//! output of one that quantises as it reads.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use fathom_model::{Logits, Spine};
use fathom_weights::Checkpoint;
use fathom_weights::int8_spine::{FILE_NAME, Int8Writer, source_digest};

use crate::load::{load_config, read_config};
use crate::options::LoadRequest;

/// What [`int8_spine`] wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Converted {
    pub path: PathBuf,
    /// Matrices in the file.
    pub matrices: usize,
    /// The file's size.
    pub bytes: u64,
    /// Those matrices' bytes as stored in the checkpoint.
    pub source_bytes: u64,
    /// The receipt's digest of the source matrices.
    pub source_digest: String,
    pub seconds: f64,
}

/// The head's codes are recorded from the whole head as a load quantises
/// it: a budget that would read the head in row blocks is refused, naming
/// the least that keeps it (a plan that does not fit at all is refused by
/// the load itself, naming its own least).
fn refuse_a_head_in_blocks(config: &fathom_model::ModelConfig, req: &LoadRequest) -> Result<()> {
    let plan = |r: &LoadRequest| crate::plan::plan(config, r, 1, Spine::Int8);
    let Ok(p) = plan(req) else { return Ok(()) };
    if !p.ledger.tiers.head_on_disk {
        return Ok(());
    }
    let keeps = |b: u64| {
        let r = LoadRequest {
            ram_budget: Some(b),
            ..req.clone()
        };
        plan(&r).is_ok_and(|p| !p.ledger.tiers.head_on_disk)
    };
    let least = crate::plan::least_budget(p.budget, keeps);
    if least == u64::MAX {
        bail!(
            "fathom convert quantises the head whole, but this load reads it in row blocks whatever the budget: leave out --spine-resident-layers"
        );
    }
    bail!(
        "fathom convert quantises the head whole, but a RAM budget of {} reads it in row blocks — give at least --ram-budget {}MB",
        fathom_weights::units::format_bytes(p.budget),
        least.div_ceil(1_000_000)
    )
}

/// Writes `dir`'s int8 spine file; an existing one is replaced only when
/// `force`.
pub fn int8_spine(dir: &Path, req: &LoadRequest, force: bool) -> Result<Converted> {
    let dest = dir.join(FILE_NAME);
    if dest.exists() && !force {
        bail!(
            "{} exists (every --spine int8 load reads it): give --force to write it again",
            dest.display()
        );
    }
    let config = read_config(dir)?;
    refuse_a_head_in_blocks(&config, req)?;
    let ck = Checkpoint::open(dir).with_context(|| format!("cannot open {}", dir.display()))?;
    if dest.exists() {
        std::fs::remove_file(&dest)
            .with_context(|| format!("cannot replace {}", dest.display()))?;
    }
    let t0 = Instant::now();
    let writer = Arc::new(Int8Writer::create(dir, &ck)?);
    let part = dir.join(format!("{FILE_NAME}.part"));
    let written = (|| -> Result<Converted> {
        let recording = fathom_model::int8_record::record(writer.clone())
            .context("another int8 conversion is running in this process")?;
        let loaded = load_config(config, req, 1, Spine::Int8)?;
        let mut state = loaded.model.new_state();
        loaded
            .model
            .forward(state.as_mut(), &[0], Logits::Last)
            .context("the pass that reads every layer failed")?;
        drop(recording);
        drop(state);
        drop(loaded);
        let sources = writer.sources();
        if sources.is_empty() {
            bail!(
                "a --spine int8 load of {} quantises no matrix",
                dir.display()
            );
        }
        let source_bytes = sources
            .iter()
            .filter_map(|s| ck.get(s))
            .map(|l| l.len)
            .sum();
        let digest = source_digest(&ck, sources.iter().map(String::as_str))?;
        let (path, bytes) = writer.finish(&digest)?;
        Ok(Converted {
            path,
            matrices: sources.len(),
            bytes,
            source_bytes,
            source_digest: digest,
            seconds: t0.elapsed().as_secs_f64(),
        })
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&part);
    }
    written
}
