//! Replies of models served through Jinja templates (Qwen3, DeepSeek-R1/V3,
//! Kimi K2): reasoning between `<think>` and `</think>`, tool calls as
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
//!
//! Text is kept verbatim: the newline models usually write right after
//! `<think>` or `</think>` stays in the reasoning or content it belongs to
//! (templates differ on it, and dropping it would lose text if a model does
//! not write one).

use serde_json::Value;

use crate::reply::{ReplyDelta, ReplyParser};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// Longest tool-call body held back waiting for `</tool_call>`; a longer
/// one is given up and released as content.
pub const MAX_CALL_BODY: usize = 64 * 1024;

/// Whether a rendered generation prompt leaves the reply inside an open
/// `<think>` block (the last `<think>` is not followed by `</think>`).
pub fn prompt_opens_think(prompt: &str) -> bool {
    match prompt.rfind(THINK_OPEN) {
        Some(open) => !prompt[open..].contains(THINK_CLOSE),
        None => false,
    }
}

/// `<think>` / `<tool_call>` replies, parsed as they stream.
pub struct TagReply {
    in_think: bool,
    /// Collecting a tool call's body (held in `buf`).
    in_call: bool,
    buf: String,
    calls: usize,
}

impl TagReply {
    /// `in_think`: the prompt already opened `<think>`, so the reply starts
    /// as reasoning and a `</think>` ends it.
    pub fn new(in_think: bool) -> Self {
        TagReply {
            in_think,
            in_call: false,
            buf: String::new(),
            calls: 0,
        }
    }

    fn text(&self, t: &str, out: &mut Vec<ReplyDelta>) {
        if t.is_empty() {
            return;
        }
        let d = if self.in_think {
            ReplyDelta::Reasoning(t.to_string())
        } else {
            ReplyDelta::Content(t.to_string())
        };
        merge(out, d);
    }

    /// Tags recognised in the current state.
    fn tags(&self) -> &'static [&'static str] {
        if self.in_think {
            &[THINK_CLOSE]
        } else {
            &[THINK_OPEN, CALL_OPEN]
        }
    }

    fn drain(&mut self, out: &mut Vec<ReplyDelta>, at_end: bool) {
        loop {
            if self.in_call {
                if let Some(i) = self.buf.find(CALL_CLOSE) {
                    let body: String = self.buf.drain(..i).collect();
                    self.buf.drain(..CALL_CLOSE.len());
                    self.in_call = false;
                    match parse_call(&body) {
                        Some((name, arguments)) => {
                            out.push(ReplyDelta::ToolCall {
                                index: self.calls,
                                name,
                                arguments,
                            });
                            self.calls += 1;
                        }
                        None => {
                            self.text(&format!("{CALL_OPEN}{body}{CALL_CLOSE}"), out);
                        }
                    }
                    continue;
                }
                if at_end || self.buf.len() > MAX_CALL_BODY {
                    let body = std::mem::take(&mut self.buf);
                    self.in_call = false;
                    self.text(&format!("{CALL_OPEN}{body}"), out);
                }
                return;
            }
            let Some(i) = self.buf.find('<') else {
                let t = std::mem::take(&mut self.buf);
                self.text(&t, out);
                return;
            };
            let before: String = self.buf.drain(..i).collect();
            self.text(&before, out);
            let rest = self.buf.as_str();
            if let Some(tag) = self.tags().iter().find(|t| rest.starts_with(**t)) {
                self.buf.drain(..tag.len());
                match *tag {
                    THINK_OPEN => self.in_think = true,
                    THINK_CLOSE => self.in_think = false,
                    _ => self.in_call = true,
                }
                continue;
            }
            let undecided = self.tags().iter().any(|t| t.starts_with(rest));
            if undecided && !at_end {
                // `rest` is shorter than the longest tag (11 bytes).
                return;
            }
            self.buf.drain(..1);
            self.text("<", out);
        }
    }
}

impl ReplyParser for TagReply {
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

/// `{"name": "f", "arguments": {…} | "{…}"}` → name and compact arguments.
/// Missing or null arguments are `{}`; anything else is not a call.
fn parse_call(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let args = match obj.get("arguments") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(a @ Value::Object(_)) => a.clone(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s).ok()? {
            a @ Value::Object(_) => a,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some((name, args.to_string()))
}

/// Appends, merging with a previous delta of the same kind.
fn merge(out: &mut Vec<ReplyDelta>, d: ReplyDelta) {
    match (out.last_mut(), &d) {
        (Some(ReplyDelta::Reasoning(a)), ReplyDelta::Reasoning(b))
        | (Some(ReplyDelta::Content(a)), ReplyDelta::Content(b)) => a.push_str(b),
        _ => out.push(d),
    }
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

    fn whole(in_think: bool, text: &str) -> Vec<ReplyDelta> {
        let mut p = TagReply::new(in_think);
        let mut out = Vec::new();
        collect(&mut out, p.push(text));
        collect(&mut out, p.finish());
        out
    }

    /// Pushes `text` in pieces cut at `cuts` (byte offsets on char boundaries).
    fn pieces(in_think: bool, text: &str, cuts: &[usize]) -> Vec<ReplyDelta> {
        let mut p = TagReply::new(in_think);
        let mut out = Vec::new();
        let mut at = 0;
        for &c in cuts.iter().chain(std::iter::once(&text.len())) {
            collect(&mut out, p.push(&text[at..c]));
            at = c;
        }
        collect(&mut out, p.finish());
        out
    }

    const REPLY: &str = "<think>\nIs 2<3? a<b </thin yes ünï</think>\n\nSure <tool> x < y.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": [1, 2]}}\n</tool_call>\n<tool_call>{\"name\": \"now\", \"arguments\": \"{\\\"tz\\\": \\\"UTC\\\"}\"}</tool_call>";

    fn reply_want() -> Vec<ReplyDelta> {
        vec![
            ReplyDelta::Reasoning("\nIs 2<3? a<b </thin yes ünï".into()),
            ReplyDelta::Content("\n\nSure <tool> x < y.\n".into()),
            ReplyDelta::ToolCall {
                index: 0,
                name: "add".into(),
                arguments: r#"{"a":2,"b":[1,2]}"#.into(),
            },
            ReplyDelta::Content("\n".into()),
            ReplyDelta::ToolCall {
                index: 1,
                name: "now".into(),
                arguments: r#"{"tz":"UTC"}"#.into(),
            },
        ]
    }

    #[test]
    fn separates_reasoning_content_and_tool_calls() {
        assert_eq!(whole(false, REPLY), reply_want());
    }

    #[test]
    fn every_split_point_gives_the_same_deltas() {
        let want = whole(false, REPLY);
        for c in (0..=REPLY.len()).filter(|&c| REPLY.is_char_boundary(c)) {
            assert_eq!(pieces(false, REPLY, &[c]), want, "cut at {c}");
        }
        let one_byte: Vec<usize> = (1..REPLY.len())
            .filter(|&c| REPLY.is_char_boundary(c))
            .collect();
        assert_eq!(pieces(false, REPLY, &one_byte), want, "char by char");
    }

    #[test]
    fn in_think_start_ends_at_close_tag() {
        let text = "plan it\n</think>\n\nDone.";
        assert_eq!(
            whole(true, text),
            vec![
                ReplyDelta::Reasoning("plan it\n".into()),
                ReplyDelta::Content("\n\nDone.".into()),
            ]
        );
        for c in 0..=text.len() {
            assert_eq!(pieces(true, text, &[c]), whole(true, text), "cut at {c}");
        }
        // Without the flag the same text is all content (a stray close tag is kept).
        assert_eq!(whole(false, text), vec![ReplyDelta::Content(text.into())]);
    }

    #[test]
    fn tool_call_tags_inside_reasoning_are_reasoning() {
        let text = "<think>maybe <tool_call>{\"name\":\"f\"}</tool_call></think>ok";
        assert_eq!(
            whole(false, text),
            vec![
                ReplyDelta::Reasoning("maybe <tool_call>{\"name\":\"f\"}</tool_call>".into()),
                ReplyDelta::Content("ok".into()),
            ]
        );
    }

    #[test]
    fn malformed_tool_calls_are_content() {
        for body in [
            "not json",
            "{\"name\": \"f\", \"arguments\": {\"a\": 1}",
            "{\"arguments\": {}}",
            "{\"name\": 3, \"arguments\": {}}",
            "{\"name\": \"f\", \"arguments\": [1]}",
            "{\"name\": \"f\", \"arguments\": \"{oops\"}",
            "[1, 2]",
        ] {
            let text = format!("a<tool_call>{body}</tool_call>b");
            assert_eq!(
                whole(false, &text),
                vec![ReplyDelta::Content(text.clone())],
                "{body}"
            );
        }
        // Missing arguments: a call without parameters.
        assert_eq!(
            whole(false, "<tool_call>{\"name\": \"ping\"}</tool_call>"),
            vec![ReplyDelta::ToolCall {
                index: 0,
                name: "ping".into(),
                arguments: "{}".into(),
            }]
        );
    }

    #[test]
    fn partial_tags_are_held_and_released_by_finish() {
        let mut p = TagReply::new(false);
        assert_eq!(p.push("x <thi"), vec![ReplyDelta::Content("x ".into())]);
        assert_eq!(p.push("nk>"), vec![]);
        assert_eq!(p.push("r</th"), vec![ReplyDelta::Reasoning("r".into())]);
        assert_eq!(p.finish(), vec![ReplyDelta::Reasoning("</th".into())]);

        let mut q = TagReply::new(false);
        assert_eq!(q.push("y <tool_c"), vec![ReplyDelta::Content("y ".into())]);
        assert_eq!(q.finish(), vec![ReplyDelta::Content("<tool_c".into())]);

        // An unterminated call is released whole.
        let mut r = TagReply::new(false);
        assert_eq!(r.push("<tool_call>{\"name\": \"f\""), vec![]);
        assert_eq!(
            r.finish(),
            vec![ReplyDelta::Content("<tool_call>{\"name\": \"f\"".into())]
        );
    }

    #[test]
    fn a_lone_angle_bracket_passes_through() {
        let mut p = TagReply::new(false);
        assert_eq!(p.push("a < b"), vec![ReplyDelta::Content("a < b".into())]);
        assert_eq!(p.push("<"), vec![]);
        assert_eq!(p.push("="), vec![ReplyDelta::Content("<=".into())]);
        assert_eq!(p.push("<<think"), vec![ReplyDelta::Content("<".into())]);
        assert_eq!(p.push("er"), vec![ReplyDelta::Content("<thinker".into())]);
        assert_eq!(p.finish(), vec![]);
    }

    #[test]
    fn held_back_text_is_bounded() {
        let mut p = TagReply::new(false);
        p.push("<tool_call>{\"name\": \"f\", \"arguments\": \"");
        let chunk = "z".repeat(1024);
        let mut released = Vec::new();
        for _ in 0..70 {
            collect(&mut released, p.push(&chunk));
            assert!(p.buf.len() <= MAX_CALL_BODY + chunk.len());
        }
        assert!(matches!(&released[..], [ReplyDelta::Content(t)] if t.starts_with("<tool_call>{")));
        // After giving up, text flows again.
        assert_eq!(p.push("ok"), vec![ReplyDelta::Content("ok".into())]);
        // Tag detection never holds more than a tag's length.
        let mut q = TagReply::new(false);
        q.push("<tool_cal");
        assert!(q.buf.len() <= 64);
    }

    #[test]
    fn prompt_think_state() {
        assert!(prompt_opens_think("<|im_start|>assistant\n<think>\n"));
        assert!(prompt_opens_think("<｜Assistant｜><think>\n"));
        assert!(!prompt_opens_think(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_think("<|im_start|>assistant\n"));
    }
}
