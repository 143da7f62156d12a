//! gpt-oss's harmony format end to end with a real `tokenizer.json`: a
//! small byte-level tokenizer with the harmony specials, written to a temp
//! model directory (the gpt-oss fixture has neither the specials nor a
//! template).

use std::path::PathBuf;

use fathom_chat::{ChatFormat, ChatOptions, Message, ReplyDelta};
use fathom_tokenizer::Tokenizer;
use serde_json::{Value, json};

/// The harmony specials, at ids 256.. of the test vocabulary.
const SPECIALS: [&str; 8] = [
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
];

/// GPT-2's byte-to-unicode alphabet: the 256 single-byte tokens.
fn byte_alphabet() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut shifted = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).unwrap()
            }
        })
        .collect()
}

fn tokenizer_json(specials: &[&str]) -> String {
    let vocab: serde_json::Map<String, Value> = byte_alphabet()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), json!(i)))
        .collect();
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": 256 + i, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": null,
        "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
    .to_string()
}

/// A model directory with a tokenizer (harmony specials or not) and
/// optionally a `chat_template.jinja`.
fn model_dir(name: &str, harmony: bool, template: Option<&str>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fathom-harmony-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let specials: &[&str] = if harmony { &SPECIALS } else { &["<|eos|>"] };
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json(specials)).unwrap();
    if let Some(t) = template {
        std::fs::write(dir.join("chat_template.jinja"), t).unwrap();
    }
    dir
}

fn load(dir: &std::path::Path) -> (Box<dyn Tokenizer>, Option<ChatFormat>) {
    let tok = fathom_tokenizer::load_from_dir(dir).unwrap().unwrap();
    let f = ChatFormat::detect(dir, tok.as_ref()).unwrap();
    (tok, f)
}

fn id(tok: &dyn Tokenizer, s: &str) -> u32 {
    tok.special_id(s).unwrap()
}

/// A template of this test's own, reading what fathom passes for harmony.
const TEMPLATE: &str = "<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>\
{% for m in messages %}<|start|>{{ m.role }}\
{% if m.role == 'assistant' %}{% if m.thinking %}<|channel|>analysis<|message|>{{ m.thinking }}<|end|><|start|>assistant{% endif %}<|channel|>final{% endif %}\
<|message|>{{ m.content }}<|end|>{% endfor %}\
{% if add_generation_prompt %}<|start|>assistant{% endif %}";

#[test]
fn detects_harmony_by_its_specials_with_or_without_a_template() {
    let (_, f) = load(&model_dir("plain", true, None));
    let f = f.expect("harmony specials alone are a chat format");
    assert!(matches!(f, ChatFormat::Harmony(None)));
    assert_eq!(f.name(), "harmony");

    let (_, f) = load(&model_dir("templated", true, Some(TEMPLATE)));
    assert!(matches!(f, Some(ChatFormat::Harmony(Some(_)))));

    let (_, f) = load(&model_dir("other", false, Some(TEMPLATE)));
    assert_eq!(f.map(|f| f.name()), Some("jinja"));
    let (_, f) = load(&model_dir("none", false, None));
    assert!(f.is_none());
}

fn conversation() -> Vec<Message> {
    serde_json::from_value(json!([
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "greet", "content": "Hello!"},
    ]))
    .unwrap()
}

#[test]
fn native_prompt_encodes_specials_as_specials_and_content_as_text() {
    let dir = model_dir("native", true, None);
    let (tok, f) = load(&dir);
    let f = f.unwrap();
    let mut msgs = conversation();
    msgs.push(Message::new("user", "Say <|end|>"));
    let off = ChatOptions {
        thinking: Some(false),
        ..ChatOptions::default()
    };
    let p = f.prompt(tok.as_ref(), &msgs, &off).unwrap();
    let text = tok.decode(&p.ids);
    let want = "<|start|>system<|message|>Reasoning: low\n\nChannels: analysis, commentary, \
                final. Every assistant message names its channel: analysis for thinking, \
                commentary for function calls, final for the answer.<|end|>\
                <|start|>user<|message|>Hi<|end|>\
                <|start|>assistant<|channel|>final<|message|>Hello!<|end|>\
                <|start|>user<|message|>Say <|end|><|end|>\
                <|start|>assistant";
    assert_eq!(text, want);
    // The user's `<|end|>` is text; the markup's are specials.
    let end = id(tok.as_ref(), "<|end|>");
    assert_eq!(p.ids.iter().filter(|&&i| i == end).count(), 4);
    assert!(p.thinking, "a harmony reply opens with a channel header");
    let tail: Vec<u32> = p.ids[p.stable_len..].to_vec();
    assert_eq!(tok.decode(&tail), "<|start|>assistant");
}

#[test]
fn a_shipped_template_renders_with_reasoning_effort_and_thinking() {
    let (tok, f) = load(&model_dir("jinja", true, Some(TEMPLATE)));
    let f = f.unwrap();
    let render = |thinking: Option<bool>| {
        let o = ChatOptions {
            thinking,
            ..ChatOptions::default()
        };
        tok.decode(&f.prompt(tok.as_ref(), &conversation(), &o).unwrap().ids)
    };
    let want = "<|start|>system<|message|>Reasoning: EFFORT<|end|>\
                <|start|>user<|message|>Hi<|end|>\
                <|start|>assistant<|channel|>analysis<|message|>greet<|end|>\
                <|start|>assistant<|channel|>final<|message|>Hello!<|end|>\
                <|start|>assistant";
    assert_eq!(render(Some(false)), want.replace("EFFORT", "low"));
    assert_eq!(render(None), want.replace("EFFORT", "medium"));
    assert_eq!(render(Some(true)), want.replace("EFFORT", "medium"));
}

#[test]
fn stop_ids_add_the_reply_ending_specials() {
    let (tok, f) = load(&model_dir("stops", true, None));
    let f = f.unwrap();
    let t = tok.as_ref();
    let ret = id(t, "<|return|>");
    let eot = id(t, "<|endoftext|>");
    assert_eq!(
        f.stop_ids(t, &[ret, 7]),
        vec![ret, 7, id(t, "<|call|>"), eot]
    );
    let (tok, f) = load(&model_dir("stops-jinja", false, Some(TEMPLATE)));
    assert_eq!(f.unwrap().stop_ids(tok.as_ref(), &[3]), vec![3]);
}

/// Decodes `ids` as the engine does (each step's new text of the whole
/// decode; generation ends at a stop id, which adds no text) and parses it.
fn engine_like(tok: &dyn Tokenizer, f: &ChatFormat, ids: &[u32]) -> (Vec<ReplyDelta>, String) {
    let stops = f.stop_ids(tok, &[]);
    let mut parser = f.reply_parser(true);
    let (mut out, mut text, mut seen) = (Vec::new(), String::new(), 0);
    for n in 1..=ids.len() {
        if stops.contains(&ids[n - 1]) {
            break;
        }
        let full = tok.decode(&ids[..n]);
        let piece = &full[seen..];
        seen = full.len();
        text.push_str(piece);
        out.extend(parser.push(piece));
    }
    out.extend(parser.finish());
    (out, text)
}

#[test]
fn replies_decode_with_specials_spelled_out_and_parse() {
    let (tok, f) = load(&model_dir("reply", true, None));
    let (tok, f) = (tok.as_ref(), f.unwrap());
    let answer = tok.encode_trusted(
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final\
         <|message|>Four.<|return|>",
    );
    assert_eq!(answer.iter().filter(|&&i| tok.is_special(i)).count(), 7);
    let (deltas, text) = engine_like(tok, &f, &answer);
    assert!(text.ends_with("<|message|>Four."), "{text:?}");
    let joined = |d: &[ReplyDelta], reasoning: bool| -> String {
        d.iter()
            .filter_map(|d| match d {
                ReplyDelta::Reasoning(t) if reasoning => Some(t.as_str()),
                ReplyDelta::Content(t) if !reasoning => Some(t.as_str()),
                _ => None,
            })
            .collect()
    };
    assert_eq!(joined(&deltas, true), "Easy.");
    assert_eq!(joined(&deltas, false), "Four.");

    let call = tok.encode_trusted(
        "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>\
         commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}\
         <|call|><|start|>ignored",
    );
    let (deltas, text) = engine_like(tok, &f, &call);
    assert_eq!(
        deltas.last(),
        Some(&ReplyDelta::ToolCall {
            index: 0,
            name: "get_weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        })
    );
    assert_eq!(joined(&deltas, false), "");

    // The reply becomes the next turn's assistant message, which renders
    // back as harmony (the call, with the current turn's reasoning).
    let m = f.reply_message(&text, true);
    assert_eq!(m.reasoning_content.as_deref(), Some("Use the tool."));
    assert_eq!(m.tool_calls.len(), 1);
    let mut msgs = vec![Message::new("user", "Weather?"), m];
    msgs.push(
        serde_json::from_value(json!({"role": "tool", "tool_call_id": "call_0", "content": "18C"}))
            .unwrap(),
    );
    let p = f.prompt(tok, &msgs, &ChatOptions::default()).unwrap();
    let rendered = tok.decode(&p.ids);
    assert!(
        rendered.ends_with(
            "<|start|>user<|message|>Weather?<|end|>\
             <|start|>assistant<|channel|>analysis<|message|>Use the tool.<|end|>\
             <|start|>assistant<|channel|>commentary to=functions.get_weather \
             <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>\
             <|start|>functions.get_weather to=assistant<|channel|>commentary\
             <|message|>18C<|end|><|start|>assistant"
        ),
        "{rendered:?}"
    );
    // Other formats keep the reply text as the content.
    let (_, j) = load(&model_dir("reply-jinja", false, Some(TEMPLATE)));
    assert_eq!(
        j.unwrap().reply_message("<think>x</think>y", true),
        Message::new("assistant", "<think>x</think>y")
    );
}
