//! `Grammar::json_object`: any JSON document whose top level is an object.

mod common;

use common::{obj, run, valid};
use fathom_constrain::Matcher;

const DOC: &str = r#"{"a": [1, 2.5e-3, "x\u00e9", true, null, {"b": {}}]}"#;

#[test]
fn accepts_byte_by_byte_complete_only_at_end() {
    let g = obj();
    let mut m = Matcher::new(&g);
    for (i, b) in DOC.bytes().enumerate() {
        assert!(m.feed(&[b]), "byte {i} ({:?}) rejected", b as char);
        let last = i + 1 == DOC.len();
        assert_eq!(m.is_complete(), last, "is_complete after {:?}", &DOC[..=i]);
        assert_eq!(m.is_finished(), last, "is_finished after {:?}", &DOC[..=i]);
    }
    assert!(!m.feed(b" "), "trailing whitespace");
}

#[test]
fn types_are_shareable() {
    fn check<T: Send + Sync>() {}
    check::<fathom_constrain::Grammar>();
    check::<Matcher>();
    check::<fathom_constrain::TokenTrie>();
}

#[test]
fn accepts_in_one_feed() {
    let g = obj();
    let mut m = Matcher::new(&g);
    assert!(m.feed(DOC.as_bytes()));
    assert!(m.is_complete() && m.is_finished());
    assert!(valid(&g, "{}"));
    assert!(valid(
        &g,
        " \n{ \"k\" :\t\"v\" , \"k2\":[ ] ,\"n\":-0.5E+2}"
    ));
    assert!(valid(&g, r#"{"s":"\"\\\/\b\f\n\r\t\ud83d\ude00 é€😀"}"#));
    assert!(valid(&g, r#"{"a":{"a":{"a":[[[[]]]]}}}"#));
    assert!(
        valid(&g, r#"{"a":"x","a":"y"}"#),
        "duplicate free-form keys are not tracked"
    );
}

#[test]
fn rejections() {
    let g = obj();
    for bad in [
        "[1]",
        "1",
        "\"s\"",
        "{\"a\":01}",
        "{\"a\":1,}",
        "{\"a\" 1}",
        "{} x",
        "{}x",
        "{}}",
        "{} ",
        "{\"a\":\"x\ny\"}",
        "{\"a\":\"\t\"}",
        "{\"a\":tru}",
        "{\"a\":truex}",
        "{\"a\":1.}",
        "{\"a\":.5}",
        "{\"a\":+1}",
        "{\"a\":\"\\x\"}",
        "{\"a\":\"\\u12G4\"}",
        "{a:1}",
        "{\"a\":[1 2]}",
        "{\"a\":[,]}",
        "{\"a\":1 \"b\":2}",
    ] {
        assert_eq!(run(&g, bad.as_bytes()), None, "{bad:?} should be rejected");
    }
    assert_eq!(run(&g, b"{\"a\":\"\xff\"}"), None, "invalid UTF-8");
    assert_eq!(run(&g, b"{\"a\":\"\xc3\"}"), None, "truncated UTF-8");
    assert_eq!(run(&g, b"{\"a\":\"\xc0\xaf\"}"), None, "overlong UTF-8");
    assert_eq!(
        run(&g, b"{\"a\":\"\xed\xa0\x80\"}"),
        None,
        "UTF-8 surrogate"
    );
    assert_eq!(
        run(&g, b"{\"\x80\":1}"),
        None,
        "stray continuation byte in a key"
    );
}

#[test]
fn prefixes_are_incomplete() {
    let g = obj();
    for p in [
        "",
        "{",
        "{\"a\"",
        "{\"a\":",
        "{\"a\":1",
        "{\"a\":[1]",
        "{\"a\":\"x",
    ] {
        assert_eq!(run(&g, p.as_bytes()), Some(false), "{p:?}");
    }
}

#[test]
fn whitespace_runs_are_capped() {
    let g = obj();
    let sp = |n: usize| " ".repeat(n);
    assert!(valid(&g, &format!("{}{{{}}}", sp(16), sp(16))));
    assert!(valid(
        &g,
        &format!("{{\"a\":{}1{}}}", "\n".repeat(16), "\t".repeat(16))
    ));
    assert_eq!(run(&g, sp(17).as_bytes()), None);
    assert_eq!(
        run(&g, format!("{{{}}}", sp(17)).as_bytes()),
        None,
        "17 spaces in a row"
    );
    assert_eq!(
        run(&g, format!("{{\"a\":{}1}}", " \r\n\t".repeat(5)).as_bytes()),
        None,
        "mixed run of 20"
    );
    assert!(
        valid(&g, &format!("{{\"a\":\"{}\"}}", sp(40))),
        "spaces inside strings are content"
    );
}

#[test]
fn a_lower_whitespace_cap_keeps_documents_compact() {
    let g = std::sync::Arc::new(fathom_constrain::Grammar::json_object().with_max_whitespace(1));
    assert!(valid(&g, "{\"a\": [1, 2], \"b\":\n{}}"));
    assert!(!valid(&g, "{\"a\":  1}"));
    assert!(!valid(&g, "{\"a\": 1,\n  \"b\": 2}"));
    let none = std::sync::Arc::new(fathom_constrain::Grammar::json_object().with_max_whitespace(0));
    assert!(valid(&none, "{\"a\":[1,2]}"));
    assert!(!valid(&none, "{\"a\": 1}"));
}
