//! The parts of a Kimi `tokenizer_config.json` the tokenizer needs.
//!
//! The file is read as an untyped `serde_json::Value` on purpose: real configs carry
//! integers wider than 64 bits (a huge `model_max_length`) and many fields we do not use,
//! so a typed struct would reject files that the reference implementation accepts.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use crate::TokenizerError;

/// What the tiktoken loader takes from `tokenizer_config.json`.
#[derive(Debug, Default, Clone)]
pub struct KimiConfig {
    /// `added_tokens_decoder[id].content`, keyed by id.
    pub added_tokens: HashMap<u32, String>,
    /// The pre-tokenizer pattern, if the config carries one (`pat_str`).
    pub pat_str: Option<String>,
}

/// Parses the config text. `path` is used for error messages only.
pub fn parse_kimi_config(text: &str, path: &Path) -> Result<KimiConfig, TokenizerError> {
    let err = |field: &str, message: String| TokenizerError::Config {
        path: path.to_path_buf(),
        field: field.to_string(),
        message,
    };
    let root: Value = serde_json::from_str(text).map_err(|e| err("<root>", e.to_string()))?;
    let Value::Object(root) = root else {
        return Err(err("<root>", "expected a JSON object".to_string()));
    };
    let mut config = KimiConfig::default();
    match root.get("pat_str") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => config.pat_str = Some(s.clone()),
        Some(other) => return Err(err("pat_str", format!("expected a string, found {other}"))),
    }
    match root.get("added_tokens_decoder") {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => {
            for (key, entry) in map {
                let field = format!("added_tokens_decoder.{key}");
                let id: u32 = key
                    .parse()
                    .map_err(|_| err(&field, "key is not a token id".to_string()))?;
                let content = match entry {
                    Value::Object(o) => o.get("content").and_then(Value::as_str),
                    _ => None,
                };
                let Some(content) = content else {
                    return Err(err(&field, "missing string `content`".to_string()));
                };
                config.added_tokens.insert(id, content.to_string());
            }
        }
        Some(other) => {
            return Err(err(
                "added_tokens_decoder",
                format!("expected an object, found {other}"),
            ));
        }
    }
    Ok(config)
}
