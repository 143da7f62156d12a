//! Random JSON schemas, well-formed and not, through the compiler and the
//! matcher: every schema compiles or is refused with an error that names
//! where (a JSON pointer into the schema) and why; nothing panics; a
//! compiled grammar's masks agree with feeding bytes one by one.

mod common;

use std::sync::Arc;

use common::Rng;
use fathom_constrain::{Grammar, Matcher, TokenTrie};
use serde_json::{Map, Value, json};

const TYPES: [&str; 8] = [
    "object", "array", "string", "number", "integer", "boolean", "null", "float",
];
const KEYWORDS: [&str; 22] = [
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "$ref",
    "$defs",
    "minLength",
    "maxLength",
    "description",
    "format",
    "pattern",
    "allOf",
    "not",
    "minimum",
    "x-extra",
];

/// A small JSON value of any kind.
fn scalar(r: &mut Rng) -> Value {
    match r.below(9) {
        0 => Value::Null,
        1 => json!(r.below(2) == 0),
        2 => json!(r.below(100) as i64 - 50),
        3 => json!(r.below(1000) as f64 / 7.0),
        4 => json!(["a", "b\"c", "ü", "", "\\n"][r.below(5)]),
        5 => json!([1, "x", null]),
        6 => json!({"k": 1}),
        7 => json!(-1),
        _ => json!(u64::MAX),
    }
}

/// A value for `kw`: usually of the right shape, sometimes not.
fn keyword_value(r: &mut Rng, kw: &str, depth: u32) -> Value {
    if r.below(8) == 0 {
        return scalar(r);
    }
    match kw {
        "type" => {
            if r.below(3) == 0 {
                let n = 1 + r.below(3);
                Value::Array((0..n).map(|_| json!(TYPES[r.below(TYPES.len())])).collect())
            } else {
                json!(TYPES[r.below(TYPES.len())])
            }
        }
        "properties" | "$defs" => {
            let mut m = Map::new();
            for _ in 0..r.below(4) {
                let name = ["a", "b", "c\"q", "ü", ""][r.below(5)];
                m.insert(name.to_string(), schema(r, depth + 1));
            }
            Value::Object(m)
        }
        "required" => Value::Array(
            (0..r.below(4))
                .map(|_| json!(["a", "b", "zz", "c\"q"][r.below(4)]))
                .collect(),
        ),
        "additionalProperties" | "items" | "not" => match r.below(3) {
            0 => json!(r.below(2) == 0),
            _ => schema(r, depth + 1),
        },
        "minItems" | "maxItems" | "minLength" | "maxLength" | "minimum" => {
            json!([0i64, 1, 2, 5, 1000, -1, 4_294_967_296][r.below(7)])
        }
        "enum" => Value::Array((0..r.below(4)).map(|_| scalar(r)).collect()),
        "const" => scalar(r),
        "anyOf" | "oneOf" | "allOf" => {
            Value::Array((0..r.below(4)).map(|_| schema(r, depth + 1)).collect())
        }
        "$ref" => json!(
            [
                "#",
                "#/$defs/a",
                "#/$defs/b",
                "#/properties/a",
                "#/nowhere",
                "http://x/y",
                "#/$defs/c%22q"
            ][r.below(7)]
        ),
        "pattern" => json!("^a+$"),
        "format" => json!("date-time"),
        _ => scalar(r),
    }
}

/// A random schema (objects of keywords, or a boolean schema).
fn schema(r: &mut Rng, depth: u32) -> Value {
    if depth > 4 || r.below(10) == 0 {
        return json!(r.below(2) == 0);
    }
    let mut m = Map::new();
    for _ in 0..r.below(5) {
        let kw = KEYWORDS[r.below(KEYWORDS.len())];
        let v = keyword_value(r, kw, depth);
        m.insert(kw.to_string(), v);
    }
    Value::Object(m)
}

/// The JSON pointer an error names (`root` is the whole schema).
fn named_path(msg: &str) -> &str {
    let rest = msg
        .strip_prefix("schema at ")
        .unwrap_or_else(|| panic!("error without its place: {msg}"));
    rest.split(':').next().unwrap()
}

#[test]
fn random_schemas_compile_or_name_their_fault() {
    let mut r = Rng(0x0DDB_A11);
    let mut compiled = 0;
    let mut refused = 0;
    // A vocabulary of bytes and JSON-ish pieces for mask checks.
    let mut vocab: Vec<Option<Vec<u8>>> = (0u8..=127).map(|b| Some(vec![b])).collect();
    for t in [
        "true", "false", "null", "\"a\"", "{\"", "\":", "},", "[1", "\"b", "ü", "\\\"", "12",
    ] {
        vocab.push(Some(t.as_bytes().to_vec()));
    }
    let trie = TokenTrie::new(&vocab);
    let mut allowed = vec![false; vocab.len()];
    for round in 0..4000 {
        let s = schema(&mut r, 0);
        match Grammar::from_schema(&s) {
            Err(e) => {
                refused += 1;
                let msg = e.to_string();
                let path = named_path(&msg);
                if path != "root" {
                    assert!(
                        s.pointer(path).is_some(),
                        "round {round}: {msg}\nnames {path:?}, not in {s}"
                    );
                }
                assert!(
                    msg.contains("keyword `") || msg.contains("matches no value"),
                    "round {round}: {msg}"
                );
            }
            Ok(g) => {
                compiled += 1;
                let g = Arc::new(g);
                // Walk random allowed tokens; each one the mask allows must feed.
                let mut m = Matcher::new(&g);
                for _ in 0..40 {
                    trie.allowed(&m, &mut allowed);
                    let ok: Vec<usize> = (0..vocab.len()).filter(|&i| allowed[i]).collect();
                    if ok.is_empty() {
                        break;
                    }
                    let pick = ok[r.below(ok.len())];
                    let bytes = vocab[pick].as_ref().unwrap();
                    assert!(
                        m.feed(bytes),
                        "round {round}: the mask allowed {bytes:?} for {s}"
                    );
                }
                // Random bytes never panic.
                let mut m = Matcher::new(&g);
                for _ in 0..20 {
                    if !m.feed(&[(r.next() & 0xFF) as u8]) {
                        break;
                    }
                }
            }
        }
    }
    eprintln!("{compiled} compiled, {refused} refused");
    assert!(
        compiled > 500 && refused > 500,
        "{compiled} compiled, {refused} refused"
    );
}

#[test]
fn deep_and_wide_schemas_are_bounded() {
    // Nesting as deep as a request body can carry (serde_json stops at 128).
    let mut s = json!({"type": "string"});
    for _ in 0..60 {
        s = json!({"type": "array", "items": {"anyOf": [s, {"type": "null"}]}});
    }
    let g = Arc::new(Grammar::from_schema(&s).unwrap());
    let mut m = Matcher::new(&g);
    assert!(m.feed(&b"[".repeat(60)));
    assert!(m.feed(b"\"x\""));
    assert!(m.feed(&b"]".repeat(60)) && m.is_complete());
    // Every alternative open at once: anyOf of anyOf of ... stays within its forks.
    let mut s = json!({"type": "integer"});
    for _ in 0..12 {
        s = json!({"anyOf": [s.clone(), s, {"type": "number"}]});
    }
    let g = Arc::new(Grammar::from_schema(&s).unwrap());
    let mut m = Matcher::new(&g);
    assert!(m.feed(b"12345"));
    assert!(m.is_complete());
}

#[test]
fn an_empty_literal_set_is_refused_not_a_panic() {
    // Found by the fuzz above: `enum` filtered through an `anyOf` whose only
    // branch is an empty `enum` stepped a literal frame with no literal.
    for s in [
        json!({"enum": ["a"], "anyOf": [{"enum": []}]}),
        json!({"const": 1, "oneOf": [{"enum": []}, {"enum": []}]}),
    ] {
        let e = Grammar::from_schema(&s).unwrap_err().to_string();
        assert_eq!(e, "schema at root: matches no value", "{s}");
    }
    let g = Arc::new(
        Grammar::from_schema(&json!({"anyOf": [{"enum": []}, {"type": "null"}]})).unwrap(),
    );
    let mut m = Matcher::new(&g);
    assert!(m.feed(b"null") && m.is_complete());
    assert!(!Matcher::new(&g).feed(b"\"a\""));
}
