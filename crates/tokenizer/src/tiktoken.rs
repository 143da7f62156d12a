//! [`TiktokenBpe`]: Kimi's tiktoken-style byte-level BPE.
//!
//! Layout of the id space (Kimi K3): ids `0..n` are the BPE ranks from
//! `tiktoken.model`; the 256 ids after them are reserved specials whose spellings come
//! from `tokenizer_config.json` (`added_tokens_decoder[id].content`), defaulting to
//! `<|reserved_token_{id}|>`. Specials are only recognised by
//! [`Tokenizer::encode_trusted`]; ordinary [`Tokenizer::encode`] treats `<|open|>` as
//! plain text, so user content cannot inject template markup.

use std::collections::HashMap;
use std::path::Path;

use crate::bpe::encode_piece;
use crate::config::parse_kimi_config;
use crate::hash::RankMap;
use crate::pretokenize::{KIMI_PATTERN, Pretokenizer, split_for_encoding};
use crate::ranks::parse_rank_file;
use crate::{Tokenizer, TokenizerError};

/// Number of reserved special ids after the ranks.
pub const NUM_RESERVED_SPECIALS: u32 = 256;

/// A byte-level BPE with tiktoken's merge rule and Kimi's pre-tokenizer.
#[derive(Debug)]
pub struct TiktokenBpe {
    ranks: RankMap,
    /// Token bytes by id (ranks then specials); `None` for ids in gaps.
    id_bytes: Vec<Option<Vec<u8>>>,
    specials: HashMap<String, u32>,
    /// Specials grouped by first byte, longest first, for the trusted scanner.
    specials_by_first_byte: HashMap<u8, Vec<(Vec<u8>, u32)>>,
    pretokenizer: Pretokenizer,
}

impl TiktokenBpe {
    /// Builds a tokenizer from token bytes indexed by rank, special tokens and a
    /// pre-tokenizer pattern.
    ///
    /// Checks: token bytes are unique and non-empty; all 256 single bytes are present;
    /// special names are unique, non-empty, not a prefix of one another, and their ids
    /// do not collide with ranks or with each other.
    pub fn new(
        ranks: Vec<Vec<u8>>,
        specials: Vec<(String, u32)>,
        pattern: &str,
    ) -> Result<Self, TokenizerError> {
        Self::build(ranks, specials, pattern, None)
    }

    /// Loads `tiktoken.model` and, optionally, `tokenizer_config.json` (special
    /// spellings and `pat_str`). Without a config the specials get default names and the
    /// pattern is Kimi's.
    pub fn from_files(
        rank_path: &Path,
        config_path: Option<&Path>,
    ) -> Result<Self, TokenizerError> {
        let text = read(rank_path)?;
        let ranks = parse_rank_file(&text, rank_path)?;
        let config = match config_path {
            Some(p) => parse_kimi_config(&read(p)?, p)?,
            None => Default::default(),
        };
        let n = ranks.len() as u32;
        let specials = (n..n + NUM_RESERVED_SPECIALS)
            .map(|id| {
                let name = config
                    .added_tokens
                    .get(&id)
                    .cloned()
                    .unwrap_or_else(|| format!("<|reserved_token_{id}|>"));
                (name, id)
            })
            .collect();
        let pattern = config.pat_str.as_deref().unwrap_or(KIMI_PATTERN);
        Self::build(ranks, specials, pattern, Some(rank_path))
    }

    fn build(
        ranks: Vec<Vec<u8>>,
        specials: Vec<(String, u32)>,
        pattern: &str,
        origin: Option<&Path>,
    ) -> Result<Self, TokenizerError> {
        let ranks_err = |message: String| TokenizerError::Ranks {
            origin: origin.map(Path::to_path_buf),
            message,
        };
        let n = u32::try_from(ranks.len()).map_err(|_| ranks_err("too many ranks".into()))?;
        let mut map = RankMap::default();
        map.reserve(ranks.len());
        for (rank, bytes) in ranks.iter().enumerate() {
            if bytes.is_empty() {
                return Err(ranks_err(format!("rank {rank} is empty")));
            }
            if let Some(old) = map.insert(bytes.clone(), rank as u32) {
                return Err(ranks_err(format!(
                    "ranks {old} and {rank} have the same bytes {bytes:?}"
                )));
            }
        }
        if let Some(b) = (0..=255u8).find(|b| !map.contains_key(&[*b][..])) {
            return Err(ranks_err(format!("single byte 0x{b:02x} has no rank")));
        }
        let specials_map = check_specials(&specials, n)?;
        let vocab = specials.iter().map(|s| s.1 + 1).max().unwrap_or(0).max(n);
        let mut id_bytes: Vec<Option<Vec<u8>>> = ranks.into_iter().map(Some).collect();
        id_bytes.resize(vocab as usize, None);
        let mut by_first: HashMap<u8, Vec<(Vec<u8>, u32)>> = HashMap::new();
        for (name, id) in &specials {
            id_bytes[*id as usize] = Some(name.as_bytes().to_vec());
            by_first
                .entry(name.as_bytes()[0])
                .or_default()
                .push((name.as_bytes().to_vec(), *id));
        }
        for list in by_first.values_mut() {
            list.sort_by_key(|(name, _)| std::cmp::Reverse(name.len()));
        }
        Ok(Self {
            ranks: map,
            id_bytes,
            specials: specials_map,
            specials_by_first_byte: by_first,
            pretokenizer: Pretokenizer::new(pattern)?,
        })
    }

    /// Number of BPE ranks (ids below this are ordinary tokens).
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Encodes ordinary text into `out` (no special-token recognition).
    fn encode_ordinary_into(&self, text: &str, out: &mut Vec<u32>) {
        for slice in split_for_encoding(text) {
            self.pretokenizer.for_each_piece(slice, |piece| {
                encode_piece(&self.ranks, piece.as_bytes(), out)
            });
        }
    }

    /// Finds the special token starting at byte `i` of `text`, if any.
    fn special_at(&self, text: &str, i: usize) -> Option<(usize, u32)> {
        let rest = &text.as_bytes()[i..];
        let candidates = self.specials_by_first_byte.get(&rest[0])?;
        candidates
            .iter()
            .find(|(name, _)| rest.starts_with(name))
            .map(|(name, id)| (name.len(), *id))
    }
}

fn read(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn check_specials(
    specials: &[(String, u32)],
    num_ranks: u32,
) -> Result<HashMap<String, u32>, TokenizerError> {
    let err = TokenizerError::Specials;
    let mut by_name = HashMap::new();
    let mut ids = std::collections::HashSet::new();
    for (name, id) in specials {
        if name.is_empty() {
            return Err(err(format!("id {id} has an empty name")));
        }
        if *id < num_ranks {
            return Err(err(format!("{name:?} has id {id}, which is a BPE rank")));
        }
        if *id == u32::MAX {
            return Err(err(format!("{name:?} has id u32::MAX")));
        }
        if !ids.insert(*id) {
            return Err(err(format!("id {id} is used twice")));
        }
        if by_name.insert(name.clone(), *id).is_some() {
            return Err(err(format!("{name:?} is defined twice")));
        }
    }
    // A special that is a prefix of another would make recognition order-dependent.
    let mut names: Vec<&str> = by_name.keys().map(String::as_str).collect();
    names.sort_unstable();
    for w in names.windows(2) {
        if w[1].starts_with(w[0]) {
            return Err(err(format!("{:?} is a prefix of {:?}", w[0], w[1])));
        }
    }
    Ok(by_name)
}

impl Tokenizer for TiktokenBpe {
    fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_ordinary_into(text, &mut out);
        out
    }

    fn encode_trusted(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut plain_start = 0;
        let mut i = 0;
        while i < text.len() {
            if let Some((len, id)) = self.special_at(text, i) {
                self.encode_ordinary_into(&text[plain_start..i], &mut out);
                out.push(id);
                i += len;
                plain_start = i;
            } else {
                i += 1;
                while i < text.len() && !text.is_char_boundary(i) {
                    i += 1;
                }
            }
        }
        self.encode_ordinary_into(&text[plain_start..], &mut out);
        out
    }

    fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.decode_bytes(ids)).into_owned()
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

impl TiktokenBpe {
    /// Concatenated bytes of `ids`; unknown ids contribute an invalid byte (0xFF) so
    /// they surface as U+FFFD rather than vanish.
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for &id in ids {
            match self.id_bytes.get(id as usize) {
                Some(Some(b)) => out.extend_from_slice(b),
                _ => out.push(0xFF),
            }
        }
        out
    }
}
