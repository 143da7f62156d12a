//! Pre-tokenization: cutting text into the pieces that BPE runs on.
//!
//! Two stages, both as in Kimi's `tokenization_kimi.py`:
//! 1. [`split_for_encoding`] bounds the work per regex call: slices of at most
//!    [`MAX_SLICE_CHARS`] characters, and any run of more than [`MAX_RUN_CHARS`]
//!    characters of one class (whitespace or not, by Python's `str.isspace()`) is cut.
//!    The cuts change token boundaries only in pathological inputs, but they must be
//!    reproduced to match the reference on those inputs.
//! 2. [`Pretokenizer::pieces`] runs the pattern over each slice. The pattern uses a
//!    look-ahead (`\s+(?!\S)`), so it is compiled with `fancy-regex`, the engine the
//!    reference (`tiktoken`) itself uses.

use fancy_regex::Regex;

use crate::TokenizerError;

/// Kimi's pre-tokenizer pattern (`tokenization_kimi.py`), eight alternatives in order.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Slices handed to the regex are at most this many characters (`TIKTOKEN_MAX_ENCODE_CHARS`).
pub const MAX_SLICE_CHARS: usize = 400_000;
/// A run of one whitespace class longer than this is cut (`MAX_NO_WHITESPACES_CHARS`).
pub const MAX_RUN_CHARS: usize = 25_000;

/// Python's `str.isspace()`: Unicode whitespace plus the information separators
/// U+001C..U+001F, which Rust's `char::is_whitespace` does not include.
pub fn python_isspace(c: char) -> bool {
    matches!(
        c,
        '\u{9}'..='\u{d}'
            | '\u{1c}'..='\u{20}'
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// Splits `text` into the slices the reference encodes independently.
///
/// Each character is visited once, so this is linear in the input.
pub fn split_for_encoding(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for slice in char_chunks(text, MAX_SLICE_CHARS) {
        split_long_runs(slice, MAX_RUN_CHARS, &mut out);
    }
    out
}

/// Cuts `text` every `max_chars` characters.
fn char_chunks(text: &str, max_chars: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut count = 0;
    for (i, _) in text.char_indices() {
        if count == max_chars {
            out.push(&text[start..i]);
            start = i;
            count = 0;
        }
        count += 1;
    }
    if start < text.len() || text.is_empty() {
        out.push(&text[start..]);
    }
    out
}

/// Cuts a slice where a same-class run would exceed `max_run` characters; the cut
/// falls before the character that would make the run `max_run + 1` long.
fn split_long_runs<'a>(text: &'a str, max_run: usize, out: &mut Vec<&'a str>) {
    let mut run_len = 0usize;
    let mut run_is_space = text.chars().next().is_some_and(python_isspace);
    let mut start = 0;
    for (i, c) in text.char_indices() {
        let is_space = python_isspace(c);
        if is_space != run_is_space {
            run_len = 1;
            run_is_space = is_space;
        } else {
            run_len += 1;
            if run_len > max_run {
                out.push(&text[start..i]);
                start = i;
                run_len = 1;
            }
        }
    }
    out.push(&text[start..]);
}

/// A compiled pre-tokenizer pattern.
#[derive(Debug)]
pub struct Pretokenizer {
    regex: Regex,
}

impl Pretokenizer {
    /// Compiles `pattern`.
    pub fn new(pattern: &str) -> Result<Self, TokenizerError> {
        // The default backtrack limit (1e6) is per match attempt; our inputs are bounded
        // by the run splitting above, so keep fancy-regex's default.
        let regex = Regex::new(pattern).map_err(|e| TokenizerError::Pattern(e.to_string()))?;
        Ok(Self { regex })
    }

    /// Calls `f` with each piece of `text`, in order. Text the pattern does not match
    /// (possible only with a custom pattern) is skipped, as the reference does.
    pub fn for_each_piece(&self, text: &str, mut f: impl FnMut(&str)) {
        let mut pos = 0;
        while pos < text.len() {
            match self.regex.find_from_pos(text, pos) {
                Ok(Some(m)) => {
                    if m.end() == m.start() {
                        // An empty match cannot advance; step one character.
                        pos = next_char_boundary(text, m.end());
                        continue;
                    }
                    f(m.as_str());
                    pos = m.end();
                }
                Ok(None) => break,
                // A backtracking limit: fall back to the rest of the slice as one piece
                // rather than dropping text (the BPE merge loop handles any length).
                Err(_) => {
                    f(&text[pos..]);
                    break;
                }
            }
        }
    }
}

fn next_char_boundary(text: &str, pos: usize) -> usize {
    let mut p = pos + 1;
    while p < text.len() && !text.is_char_boundary(p) {
        p += 1;
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isspace_matches_python_list() {
        let expected: Vec<u32> = vec![
            0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000,
            0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028,
            0x2029, 0x202f, 0x205f, 0x3000,
        ];
        let got: Vec<u32> = (0..=0x10ffffu32)
            .filter_map(char::from_u32)
            .filter(|&c| python_isspace(c))
            .map(|c| c as u32)
            .collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn long_runs_are_cut_at_the_limit() {
        let mut out = Vec::new();
        split_long_runs("aaaaa  bb", 2, &mut out);
        assert_eq!(out, vec!["aa", "aa", "a  bb"]);
        let text = "x".repeat(MAX_RUN_CHARS * 2 + 3);
        let parts = split_for_encoding(&text);
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        assert_eq!(lens, vec![MAX_RUN_CHARS, MAX_RUN_CHARS, 3]);
    }

    #[test]
    fn slices_are_bounded_in_chars() {
        let text = "ab ".repeat(MAX_SLICE_CHARS / 3 + 10);
        let parts = split_for_encoding(&text);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].chars().count(), MAX_SLICE_CHARS);
        assert_eq!(parts.concat(), text);
    }

    #[test]
    fn kimi_pattern_splits_han_and_latin() {
        let p = Pretokenizer::new(KIMI_PATTERN).unwrap();
        let mut pieces = Vec::new();
        p.for_each_piece("中文English混合 it's  x\n\n", |s| {
            pieces.push(s.to_string())
        });
        assert_eq!(
            pieces,
            vec!["中文", "English", "混合", " it's", " ", " x", "\n\n"]
        );
    }
}
