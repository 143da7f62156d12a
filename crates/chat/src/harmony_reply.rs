//! Replies in gpt-oss's harmony format, parsed as they stream.
//!
//! The reply follows the generation prompt `<|start|>assistant`, so it
//! opens with the first message's header, e.g.
//! `<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>`.
//! The parser gets the reply's text with special tokens spelled out (the
//! engine decodes them as text), except the stop tokens, which end
//! generation without being part of the text: a reply may therefore stop
//! right after a body, and [`ReplyParser::finish`] closes it.
//!
//! - analysis channel → [`ReplyDelta::Reasoning`];
//! - a header with `to=functions.NAME` (any channel; commentary in practice)
//!   → one [`ReplyDelta::ToolCall`], its body the arguments (a JSON object;
//!   an empty body is `{}`);
//! - anything else (final, a commentary preamble, other recipients, no
//!   channel) → [`ReplyDelta::Content`];
//! - `<|end|>` closes a message, `<|start|>` opens the next,
//!   `<|return|>`/`<|call|>`/`<|endoftext|>` end the reply (later text is
//!   dropped).
//!
//! Malformed text is passed through as content: a header cut short by a
//! closing token or longer than [`MAX_HEADER`], a call whose body is not a
//! JSON object or longer than [`MAX_CALL_BODY`], stray text between messages.
//! Every decision depends on the text only, never on how it was chunked.

use serde_json::Value;

use crate::harmony::{CALL, END, END_OF_TEXT, MESSAGE, RETURN, START};
use crate::reply::{ReplyDelta, ReplyParser, push as merge};
use crate::tag_reply::MAX_CALL_BODY;

/// Longest header (between `<|start|>` and `<|message|>`) waited for; a
/// longer one is given up and released as content.
pub const MAX_HEADER: usize = 1024;

/// Tokens that end a header.
const HEADER_ENDS: [&str; 6] = [MESSAGE, START, END, RETURN, CALL, END_OF_TEXT];
/// Tokens that end a body.
const BODY_ENDS: [&str; 5] = [END, START, RETURN, CALL, END_OF_TEXT];
/// The longest of them (`<|endoftext|>`).
const LONGEST: usize = END_OF_TEXT.len();

#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Reading a header, held in `buf`.
    Header,
    Reasoning,
    Content,
    /// A call to `name`; its body is held in `buf`. `header` is kept to
    /// release the message as text if the call is malformed.
    Call {
        name: String,
        header: String,
    },
    /// The reply has ended.
    Done,
}

/// Harmony replies, parsed as they stream.
pub struct HarmonyReply {
    state: State,
    buf: String,
    calls: usize,
}

impl Default for HarmonyReply {
    fn default() -> Self {
        Self::new()
    }
}

impl HarmonyReply {
    /// A parser for the text after the generation prompt `<|start|>assistant`.
    pub fn new() -> Self {
        HarmonyReply {
            state: State::Header,
            buf: String::new(),
            calls: 0,
        }
    }

    fn content(out: &mut Vec<ReplyDelta>, t: &str) {
        if !t.is_empty() {
            merge(out, ReplyDelta::Content(t.to_string()));
        }
    }

    /// The state after a closing token.
    fn close(&mut self, token: &str) {
        self.state = if token == START || token == END {
            State::Header
        } else {
            State::Done
        };
    }

    fn drain(&mut self, out: &mut Vec<ReplyDelta>, at_end: bool) {
        loop {
            match &self.state {
                State::Done => {
                    self.buf.clear();
                    return;
                }
                State::Header => {
                    if !self.header(out, at_end) {
                        return;
                    }
                }
                State::Call { .. } => {
                    if !self.call(out, at_end) {
                        return;
                    }
                }
                State::Reasoning | State::Content => {
                    if !self.body(out, at_end) {
                        return;
                    }
                }
            }
        }
    }

    /// Reads a header; false when more text is needed.
    fn header(&mut self, out: &mut Vec<ReplyDelta>, at_end: bool) -> bool {
        match earliest(&self.buf, &HEADER_ENDS) {
            Some((i, token)) if i <= MAX_HEADER => {
                let header: String = self.buf.drain(..i).collect();
                self.buf.drain(..token.len());
                if token == MESSAGE {
                    self.state = classify(&header);
                } else {
                    // No `<|message|>`: the header was text after all.
                    Self::content(out, &header);
                    self.close(token);
                }
                true
            }
            found if found.is_some() || self.buf.len() >= MAX_HEADER + LONGEST => {
                let cut = floor_char_boundary(&self.buf, MAX_HEADER);
                let text: String = self.buf.drain(..cut).collect();
                Self::content(out, &text);
                self.state = State::Content;
                true
            }
            _ if at_end => {
                let text = std::mem::take(&mut self.buf);
                Self::content(out, &text);
                false
            }
            _ => false,
        }
    }

    /// Collects a call's body; false when more text is needed.
    fn call(&mut self, out: &mut Vec<ReplyDelta>, at_end: bool) -> bool {
        let State::Call { name, header } = &self.state else {
            return false;
        };
        let (name, header) = (name.clone(), header.clone());
        match earliest(&self.buf, &BODY_ENDS) {
            Some((i, token)) if i <= MAX_CALL_BODY => {
                let body: String = self.buf.drain(..i).collect();
                self.buf.drain(..token.len());
                self.emit_call(out, name, &header, &body);
                self.close(token);
                true
            }
            found if found.is_some() || self.buf.len() >= MAX_CALL_BODY + LONGEST => {
                // Too long for a call: the message is text, and so is the rest.
                let cut = floor_char_boundary(&self.buf, MAX_CALL_BODY);
                let body: String = self.buf.drain(..cut).collect();
                Self::content(out, &format!("{header}{MESSAGE}{body}"));
                self.state = State::Content;
                true
            }
            _ if at_end => {
                let body = std::mem::take(&mut self.buf);
                self.emit_call(out, name, &header, &body);
                self.state = State::Done;
                false
            }
            _ => false,
        }
    }

    fn emit_call(&mut self, out: &mut Vec<ReplyDelta>, name: String, header: &str, body: &str) {
        let arguments = match body.trim() {
            "" => Some("{}".to_string()),
            t => match serde_json::from_str::<Value>(t) {
                Ok(v @ Value::Object(_)) => Some(v.to_string()),
                _ => None,
            },
        };
        match arguments {
            Some(arguments) => {
                out.push(ReplyDelta::ToolCall {
                    index: self.calls,
                    name,
                    arguments,
                });
                self.calls += 1;
            }
            None => Self::content(out, &format!("{header}{MESSAGE}{body}")),
        }
    }

    /// Streams a reasoning or content body; false when more text is needed.
    fn body(&mut self, out: &mut Vec<ReplyDelta>, at_end: bool) -> bool {
        let reasoning = self.state == State::Reasoning;
        let emit = |out: &mut Vec<ReplyDelta>, t: String| {
            if !t.is_empty() {
                merge(
                    out,
                    if reasoning {
                        ReplyDelta::Reasoning(t)
                    } else {
                        ReplyDelta::Content(t)
                    },
                );
            }
        };
        let Some(i) = self.buf.find("<|") else {
            // A trailing `<` may begin a token.
            let keep = usize::from(!at_end && self.buf.ends_with('<'));
            let t: String = self.buf.drain(..self.buf.len() - keep).collect();
            emit(out, t);
            return false;
        };
        emit(out, self.buf.drain(..i).collect());
        let rest = self.buf.as_str();
        if let Some(token) = BODY_ENDS.iter().find(|t| rest.starts_with(**t)) {
            self.buf.drain(..token.len());
            self.close(token);
            return true;
        }
        if !at_end && BODY_ENDS.iter().any(|t| t.starts_with(rest)) {
            return false;
        }
        self.buf.drain(..2);
        emit(out, "<|".to_string());
        true
    }
}

impl ReplyParser for HarmonyReply {
    fn push(&mut self, text: &str) -> Vec<ReplyDelta> {
        if self.state == State::Done {
            return Vec::new();
        }
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.drain(&mut out, false);
        out
    }

    fn finish(&mut self) -> Vec<ReplyDelta> {
        let mut out = Vec::new();
        self.drain(&mut out, true);
        self.state = State::Done;
        out
    }
}

/// The first of `tokens` in `s`: its offset and which.
fn earliest(s: &str, tokens: &[&'static str]) -> Option<(usize, &'static str)> {
    tokens
        .iter()
        .filter_map(|t| s.find(t).map(|i| (i, *t)))
        .min_by_key(|&(i, _)| i)
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// What a message's header makes of its body.
fn classify(header: &str) -> State {
    let h = parse_header(header);
    if let Some(name) = h
        .recipient
        .as_deref()
        .and_then(|r| r.strip_prefix("functions."))
        .filter(|n| !n.is_empty())
    {
        return State::Call {
            name: name.to_string(),
            header: header.to_string(),
        };
    }
    if h.channel.as_deref() == Some("analysis") {
        State::Reasoning
    } else {
        State::Content
    }
}

/// A header's channel and recipient.
#[derive(Debug, Default, PartialEq)]
struct Header {
    channel: Option<String>,
    recipient: Option<String>,
}

/// `ROLE [to=R]<|channel|>CHANNEL [to=R] [<|constrain|>TYPE]`, in any order
/// of the words: the channel is the word after `<|channel|>`, the recipient
/// the word starting `to=`; `<|constrain|>`'s word is not needed.
fn parse_header(header: &str) -> Header {
    let mut h = Header::default();
    // Words, with each special spelled as its own word.
    let spaced = header.replace("<|", " <|").replace("|>", "|> ");
    let mut words = spaced.split_whitespace().peekable();
    while let Some(w) = words.next() {
        match w {
            "<|channel|>" => {
                if let Some(c) = words.next_if(|c| !c.starts_with("<|")) {
                    h.channel = Some(c.to_string());
                }
            }
            "<|constrain|>" => {
                words.next_if(|c| !c.starts_with("<|"));
            }
            w => {
                if let Some(r) = w.strip_prefix("to=") {
                    h.recipient = Some(r.to_string());
                }
            }
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(out: &mut Vec<ReplyDelta>, ds: Vec<ReplyDelta>) {
        for d in ds {
            match d {
                ReplyDelta::ToolCall { .. } => out.push(d),
                d => merge(out, d),
            }
        }
    }

    /// Pushes `text` cut at `cuts` (byte offsets on char boundaries).
    fn pieces(text: &str, cuts: &[usize]) -> Vec<ReplyDelta> {
        let mut p = HarmonyReply::new();
        let mut out = Vec::new();
        let mut at = 0;
        for &c in cuts.iter().chain(std::iter::once(&text.len())) {
            collect(&mut out, p.push(&text[at..c]));
            at = c;
        }
        collect(&mut out, p.finish());
        out
    }

    fn whole(text: &str) -> Vec<ReplyDelta> {
        pieces(text, &[])
    }

    /// The same result for every single cut, and char by char.
    fn same_for_every_split(text: &str) -> Vec<ReplyDelta> {
        let want = whole(text);
        let bounds: Vec<usize> = (0..=text.len())
            .filter(|&c| text.is_char_boundary(c))
            .collect();
        for &c in &bounds {
            assert_eq!(pieces(text, &[c]), want, "cut at {c} of {text:?}");
        }
        assert_eq!(pieces(text, &bounds), want, "char by char: {text:?}");
        want
    }

    fn reasoning(t: &str) -> ReplyDelta {
        ReplyDelta::Reasoning(t.into())
    }
    fn content(t: &str) -> ReplyDelta {
        ReplyDelta::Content(t.into())
    }
    fn call(index: usize, name: &str, arguments: &str) -> ReplyDelta {
        ReplyDelta::ToolCall {
            index,
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    const ANSWER: &str = "<|channel|>analysis<|message|>2<3 and a<b; <|x|> ünï.<|end|>\
                          <|start|>assistant<|channel|>final<|message|>It is 4 <ok>.<|return|>";

    #[test]
    fn analysis_is_reasoning_and_final_is_content() {
        let want = vec![
            reasoning("2<3 and a<b; <|x|> ünï."),
            content("It is 4 <ok>."),
        ];
        assert_eq!(same_for_every_split(ANSWER), want);
        // As the engine delivers it: the stop token is not in the text.
        let cut = ANSWER.strip_suffix("<|return|>").unwrap();
        assert_eq!(same_for_every_split(cut), want);
        // Text after the end of the reply is dropped.
        assert_eq!(same_for_every_split(&format!("{ANSWER}more")), want);
    }

    const CALL_REPLY: &str = "<|channel|>analysis<|message|>Need weather.<|end|>\
        <|start|>assistant<|channel|>commentary to=functions.get_weather \
        <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": [1, 2]}<|call|>";

    #[test]
    fn a_commentary_message_to_a_function_is_a_tool_call() {
        let want = vec![
            reasoning("Need weather."),
            call(0, "get_weather", r#"{"city":"Paris","days":[1,2]}"#),
        ];
        assert_eq!(same_for_every_split(CALL_REPLY), want);
        let cut = CALL_REPLY.strip_suffix("<|call|>").unwrap();
        assert_eq!(same_for_every_split(cut), want);
        // The recipient may come before the channel; an empty body is `{}`.
        let early = "<|channel|>analysis<|message|>x<|end|>\
                     <|start|>assistant to=functions.now<|channel|>commentary<|message|>";
        assert_eq!(
            same_for_every_split(early),
            vec![reasoning("x"), call(0, "now", "{}")]
        );
    }

    #[test]
    fn preambles_and_other_recipients_are_content_and_calls_count() {
        let text = "<|channel|>commentary<|message|>Let me check.<|end|>\
                    <|start|>assistant<|channel|>commentary to=functions.a<|message|>{}<|end|>\
                    <|start|>assistant<|channel|>analysis to=python<|message|>print(1)<|end|>\
                    <|start|>assistant<|channel|>commentary to=functions.b<|message|>{\"k\":1}<|call|>";
        assert_eq!(
            same_for_every_split(text),
            vec![
                content("Let me check."),
                call(0, "a", "{}"),
                reasoning("print(1)"),
                call(1, "b", r#"{"k":1}"#),
            ]
        );
    }

    #[test]
    fn malformed_text_passes_through_as_content() {
        // No header at all.
        assert_eq!(
            same_for_every_split("Just text <|"),
            vec![content("Just text <|")]
        );
        // A header cut short by `<|end|>`, then a proper message.
        assert_eq!(
            same_for_every_split("oops<|end|><|start|>assistant<|channel|>final<|message|>ok"),
            vec![content("oopsok")]
        );
        // Stray text before `<|start|>`.
        assert_eq!(
            same_for_every_split(
                "<|channel|>final<|message|>a<|end|>\n<|start|>assistant<|channel|>final<|message|>b"
            ),
            vec![content("a\nb")]
        );
        // Call bodies that are not a JSON object.
        for body in ["not json", "[1, 2]", "{\"a\": 1", "\"s\""] {
            let text = format!("<|channel|>commentary to=functions.f<|message|>{body}<|call|>");
            assert_eq!(
                same_for_every_split(&text),
                vec![content(&format!(
                    "<|channel|>commentary to=functions.f<|message|>{body}"
                ))],
                "{body}"
            );
        }
        // `to=functions.` without a name is no call.
        assert_eq!(
            same_for_every_split("<|channel|>commentary to=functions.<|message|>{}"),
            vec![content("{}")]
        );
        // An unterminated header is released by `finish`.
        assert_eq!(
            same_for_every_split("<|channel|>analy"),
            vec![content("<|channel|>analy")]
        );
        assert_eq!(whole(""), vec![]);
    }

    #[test]
    fn streaming_releases_text_as_soon_as_it_is_decided() {
        let mut p = HarmonyReply::new();
        assert_eq!(p.push("<|channel|>analysis<|mess"), vec![]);
        assert_eq!(p.push("age|>think"), vec![reasoning("think")]);
        assert_eq!(p.push("ing <"), vec![reasoning("ing ")]);
        assert_eq!(p.push("|en"), vec![]);
        assert_eq!(
            p.push("d|><|start|>assistant<|channel|>final<|message|>Hi"),
            vec![content("Hi")]
        );
        assert_eq!(p.push("<|return|>ignored"), vec![]);
        assert_eq!(p.push("more"), vec![]);
        assert_eq!(p.finish(), vec![]);
    }

    #[test]
    fn held_back_text_is_bounded() {
        // A header that never ends.
        let mut p = HarmonyReply::new();
        let mut out = Vec::new();
        for _ in 0..40 {
            collect(&mut out, p.push(&"h".repeat(100)));
            assert!(p.buf.len() < MAX_HEADER + LONGEST + 100);
        }
        assert_eq!(out, vec![content(&"h".repeat(4000))]);
        // A call body that never ends.
        let mut q = HarmonyReply::new();
        let mut out = Vec::new();
        collect(
            &mut out,
            q.push("<|channel|>commentary to=functions.f<|message|>{\"a\": \""),
        );
        for _ in 0..70 {
            collect(&mut out, q.push(&"z".repeat(1024)));
            assert!(q.buf.len() <= MAX_CALL_BODY + LONGEST + 1024);
        }
        assert!(
            matches!(&out[..], [ReplyDelta::Content(t)] if t.starts_with("<|channel|>commentary"))
        );
        assert_eq!(q.push("<|call|>"), vec![]);
        // The give-up point does not depend on chunking.
        let long = format!(
            "<|channel|>commentary to=functions.f<|message|>{}<|call|>",
            "é".repeat(MAX_CALL_BODY)
        );
        let cuts = |t: &str, at: &[usize]| -> Vec<usize> {
            at.iter().map(|&c| floor_char_boundary(t, c)).collect()
        };
        assert_eq!(
            pieces(&long, &cuts(&long, &[100, 70_001, 70_003])),
            whole(&long)
        );
        let h = format!("{}<|message|>x", "ü".repeat(MAX_HEADER));
        assert_eq!(pieces(&h, &cuts(&h, &[2, MAX_HEADER + 2])), whole(&h));
    }

    #[test]
    fn headers_parse_in_any_order() {
        let h = parse_header("<|channel|>commentary to=functions.get <|constrain|>json");
        assert_eq!(h.channel.as_deref(), Some("commentary"));
        assert_eq!(h.recipient.as_deref(), Some("functions.get"));
        let h = parse_header("assistant to=functions.x<|channel|>commentary json");
        assert_eq!(h.recipient.as_deref(), Some("functions.x"));
        assert_eq!(h.channel.as_deref(), Some("commentary"));
        assert_eq!(
            parse_header("assistant<|channel|><|constrain|>"),
            Header::default()
        );
    }
}
