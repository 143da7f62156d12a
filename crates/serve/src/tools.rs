//! `tool_choice`: parsed, and when it requires a call (`required`, or one
//! named function), the program of [`Step`]s that makes the reply that
//! call in the model's chat format:
//!
//! - XTML: `<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>`
//!   `<|open|>json type="object"<|sep|>ARGS<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>`
//!   (after the thinking block when thinking is on: the block is free text
//!   until the model closes it);
//! - Jinja templates: `<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>`
//!   (after `</think>` when the prompt opened a thinking block);
//! - harmony: the analysis message, then
//!   `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`.
//!
//! ARGS is a JSON object matching the function's `parameters` schema (`{}`
//! when it has none: the function takes no arguments). One call per reply.

use std::sync::Arc;

use fathom_chat::{ChatFormat, ToolChoice, escape_attr};
use fathom_constrain::Grammar;
use fathom_tokenizer::Tokenizer;
use serde_json::Value;

use crate::constraint::Step;
use crate::error::ApiError;

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Choice {
    Auto,
    None,
    Required,
    /// This function must be called.
    Named(String),
}

impl Choice {
    /// What the prompt tells the model (a named function: that it must
    /// call a tool; the constraint picks which).
    pub fn for_prompt(&self) -> ToolChoice {
        match self {
            Choice::Auto => ToolChoice::Auto,
            Choice::None => ToolChoice::None,
            Choice::Required | Choice::Named(_) => ToolChoice::Required,
        }
    }

    pub fn enforced(&self) -> bool {
        matches!(self, Choice::Required | Choice::Named(_))
    }
}

const PARAM: &str = "tool_choice";

/// `tool_choice`: `"auto"`, `"none"`, `"required"` or
/// `{"type": "function", "function": {"name": NAME}}`.
pub(crate) fn parse(v: Option<&Value>) -> Result<Option<Choice>, ApiError> {
    let named =
        "use auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}";
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(Some(Choice::Auto)),
            "required" => Ok(Some(Choice::Required)),
            "none" => Ok(Some(Choice::None)),
            other => Err(ApiError::invalid(
                PARAM,
                format!("tool_choice {other:?}: {named}"),
            )),
        },
        Some(Value::Object(o)) => {
            if o.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::invalid(
                    PARAM,
                    format!("tool_choice.type must be \"function\": {named}"),
                ));
            }
            match o.get("function").and_then(|f| f.get("name")) {
                Some(Value::String(n)) if !n.is_empty() => Ok(Some(Choice::Named(n.clone()))),
                _ => Err(ApiError::invalid(
                    PARAM,
                    "tool_choice.function.name must be a non-empty string",
                )),
            }
        }
        Some(_) => Err(ApiError::invalid(PARAM, format!("tool_choice: {named}"))),
    }
}

/// A function the reply may call, with its arguments' grammar.
#[derive(Debug, Clone)]
pub(crate) struct Tool {
    pub name: String,
    pub args: Arc<Grammar>,
}

/// Most consecutive whitespace bytes in arguments: `{"a": 1, "b": 2}`
/// as written by hand or by `json.dumps`, no more (a model fond of
/// whitespace would spend its tokens on it).
const ARGS_WHITESPACE: u8 = 1;

/// Longest function name (OpenAI's limit).
const MAX_NAME: usize = 64;

/// The functions of `tools` that `choice` allows (all for `required`, the
/// named one for a named choice), their `parameters` compiled.
pub(crate) fn callable(tools: Option<&Value>, choice: &Choice) -> Result<Vec<Tool>, ApiError> {
    let list = match tools {
        Some(Value::Array(a)) if !a.is_empty() => a,
        _ => {
            return Err(ApiError::invalid(
                PARAM,
                "tool_choice requires a tool call, but the request has no tools",
            ));
        }
    };
    let mut out: Vec<Tool> = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let f = t.get("function").unwrap_or(t);
        let Some(name) = f.get("name").and_then(Value::as_str) else {
            return Err(ApiError::invalid(
                "tools",
                format!("tools[{i}].function.name is missing"),
            ));
        };
        if let Choice::Named(want) = choice
            && want != name
        {
            continue;
        }
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
        if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(ok) {
            return Err(ApiError::invalid(
                "tools",
                format!(
                    "tools[{i}].function.name {name:?}: a called function's name has 1 to \
                     {MAX_NAME} letters, digits, '_', '-' or '.'"
                ),
            ));
        }
        if out.iter().any(|t| t.name == name) {
            continue;
        }
        // No `parameters`: the function takes none (OpenAI's reading).
        let none =
            serde_json::json!({"type": "object", "properties": {}, "additionalProperties": false});
        let schema = match f.get("parameters") {
            None | Some(Value::Null) => &none,
            Some(schema) => schema,
        };
        let args = Grammar::from_schema(schema)
            .map_err(|e| {
                ApiError::invalid("tools", format!("tools[{i}].function.parameters: {e}"))
            })?
            .with_max_whitespace(ARGS_WHITESPACE);
        out.push(Tool {
            name: name.to_string(),
            args: Arc::new(args),
        });
    }
    if let (Choice::Named(want), true) = (choice, out.is_empty()) {
        return Err(ApiError::invalid(
            PARAM,
            format!("tool_choice names the function {want:?}, which is not in tools"),
        ));
    }
    Ok(out)
}

/// The ids of a special token the format needs.
fn special(tok: &dyn Tokenizer, s: &str) -> Result<u32, ApiError> {
    tok.special_id(s).ok_or_else(|| {
        ApiError::bad_request(format!(
            "this model's tokenizer lacks {s}: tool_choice cannot be enforced"
        ))
    })
}

/// Every special id and every stop id: what free text before the call may
/// not contain.
pub(crate) fn specials_and_stops(tok: &dyn Tokenizer, vocab: usize, stops: &[u32]) -> Vec<u32> {
    let mut v: Vec<u32> = (0..vocab as u32).filter(|&id| tok.is_special(id)).collect();
    v.extend_from_slice(stops);
    v.sort_unstable();
    v.dedup();
    v
}

/// What a program needs to know of the request.
pub(crate) struct Reply<'a> {
    pub format: &'a ChatFormat,
    pub tok: &'a dyn Tokenizer,
    /// The reply starts in the thinking block.
    pub thinking: bool,
    /// Ids free text may not contain (all specials and stops for XTML and
    /// harmony, the stops for Jinja templates).
    pub banned: Arc<Vec<u32>>,
    pub stops: &'a [u32],
}

/// The steps that make the reply one call to one of `tools`.
pub(crate) fn program(r: &Reply<'_>, tools: &[Tool]) -> Result<Vec<Step>, ApiError> {
    match r.format {
        ChatFormat::Xtml => xtml(r, tools),
        ChatFormat::Jinja(_) => Ok(tagged(r, tools)),
        ChatFormat::Harmony(_) => harmony(r, tools),
    }
}

fn xtml(r: &Reply<'_>, tools: &[Tool]) -> Result<Vec<Step>, ApiError> {
    let tok = r.tok;
    let open = special(tok, fathom_chat::OPEN)?;
    let close = special(tok, fathom_chat::CLOSE)?;
    let sep = special(tok, fathom_chat::SEP)?;
    let text = |s: &str| tok.encode(s);
    let mut steps = Vec::new();
    let mut lead = Vec::new();
    if r.thinking {
        steps.push(Step::Free {
            trigger: vec![close],
            banned: r.banned.clone(),
        });
        lead.extend(text("think"));
        lead.extend([sep, open]);
        lead.extend(text("response"));
        lead.extend([sep, close]);
    } else {
        lead.push(close);
    }
    lead.extend(text("response"));
    lead.extend([sep, open]);
    lead.extend(text("tools"));
    lead.extend([sep, open]);
    steps.push(Step::Ids(lead));
    let mut tail = vec![close];
    for (tag, last) in [("json", false), ("call", false), ("tools", true)] {
        tail.extend(text(tag));
        tail.push(sep);
        if !last {
            tail.push(close);
        }
    }
    let alts = tools
        .iter()
        .map(|t| {
            let mut head = text(&format!(
                "call tool=\"{}\" index=\"1\"",
                escape_attr(&t.name)
            ));
            head.extend([sep, open]);
            head.extend(text("json type=\"object\""));
            head.push(sep);
            (
                head,
                vec![Step::Json(t.args.clone()), Step::Ids(tail.clone())],
            )
        })
        .collect();
    steps.push(Step::Pick(alts));
    Ok(steps)
}

fn tagged(r: &Reply<'_>, tools: &[Tool]) -> Vec<Step> {
    let tok = r.tok;
    let mut steps = Vec::new();
    let open = if r.thinking {
        steps.push(Step::Free {
            trigger: tok.encode_trusted("</think>"),
            banned: Arc::new(r.stops.to_vec()),
        });
        "\n\n<tool_call>\n"
    } else {
        "<tool_call>\n"
    };
    steps.push(Step::Ids(tok.encode_trusted(open)));
    let tail = tok.encode_trusted("}\n</tool_call>");
    let alts = tools
        .iter()
        .map(|t| {
            let name = Value::String(t.name.clone()).to_string();
            let head = tok.encode_trusted(&format!("{{\"name\": {name}, \"arguments\": "));
            (
                head,
                vec![Step::Json(t.args.clone()), Step::Ids(tail.clone())],
            )
        })
        .collect();
    steps.push(Step::Pick(alts));
    steps
}

fn harmony(r: &Reply<'_>, tools: &[Tool]) -> Result<Vec<Step>, ApiError> {
    let tok = r.tok;
    let channel = special(tok, "<|channel|>")?;
    let message = special(tok, "<|message|>")?;
    let start = special(tok, "<|start|>")?;
    let end = special(tok, "<|end|>")?;
    let call = special(tok, "<|call|>")?;
    let constrain = tok.special_id("<|constrain|>");
    let mut analysis = vec![channel];
    analysis.extend(tok.encode("analysis"));
    analysis.push(message);
    let mut next = vec![start];
    next.extend(tok.encode("assistant"));
    next.push(channel);
    let alts = tools
        .iter()
        .map(|t| {
            let mut head = tok.encode(&format!("commentary to=functions.{} ", t.name));
            if let Some(c) = constrain {
                head.push(c);
                head.extend(tok.encode("json"));
            }
            head.push(message);
            (
                head,
                vec![Step::Json(t.args.clone()), Step::Ids(vec![call])],
            )
        })
        .collect();
    Ok(vec![
        Step::Ids(analysis),
        Step::Free {
            trigger: vec![end],
            banned: r.banned.clone(),
        },
        Step::Ids(next),
        Step::Pick(alts),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::constraint::{ToolConstraint, trie};
    use fathom_chat::{ChatTemplate, HarmonyReply, ReplyDelta, ReplyParser, TagReply, XtmlReply};
    use fathom_constrain::Matcher;
    use fathom_engine::Constraint;
    use serde_json::json;

    /// One id per byte, then the specials of every format.
    struct Toy;

    const SPECIALS: [&str; 12] = [
        "<|open|>",
        "<|close|>",
        "<|sep|>",
        "<|end_of_msg|>",
        "<|channel|>",
        "<|message|>",
        "<|start|>",
        "<|end|>",
        "<|call|>",
        "<|constrain|>",
        "<|return|>",
        "[EOS]",
    ];
    const EOS: u32 = 256 + 11;

    impl Tokenizer for Toy {
        fn encode(&self, text: &str) -> Vec<u32> {
            text.bytes().map(u32::from).collect()
        }
        fn encode_trusted(&self, mut text: &str) -> Vec<u32> {
            let mut ids = Vec::new();
            while !text.is_empty() {
                if let Some((i, s)) = SPECIALS
                    .iter()
                    .enumerate()
                    .find(|(_, s)| text.starts_with(**s))
                {
                    ids.push(256 + i as u32);
                    text = &text[s.len()..];
                } else {
                    ids.push(u32::from(text.as_bytes()[0]));
                    text = &text[1..];
                }
            }
            ids
        }
        fn decode(&self, ids: &[u32]) -> String {
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&i| self.token_bytes(i).unwrap())
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
            match id {
                0..=255 => Some(vec![id as u8]),
                _ => SPECIALS
                    .get(id as usize - 256)
                    .map(|s| s.as_bytes().to_vec()),
            }
        }
        fn special_id(&self, name: &str) -> Option<u32> {
            SPECIALS
                .iter()
                .position(|s| *s == name)
                .map(|i| 256 + i as u32)
        }
        fn is_special(&self, id: u32) -> bool {
            id >= 256
        }
        fn vocab_size(&self) -> usize {
            256 + SPECIALS.len()
        }
    }

    fn tools_json() -> Value {
        json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "additionalProperties": false, "required": ["city", "unit"],
                "properties": {"city": {"type": "string", "maxLength": 8},
                               "unit": {"enum": ["c", "f"]}}}}},
            {"type": "function", "function": {"name": "get_time"}}
        ])
    }

    /// A stand-in model: random logits, the end-of-sequence id always the
    /// most likely (the mask must hold it off), and `script` preferred in
    /// order (what it "means" to write: some thinking, then the close).
    fn run(
        format: &ChatFormat,
        thinking: bool,
        choice: &Choice,
        script: &str,
        seed: u64,
    ) -> Vec<ReplyDelta> {
        let tok = Toy;
        let vocab = tok.vocab_size();
        let tools = callable(Some(&tools_json()), choice).unwrap();
        let stops = [EOS, 256 + 8, 256 + 10];
        let banned = Arc::new(specials_and_stops(&tok, vocab, &stops));
        let r = Reply {
            format,
            tok: &tok,
            thinking,
            banned,
            stops: &stops,
        };
        let steps = program(&r, &tools).unwrap();
        let tok: Arc<dyn Tokenizer> = Arc::new(Toy);
        let mut c = ToolConstraint::new(
            &steps,
            Arc::new(trie(tok.as_ref(), vocab)),
            tok.clone(),
            vocab,
        );
        let want = Toy.encode_trusted(script);
        let (mut at, mut x, mut out) = (0usize, seed, Vec::new());
        while !c.is_done() {
            assert!(out.len() < 4000, "no end: {:?}", tok.decode(&out));
            let mut logits: Vec<f32> = (0..vocab)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 1000) as f32 / 100.0
                })
                .collect();
            logits[EOS as usize] = 50.0;
            logits[usize::from(b'}')] += 8.0;
            logits[usize::from(b'"')] += 4.0;
            if let Some(&w) = want.get(at) {
                logits[w as usize] = 100.0;
            }
            assert!(
                c.mask(&mut logits),
                "nothing allowed after {:?}",
                tok.decode(&out)
            );
            let pick = (0..vocab)
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap() as u32;
            assert!(logits[pick as usize].is_finite());
            if want.get(at) == Some(&pick) {
                at += 1;
            }
            c.accept(pick);
            out.push(pick);
        }
        let text = tok.decode(&out);
        let mut p: Box<dyn ReplyParser> = match format {
            ChatFormat::Xtml => Box::new(XtmlReply::new(thinking)),
            ChatFormat::Jinja(_) => Box::new(TagReply::new(thinking)),
            ChatFormat::Harmony(_) => Box::new(HarmonyReply::new()),
        };
        let mut d = p.push(&text);
        d.extend(p.finish());
        assert!(!out.contains(&EOS), "{text:?}");
        d
    }

    /// The one call among `deltas`, checked against its tool's schema.
    fn the_call(deltas: &[ReplyDelta], choice: &Choice) -> (String, Value) {
        let calls: Vec<_> = deltas
            .iter()
            .filter_map(|d| match d {
                ReplyDelta::ToolCall {
                    name, arguments, ..
                } => Some((name.clone(), arguments.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(calls.len(), 1, "{deltas:?}");
        let (name, args) = calls[0].clone();
        let tools = callable(Some(&tools_json()), choice).unwrap();
        let tool = tools
            .iter()
            .find(|t| t.name == name)
            .expect("a declared tool");
        let mut m = Matcher::new(&tool.args);
        assert!(m.feed(args.trim().as_bytes()) && m.is_complete(), "{args}");
        (name, serde_json::from_str(&args).unwrap())
    }

    #[test]
    fn every_format_replies_with_one_valid_call() {
        let jinja = ChatFormat::Jinja(Box::new(ChatTemplate::new("{{ messages }}").unwrap()));
        let harmony = ChatFormat::Harmony(None);
        let cases: [(&ChatFormat, bool, &str); 5] = [
            (&ChatFormat::Xtml, false, ""),
            (&ChatFormat::Xtml, true, "hmm, the weather.<|close|>"),
            (&jinja, false, ""),
            (&jinja, true, "let me see</think>"),
            (
                &harmony,
                true,
                "<|channel|>analysis<|message|>call it<|end|>",
            ),
        ];
        for (format, thinking, script) in cases {
            for seed in 1..6u64 {
                let choice = Choice::Required;
                let d = run(format, thinking, &choice, script, seed * 7919);
                let (name, _) = the_call(&d, &choice);
                assert!(["get_weather", "get_time"].contains(&name.as_str()));
                let named = Choice::Named("get_weather".into());
                let d = run(format, thinking, &named, script, seed * 104_729);
                let (name, args) = the_call(&d, &named);
                assert_eq!(name, "get_weather");
                assert!(
                    args["city"].is_string()
                        && ["c", "f"].contains(&args["unit"].as_str().unwrap()),
                    "{args}"
                );
            }
        }
    }

    #[test]
    fn tool_choice_values_and_their_errors() {
        assert_eq!(parse(None).unwrap(), None);
        assert_eq!(
            parse(Some(&json!("required"))).unwrap(),
            Some(Choice::Required)
        );
        assert_eq!(
            parse(Some(
                &json!({"type": "function", "function": {"name": "f"}})
            ))
            .unwrap(),
            Some(Choice::Named("f".into()))
        );
        for (bad, needle) in [
            (json!("always"), "\"always\""),
            (
                json!({"type": "tool", "function": {"name": "f"}}),
                "tool_choice.type",
            ),
            (json!({"type": "function", "function": {}}), "function.name"),
            (json!(3), "use auto"),
        ] {
            let e = parse(Some(&bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("tool_choice"));
            assert!(e.message.contains(needle), "{bad}: {}", e.message);
        }
        let named = Choice::Named("nope".into());
        let e = callable(Some(&tools_json()), &named).unwrap_err();
        assert!(
            e.message.contains("\"nope\", which is not in tools"),
            "{}",
            e.message
        );
        let e = callable(None, &Choice::Required).unwrap_err();
        assert!(e.message.contains("no tools"), "{}", e.message);
        let bad_schema = json!([{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "x+"}}}}}]);
        let e = callable(Some(&bad_schema), &Choice::Required).unwrap_err();
        assert!(
            e.message.starts_with("tools[0].function.parameters: "),
            "{}",
            e.message
        );
        // A function without parameters takes none.
        let t = callable(Some(&tools_json()), &Choice::Named("get_time".into())).unwrap();
        let fed = |doc: &[u8]| {
            let mut m = Matcher::new(&t[0].args);
            m.feed(doc) && m.is_complete()
        };
        assert!(fed(b"{}") && fed(b"{ }") && !fed(b"{  }"));
        assert!(!fed(b"{\"a\": 1}"));
        let bad_name = json!([{"type": "function", "function": {"name": "a b"}}]);
        let e = callable(Some(&bad_name), &Choice::Required).unwrap_err();
        assert!(e.message.contains("\"a b\""), "{}", e.message);
    }
}
