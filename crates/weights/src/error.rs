//! Errors of checkpoint reading. Every variant names the file and, where there
//! is one, the tensor, so a user can find the broken piece.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// The reason is part of the message (not a separate source, so error
    /// chains do not print it twice).
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error(
        "{path}: not a model directory: neither model.safetensors.index.json nor model.safetensors exists"
    )]
    NoCheckpoint { path: PathBuf },
    #[error("{path}: invalid index: {msg}")]
    BadIndex { path: PathBuf, msg: String },
    #[error("{path}: invalid safetensors header: {msg}")]
    BadHeader { path: PathBuf, msg: String },
    #[error("{path}: tensor {tensor}: {msg}")]
    BadTensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    #[error("tensor {0} is not in the checkpoint")]
    Missing(String),
    #[error("checkpoint does not match the model: {0}")]
    Mismatch(String),
}

impl WeightsError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        WeightsError::Io {
            path: path.into(),
            err: source,
        }
    }
}

pub type Result<T, E = WeightsError> = std::result::Result<T, E>;
