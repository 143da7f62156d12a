//! Errors of synthetic checkpoint writing. Each names the flag, file or
//! tensor involved, so the CLI can print it as one line.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// A bad flag value or combination; the message names the flag.
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} already holds a model ({found}); pass --force to replace it")]
    Exists { path: PathBuf, found: String },
    #[error(
        "{path}: not enough free disk space: the model needs {need} bytes, {free} are available"
    )]
    NoSpace { path: PathBuf, need: u64, free: u64 },
}

impl SynthError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        SynthError::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T, E = SynthError> = std::result::Result<T, E>;
