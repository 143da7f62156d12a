//! Behaviour on small hand-built tokenizers: streaming, validation, pathological input.

mod common;

use std::time::Instant;

use fathom_tokenizer::{
    KIMI_PATTERN, StreamDecoder, TiktokenBpe, Tokenizer, TokenizerError, load_from_dir,
};

/// 256 single bytes plus the given merges, in rank order.
fn byte_ranks(extra: &[&[u8]]) -> Vec<Vec<u8>> {
    let mut ranks: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    ranks.extend(extra.iter().map(|e| e.to_vec()));
    ranks
}

/// Multibyte characters split across tokens are released only when complete.
#[test]
fn stream_decoder_holds_partial_characters() {
    // "中" = e4 b8 ad, "🦀" = f0 9f a6 80: make tokens that cut inside both.
    let ranks = byte_ranks(&[b"\xe4\xb8", b"\xad\xf0", b"\x9f\xa6"]);
    let tok = TiktokenBpe::new(ranks, vec![("<|x|>".into(), 300)], KIMI_PATTERN).unwrap();
    let ids = [256, 257, 258, 0x80, 300, b'a' as u32];
    let mut dec = StreamDecoder::new(&tok);
    let outs: Vec<String> = ids.iter().map(|&id| dec.push(id)).collect();
    assert_eq!(outs, vec!["", "中", "", "🦀", "<|x|>", "a"]);
    assert!(!dec.has_pending());
    assert_eq!(dec.finish(), "");
}

/// Invalid bytes come out as U+FFFD right away; a dangling partial character is flushed
/// as U+FFFD by `finish`; the whole stream equals the lossy `decode`.
#[test]
fn stream_decoder_replaces_invalid_bytes() {
    let tok = TiktokenBpe::new(byte_ranks(&[]), vec![], KIMI_PATTERN).unwrap();
    let ids = [b'a' as u32, 0x80, 0xe4, 0xb8, b'b' as u32, 0xf0, 0x9f];
    let mut dec = StreamDecoder::new(&tok);
    let mut outs: Vec<String> = ids.iter().map(|&id| dec.push(id)).collect();
    assert_eq!(outs, vec!["a", "\u{FFFD}", "", "", "\u{FFFD}b", "", ""]);
    assert!(dec.has_pending());
    outs.push(dec.finish());
    assert_eq!(outs.last().unwrap(), "\u{FFFD}");
    assert_eq!(outs.concat(), tok.decode(&ids));
    assert_eq!(dec.push(9_999), "\u{FFFD}");
}

/// Rank-table problems are reported, not panicked on.
#[test]
fn new_rejects_bad_tables() {
    let missing = byte_ranks(&[])[1..].to_vec();
    let e = TiktokenBpe::new(missing, vec![], KIMI_PATTERN).unwrap_err();
    assert!(e.to_string().contains("0x00"), "{e}");

    let dup = byte_ranks(&[b"a"]);
    let e = TiktokenBpe::new(dup, vec![], KIMI_PATTERN).unwrap_err();
    assert!(e.to_string().contains("same bytes"), "{e}");

    let prefix = vec![("<|a|>".to_string(), 256), ("<|a|>x".to_string(), 257)];
    let e = TiktokenBpe::new(byte_ranks(&[]), prefix, KIMI_PATTERN).unwrap_err();
    assert!(e.to_string().contains("prefix"), "{e}");

    let clash = vec![("<|a|>".to_string(), 10)];
    let e = TiktokenBpe::new(byte_ranks(&[]), clash, KIMI_PATTERN).unwrap_err();
    assert!(e.to_string().contains("BPE rank"), "{e}");

    let e = TiktokenBpe::new(byte_ranks(&[]), vec![], "(unclosed").unwrap_err();
    assert!(matches!(e, TokenizerError::Pattern(_)), "{e}");
}

fn write_tmp(name: &str, files: &[(&str, &str)]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("fathom-tok-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (f, text) in files {
        std::fs::write(dir.join(f), text).unwrap();
    }
    dir
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A rank file with an out-of-order rank fails naming the file and line.
#[test]
fn rank_file_errors_name_the_line() {
    let mut text: String = (0..=255u8)
        .map(|b| format!("{} {b}\n", b64(&[b])))
        .collect();
    text.push_str(&format!("{} 300\n", b64(b"ab")));
    let dir = write_tmp("gap", &[("tiktoken.model", &text)]);
    let e = TiktokenBpe::from_files(&dir.join("tiktoken.model"), None).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("tiktoken.model:257:"), "{msg}");
    assert!(msg.contains("expected 256"), "{msg}");

    let dir = write_tmp("b64", &[("tiktoken.model", "!!!! 0\n")]);
    let e = TiktokenBpe::from_files(&dir.join("tiktoken.model"), None).unwrap_err();
    assert!(
        e.to_string().contains("tiktoken.model:1: invalid base64"),
        "{e}"
    );

    let dir = write_tmp("short", &[("tiktoken.model", &text[..text.len() / 2])]);
    let e = TiktokenBpe::from_files(&dir.join("tiktoken.model"), None);
    assert!(e.is_err());
}

/// Configs with integers wider than 64 bits load; malformed fields are named.
#[test]
fn config_is_parsed_tolerantly() {
    let ranks: String = (0..=255u8)
        .map(|b| format!("{} {b}\n", b64(&[b])))
        .collect();
    let config = r#"{"model_max_length": 1000000000000000019884624838656,
        "added_tokens_decoder": {"256": {"content": "[BOS]", "special": true},
                                 "999": {"content": "ignored"}},
        "pat_str": "\\S+|\\s+"}"#;
    let dir = write_tmp(
        "cfg",
        &[
            ("tiktoken.model", &ranks),
            ("tokenizer_config.json", config),
        ],
    );
    let tok = load_from_dir(&dir).unwrap().expect("tokenizer found");
    assert_eq!(tok.special_id("[BOS]"), Some(256));
    assert_eq!(tok.special_id("<|reserved_token_257|>"), Some(257));
    assert_eq!(tok.special_id("ignored"), None);
    assert_eq!(tok.vocab_size(), 512);
    // The config's pattern is used: "a b" splits as "a", " ", "b" (all single bytes).
    assert_eq!(tok.encode("a b"), vec![97, 32, 98]);

    let bad = r#"{"added_tokens_decoder": {"256": {"contents": "x"}}}"#;
    let dir = write_tmp(
        "badcfg",
        &[("tiktoken.model", &ranks), ("tokenizer_config.json", bad)],
    );
    let e = load_from_dir(&dir).err().expect("error");
    let msg = e.to_string();
    assert!(msg.contains("tokenizer_config.json"), "{msg}");
    assert!(msg.contains("added_tokens_decoder.256"), "{msg}");
}

/// An empty directory has no tokenizer.
#[test]
fn load_from_dir_without_tokenizer_is_none() {
    let dir = write_tmp("empty", &[]);
    assert!(load_from_dir(&dir).unwrap().is_none());
}

/// Megabytes of a single character class encode in (near) linear time: the pre-split
/// bounds regex work and the heap merge bounds BPE work on long pieces.
#[test]
fn long_single_class_input_is_fast() {
    let dir = common::k3_dir();
    let tok = load_from_dir(&dir).unwrap().unwrap();
    for (unit, n) in [
        ("a", 3_000_000usize),
        (" ", 3_000_000),
        ("中", 1_000_000),
        ("7", 1_000_000),
    ] {
        let text = unit.repeat(n);
        let t = Instant::now();
        let ids = tok.encode(&text);
        let secs = t.elapsed().as_secs_f64();
        assert!(!ids.is_empty());
        assert_eq!(tok.decode(&ids), text);
        eprintln!("{:?} x {n}: {} ids in {secs:.3}s", unit, ids.len());
        assert!(secs < 20.0, "{unit:?} x {n} took {secs:.1}s");
    }
}

/// The 10 MB measurement from the issue (run with `--ignored --nocapture`): one
/// character class, plus mixed code text for ordinary throughput.
#[test]
#[ignore = "slow; a measurement, not a check"]
fn ten_megabytes_measurement() {
    let tok = load_from_dir(&common::k3_dir()).unwrap().unwrap();
    let code = "def f(x):\n    return [i * 2 for i in range(x)]  # 中文 comment\n";
    for (label, text) in [
        ("a", "a".repeat(10 << 20)),
        ("space", " ".repeat(10 << 20)),
        ("code", code.repeat((10 << 20) / code.len())),
    ] {
        let t = Instant::now();
        let ids = tok.encode(&text);
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "{label}: {} MB -> {} ids in {secs:.2}s ({:.1} MB/s)",
            text.len() >> 20,
            ids.len(),
            text.len() as f64 / 1e6 / secs
        );
        assert!(secs < 60.0);
    }
}
