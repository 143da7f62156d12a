//! Pieces shared by the subcommands: loading a model directory, parsing
//! prompts, and the tokenizer a model ships.

use std::path::Path;

use anyhow::{Context, Result, bail};
use fathom_tokenizer::Tokenizer;

/// Parses `1,2,3` (spaces allowed).
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<u32>()
                .with_context(|| format!("--prompt-ids: {p:?} is not a token id"))
        })
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("empty prompt: give at least one token id");
    }
    Ok(ids)
}

/// The tokenizer shipped in the model directory, if any.
pub fn tokenizer(dir: &Path) -> Result<Option<Box<dyn Tokenizer>>> {
    fathom_tokenizer::load_from_dir(dir)
        .with_context(|| format!("cannot load the tokenizer in {}", dir.display()))
}

/// Resolves the prompt: explicit ids, or text through the model's tokenizer.
pub fn prompt_ids(
    ids: Option<&str>,
    text: Option<&str>,
    tok: Option<&dyn Tokenizer>,
    model_dir: &Path,
) -> Result<Vec<u32>> {
    match (ids, text) {
        (Some(ids), None) => parse_ids(ids),
        (None, Some(text)) => {
            let Some(tok) = tok else {
                bail!(
                    "{} ships no tokenizer (tiktoken.model or tokenizer.json): use --prompt-ids",
                    model_dir.display()
                );
            };
            let ids = tok.encode(text);
            if ids.is_empty() {
                bail!("empty prompt: the text encodes to no tokens");
            }
            Ok(ids)
        }
        _ => bail!("give exactly one of --prompt-ids and --prompt"),
    }
}

/// Rejects ids outside the model's vocabulary with a clear message.
pub fn check_vocab(ids: &[u32], vocab: usize) -> Result<()> {
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("token id {bad} is outside the model's vocabulary (0..{vocab})");
    }
    Ok(())
}

/// `--spine`: precision of the resident spine matrices.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default)]
pub enum SpineArg {
    /// As stored (bf16): exact.
    #[default]
    Bf16,
    /// Per-row int8, quantised at load: half the bytes, lossy.
    Int8,
}

impl SpineArg {
    /// The representation the RAM ledger counts and `apply_spine` produces.
    pub fn spine(self) -> fathom_model::Spine {
        match self {
            SpineArg::Bf16 => fathom_model::Spine::Bf16,
            SpineArg::Int8 => fathom_model::Spine::Int8,
        }
    }
}

/// Puts a loaded model's spine in the precision `arg` asks for, announcing
/// the choice on stderr (int8 is labelled lossy), and returns it.
pub fn apply_spine(model: &mut fathom_model::K3Model, arg: SpineArg) -> fathom_model::Spine {
    use fathom_model::Spine;
    let spine = arg.spine();
    if spine == Spine::Int8 {
        model.weights.quantize_spine_int8();
        eprintln!("spine: int8 (lossy: per-row int8 weights, quantised at load)");
    } else {
        eprintln!("spine: bf16 (exact, as stored)");
    }
    spine
}
