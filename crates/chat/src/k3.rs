//! Kimi K3 "XTML" chat rendering.
//!
//! Facts follow `docs/k3-tokenizer-chat.md` and the released `encoding_k3.py` as seen
//! through public ports (the system texts below are the released strings):
//! - tags: `<|open|>` tag ` key="value"`… `<|sep|>` … `<|close|>` tag `<|sep|>`;
//!   attribute values escape `&` → `&amp;` and `"` → `&quot;`;
//! - every message ends with `<|end_of_msg|>`; no BOS;
//! - generated system messages: `tool-declare` (when tools are given), then
//!   `thinking-effort` (default effort `max`), the conversation, then `tool-choice` and
//!   `response-format` when requested;
//! - generation prompt: `<|open|>message role="assistant"<|sep|>` + `<|open|>think<|sep|>`
//!   (thinking) or `<|open|>response<|sep|>` (thinking off).
//!
//! Output is [`Segment`]s: special tokens are `Trusted`, everything else — tag names,
//! attributes and content — is `Text`. That keeps ids identical to encoding the whole
//! rendered string with specials allowed (specials split the text either way), while a
//! special spelled inside content or a `name` attribute stays ordinary text.

use serde_json::Value;

use crate::ChatError;
use crate::message::{Content, Message};
use crate::pyjson::deep_sort_keys;
use crate::segment::{Segment, SegmentWriter};
use crate::tool_args::{RenderedArgs, render_args};

/// Special-token spellings used by the template.
pub const OPEN: &str = "<|open|>";
pub const CLOSE: &str = "<|close|>";
pub const SEP: &str = "<|sep|>";
pub const END_OF_MSG: &str = "<|end_of_msg|>";

/// How much the model should think; rendered into the `thinking-effort` message.
/// (`medium` is named in the released text but not accepted by the released renderer.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkingEffort {
    Low,
    High,
    Max,
}

impl ThinkingEffort {
    /// The spelling used in the prompt.
    pub fn as_str(self) -> &'static str {
        match self {
            ThinkingEffort::Low => "low",
            ThinkingEffort::High => "high",
            ThinkingEffort::Max => "max",
        }
    }
}

/// `tool_choice` values that add a system message (`auto` adds none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    Required,
    None,
}

/// `response_format` values that add a system message.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    Text,
    JsonObject,
    /// The JSON schema the response must match.
    JsonSchema(Value),
}

/// Rendering options; `Default` is the released default (thinking on, effort `max`).
#[derive(Debug, Clone, PartialEq)]
pub struct K3Options {
    /// Emit think blocks and end the prompt in the think channel.
    pub thinking: bool,
    /// Effort for the `thinking-effort` message (only when `thinking`); `None` omits it.
    pub thinking_effort: Option<ThinkingEffort>,
    /// End with the assistant's opening tags.
    pub add_generation_prompt: bool,
    /// Tool specs (OpenAI `tools` array) for the `tool-declare` message.
    pub tools: Option<Value>,
    pub tool_choice: Option<ToolChoice>,
    pub response_format: Option<ResponseFormat>,
}

impl Default for K3Options {
    fn default() -> Self {
        Self {
            thinking: true,
            thinking_effort: Some(ThinkingEffort::Max),
            add_generation_prompt: true,
            tools: None,
            tool_choice: None,
            response_format: None,
        }
    }
}

/// The released `thinking-effort` message body.
pub fn thinking_effort_text(effort: ThinkingEffort) -> String {
    format!(
        "`thinking_effort` guides on how much to think in your thinking channel \
         (not including the response channel), supported values include `low`, \
         `medium`, `high`, and `max`.\nNow the system is invoked with \
         `thinking_effort={}`.",
        effort.as_str()
    )
}

/// Escapes an attribute value.
pub fn escape_attr(value: &str) -> String {
    value.replace('&', "&amp;").replace('"', "&quot;")
}

/// Renders a conversation to segments.
pub fn render_k3(messages: &[Message], options: &K3Options) -> Result<Vec<Segment>, ChatError> {
    let mut w = Xtml::default();
    if let Some(tools) = options.tools.as_ref().filter(|t| !is_empty_list(t)) {
        w.tool_declare(&deep_sort_keys(tools), false);
    }
    if options.thinking
        && let Some(effort) = options.thinking_effort
    {
        w.internal_system("thinking-effort", &thinking_effort_text(effort));
    }
    let messages = order_tool_results(messages);
    let mut last_calls: &[crate::message::ToolCall] = &[];
    let mut tool_index = 0usize;
    for (index, m) in messages.iter().enumerate() {
        match m.role.as_str() {
            "system" if m.tools.is_some() => {
                let tools = m.tools.as_ref().map(deep_sort_keys).unwrap_or(Value::Null);
                w.tool_declare(&tools, true);
            }
            "user" | "system" => {
                let mut attrs = vec![("role", m.role.clone())];
                attrs.extend(m.name.clone().map(|n| ("name", n)));
                w.message(&attrs, &content_text(m, index)?);
            }
            "tool" => {
                tool_index += 1;
                let name = m
                    .tool
                    .clone()
                    .or_else(|| m.name.clone())
                    .or_else(|| {
                        last_calls
                            .get(tool_index - 1)
                            .map(|c| c.function.name.clone())
                    })
                    .ok_or(ChatError::UnnamedToolResult { index })?;
                let attrs = [
                    ("role", "tool".to_string()),
                    ("tool", name),
                    ("index", tool_index.to_string()),
                ];
                w.message(&attrs, &content_text(m, index)?);
            }
            "assistant" => {
                last_calls = &m.tool_calls;
                tool_index = 0;
                let mut attrs = vec![("role", "assistant".to_string())];
                attrs.extend(m.name.clone().map(|n| ("name", n)));
                w.open("message", &attrs);
                w.assistant_body(m, index, options.thinking)?;
                w.close("message");
                w.special(END_OF_MSG);
            }
            other => {
                return Err(ChatError::UnknownRole {
                    index,
                    role: other.to_string(),
                });
            }
        }
    }
    w.tool_choice(options.tool_choice);
    w.response_format(options.response_format.as_ref());
    if options.add_generation_prompt {
        w.open("message", &[("role", "assistant".to_string())]);
        w.open(
            if options.thinking {
                "think"
            } else {
                "response"
            },
            &[],
        );
    }
    Ok(w.out.finish())
}

fn is_empty_list(v: &Value) -> bool {
    matches!(v, Value::Null) || v.as_array().is_some_and(Vec::is_empty)
}

/// Text of a message's content; image or other non-text parts are an error.
pub(crate) fn content_text(m: &Message, index: usize) -> Result<String, ChatError> {
    match &m.content {
        None => Ok(String::new()),
        Some(Content::Text(s)) => Ok(s.clone()),
        Some(Content::Parts(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => out.push_str(t),
                    ("text", None) => {}
                    (kind, _) => {
                        return Err(ChatError::UnsupportedContent {
                            index,
                            kind: kind.to_string(),
                        });
                    }
                }
            }
            Ok(out)
        }
    }
}

/// Puts each run of tool results in the order of the preceding assistant's calls and
/// names them after the call, when every result's `tool_call_id` matches a call (as
/// the released renderer does); otherwise leaves the run as given.
fn order_tool_results(messages: &[Message]) -> Vec<Message> {
    let mut out = Vec::with_capacity(messages.len());
    let mut calls: &[crate::message::ToolCall] = &[];
    let mut i = 0;
    while i < messages.len() {
        if messages[i].role != "tool" {
            if messages[i].role == "assistant" {
                calls = &messages[i].tool_calls;
            }
            out.push(messages[i].clone());
            i += 1;
            continue;
        }
        let start = i;
        while i < messages.len() && messages[i].role == "tool" {
            i += 1;
        }
        let run = &messages[start..i];
        let positions: Option<Vec<usize>> = run
            .iter()
            .map(|m| {
                let id = m.tool_call_id.as_deref()?;
                calls.iter().position(|c| c.id.as_deref() == Some(id))
            })
            .collect();
        match positions {
            Some(pos) => {
                let mut order: Vec<usize> = (0..run.len()).collect();
                order.sort_by_key(|&k| pos[k]);
                for k in order {
                    let mut m = run[k].clone();
                    let name = calls[pos[k]].function.name.clone();
                    if m.name.is_some() {
                        m.name = Some(name.clone());
                    }
                    m.tool = Some(name);
                    out.push(m);
                }
            }
            None => out.extend(run.iter().cloned()),
        }
    }
    out
}

/// Writes XTML markup into segments.
#[derive(Default)]
struct Xtml {
    out: SegmentWriter,
}

impl Xtml {
    fn special(&mut self, s: &str) {
        self.out.trusted(s);
    }

    fn open(&mut self, tag: &str, attrs: &[(&str, String)]) {
        self.special(OPEN);
        let mut text = tag.to_string();
        for (k, v) in attrs {
            text.push_str(&format!(" {k}=\"{}\"", escape_attr(v)));
        }
        self.out.text(&text);
        self.special(SEP);
    }

    fn close(&mut self, tag: &str) {
        self.special(CLOSE);
        self.out.text(tag);
        self.special(SEP);
    }

    fn message(&mut self, attrs: &[(&str, String)], body: &str) {
        self.open("message", attrs);
        self.out.text(body);
        self.close("message");
        self.special(END_OF_MSG);
    }

    fn internal_system(&mut self, kind: &str, body: &str) {
        let attrs = [("role", "system".to_string()), ("type", kind.to_string())];
        self.message(&attrs, body.trim());
    }

    fn tool_declare(&mut self, tools: &Value, dynamic: bool) {
        // Compact JSON (`separators=(",", ":")`), keys already sorted.
        let json = serde_json::to_string(tools).unwrap_or_default();
        let body = if dynamic {
            format!(
                "## New Tools Available\nThe system dynamically extends the toolset via \
                 lazy-loading.\nYou have access to all existing and extended tools.\nHere are \
                 the specs for the extended tools.\n\n```json\n{json}\n```"
            )
        } else {
            format!(
                "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{json}\n```"
            )
        };
        let attrs = [
            ("role", "system".to_string()),
            ("type", "tool-declare".to_string()),
        ];
        self.message(&attrs, &body);
    }

    fn assistant_body(
        &mut self,
        m: &Message,
        index: usize,
        thinking: bool,
    ) -> Result<(), ChatError> {
        if thinking {
            self.open("think", &[]);
            self.out.text(m.reasoning_content.as_deref().unwrap_or(""));
            self.close("think");
        }
        self.open("response", &[]);
        self.out.text(&content_text(m, index)?);
        self.close("response");
        if m.tool_calls.is_empty() {
            return Ok(());
        }
        self.open("tools", &[]);
        for (k, call) in m.tool_calls.iter().enumerate() {
            let attrs = [
                ("tool", call.function.name.clone()),
                ("index", (k + 1).to_string()),
            ];
            self.open("call", &attrs);
            match render_args(&call.function.arguments) {
                Some(RenderedArgs::Fields(fields)) => {
                    for (key, kind, value) in fields {
                        let attrs = [("key", key), ("type", kind.to_string())];
                        self.open("argument", &attrs);
                        self.out.text(&value);
                        self.close("argument");
                    }
                }
                Some(RenderedArgs::RawJson(raw)) => {
                    self.open("json", &[("type", "object".to_string())]);
                    self.out.text(&raw);
                    self.close("json");
                }
                None => return Err(ChatError::BadToolArguments { index, call: k + 1 }),
            }
            self.close("call");
        }
        self.close("tools");
        Ok(())
    }

    fn tool_choice(&mut self, choice: Option<ToolChoice>) {
        let body = match choice {
            Some(ToolChoice::Required) => {
                "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
            }
            Some(ToolChoice::None) => {
                "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
            }
            Some(ToolChoice::Auto) | None => return,
        };
        self.internal_system("tool-choice", body);
    }

    fn response_format(&mut self, format: Option<&ResponseFormat>) {
        const RAW: &str = "Your response must be raw JSON data without markdown code blocks \
                           (```json) or any additional formatting.";
        let body = match format {
            Some(ResponseFormat::JsonObject) => {
                format!("The system is invoked with `response_format=json_object`.\n{RAW}")
            }
            Some(ResponseFormat::JsonSchema(schema)) => format!(
                "The system is invoked with `response_format=json_schema`.\n{RAW}\nThe JSON \
                 data must match the following schema:\n```json\n{}\n```",
                serde_json::to_string(schema).unwrap_or_default()
            ),
            Some(ResponseFormat::Text) | None => return,
        };
        self.internal_system("response-format", &body);
    }
}
