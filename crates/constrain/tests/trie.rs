//! `TokenTrie::allowed` against hand-computed sets and against brute force.

mod common;

use std::sync::Arc;

use common::{Rng, obj, schema};
use fathom_constrain::{Grammar, Matcher, TokenTrie};
use serde_json::json;

fn vocab(tokens: &[Option<&[u8]>]) -> Vec<Option<Vec<u8>>> {
    tokens.iter().map(|t| t.map(|t| t.to_vec())).collect()
}

fn allowed_ids(trie: &TokenTrie, m: &Matcher, n: usize) -> Vec<usize> {
    let mut mask = vec![true; n];
    trie.allowed(m, &mut mask);
    (0..n).filter(|&i| mask[i]).collect()
}

#[test]
fn small_vocab_exact_sets() {
    let toks: [Option<&[u8]>; 11] = [
        Some(b"{"),
        Some(b"}"),
        Some(b"\""),
        Some(b"a"),
        Some(b"\":"),
        Some(b" "),
        Some(b"1"),
        Some(b"{\""),
        Some(b"x"),
        None, // <|special|>
        Some(b""),
    ];
    let v = vocab(&toks);
    let trie = TokenTrie::new(&v);
    let g = obj();
    let mut m = Matcher::new(&g);
    assert_eq!(
        allowed_ids(&trie, &m, v.len()),
        [0, 5, 7],
        "fresh: `{{`, ` `, `{{\"`"
    );
    assert!(m.feed(b"{"));
    assert_eq!(
        allowed_ids(&trie, &m, v.len()),
        [1, 2, 4, 5],
        "after `{{`: `}}`, `\"`, `\":` (empty key), ` `"
    );
    assert!(m.feed(b"\"a"));
    assert_eq!(
        allowed_ids(&trie, &m, v.len()),
        [0, 1, 2, 3, 4, 5, 6, 7, 8],
        "in a key: any text, `\"` closes it"
    );
    assert!(m.feed(b"\":"));
    assert_eq!(
        allowed_ids(&trie, &m, v.len()),
        [0, 2, 4, 5, 6, 7],
        "after `{{\"a\":`: a value (`\":` opens a string) or whitespace"
    );
    assert!(m.feed(b"1"));
    assert_eq!(
        allowed_ids(&trie, &m, v.len()),
        [1, 5, 6],
        "after a number: digits, `}}`, ` `"
    );
    assert!(m.feed(b"}"));
    assert!(allowed_ids(&trie, &m, v.len()).is_empty(), "finished");
}

#[test]
fn schema_keys_are_masked() {
    let v = vocab(&[
        Some(b"\"name"),
        Some(b"\"age"),
        Some(b"\"x"),
        Some(b"name"),
        Some(b"\""),
        Some(b"\":\""),
        Some(b"\","),
    ]);
    let trie = TokenTrie::new(&v);
    let g = schema(
        json!({"type": "object", "properties": {"name": {"type": "string"}, "age": {}}, "additionalProperties": false}),
    );
    let mut m = Matcher::new(&g);
    assert!(m.feed(b"{"));
    assert_eq!(allowed_ids(&trie, &m, v.len()), [0, 1, 4]);
    assert!(m.feed(b"\"name\":\"Al"));
    assert_eq!(
        allowed_ids(&trie, &m, v.len()),
        [3, 4, 6],
        "`\"x` cannot follow a string value"
    );
    assert!(m.feed(b"\","));
    assert_eq!(allowed_ids(&trie, &m, v.len()), [1, 4], "`name` is used");
}

/// Random JSON text with random structural whitespace.
fn gen_value(r: &mut Rng, depth: u32, out: &mut String) {
    let ws = |r: &mut Rng, out: &mut String| {
        for _ in 0..r.below(3).saturating_sub(1) {
            out.push([' ', '\n', '\t', '\r'][r.below(4)]);
        }
    };
    let kind = if depth == 0 {
        2 + r.below(4)
    } else {
        r.below(6)
    };
    match kind {
        0 => {
            out.push('{');
            for i in 0..r.below(4) {
                if i > 0 {
                    out.push(',');
                }
                ws(r, out);
                gen_string(r, out);
                ws(r, out);
                out.push(':');
                ws(r, out);
                gen_value(r, depth - 1, out);
                ws(r, out);
            }
            out.push('}');
        }
        1 => {
            out.push('[');
            for i in 0..r.below(4) {
                if i > 0 {
                    out.push(',');
                }
                ws(r, out);
                gen_value(r, depth - 1, out);
                ws(r, out);
            }
            out.push(']');
        }
        2 => gen_string(r, out),
        3 => out.push_str(["0", "-12", "3.25", "1e5", "-0.5E-07", "42"][r.below(6)]),
        _ => out.push_str(["true", "false", "null"][r.below(3)]),
    }
}

fn gen_string(r: &mut Rng, out: &mut String) {
    out.push('"');
    for _ in 0..r.below(6) {
        out.push_str(
            [
                "a",
                "k",
                " ",
                "é",
                "😀",
                "\\n",
                "\\\"",
                "\\u00e9",
                "\\ud83d\\ude00",
                "{",
                ":",
                ",",
            ][r.below(12)],
        );
    }
    out.push('"');
}

/// A vocabulary of every single byte, hand-picked tokens and random pieces of `docs`.
fn vocab_from(docs: &[String], r: &mut Rng) -> Vec<Option<Vec<u8>>> {
    let mut v: Vec<Option<Vec<u8>>> = (0..=255u8).map(|b| Some(vec![b])).collect();
    for t in [
        "\":", "\",", "\"}", "{\"", "}}", "]]", "],", "  ", "\n\n", "1,", "0.", "e-", "\\u", "tru",
        "null}", "\":\"",
    ] {
        v.push(Some(t.as_bytes().to_vec()));
    }
    v.push(None);
    v.push(Some(Vec::new()));
    for _ in 0..400 {
        let d = docs[r.below(docs.len())].as_bytes();
        let start = r.below(d.len());
        let len = 1 + r.below(8.min(d.len() - start));
        v.push(Some(d[start..start + len].to_vec()));
    }
    v
}

/// For every prefix of every doc, the trie mask equals feeding each token to a clone.
fn check_against_brute_force(g: &Arc<Grammar>, docs: &[String], r: &mut Rng) {
    check_vocab(g, docs, &vocab_from(docs, r));
}

fn check_vocab(g: &Arc<Grammar>, docs: &[String], v: &[Option<Vec<u8>>]) {
    let trie = TokenTrie::new(v);
    let mut mask = vec![false; v.len()];
    for doc in docs {
        let mut m = Matcher::new(g);
        for (i, &b) in doc.as_bytes().iter().enumerate() {
            trie.allowed(&m, &mut mask);
            for (id, t) in v.iter().enumerate() {
                let expect = match t {
                    Some(t) if !t.is_empty() => m.clone().feed(t),
                    _ => false,
                };
                assert_eq!(
                    mask[id],
                    expect,
                    "doc {doc:?} at {i}, token {:?}",
                    t.as_deref().map(String::from_utf8_lossy)
                );
            }
            assert!(
                mask.iter().any(|&a| a),
                "no token allowed inside {doc:?} at {i}"
            );
            assert!(m.feed(&[b]), "doc {doc:?} rejected at {i}");
        }
        assert!(m.is_complete(), "{doc:?}");
    }
}

#[test]
fn matches_brute_force_json_object() {
    let mut r = Rng(0x9E37_79B9_7F4A_7C15);
    let docs: Vec<String> = (0..40)
        .map(|_| {
            let mut s = String::from("{");
            let mut inner = String::new();
            gen_value(&mut r, 3, &mut inner);
            s.push_str("\"k\":");
            s.push_str(&inner);
            s.push_str(",\"z\" : ");
            gen_value(&mut r, 2, &mut s);
            s.push('}');
            s
        })
        .collect();
    check_against_brute_force(&obj(), &docs, &mut r);
    // A BPE-like vocabulary on a few of the same documents.
    check_vocab(&obj(), &docs[..6], &synthetic_vocab(2000));
}

#[test]
fn matches_brute_force_schemas() {
    let mut r = Rng(12345);
    let person = schema(json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 4},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "role": {"enum": ["admin", "user", 10, 1]},
            "tree": {"$ref": "#/$defs/node"}
        },
        "required": ["name", "age"],
        "additionalProperties": false,
        "$defs": {"node": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}
    }));
    let docs: Vec<String> = [
        r#"{"name":"Ann","age":41,"tags":["a","b"],"role":"admin"}"#,
        r#"{ "role" : 10 , "age": -3, "name": "é😀"}"#,
        r#"{"tree":{"c":[{},{"c":[]}],"x":[1,"2"]},"age":0,"name":"\u00e9"}"#,
        r#"{"age":7,"role":1,"name":""}"#,
    ]
    .map(String::from)
    .to_vec();
    check_against_brute_force(&person, &docs, &mut r);
    let alt = schema(json!({"type": "array", "items": {"anyOf": [
        {"type": "string", "minLength": 2},
        {"type": "integer"},
        {"const": {"k": [1, 2]}},
        {"type": "object", "properties": {"k": {"type": "array"}}, "required": ["k"], "additionalProperties": false}
    ]}}));
    let docs: Vec<String> = [
        r#"["ab", 12, {"k":[1,2]}, {"k": [3]}, "xyz"]"#,
        r#"[{"k":[1,2,3]},-0]"#,
    ]
    .map(String::from)
    .to_vec();
    check_against_brute_force(&alt, &docs, &mut r);
    let short = schema(
        json!({"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 6}}),
    );
    let docs: Vec<String> = [
        r#"["abcdef","é😀\n\u00e9xy", "a b c", "的的的的的的"]"#,
        r#"["{\"a\":", "]]]]]]"]"#,
    ]
    .map(String::from)
    .to_vec();
    check_against_brute_force(&short, &docs, &mut r);
}

/// A synthetic byte-level BPE-like vocabulary.
fn synthetic_vocab(n: usize) -> Vec<Option<Vec<u8>>> {
    let mut r = Rng(7);
    let letters = b"etaoinshrdlcumwfgypbvkjxqz";
    let mut v: Vec<Option<Vec<u8>>> = (0..=255u8).map(|b| Some(vec![b])).collect();
    for t in [
        "\":", "\",", "\"}", "{\"", "},", "\":\"", "\":[", "\n", "  ", "    ", "\n  ",
    ] {
        v.push(Some(t.as_bytes().to_vec()));
    }
    while v.len() < n {
        let mut t = Vec::new();
        match r.below(10) {
            0 => t.extend_from_slice(["é", "的", "😀", "ñ", "ü"][r.below(5)].as_bytes()),
            1 if r.below(2) == 0 => {
                let s = ["éa", "的的", "😀x", "дом", " 日本語"][r.below(5)].as_bytes();
                let a = r.below(s.len());
                t.extend_from_slice(&s[a..a + 1 + r.below(s.len() - a)]);
            }
            1 => t.extend((0..1 + r.below(4)).map(|_| b"0123456789"[r.below(10)])),
            2 => t.extend((0..1 + r.below(3)).map(|_| b"{}[]\",:.-_()"[r.below(12)])),
            _ => {
                if r.below(2) == 0 {
                    t.push(b' ');
                }
                t.extend(
                    (0..1 + r.below(9))
                        .map(|_| letters[r.below(letters.len()).min(r.below(letters.len()))]),
                );
            }
        }
        v.push(Some(t));
    }
    v
}

#[test]
#[ignore = "timing smoke test; run with --ignored --nocapture"]
fn timing_160k() {
    let v = synthetic_vocab(160_000);
    let t0 = std::time::Instant::now();
    let trie = TokenTrie::new(&v);
    println!("trie built in {:?}", t0.elapsed());
    let bounded = schema(
        json!({"type": "object", "properties": {"s": {"type": "string", "maxLength": 1000}}}),
    );
    let mut mask = vec![false; v.len()];
    let cases = [
        "",
        "{",
        "{\"",
        "{\"ke",
        "{\"key\":",
        "{\"key\":\"",
        "{\"key\":\"some te",
        "{\"key\":12",
        "{\"key\":[1,",
    ];
    let cases = cases
        .iter()
        .map(|p| (obj(), *p))
        .chain([(bounded.clone(), "{\"s\":\"ab"), (bounded, "{\"s")]);
    for (g, prefix) in cases {
        let mut m = Matcher::new(&g);
        assert!(m.feed(prefix.as_bytes()));
        let reps = 50;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            trie.allowed(&m, &mut mask);
        }
        let per_call = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
        let n = mask.iter().filter(|&&a| a).count();
        println!("{prefix:>22}: {per_call:>7.3} ms, {n} allowed");
        for (id, t) in v.iter().enumerate() {
            let t = t.as_deref().unwrap();
            assert_eq!(mask[id], m.clone().feed(t), "{prefix:?} then {t:?}");
        }
    }
}
