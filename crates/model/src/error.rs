//! Model-level errors.

use fathom_weights::WeightsError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// An unsupported or inconsistent `config.json`; `field` is the JSON path.
    #[error("config.json: {field}: {msg}")]
    Config { field: String, msg: String },
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("empty input: at least one token is needed")]
    EmptyInput,
    #[error("expert source: {0}")]
    Experts(String),
    /// A tensor whose shape or dtype does not fit its use; the message names it.
    #[error("tensor {0}")]
    Tensor(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
