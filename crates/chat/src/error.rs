//! Errors from chat rendering.

use std::path::PathBuf;

/// Why a conversation or template could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// A message has a role the renderer does not know.
    #[error("message {index}: unknown role {role:?}")]
    UnknownRole { index: usize, role: String },
    /// Image (or other non-text) content: this engine is text-only.
    #[error("message {index}: content part of type {kind:?} is not supported (text-only engine)")]
    UnsupportedContent { index: usize, kind: String },
    /// A tool result whose tool name cannot be found.
    #[error(
        "message {index}: tool result has no tool name (set `name`, `tool`, or a matching `tool_call_id`)"
    )]
    UnnamedToolResult { index: usize },
    /// Tool-call arguments that are neither an object nor a string.
    #[error("message {index}: tool call {call}: arguments must be a JSON object or a string")]
    BadToolArguments { index: usize, call: usize },
    /// An entry of the `tools` array that cannot be declared (no function name).
    #[error("tools[{index}]: {message}")]
    InvalidTool { index: usize, message: String },
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is malformed where the chat template lives.
    #[error("{path}: field `{field}`: {message}")]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },
    /// The Jinja template failed to compile or render (includes `raise_exception`).
    #[error("chat template: {0}")]
    Template(String),
}

impl From<minijinja::Error> for ChatError {
    fn from(e: minijinja::Error) -> Self {
        // `{:#}` includes the template name, line and the source excerpt.
        ChatError::Template(format!("{e:#}"))
    }
}
