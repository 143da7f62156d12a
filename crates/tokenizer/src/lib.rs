//! Tokenizers for fathom.
//!
//! - [`TiktokenBpe`]: Kimi K3's tiktoken-style byte-level BPE (`tiktoken.model` +
//!   `tokenizer_config.json`), written here so that its merge loop, pre-splitting and
//!   special-token policy are ours to test; checked id-for-id against Python `tiktoken`.
//! - [`HfTokenizer`]: any Hugging Face `tokenizer.json`, through the `tokenizers` crate.
//! - [`StreamDecoder`]: incremental detokenisation that never splits a character.
//!
//! Both tokenizers sit behind [`Tokenizer`], whose central rule is the split between
//! untrusted text ([`Tokenizer::encode`]: a special's spelling is ordinary text) and
//! trusted template markup ([`Tokenizer::encode_trusted`]: specials are recognised).
//! Chat rendering encodes user content with the first and markup with the second, so a
//! user typing `<|open|>` cannot forge a message boundary.

mod bpe;
mod config;
mod error;
mod hash;
mod hf;
mod pretokenize;
mod ranks;
mod stream;
mod tiktoken;

use std::path::Path;

pub use config::{KimiConfig, parse_kimi_config};
pub use error::TokenizerError;
pub use hf::HfTokenizer;
pub use pretokenize::{KIMI_PATTERN, MAX_RUN_CHARS, MAX_SLICE_CHARS, python_isspace};
pub use ranks::parse_rank_file;
pub use stream::StreamDecoder;
pub use tiktoken::{NUM_RESERVED_SPECIALS, TiktokenBpe};

/// A text ↔ token-id mapping.
pub trait Tokenizer: Send + Sync {
    /// Encodes ordinary (untrusted) text: special-token spellings are plain text.
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Encodes trusted text (template markup): special-token spellings become specials.
    fn encode_trusted(&self, text: &str) -> Vec<u32>;
    /// Decodes ids to text; invalid UTF-8 (and unknown ids) become U+FFFD.
    fn decode(&self, ids: &[u32]) -> String;
    /// Raw bytes of one token (a special's spelling for specials); `None` if unknown.
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>>;
    /// The id of a special token, by spelling.
    fn special_id(&self, name: &str) -> Option<u32>;
    /// Whether `id` is a special token (markup, never plain text).
    fn is_special(&self, id: u32) -> bool;
    /// Size of the id space (ranks plus specials), i.e. the expected `lm_head` rows.
    fn vocab_size(&self) -> usize;
}

/// Loads whatever tokenizer a model directory ships: `tiktoken.model` (with
/// `tokenizer_config.json` if present) or else `tokenizer.json`. `Ok(None)` if neither
/// file exists.
pub fn load_from_dir(dir: &Path) -> Result<Option<Box<dyn Tokenizer>>, TokenizerError> {
    let rank_path = dir.join("tiktoken.model");
    if rank_path.is_file() {
        let config = dir.join("tokenizer_config.json");
        let config = config.is_file().then_some(config);
        let tok = TiktokenBpe::from_files(&rank_path, config.as_deref())?;
        return Ok(Some(Box::new(tok)));
    }
    let json_path = dir.join("tokenizer.json");
    if json_path.is_file() {
        return Ok(Some(Box::new(HfTokenizer::from_file(&json_path)?)));
    }
    Ok(None)
}
