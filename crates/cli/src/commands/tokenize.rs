//! `fathom tokenize`: text → token ids with the model's own tokenizer.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;

use crate::common::tokenizer;

/// Encode text with the tokenizer a model ships (tiktoken.model or tokenizer.json).
#[derive(Args)]
pub struct TokenizeArgs {
    /// Model directory, or ORG/NAME[@REV] pulled by `fathom pull`.
    #[arg(long, value_parser = fathom_hub::resolve_model)]
    model: PathBuf,
    /// Recognise special-token spellings (e.g. <|open|>) as specials; by default
    /// text is untrusted and specials are ordinary characters.
    #[arg(long)]
    trusted: bool,
    /// Print {"ids": [...]} instead of one id per line with its piece.
    #[arg(long)]
    json: bool,
    /// The text to encode.
    text: String,
}

pub fn run(a: TokenizeArgs) -> Result<()> {
    let Some(tok) = tokenizer(&a.model)? else {
        bail!(
            "{} ships no tokenizer (tiktoken.model or tokenizer.json)",
            a.model.display()
        );
    };
    let ids = if a.trusted {
        tok.encode_trusted(&a.text)
    } else {
        tok.encode(&a.text)
    };
    if a.json {
        println!("{}", serde_json::json!({ "ids": ids }));
    } else {
        for id in ids {
            let piece = tok.token_bytes(id).unwrap_or_default();
            println!("{id:>8}  {:?}", String::from_utf8_lossy(&piece));
        }
    }
    Ok(())
}
