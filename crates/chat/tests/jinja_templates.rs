//! HF Jinja templates against Python jinja2 configured as transformers does
//! (`data/make_goldens.py` writes `data/jinja_goldens.json`).

use std::path::PathBuf;

use fathom_chat::{ChatError, ChatTemplate, Segment};
use serde_json::{Value, json};

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn template(name: &str) -> ChatTemplate {
    let source = std::fs::read_to_string(data().join(name)).unwrap();
    ChatTemplate::new(&source).unwrap()
}

fn with_specials(ctx: &Value) -> serde_json::Map<String, Value> {
    let mut map = ctx.as_object().unwrap().clone();
    map.insert("bos_token".into(), json!("<s>"));
    map.insert("eos_token".into(), json!("</s>"));
    map
}

/// Every golden renders byte-for-byte as jinja2 does, including `raise_exception`.
#[test]
fn renders_like_python_jinja2() {
    let text = std::fs::read_to_string(data().join("jinja_goldens.json")).unwrap();
    let goldens: Vec<Value> = serde_json::from_str(&text).unwrap();
    assert_eq!(goldens.len(), 7);
    for g in &goldens {
        let label = format!("{} / {}", g["template"], g["case"]);
        let tmpl = template(g["template"].as_str().unwrap());
        let result = tmpl.render(&with_specials(&g["context"]));
        match g.get("expected").and_then(Value::as_str) {
            Some(expected) => assert_eq!(result.unwrap(), expected, "{label}"),
            None => {
                let err = result.expect_err(&label);
                let wanted = g["error"].as_str().unwrap();
                assert!(matches!(err, ChatError::Template(_)), "{label}");
                assert!(err.to_string().contains(wanted), "{label}: {err}");
            }
        }
    }
}

/// `tojson` does not HTML-escape and uses Python separators; `indent` works.
#[test]
fn tojson_is_hf_compatible() {
    let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}").unwrap();
    let mut ctx = serde_json::Map::new();
    ctx.insert("x".into(), json!({"a": "<&'>", "b": [1]}));
    assert_eq!(
        t.render(&ctx).unwrap(),
        "{\"a\": \"<&'>\", \"b\": [1]}|{\n  \"a\": \"<&'>\",\n  \"b\": [\n    1\n  ]\n}"
    );
}

/// `strftime_now` renders the current date in the requested format.
#[test]
fn strftime_now_is_available() {
    let t = ChatTemplate::new("{{ strftime_now('%Y') }}").unwrap();
    let year: i32 = t.render(&serde_json::Map::new()).unwrap().parse().unwrap();
    assert!(year >= 2025, "{year}");
}

fn tmp_dir(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fathom-chat-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (f, text) in files {
        std::fs::write(dir.join(f), text).unwrap();
    }
    dir
}

/// Templates load from `chat_template.jinja`, or `tokenizer_config.json` in string or
/// list form, with `bos_token` (string or AddedToken object) from the config.
#[test]
fn loads_from_model_dir() {
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let config = json!({
        "bos_token": {"content": "<B>", "special": true},
        "model_max_length": 1000000000000000019884624838656u128 as f64,
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"}
        ]
    });
    let dir = tmp_dir("list", &[("tokenizer_config.json", &config.to_string())]);
    let t = ChatTemplate::from_model_dir(&dir)
        .unwrap()
        .expect("template");
    assert_eq!(
        t.render_segments(&msgs, true).unwrap(),
        vec![Segment::Trusted("<B>hi".into())]
    );

    let dir = tmp_dir(
        "file",
        &[
            (
                "tokenizer_config.json",
                r#"{"eos_token": "</s>", "chat_template": "ignored"}"#,
            ),
            (
                "chat_template.jinja",
                "{{ messages[0].content }}{{ eos_token }}",
            ),
        ],
    );
    let t = ChatTemplate::from_model_dir(&dir).unwrap().unwrap();
    assert_eq!(
        t.render_segments(&msgs, false).unwrap()[0].as_str(),
        "hi</s>"
    );

    let dir = tmp_dir("none", &[("tokenizer_config.json", "{}")]);
    assert!(ChatTemplate::from_model_dir(&dir).unwrap().is_none());

    let dir = tmp_dir(
        "bad",
        &[("tokenizer_config.json", r#"{"chat_template": 5}"#)],
    );
    let err = ChatTemplate::from_model_dir(&dir).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("chat_template"),
        "{err}"
    );
}

/// A template syntax error is an error naming the problem, not a panic.
#[test]
fn bad_template_is_an_error() {
    let err = ChatTemplate::new("{% for x in %}").unwrap_err();
    assert!(matches!(err, ChatError::Template(_)), "{err}");
}
