//! Errors for loading and building tokenizers.
//!
//! Every variant names the file (and line or field where there is one) so a bad model
//! directory can be fixed from the message alone.

use std::path::PathBuf;

/// Why a tokenizer could not be loaded or built.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The file could not be read at all.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line of a `tiktoken.model` rank file is malformed or breaks an invariant.
    #[error("{path}:{line}: {message}")]
    RankFile {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// The rank table as a whole is unusable (e.g. a single byte is missing).
    #[error("rank table{}: {message}", display_origin(.origin))]
    Ranks {
        origin: Option<PathBuf>,
        message: String,
    },
    /// `tokenizer_config.json` is not valid JSON or a field has the wrong shape.
    #[error("{path}: field `{field}`: {message}")]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },
    /// The special-token list is inconsistent (duplicate, prefix of another, id clash).
    #[error("special tokens: {0}")]
    Specials(String),
    /// The pre-tokenizer pattern does not compile.
    #[error("pre-tokenizer pattern does not compile: {0}")]
    Pattern(String),
    /// The HF `tokenizers` crate rejected a `tokenizer.json`.
    #[error("{path}: {message}")]
    HfTokenizer { path: PathBuf, message: String },
}

fn display_origin(origin: &Option<PathBuf>) -> String {
    match origin {
        Some(p) => format!(" {}", p.display()),
        None => String::new(),
    }
}
