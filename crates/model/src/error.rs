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
    /// A NaN or infinity in a sequence's results (corrupt weights or input).
    #[error("non-finite values in the logits of {what}: the checkpoint or the input is corrupt")]
    NonFinite { what: String },
    /// A sequence state misused (from another model, restored to its future, …).
    #[error("sequence state: {0}")]
    State(String),
    /// The attention cache could not be written or read back.
    #[error("{0}")]
    Cache(String),
    /// A streamed spine layer could not be read for a pass (the message
    /// names the file and the tensor); the pass changed nothing.
    #[error("spine layer {layer}: {msg}")]
    Spine { layer: usize, msg: String },
    /// A block of a head read in row blocks could not be read (the message
    /// names the tensor, its rows and the file); the pass changed nothing.
    #[error("spine head: {0}")]
    SpineHead(String),
    /// Unknown `model_type`/`architectures`; the message lists what is supported.
    #[error("{0}")]
    Unsupported(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
