//! Splitting a generated reply into reasoning, content and tool calls, as
//! it streams.
//!
//! Parsers take the reply's text piece by piece (special tokens spelled
//! out) and return what is certain so far: text that might still turn out
//! to be markup is held back until it is decided.

use serde_json::{Map, Value};

use crate::k3::{CLOSE, END_OF_MSG, OPEN, SEP};

/// Part of a reply.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyDelta {
    Reasoning(String),
    Content(String),
    /// A complete tool call; `arguments` is a JSON object as text.
    ToolCall {
        index: usize,
        name: String,
        arguments: String,
    },
}

/// Parses one reply incrementally.
pub trait ReplyParser: Send {
    fn push(&mut self, text: &str) -> Vec<ReplyDelta>;
    /// Releases whatever is held back.
    fn finish(&mut self) -> Vec<ReplyDelta>;
}

/// Formats without channels: everything is content.
pub struct PlainReply;

impl ReplyParser for PlainReply {
    fn push(&mut self, text: &str) -> Vec<ReplyDelta> {
        if text.is_empty() {
            Vec::new()
        } else {
            vec![ReplyDelta::Content(text.to_string())]
        }
    }
    fn finish(&mut self) -> Vec<ReplyDelta> {
        Vec::new()
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Channel {
    Think,
    Response,
    /// Between blocks, inside `tools`, or after the message: markup only.
    Outside,
    /// Inside a call: collecting an argument's value.
    Argument {
        key: String,
        kind: String,
    },
    /// Inside a call: a raw `json` arguments block.
    Json,
}

/// Kimi XTML replies: `think`, `response` and `tools` blocks.
pub struct XtmlReply {
    channel: Channel,
    buf: String,
    call: Option<(String, Map<String, Value>, Option<String>)>,
    value: String,
    calls: usize,
}

/// Longest markup (tag with attributes) held back before it is given up as text.
const MAX_TAG: usize = 4096;

impl XtmlReply {
    pub fn new(thinking: bool) -> Self {
        XtmlReply {
            channel: if thinking {
                Channel::Think
            } else {
                Channel::Response
            },
            buf: String::new(),
            call: None,
            value: String::new(),
            calls: 0,
        }
    }

    fn text(&mut self, t: &str, out: &mut Vec<ReplyDelta>) {
        if t.is_empty() {
            return;
        }
        match &self.channel {
            Channel::Think => push(out, ReplyDelta::Reasoning(t.to_string())),
            Channel::Response => push(out, ReplyDelta::Content(t.to_string())),
            Channel::Argument { .. } | Channel::Json => self.value.push_str(t),
            Channel::Outside => {
                // Stray text between blocks is content (whitespace is dropped).
                if !t.trim().is_empty() && self.call.is_none() {
                    push(out, ReplyDelta::Content(t.to_string()));
                }
            }
        }
    }

    /// Acts on one piece of markup (`open`: `<|open|>`, else `<|close|>`).
    fn tag(&mut self, open: bool, tag: &str, out: &mut Vec<ReplyDelta>) {
        let (name, attrs) = parse_tag(tag);
        let attr = |k: &str| attrs.iter().find(|(a, _)| a == k).map(|(_, v)| v.clone());
        match (open, name.as_str()) {
            (true, "think") => self.channel = Channel::Think,
            (true, "response") => self.channel = Channel::Response,
            (true, "call") => {
                self.call = Some((attr("tool").unwrap_or_default(), Map::new(), None));
                self.channel = Channel::Outside;
            }
            (true, "argument") => {
                self.value.clear();
                self.channel = Channel::Argument {
                    key: attr("key").unwrap_or_default(),
                    kind: attr("type").unwrap_or_else(|| "string".into()),
                };
            }
            (true, "json") => {
                self.value.clear();
                self.channel = Channel::Json;
            }
            (false, "argument") => {
                if let (Channel::Argument { key, kind }, Some(call)) =
                    (&self.channel, &mut self.call)
                {
                    let v = typed_value(kind, &self.value);
                    call.1.insert(key.clone(), v);
                }
                self.channel = Channel::Outside;
            }
            (false, "json") => {
                if let Some(call) = &mut self.call {
                    call.2 = Some(std::mem::take(&mut self.value));
                }
                self.channel = Channel::Outside;
            }
            (false, "call") => {
                if let Some((name, args, raw)) = self.call.take() {
                    let arguments = raw.unwrap_or_else(|| Value::Object(args).to_string());
                    out.push(ReplyDelta::ToolCall {
                        index: self.calls,
                        name,
                        arguments,
                    });
                    self.calls += 1;
                }
                self.channel = Channel::Outside;
            }
            _ => self.channel = Channel::Outside,
        }
    }

    fn drain(&mut self, out: &mut Vec<ReplyDelta>, at_end: bool) {
        loop {
            let Some(i) = self.buf.find("<|") else {
                let keep = if at_end {
                    0
                } else {
                    usize::from(self.buf.ends_with('<'))
                };
                let t: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.text(&t, out);
                return;
            };
            let before: String = self.buf.drain(..i).collect();
            self.text(&before, out);
            let rest = self.buf.as_str();
            let special = [OPEN, CLOSE, END_OF_MSG, SEP]
                .into_iter()
                .find(|s| rest.starts_with(s));
            let Some(special) = special else {
                let undecided = [OPEN, CLOSE, END_OF_MSG, SEP]
                    .iter()
                    .any(|s| s.starts_with(rest));
                if undecided && !at_end {
                    return;
                }
                self.buf.drain(..2);
                self.text("<|", out);
                continue;
            };
            if special == END_OF_MSG || special == SEP {
                self.buf.drain(..special.len());
                continue;
            }
            match rest[special.len()..].find(SEP) {
                Some(j) => {
                    let tag = rest[special.len()..special.len() + j].to_string();
                    self.buf.drain(..special.len() + j + SEP.len());
                    self.tag(special == OPEN, &tag, out);
                }
                None if !at_end && rest.len() < MAX_TAG => return,
                None => {
                    let t: String = self.buf.drain(..special.len()).collect();
                    self.text(&t, out);
                }
            }
        }
    }
}

impl ReplyParser for XtmlReply {
    fn push(&mut self, text: &str) -> Vec<ReplyDelta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.drain(&mut out, false);
        out
    }
    fn finish(&mut self) -> Vec<ReplyDelta> {
        let mut out = Vec::new();
        self.drain(&mut out, true);
        out
    }
}

/// Appends, merging with a previous delta of the same kind.
pub(crate) fn push(out: &mut Vec<ReplyDelta>, d: ReplyDelta) {
    match (out.last_mut(), &d) {
        (Some(ReplyDelta::Reasoning(a)), ReplyDelta::Reasoning(b))
        | (Some(ReplyDelta::Content(a)), ReplyDelta::Content(b)) => a.push_str(b),
        _ => out.push(d),
    }
}

/// `name key="v" …` → name and unescaped attributes.
fn parse_tag(tag: &str) -> (String, Vec<(String, String)>) {
    let tag = tag.trim();
    let (name, mut rest) = tag.split_once(' ').unwrap_or((tag, ""));
    let mut attrs = Vec::new();
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim().to_string();
        let after = &rest[eq + 2..];
        let Some(end) = after.find('"') else { break };
        let v = after[..end].replace("&quot;", "\"").replace("&amp;", "&");
        attrs.push((key, v));
        rest = &after[end + 1..];
    }
    (name.to_string(), attrs)
}

/// An argument's value by its declared type (text kept as a string when it
/// does not parse).
fn typed_value(kind: &str, text: &str) -> Value {
    if kind == "string" {
        return Value::String(text.to_string());
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(p: &mut dyn ReplyParser, text: &str, step: usize) -> Vec<ReplyDelta> {
        let chars: Vec<char> = text.chars().collect();
        let mut out = Vec::new();
        for c in chars.chunks(step) {
            for d in p.push(&c.iter().collect::<String>()) {
                push_any(&mut out, d);
            }
        }
        for d in p.finish() {
            push_any(&mut out, d);
        }
        out
    }

    fn push_any(out: &mut Vec<ReplyDelta>, d: ReplyDelta) {
        match d {
            ReplyDelta::ToolCall { .. } => out.push(d),
            d => push(out, d),
        }
    }

    const REPLY: &str = "Let me see <b>.<|close|>think<|sep|><|open|>response<|sep|>It is 4 & <|x|>.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"add\" index=\"0\"<|sep|><|open|>argument key=\"a\" type=\"number\"<|sep|>2<|close|>argument<|sep|><|open|>argument key=\"q&quot;\" type=\"string\"<|sep|>x<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";

    #[test]
    fn xtml_reply_splits_channels_and_calls_whatever_the_chunking() {
        let want = vec![
            ReplyDelta::Reasoning("Let me see <b>.".into()),
            ReplyDelta::Content("It is 4 & <|x|>.".into()),
            ReplyDelta::ToolCall {
                index: 0,
                name: "add".into(),
                arguments: r#"{"a":2,"q\"":"x"}"#.into(),
            },
        ];
        for step in [1, 2, 3, 7, 1000] {
            let mut p = XtmlReply::new(true);
            assert_eq!(all(&mut p, REPLY, step), want, "chunks of {step}");
        }
    }

    #[test]
    fn xtml_without_thinking_is_content_and_holds_back_only_markup_prefixes() {
        let mut p = XtmlReply::new(false);
        assert_eq!(p.push("a <"), vec![ReplyDelta::Content("a ".into())]);
        assert_eq!(p.push("|clo"), vec![]);
        assert_eq!(p.push("se|>response<|sep|>"), vec![]);
        assert_eq!(p.push("tail"), vec![ReplyDelta::Content("tail".into())]);
        let mut q = XtmlReply::new(false);
        assert_eq!(q.push("x <|op"), vec![ReplyDelta::Content("x ".into())]);
        assert_eq!(q.finish(), vec![ReplyDelta::Content("<|op".into())]);
    }
}
