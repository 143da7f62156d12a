//! A deterministic tokenizer for synthetic models: `tiktoken.model` and
//! `tokenizer_config.json` in the K3 layout (docs/k3-tokenizer-chat.md).
//!
//! Ranks `0..vocab−256`: the 256 single bytes first (rank = byte), then
//! multi-byte tokens roughly by how common they are: common ASCII pieces (whitespace runs, code punctuation, English and
//! code words with and without a leading space, capitalised), numbers up to
//! three digits (the pre-tokenizer's limit), Latin/Greek/Cyrillic letters and
//! CJK characters as UTF-8, then pseudo-random compounds of word pieces and
//! Han pairs until the table is full. Every multi-byte token is built as the
//! concatenation of two tokens already in the table, so it has a lower-ranked
//! split that byte-pair merging can reach. The table depends only on its size.
//! Ids `vocab−256..vocab` are the 256 reserved specials.

use std::collections::HashSet;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Map, Value, json};

/// Reserved special ids at the top of the vocabulary.
pub const NUM_SPECIALS: usize = 256;

/// Spellings of the named specials by offset from the first special id;
/// every other offset is `<|reserved_token_{id}|>`.
const NAMED_SPECIALS: [(usize, &str); 16] = [
    (0, "[BOS]"),
    (1, "[EOS]"),
    (2, "<|end_of_msg|>"),
    (3, "<|open|>"),
    (4, "<|close|>"),
    (5, "<|sep|>"),
    (6, "[start_header_id]"),
    (7, "[end_header_id]"),
    (9, "[EOT]"),
    (18, "<|media_begin|>"),
    (19, "<|media_content|>"),
    (20, "<|media_end|>"),
    (21, "<|media_pad|>"),
    (65, "<osagent_mode>"),
    (254, "[UNK]"),
    (255, "[PAD]"),
];

/// The spelling of special `offset` (0..256) whose id is `id`.
pub fn special_name(offset: usize, id: usize) -> String {
    NAMED_SPECIALS
        .iter()
        .find(|(o, _)| *o == offset)
        .map(|(_, s)| s.to_string())
        .unwrap_or_else(|| format!("<|reserved_token_{id}|>"))
}

/// Pieces seeded before the words: whitespace runs and code punctuation.
const PUNCT: [&str; 32] = [
    "  ", "    ", "        ", "\t\t", "\n\n", "\n    ", ", ", ". ", ".\n", "()", "{}", "[]", "::",
    "->", "=>", "==", "!=", "//", "/*", "*/", "\"\"", "''", ");", "),", ";\n", "{\n", "}\n", "...",
    "<=", ">=", "&&", "||",
];

/// Common English and programming words (written for this file).
const WORDS: &str = "the of and to in is that for it as was with be by on not he this are or his \
from at which but have an they you were her she there been one all we their has would when if so \
no will can what more about out up who some them than into only other its time new could these two \
may first then do any like my now over such our man me even most made after also did many before \
must through years where much your way well down should because each just those people how too \
little state good very make world still own see men work long get here between both life being \
under never day same another know while last might us great old year off come since against go \
came right used take three however home small found thought went say part once general high upon \
school every don does got united left number course war until always away something fact though \
water less public put think almost hand enough far took head yet government system better set told \
nothing night end why called didn find going look asked later knew point next program city business \
give group toward young days let room president side social given present several order national \
possible rather second face per among form important often things early become white case large \
need big four within felt children along saw best church ever least power development light thing \
seemed family interest want members mind country area others although turned done open god service \
certain kind problem began different door thus help sense means whole matter perhaps itself york \
fn let mut pub struct enum impl trait use mod self return match true false none some ok err def \
class import from print lambda yield async await const var function null undefined string int \
float bool char void static public private protected new delete this super extends implements \
interface package return while break continue switch case default try catch finally throw throws \
value index count data result error config model token layer expert weight buffer file path \
input output stream read write size length type name list map vec option";

/// A tiny deterministic generator for the filler stage (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

struct Table {
    tokens: Vec<Vec<u8>>,
    seen: HashSet<Vec<u8>>,
    cap: usize,
}

impl Table {
    fn full(&self) -> bool {
        self.tokens.len() >= self.cap
    }
    /// Adds `a ++ b` (both already in the table); false if it was present.
    fn concat(&mut self, a: &[u8], b: &[u8]) -> bool {
        if self.full() {
            return false;
        }
        debug_assert!(self.seen.contains(a) && self.seen.contains(b));
        let t = [a, b].concat();
        if self.seen.contains(&t) {
            return false;
        }
        self.seen.insert(t.clone());
        self.tokens.push(t);
        true
    }
    /// Adds every prefix of each piece in turn (prefix `n` is prefix `n−1`
    /// plus one byte, both present), so earlier pieces rank lower.
    fn prefixes(&mut self, pieces: &[Vec<u8>]) {
        for p in pieces {
            for n in 2..=p.len() {
                self.concat(&p[..n - 1], &p[n - 1..n]);
            }
        }
    }
}

fn word_like(t: &[u8]) -> bool {
    let body = t.strip_prefix(b" ").unwrap_or(t);
    body.len() >= 2 && body.iter().all(u8::is_ascii_alphabetic)
}

/// The `n` ranked tokens (n ≥ 256) of the synthetic rank file.
pub fn rank_tokens(n: usize) -> Vec<Vec<u8>> {
    let mut t = Table {
        tokens: Vec::with_capacity(n),
        seen: HashSet::with_capacity(n),
        cap: n,
    };
    for b in 0..=255u8 {
        t.seen.insert(vec![b]);
        t.tokens.push(vec![b]);
    }
    let mut pieces: Vec<Vec<u8>> = PUNCT.iter().map(|p| p.as_bytes().to_vec()).collect();
    for w in WORDS.split_whitespace() {
        let cap = format!("{}{}", w[..1].to_ascii_uppercase(), &w[1..]);
        for v in [
            format!(" {w}"),
            w.to_string(),
            format!(" {cap}"),
            cap.clone(),
        ] {
            pieces.push(v.into_bytes());
        }
    }
    pieces.retain(|p| p.len() >= 2);
    t.prefixes(&pieces);
    // Numbers of two and three digits.
    for a in b'0'..=b'9' {
        for b in b'0'..=b'9' {
            t.concat(&[a], &[b]);
        }
    }
    for a in b'0'..=b'9' {
        for b in b'0'..=b'9' {
            for c in b'0'..=b'9' {
                t.concat(&[a, b], &[c]);
            }
        }
    }
    // Two-byte letters, then three-byte CJK punctuation, ideographs, fullwidth forms.
    let ranges = [
        0xC0u32..0x250,
        0x370..0x400,
        0x400..0x500,
        0x3000..0x3040,
        0x4E00..0xA000,
        0xFF00..0xFFF0,
    ];
    let mut han: Vec<Vec<u8>> = Vec::new();
    for r in ranges {
        for c in r.filter_map(char::from_u32) {
            let mut buf = [0u8; 4];
            let s = c.encode_utf8(&mut buf).as_bytes().to_vec();
            if s.len() == 3 {
                t.concat(&s[..1], &s[1..2]);
            }
            let (head, last) = s.split_at(s.len() - 1);
            t.concat(head, last);
            if (0x4E00..0xA000).contains(&(c as u32)) {
                han.push(s);
            }
        }
    }
    fill_compounds(&mut t, han);
    t.tokens
}

/// Fills the rest with compounds: word piece + word piece (three in four) or
/// Han + Han, chosen pseudo-randomly among tokens already present.
fn fill_compounds(t: &mut Table, mut han: Vec<Vec<u8>>) {
    let mut heads: Vec<Vec<u8>> = t.tokens.iter().filter(|x| word_like(x)).cloned().collect();
    let mut tails: Vec<Vec<u8>> = heads.iter().filter(|x| x[0] != b' ').cloned().collect();
    han.retain(|h| t.seen.contains(h));
    let mut rng = Rng(0x05EE_D0FF_A7B0);
    let mut misses = 0usize;
    while !t.full() {
        let added = if rng.below(4) < 3 || han.len() < 2 {
            let (a, b) = (
                &heads[rng.below(heads.len())],
                &tails[rng.below(tails.len())],
            );
            if a.len() + b.len() > 24 {
                false
            } else {
                let (a, b) = (a.clone(), b.clone());
                let ok = t.concat(&a, &b);
                if ok {
                    let new = t.tokens.last().unwrap().clone();
                    if new[0] != b' ' {
                        tails.push(new.clone());
                    }
                    heads.push(new);
                }
                ok
            }
        } else {
            let (a, b) = (
                han[rng.below(han.len())].clone(),
                han[rng.below(han.len())].clone(),
            );
            let ok = a.len() + b.len() <= 12 && t.concat(&a, &b);
            if ok {
                han.push(t.tokens.last().unwrap().clone());
            }
            ok
        };
        misses = if added { 0 } else { misses + 1 };
        if misses > 10_000 {
            // Never expected at real sizes; guarantees termination anyway.
            let (i, j) = (rng.below(t.tokens.len()), rng.below(t.tokens.len()));
            let (a, b) = (t.tokens[i].clone(), t.tokens[j].clone());
            t.concat(&a, &b);
        }
    }
}

/// `tiktoken.model` text: `base64(bytes) rank` per line.
pub fn rank_file(tokens: &[Vec<u8>]) -> String {
    let mut s = String::with_capacity(tokens.len() * 16);
    for (rank, tok) in tokens.iter().enumerate() {
        s.push_str(&STANDARD.encode(tok));
        s.push(' ');
        s.push_str(&rank.to_string());
        s.push('\n');
    }
    s
}

/// The tokenizer module `tokenizer_config.json`'s `auto_map` names, written
/// beside the rank file so tools that load a checkpoint's tokenizer with
/// `trust_remote_code` (Hugging Face, llama.cpp's converter) find it.
pub const MODULE_FILE: &str = "tokenization_kimi.py";
/// Its source: tiktoken over `tiktoken.model` with the K3 pre-tokenizer.
pub const MODULE_SOURCE: &str = include_str!("tokenization_kimi.py");

/// `tokenizer_config.json` with the 256 specials at `vocab−256..vocab`.
pub fn tokenizer_config(vocab: usize) -> Value {
    let first = vocab - NUM_SPECIALS;
    let mut added = Map::new();
    for off in 0..NUM_SPECIALS {
        let id = first + off;
        added.insert(
            id.to_string(),
            json!({
                "content": special_name(off, id),
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": true
            }),
        );
    }
    json!({
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": false,
        "eos_token": "[EOS]",
        "model_max_length": 1_048_576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]"
    })
}

/// A released tokenizer read for `synth --tokenizer-from DIR`: its files
/// (written as they are) and the vocabulary they imply.
pub struct Released {
    /// Ranks in `tiktoken.model` plus the 256 specials after them.
    pub vocab: usize,
    pub files: Vec<(String, Vec<u8>)>,
}

/// Reads `dir`'s tiktoken tokenizer: `tiktoken.model` (ranks 0..n in
/// order), `tokenizer_config.json` (specials at n..n+256, as Kimi's
/// tokenizers have them) and the tokenizer module and chat template a
/// release ships beside them (`tokenization_*.py`, `chat_template.jinja`).
pub fn released_files(dir: &std::path::Path) -> crate::error::Result<Released> {
    use crate::error::SynthError::Invalid;
    let at = |m: String| Invalid(format!("--tokenizer-from {}: {m}", dir.display()));
    let read = |name: &str, cap: u64| -> crate::error::Result<Vec<u8>> {
        let p = dir.join(name);
        let len = std::fs::metadata(&p)
            .map_err(|e| at(format!("{name}: {e} (a released Kimi tokenizer has tiktoken.model and tokenizer_config.json)")))?
            .len();
        if len > cap {
            return Err(at(format!(
                "{name} is {len} bytes, more than a tokenizer file holds"
            )));
        }
        std::fs::read(&p).map_err(|e| crate::error::SynthError::io(&p, e))
    };
    let ranks = read("tiktoken.model", 64 << 20)?;
    let text = std::str::from_utf8(&ranks).map_err(|_| at("tiktoken.model is not text".into()))?;
    let mut n = 0usize;
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        let rank = line
            .split_whitespace()
            .nth(1)
            .and_then(|r| r.parse::<usize>().ok());
        if rank != Some(i) {
            return Err(at(format!(
                "tiktoken.model line {}: expected `base64 {i}` (ranks in order)",
                i + 1
            )));
        }
        n = i + 1;
    }
    if n < 256 {
        return Err(at(format!(
            "tiktoken.model has {n} ranks: fewer than the 256 bytes"
        )));
    }
    let cfg = read("tokenizer_config.json", 16 << 20)?;
    let v: Value =
        serde_json::from_slice(&cfg).map_err(|e| at(format!("tokenizer_config.json: {e}")))?;
    let ids: Vec<usize> = v
        .get("added_tokens_decoder")
        .and_then(Value::as_object)
        .map(|m| m.keys().filter_map(|k| k.parse().ok()).collect())
        .unwrap_or_default();
    if let Some(bad) = ids.iter().find(|&&id| id < n || id >= n + NUM_SPECIALS) {
        return Err(at(format!(
            "special token id {bad} is outside {n}..{} (the {NUM_SPECIALS} ids after the ranks)",
            n + NUM_SPECIALS
        )));
    }
    let mut files = vec![
        ("tiktoken.model".to_string(), ranks),
        ("tokenizer_config.json".to_string(), cfg),
    ];
    let mut extra: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| crate::error::SynthError::io(dir, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| {
            (f.starts_with("tokenization_") && f.ends_with(".py")) || f == "chat_template.jinja"
        })
        .collect();
    extra.sort();
    for f in extra {
        let bytes = read(&f, 16 << 20)?;
        files.push((f, bytes));
    }
    Ok(Released {
        vocab: n + NUM_SPECIALS,
        files,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(n: usize) -> Vec<Vec<u8>> {
        let toks = rank_tokens(n);
        assert_eq!(toks.len(), n);
        for (b, t) in toks[..256].iter().enumerate() {
            assert_eq!(t, &vec![b as u8]);
        }
        let mut rank = std::collections::HashMap::new();
        for (i, t) in toks.iter().enumerate() {
            assert!(rank.insert(t.clone(), i).is_none(), "duplicate {t:?}");
        }
        for (i, t) in toks.iter().enumerate().skip(256) {
            let ok = (1..t.len()).any(|s| {
                matches!((rank.get(&t[..s]), rank.get(&t[s..])), (Some(&a), Some(&b)) if a < i && b < i)
            });
            assert!(ok, "token {i} {t:?} has no lower-ranked split");
        }
        toks
    }

    #[test]
    fn small_and_full_size_tables_are_reachable() {
        let small = check(1024);
        assert!(small.contains(&b" the".to_vec()));
        let big = check(163_584);
        assert_eq!(&big[..1024], &small[..]);
        assert!(big.contains(&"中".as_bytes().to_vec()));
        assert!(big.contains(&b"999".to_vec()));
    }

    #[test]
    fn specials_follow_k3() {
        assert_eq!(special_name(2, 163_586), "<|end_of_msg|>");
        assert_eq!(special_name(65, 163_649), "<osagent_mode>");
        assert_eq!(special_name(8, 163_592), "<|reserved_token_163592|>");
        let c = tokenizer_config(1280);
        assert_eq!(c["added_tokens_decoder"]["1024"]["content"], "[BOS]");
        assert_eq!(c["added_tokens_decoder"]["1279"]["content"], "[PAD]");
        let r = rank_file(&rank_tokens(300));
        assert!(r.starts_with("AA== 0\n"));
        assert_eq!(r.lines().count(), 300);
    }
}
