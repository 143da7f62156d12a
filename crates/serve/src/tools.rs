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
//! ARGS is a JSON object matching the function's `parameters` schema (any
//! object when it has none). One call per reply.

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
        let args = match f.get("parameters") {
            None | Some(Value::Null) => Grammar::json_object(),
            Some(schema) => Grammar::from_schema(schema).map_err(|e| {
                ApiError::invalid("tools", format!("tools[{i}].function.parameters: {e}"))
            })?,
        };
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
