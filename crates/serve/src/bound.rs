//! A prompt's least token count from its text's length, so that a prompt
//! far longer than the context is refused before it is tokenized.
//!
//! The rule: when the tokenizer keeps every byte of its input (no
//! normalizer, and pre-tokenizers that only split or map bytes to longer
//! spellings), each token of ordinary text covers at most as many input
//! bytes as its own bytes, so a text of `n` bytes has at least
//! `ceil(n / L)` tokens, `L` the longest non-special token's length. A
//! tokenizer that may drop or shrink text (a normalizer, a whitespace
//! splitter that removes what it splits on) gets no bound: its prompts are
//! tokenized, within the bounded preparation pool.

use std::path::Path;

use fathom_chat::{ChatFormat, Content, Message};
use fathom_tokenizer::Tokenizer;
use serde_json::Value;

/// `L` for the tokenizer of the model in `dir`, or `None` when the rule does
/// not hold for it.
pub fn max_token_bytes(dir: &Path, tok: &dyn Tokenizer) -> Option<usize> {
    let keeps_bytes = if dir.join("tiktoken.model").is_file() {
        true
    } else {
        let text = std::fs::read_to_string(dir.join("tokenizer.json")).ok()?;
        let json: Value = serde_json::from_str(&text).ok()?;
        json.get("normalizer").is_none_or(Value::is_null)
            && json.get("pre_tokenizer").is_none_or(keeps)
    };
    if !keeps_bytes {
        return None;
    }
    (0..tok.vocab_size() as u32)
        .filter(|&id| !tok.is_special(id))
        .filter_map(|id| tok.token_bytes(id).map(|b| b.len()))
        .max()
        .filter(|&l| l > 0)
}

/// Whether a `tokenizer.json` pre-tokenizer keeps every input byte.
fn keeps(p: &Value) -> bool {
    match p.get("type").and_then(Value::as_str) {
        None if p.is_null() => true,
        Some("ByteLevel" | "Digits" | "Punctuation" | "Metaspace" | "UnicodeScripts") => true,
        Some("Split") => p.get("behavior").and_then(Value::as_str) != Some("Removed"),
        Some("Sequence") => p
            .get("pretokenizers")
            .and_then(Value::as_array)
            .is_some_and(|v| v.iter().all(keeps)),
        _ => false,
    }
}

/// Tokens of text `n` bytes long at least.
fn tokens_at_least(n: usize, per_token: usize) -> usize {
    n.div_ceil(per_token)
}

/// The least token count of a chat prompt: each message's text is encoded
/// on its own, so the counts add up. Counted are the texts every renderer
/// writes out verbatim: for XTML every message's content (a system message
/// declaring tools writes the tools instead); for other formats the user
/// messages' content (a template may drop or rewrite the rest).
pub(crate) fn chat_tokens_at_least(
    format: &ChatFormat,
    messages: &[Message],
    per_token: usize,
) -> (usize, usize) {
    let all = matches!(format, ChatFormat::Xtml);
    let mut bytes = 0;
    let mut tokens = 0;
    for m in messages {
        let counted = if all {
            !(m.role == "system" && m.tools.is_some())
        } else {
            m.role == "user"
        };
        if !counted {
            continue;
        }
        let n = match &m.content {
            None => 0,
            Some(Content::Text(t)) => t.len(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .filter(|p| p.kind == "text")
                .filter_map(|p| p.text.as_ref().map(String::len))
                .sum(),
        };
        bytes += n;
        tokens += tokens_at_least(n, per_token);
    }
    (tokens, bytes)
}

/// The least token count of a completion prompt given as text.
pub(crate) fn text_tokens_at_least(text: &str, per_token: usize) -> usize {
    tokens_at_least(text.len(), per_token)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pre_tokenizers_that_keep_bytes() {
        assert!(keeps(&Value::Null));
        assert!(keeps(
            &json!({"type": "ByteLevel", "add_prefix_space": false})
        ));
        assert!(keeps(&json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "behavior": "Isolated"}, {"type": "ByteLevel"}]})));
        assert!(!keeps(&json!({"type": "Whitespace"})));
        assert!(!keeps(&json!({"type": "Split", "behavior": "Removed"})));
        assert!(!keeps(&json!({"type": "Sequence", "pretokenizers": [
            {"type": "ByteLevel"}, {"type": "BertPreTokenizer"}]})));
    }

    #[test]
    fn counts_add_up_per_message() {
        let msgs: Vec<Message> = serde_json::from_value(json!([
            {"role": "system", "content": "abcde"},
            {"role": "user", "content": [{"type": "text", "text": "abc"}, {"type": "image_url"},
                                          {"type": "text", "text": "d"}]},
            {"role": "assistant", "content": null},
            {"role": "system", "content": "zzzzzzzz", "tools": []}
        ]))
        .unwrap();
        // XTML: 5 bytes → 2 tokens, 4 bytes → 1 token (4 bytes a token at most).
        assert_eq!(chat_tokens_at_least(&ChatFormat::Xtml, &msgs, 4), (3, 9));
        let jinja = ChatFormat::Jinja(Box::new(
            fathom_chat::ChatTemplate::new("{{ messages }}").unwrap(),
        ));
        assert_eq!(chat_tokens_at_least(&jinja, &msgs, 4), (1, 4));
        assert_eq!(text_tokens_at_least("", 7), 0);
        assert_eq!(text_tokens_at_least("12345678", 7), 2);
    }
}
