//! Kimi K3 XTML rendering: strings, segments and ids.

use std::path::PathBuf;

use fathom_chat::{
    ChatError, K3Options, Message, ResponseFormat, Segment, ThinkingEffort, ToolChoice,
    encode_segments, render_k3, segments_to_string,
};
use fathom_tokenizer::{Tokenizer, load_from_dir};
use serde_json::json;

const EFFORT_MAX: &str = "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>";

fn k3_tokenizer() -> Box<dyn Tokenizer> {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tokenizer/tests/data/k3-code-small");
    load_from_dir(&dir)
        .unwrap()
        .expect("k3-code-small tokenizer")
}

fn render_str(messages: &[Message], options: &K3Options) -> String {
    segments_to_string(&render_k3(messages, options).unwrap())
}

fn msgs(value: serde_json::Value) -> Vec<Message> {
    serde_json::from_value(value).expect("messages deserialize")
}

/// The doc's example renders to exactly the documented string.
#[test]
fn doc_example_renders_exactly() {
    let m = vec![Message::new("user", "Hello <|open|> & goodbye")];
    let expected = format!(
        "{EFFORT_MAX}<|open|>message role=\"user\"<|sep|>Hello <|open|> & goodbye<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"
    );
    assert_eq!(render_str(&m, &K3Options::default()), expected);
}

/// Content spelling `<|open|>` stays ordinary text; markup becomes specials; the ids
/// equal encoding the rendered string with specials allowed, minus the injected one.
#[test]
fn user_special_spelling_is_not_a_special() {
    let tok = k3_tokenizer();
    let open = tok.special_id("<|open|>").unwrap();
    let segs = render_k3(
        &[Message::new("user", "Hello <|open|> & goodbye")],
        &K3Options::default(),
    )
    .unwrap();
    assert!(segs.contains(&Segment::Text("Hello <|open|> & goodbye".into())));
    let ids = encode_segments(tok.as_ref(), &segs);
    let count = |ids: &[u32], id: u32| ids.iter().filter(|&&x| x == id).count();
    // Four opening tags: effort message, user message, assistant message, think.
    assert_eq!(count(&ids, open), 4);
    let naive = tok.encode_trusted(&segments_to_string(&segs));
    assert_eq!(
        count(&naive, open),
        5,
        "the naive encoding would inject a tag"
    );
    let user_ids = tok.encode("Hello <|open|> & goodbye");
    assert!(
        ids.windows(user_ids.len())
            .any(|w| w == user_ids.as_slice())
    );
    assert!(!user_ids.contains(&open));
    assert_eq!(tok.decode(&ids), segments_to_string(&segs));
}

/// For benign content, segment encoding equals encoding the whole rendered string as
/// trusted text (what the reference does), so ids do not depend on segmentation.
#[test]
fn segment_ids_equal_whole_string_ids() {
    let tok = k3_tokenizer();
    let m = msgs(json!([
        {"role": "system", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": "def f(x):\n    return x  ", "name": "Ann \"A\" & B"},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "think…",
         "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "run", "arguments": "{\"cmd\": \"ls\", \"n\": 2}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.txt"},
    ]));
    for thinking in [true, false] {
        let opts = K3Options {
            thinking,
            ..K3Options::default()
        };
        let segs = render_k3(&m, &opts).unwrap();
        assert_eq!(
            encode_segments(tok.as_ref(), &segs),
            tok.encode_trusted(&segments_to_string(&segs)),
            "thinking={thinking}"
        );
    }
}

/// Segment structure of a user message: specials trusted, tag text and content not.
#[test]
fn segments_of_a_named_user_message() {
    let opts = K3Options {
        thinking_effort: None,
        add_generation_prompt: false,
        ..K3Options::default()
    };
    let m = msgs(json!([{"role": "user", "content": "hi", "name": "a\"b&c"}]));
    assert_eq!(
        render_k3(&m, &opts).unwrap(),
        vec![
            Segment::Trusted("<|open|>".into()),
            Segment::Text("message role=\"user\" name=\"a&quot;b&amp;c\"".into()),
            Segment::Trusted("<|sep|>".into()),
            Segment::Text("hi".into()),
            Segment::Trusted("<|close|>".into()),
            Segment::Text("message".into()),
            Segment::Trusted("<|sep|><|end_of_msg|>".into()),
        ]
    );
}

/// Assistant bodies, tool calls (string and object arguments, unparseable ones) and
/// tool results with names resolved from the calls, reordered by `tool_call_id`.
#[test]
fn tools_round_trip() {
    let m = msgs(json!([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "reasoning_content": "plan",
         "tool_calls": [
            {"id": "a", "function": {"name": "search", "arguments": "{\"q\": \"x\", \"k\": 1e2}"}},
            {"id": "b", "function": {"name": "calc", "arguments": {"expr": [1, 2]}}},
            {"id": "c", "function": {"name": "raw", "arguments": "not json"}}
         ]},
        {"role": "tool", "tool_call_id": "b", "content": "3"},
        {"role": "tool", "tool_call_id": "a", "content": "found"},
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]));
    let opts = K3Options {
        thinking_effort: None,
        add_generation_prompt: false,
        ..K3Options::default()
    };
    let expected = concat!(
        "<|open|>message role=\"user\"<|sep|>go<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"assistant\"<|sep|>",
        "<|open|>think<|sep|>plan<|close|>think<|sep|>",
        "<|open|>response<|sep|><|close|>response<|sep|>",
        "<|open|>tools<|sep|>",
        "<|open|>call tool=\"search\" index=\"1\"<|sep|>",
        "<|open|>argument key=\"q\" type=\"string\"<|sep|>x<|close|>argument<|sep|>",
        "<|open|>argument key=\"k\" type=\"number\"<|sep|>1e2<|close|>argument<|sep|>",
        "<|close|>call<|sep|>",
        "<|open|>call tool=\"calc\" index=\"2\"<|sep|>",
        "<|open|>argument key=\"expr\" type=\"array\"<|sep|>[1, 2]<|close|>argument<|sep|>",
        "<|close|>call<|sep|>",
        "<|open|>call tool=\"raw\" index=\"3\"<|sep|>",
        "<|open|>json type=\"object\"<|sep|>not json<|close|>json<|sep|>",
        "<|close|>call<|sep|>",
        "<|close|>tools<|sep|>",
        "<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"tool\" tool=\"search\" index=\"1\"<|sep|>found<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"tool\" tool=\"calc\" index=\"2\"<|sep|>3<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"tool\" tool=\"raw\" index=\"3\"<|sep|>ok<|close|>message<|sep|><|end_of_msg|>",
    );
    assert_eq!(render_str(&m, &opts), expected);
}

/// Thinking off: no effort message, no think blocks, prompt ends in the response channel.
#[test]
fn thinking_off_generation_prompt() {
    let m = msgs(json!([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "dropped"},
        {"role": "user", "content": "q2"}
    ]));
    let opts = K3Options {
        thinking: false,
        ..K3Options::default()
    };
    assert_eq!(
        render_str(&m, &opts),
        concat!(
            "<|open|>message role=\"user\"<|sep|>q<|close|>message<|sep|><|end_of_msg|>",
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>a<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
            "<|open|>message role=\"user\"<|sep|>q2<|close|>message<|sep|><|end_of_msg|>",
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>"
        )
    );
    let low = K3Options {
        thinking_effort: Some(ThinkingEffort::Low),
        ..K3Options::default()
    };
    let s = render_str(&m[..1], &low);
    assert!(s.contains("`thinking_effort=low`.<|close|>"), "{s}");
    assert!(s.ends_with("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"));
    // A thinking history turn without reasoning still gets an (empty) think block.
    let m2 = msgs(json!([{"role": "assistant", "content": "a"}]));
    let opts = K3Options {
        thinking_effort: None,
        add_generation_prompt: false,
        ..K3Options::default()
    };
    assert_eq!(
        render_str(&m2, &opts),
        "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>a<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    );
}

/// Tool declaration (key-sorted compact JSON) comes first; tool-choice and
/// response-format messages come after the conversation.
#[test]
fn generated_system_messages() {
    let opts = K3Options {
        tools: Some(json!([{"type": "function", "function": {"name": "f", "description": "d"}}])),
        tool_choice: Some(ToolChoice::Required),
        response_format: Some(ResponseFormat::JsonObject),
        add_generation_prompt: false,
        ..K3Options::default()
    };
    let s = render_str(&[Message::new("user", "x")], &opts);
    let declare = "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n[{\"function\":{\"description\":\"d\",\"name\":\"f\"},\"type\":\"function\"}]\n```<|close|>message<|sep|><|end_of_msg|>";
    assert!(s.starts_with(&format!("{declare}{EFFORT_MAX}")), "{s}");
    assert!(s.ends_with(concat!(
        "<|open|>message role=\"system\" type=\"tool-choice\"<|sep|>The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"system\" type=\"response-format\"<|sep|>The system is invoked with `response_format=json_object`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting.<|close|>message<|sep|><|end_of_msg|>"
    )), "{s}");
}

/// Bad input is an error naming the message.
#[test]
fn rejects_images_unknown_roles_and_unnamed_tools() {
    let opts = K3Options::default();
    let img = msgs(json!([{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]}]));
    let e = render_k3(&img, &opts).unwrap_err();
    assert!(
        matches!(e, ChatError::UnsupportedContent { index: 0, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("image_url"));

    let e = render_k3(&[Message::new("developer", "x")], &opts).unwrap_err();
    assert_eq!(e.to_string(), "message 0: unknown role \"developer\"");

    let e = render_k3(
        &[Message::new("user", "x"), Message::new("tool", "r")],
        &opts,
    )
    .unwrap_err();
    assert!(
        matches!(e, ChatError::UnnamedToolResult { index: 1 }),
        "{e}"
    );

    let parts = msgs(
        json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
    );
    assert!(render_str(&parts, &opts).contains("<|sep|>ab<|close|>"));
}
