//! Reading and checking a tiktoken rank file (`tiktoken.model`).
//!
//! Format: one token per line, `base64(bytes) SP rank`. The ranks must be `0..n` in
//! order, because the rank doubles as the token id and as the merge priority; a gap
//! or a reordering means the file is not what the model was trained with.

use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use crate::TokenizerError;

/// Parses the text of a rank file. `path` is used for error messages only.
///
/// Returns the token bytes indexed by rank.
pub fn parse_rank_file(text: &str, path: &Path) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let err = |line: usize, message: String| TokenizerError::RankFile {
        path: path.to_path_buf(),
        line,
        message,
    };
    let mut ranks = Vec::new();
    for (idx, raw) in text.lines().enumerate() {
        let line_no = idx + 1;
        let line = raw.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(b64), Some(rank_text), None) = (fields.next(), fields.next(), fields.next())
        else {
            return Err(err(
                line_no,
                format!("expected `base64 rank`, found {line:?}"),
            ));
        };
        let bytes = STANDARD
            .decode(b64)
            .map_err(|e| err(line_no, format!("invalid base64 {b64:?}: {e}")))?;
        let rank: u64 = rank_text
            .parse()
            .map_err(|_| err(line_no, format!("rank {rank_text:?} is not an integer")))?;
        if rank != ranks.len() as u64 {
            return Err(err(
                line_no,
                format!(
                    "rank {rank} out of order: ranks must be contiguous from 0, expected {}",
                    ranks.len()
                ),
            ));
        }
        if bytes.is_empty() {
            return Err(err(line_no, "empty token".to_string()));
        }
        ranks.push(bytes);
    }
    if ranks.is_empty() {
        return Err(err(0, "no ranks in file".to_string()));
    }
    Ok(ranks)
}
