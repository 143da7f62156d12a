//! Drafting's choices: where drafts come from, what a draft model takes of
//! the RAM budget, and the drafter for a loaded target.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use fathom_engine::{Drafter, ModelDrafter, MtpDrafter, NgramDrafter};
use fathom_model::{CausalLm, LoadOptions};

/// Where drafts come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftChoice {
    Off,
    Ngram,
    Model(PathBuf),
    /// The checkpoint's own multi-token-prediction layer.
    Mtp,
}

pub fn parse_draft(s: &str) -> Result<DraftChoice> {
    Ok(match s {
        "off" | "none" => DraftChoice::Off,
        "ngram" => DraftChoice::Ngram,
        "mtp" => DraftChoice::Mtp,
        _ => match s.strip_prefix("model:") {
            Some(dir) if !dir.is_empty() => DraftChoice::Model(PathBuf::from(dir)),
            _ => bail!("--draft {s:?}: expected ngram, mtp, model:DIR or off"),
        },
    })
}

/// RAM a draft model takes (it is loaded whole): its shard bytes; for
/// `mtp`, the prediction layer's spine (its experts share the target's
/// expert cache). The target model's budget is reduced by it, so both fit
/// the one budget. `target` is the target's configuration.
pub fn draft_bytes(choice: &DraftChoice, target: &fathom_model::ModelConfig) -> Result<u64> {
    let model = target.dir();
    match choice {
        DraftChoice::Off | DraftChoice::Ngram => Ok(0),
        DraftChoice::Mtp => {
            let facts = target
                .memory_facts()
                .with_context(|| format!("cannot read the model config in {}", model.display()))?;
            if facts.mtp_bytes == 0 {
                bail!(
                    "--draft mtp: the {} model in {} has no multi-token-prediction layer fathom \
                     reads (config.json: num_nextn_predict_layers; the DeepSeek-V3 and R1 \
                     releases ship one): use --draft ngram or --draft model:DIR",
                    facts.family,
                    model.display()
                );
            }
            Ok(facts.mtp_bytes)
        }
        DraftChoice::Model(dir) => {
            crate::dir::check_model_dir(dir).context("--draft model:DIR")?;
            let ck = fathom_weights::Checkpoint::open(dir)
                .with_context(|| format!("cannot open the draft model in {}", dir.display()))?;
            Ok(ck.data_bytes())
        }
    }
}

/// The drafter `choice` names, for the target `model`.
pub fn make_drafter(
    choice: &DraftChoice,
    model: &Arc<dyn CausalLm>,
) -> Result<Option<Box<dyn Drafter>>> {
    let vocab = model.info().vocab_size;
    Ok(match choice {
        DraftChoice::Off => None,
        DraftChoice::Ngram => Some(Box::new(NgramDrafter::default())),
        DraftChoice::Mtp => Some(Box::new(MtpDrafter::new(model.clone())?)),
        DraftChoice::Model(dir) => {
            let dm = fathom_model::load(dir, LoadOptions::default())
                .with_context(|| format!("cannot load the draft model in {}", dir.display()))?;
            Some(Box::new(ModelDrafter::new(dm, vocab)?))
        }
    })
}
