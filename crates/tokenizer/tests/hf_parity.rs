//! `HfTokenizer` against Python `tokenizers` and the fixtures' transformers goldens.

mod common;

use common::{hf_dir, parity_cases};
use fathom_tokenizer::{HfTokenizer, StreamDecoder, Tokenizer, load_from_dir};

fn hf() -> HfTokenizer {
    HfTokenizer::from_file(&hf_dir().join("tokenizer.json")).expect("tokenizer.json loads")
}

/// Ids equal Python `tokenizers` on the whole corpus; decode and stream round-trip.
#[test]
fn ids_match_python_tokenizers_on_corpus() {
    let tok = hf();
    let cases = parity_cases("hf");
    assert!(cases.len() >= 60);
    for case in &cases {
        let got = tok.encode(&case.text);
        assert_eq!(got, case.ids, "{}", case.name);
        assert_eq!(tok.decode(&got), case.text, "decode of {}", case.name);
        let mut dec = StreamDecoder::new(&tok);
        let streamed: String =
            got.iter().map(|&id| dec.push(id)).collect::<String>() + &dec.finish();
        assert_eq!(streamed, case.text, "stream of {}", case.name);
    }
}

/// The fixtures' golden prompt (transformers 5.23, after its BOS 0) tokenizes the same.
#[test]
fn fixture_golden_prompt_ids() {
    let tok = load_from_dir(&hf_dir())
        .unwrap()
        .expect("tokenizer.json found");
    assert_eq!(
        tok.encode("def fibonacci(n):\n    "),
        vec![444, 282, 578, 268, 67, 69, 681, 10, 80, 320, 201, 260]
    );
    assert_eq!(
        tok.encode("import os\nimport sys\n\nclass Config:\n    \"\"\""),
        vec![
            1165, 2562, 201, 1165, 1473, 201, 201, 404, 1656, 72, 502, 28, 201, 261, 384
        ]
    );
}

/// Special spellings are specials only through `encode_trusted`.
#[test]
fn specials_only_in_trusted_text() {
    let tok = hf();
    let bos = tok.special_id("<|bos|>").expect("bos");
    assert_eq!(bos, 0);
    assert_eq!(tok.special_id("<|eos|>"), Some(1));
    assert_eq!(
        tok.encode_trusted("<|bos|>hi"),
        [vec![bos], tok.encode("hi")].concat()
    );
    let plain = tok.encode("<|bos|>hi");
    assert!(!plain.contains(&bos), "{plain:?}");
    assert_eq!(tok.decode(&plain), "<|bos|>hi");
    assert_eq!(tok.token_bytes(bos), Some(b"<|bos|>".to_vec()));
    assert_eq!(tok.vocab_size(), 4096);
}

/// Byte-level tokens map back to raw bytes (`Ġ` is a space, `Ċ` a newline).
#[test]
fn token_bytes_undo_byte_level_alphabet() {
    let tok = hf();
    let ids = tok.encode(" hello\n");
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&id| tok.token_bytes(id).unwrap())
        .collect();
    assert_eq!(bytes, b" hello\n");
    assert_eq!(tok.token_bytes(99_999), None);
}
