//! `TiktokenBpe` against Python `tiktoken` (see `data/make_parity.py`).

mod common;

use common::{k3_dir, parity_cases};
use fathom_tokenizer::{StreamDecoder, TiktokenBpe, Tokenizer};

fn k3() -> TiktokenBpe {
    let dir = k3_dir();
    TiktokenBpe::from_files(
        &dir.join("tiktoken.model"),
        Some(&dir.join("tokenizer_config.json")),
    )
    .expect("k3-code-small tokenizer loads")
}

/// Every corpus case encodes to exactly the reference ids and decodes back.
#[test]
fn ids_match_python_tiktoken_on_corpus() {
    let tok = k3();
    let cases = parity_cases("tiktoken");
    assert!(cases.len() >= 60, "corpus has {} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let got = tok.encode(&case.text);
        if got != case.ids {
            failures.push(format!(
                "{}: got {:?}… expected {:?}…",
                case.name,
                &got[..got.len().min(16)],
                &case.ids[..case.ids.len().min(16)]
            ));
        }
        assert_eq!(tok.decode(&got), case.text, "round trip of {}", case.name);
    }
    assert!(failures.is_empty(), "mismatches:\n{}", failures.join("\n"));
}

/// Streaming decode of every case, one id at a time, reproduces the text exactly and
/// never emits a replacement character for valid input.
#[test]
fn stream_decoder_reassembles_corpus() {
    let tok = k3();
    for case in parity_cases("tiktoken") {
        let mut dec = StreamDecoder::new(&tok);
        let mut out = String::new();
        for &id in &case.ids {
            let piece = dec.push(id);
            assert!(
                !piece.contains('\u{FFFD}'),
                "{}: U+FFFD mid-stream",
                case.name
            );
            out.push_str(&piece);
        }
        out.push_str(&dec.finish());
        assert_eq!(out, case.text, "{}", case.name);
    }
}

/// User text spelling a special token is ordinary BPE; trusted text gets the special.
#[test]
fn specials_only_in_trusted_text() {
    let tok = k3();
    let open = tok.special_id("<|open|>").expect("<|open|> exists");
    assert_eq!(open, 8195);
    let plain = tok.encode("a <|open|> b");
    assert!(!plain.contains(&open));
    assert!(plain.iter().all(|&id| (id as usize) < tok.num_ranks()));
    assert_eq!(tok.encode_trusted("a <|open|> b"), {
        let mut v = tok.encode("a ");
        v.push(open);
        v.extend(tok.encode(" b"));
        v
    });
    assert_eq!(tok.decode(&[open]), "<|open|>");
}

/// Special ids and names follow `tokenizer_config.json`, with defaults for gaps.
#[test]
fn reserved_specials_layout() {
    let tok = k3();
    assert_eq!(tok.num_ranks(), 8192);
    assert_eq!(tok.vocab_size(), 8192 + 256);
    for (name, id) in [
        ("[BOS]", 8192),
        ("[EOS]", 8193),
        ("<|end_of_msg|>", 8194),
        ("<|open|>", 8195),
        ("<|close|>", 8196),
        ("<|sep|>", 8197),
        ("[UNK]", 8446),
        ("[PAD]", 8447),
        ("<|reserved_token_8200|>", 8200),
    ] {
        assert_eq!(tok.special_id(name), Some(id), "{name}");
        assert_eq!(tok.token_bytes(id), Some(name.as_bytes().to_vec()));
    }
    assert_eq!(tok.special_id("<|nope|>"), None);
    assert_eq!(tok.token_bytes(8448), None);
}

/// Without a config the specials get `<|reserved_token_{id}|>` and the Kimi pattern.
#[test]
fn rank_file_alone_uses_defaults() {
    let tok = TiktokenBpe::from_files(&k3_dir().join("tiktoken.model"), None).unwrap();
    assert_eq!(tok.special_id("<|reserved_token_8195|>"), Some(8195));
    assert_eq!(tok.special_id("<|open|>"), None);
    let case = &parity_cases("tiktoken")[0];
    assert_eq!(tok.encode(&case.text), case.ids);
}

/// Unknown ids decode to U+FFFD instead of panicking.
#[test]
fn unknown_ids_decode_to_replacement() {
    let tok = k3();
    let mut ids = tok.encode("ok");
    ids.push(1_000_000);
    assert_eq!(tok.decode(&ids), "ok\u{FFFD}");
}
