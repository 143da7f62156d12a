//! [`HfTokenizer`]: a Hugging Face `tokenizer.json`, run by the `tokenizers` crate.
//!
//! Other model families (DeepSeek V3, Kimi K2/Linear, Qwen3, gpt-oss) ship their
//! tokenizer this way. Two instances of the same tokenizer are kept because the
//! `tokenizers` crate makes special-token recognition an instance setting
//! (`set_encode_special_tokens`), and we need both behaviours behind `&self`.
//!
//! `token_bytes` needs the raw bytes of a token, which `tokenizer.json` stores through
//! the GPT-2 byte-to-unicode alphabet when the decoder is `ByteLevel`; that alphabet is
//! inverted once at load into a per-id byte table.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use crate::{Tokenizer, TokenizerError};

/// A `tokenizer.json` tokenizer.
pub struct HfTokenizer {
    /// Recognises special tokens (trusted text).
    trusted: tokenizers::Tokenizer,
    /// Treats special-token spellings as plain text (untrusted text).
    untrusted: tokenizers::Tokenizer,
    id_bytes: Vec<Option<Vec<u8>>>,
    /// Added tokens marked `special`, by spelling.
    specials: HashMap<String, u32>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.id_bytes.len())
            .finish()
    }
}

impl HfTokenizer {
    /// Loads `tokenizer.json` from `path`.
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let hf_err = |message: String| TokenizerError::HfTokenizer {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| hf_err(e.to_string()))?;
        let trusted: tokenizers::Tokenizer = text.parse().map_err(|e| hf_err(format!("{e}")))?;
        let mut untrusted = trusted.clone();
        untrusted.set_encode_special_tokens(true);
        let id_bytes = build_id_bytes(&trusted, uses_byte_level(&json));
        let specials = trusted
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (t.content, id))
            .collect();
        Ok(Self {
            trusted,
            untrusted,
            id_bytes,
            specials,
        })
    }
}

/// True if the decoder is `ByteLevel`, alone or inside a `Sequence`.
fn uses_byte_level(json: &Value) -> bool {
    fn is_bl(d: &Value) -> bool {
        match d.get("type").and_then(Value::as_str) {
            Some("ByteLevel") => true,
            Some("Sequence") => d
                .get("decoders")
                .and_then(Value::as_array)
                .is_some_and(|ds| ds.iter().any(is_bl)),
            _ => false,
        }
    }
    json.get("decoder").is_some_and(is_bl)
}

/// GPT-2's byte-to-unicode table, inverted: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes are shifted to U+0100.. in byte order.
fn byte_level_decoder() -> HashMap<char, u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut map = HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or('\u{FFFD}')
        };
        map.insert(c, b);
    }
    map
}

fn build_id_bytes(tok: &tokenizers::Tokenizer, byte_level: bool) -> Vec<Option<Vec<u8>>> {
    let added = tok.get_added_tokens_decoder();
    let vocab = tok
        .get_vocab_size(true)
        .max(added.keys().map(|&id| id as usize + 1).max().unwrap_or(0));
    let inverse = byte_level_decoder();
    (0..vocab as u32)
        .map(|id| {
            if let Some(t) = added.get(&id) {
                return Some(t.content.as_bytes().to_vec());
            }
            let piece = tok.id_to_token(id)?;
            if byte_level
                && let Some(bytes) = piece.chars().map(|c| inverse.get(&c).copied()).collect()
            {
                return Some(bytes);
            }
            // Non-byte-level models: let the model's own decoder spell the token.
            tok.decode(&[id], false).ok().map(String::into_bytes)
        })
        .collect()
}

fn ids_of(tok: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
    // Encoding fails only on internal errors (e.g. a pathological regex); an empty
    // result is the panic-free answer and is visible to callers as "no tokens".
    tok.encode_fast(text, false)
        .map(|e| e.get_ids().to_vec())
        .unwrap_or_default()
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Vec<u32> {
        ids_of(&self.untrusted, text)
    }

    fn encode_trusted(&self, text: &str) -> Vec<u32> {
        ids_of(&self.trusted, text)
    }

    fn decode(&self, ids: &[u32]) -> String {
        match self.trusted.decode(ids, false) {
            Ok(s) => s,
            // Unknown ids make the crate fail; fall back to our byte table.
            Err(_) => {
                let mut bytes = Vec::new();
                for &id in ids {
                    match self.token_bytes(id) {
                        Some(b) => bytes.extend_from_slice(&b),
                        None => bytes.push(0xFF),
                    }
                }
                String::from_utf8_lossy(&bytes).into_owned()
            }
        }
    }

    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.id_bytes.get(id as usize)?.clone()
    }

    fn special_id(&self, name: &str) -> Option<u32> {
        self.specials.get(name).copied()
    }

    fn is_special(&self, id: u32) -> bool {
        self.specials.values().any(|&v| v == id)
    }

    fn vocab_size(&self) -> usize {
        self.id_bytes.len()
    }
}
