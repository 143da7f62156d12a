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

/// `--max-new`: at least one token (0 would load the model to generate nothing).
pub fn parse_max_new(s: &str) -> std::result::Result<usize, String> {
    let n: usize = s
        .parse()
        .map_err(|_| format!("{s:?} is not a token count"))?;
    if n == 0 {
        return Err("0 generates nothing: give at least 1 (tokens to generate at most)".into());
    }
    Ok(n)
}

/// The tokenizer shipped in the model directory, if any. A GGUF file or a
/// Hugging Face cache root is refused with what to give instead.
pub fn tokenizer(dir: &Path) -> Result<Option<std::sync::Arc<dyn Tokenizer>>> {
    if let Some(why) = crate::load::not_a_model_dir(dir) {
        bail!("{why}");
    }
    Ok(fathom_tokenizer::load_from_dir(dir)
        .with_context(|| format!("cannot load the tokenizer in {}", dir.display()))?
        .map(std::sync::Arc::from))
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

/// Announces the spine precision on stderr (int8 is labelled lossy).
pub fn announce_spine(spine: fathom_model::Spine) {
    if spine.lossy() {
        eprintln!("spine: int8 (lossy: per-row int8 weights, quantised at load)");
    } else {
        eprintln!("spine: bf16 (exact, as stored)");
    }
}

/// Sampling and stopping, shared by `run` and `batch`.
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Sampling")]
pub struct SamplingArgs {
    /// Sampling temperature; 0 (the default) is greedy decoding.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass, in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one, in [0, 1].
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens already seen (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Subtract from the logits of tokens generated at least once, in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtract this times a token's count among generated tokens, in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Seed of the random draws; the draw for a position depends only on
    /// (seed, position), so batching and drafting never change output.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when the text contains this string (repeatable; cut from the output).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Report the N most likely tokens' log-probabilities at each position (≤ 20).
    #[arg(long)]
    pub logprobs: Option<usize>,
}

impl SamplingArgs {
    /// The validated parameters; a bad value names its flag.
    pub fn params(&self) -> Result<fathom_engine::SamplingParams> {
        let p = fathom_engine::SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            logprobs: self.logprobs,
        };
        p.validate()
            .map_err(|e| anyhow::anyhow!("--{}", e.to_string().replace('_', "-")))?;
        Ok(p)
    }
}

/// Whether `--prompt TEXT` gets a BOS token: the tokenizer config's
/// `add_bos_token` decides; when it does not say, a `bos_token_id` in
/// `config.json` means yes.
pub fn wants_bos(model_dir: &Path, bos: Option<u32>) -> Option<u32> {
    let said = std::fs::read_to_string(model_dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("add_bos_token").and_then(serde_json::Value::as_bool));
    match said {
        Some(false) => None,
        _ => bos,
    }
}

/// The tokenizer as the engine's text decoder.
pub fn decoder(tok: Option<&std::sync::Arc<dyn Tokenizer>>) -> Option<fathom_engine::Decoder> {
    let t = tok?.clone();
    Some(std::sync::Arc::new(move |ids: &[u32]| t.decode(ids)))
}
