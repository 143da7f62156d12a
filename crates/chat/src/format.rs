//! A model's chat format, chosen once per model directory: how a
//! conversation becomes prompt ids and how a reply is split back into
//! reasoning, content and tool calls.

use std::path::Path;

use fathom_tokenizer::Tokenizer;
use serde_json::Value;

use crate::harmony::{
    CHANNEL, HarmonyOptions, MESSAGE, REPLY_STOPS, ReasoningEffort, render_harmony,
};
use crate::harmony_reply::HarmonyReply;
use crate::k3::{K3Options, ResponseFormat, ToolChoice, render_k3};
use crate::message::{Content, FunctionCall, ToolCall};
use crate::reply::{ReplyDelta, ReplyParser, XtmlReply};
use crate::segment::{Segment, encode_segments, segments_to_string};
use crate::tag_reply::{TagReply, prompt_opens_think};
use crate::{ChatError, ChatTemplate, Message};

/// How to render one request's conversation.
#[derive(Debug, Clone, Default)]
pub struct ChatOptions {
    /// Thinking on or off; `None` = the format's default.
    pub thinking: Option<bool>,
    /// OpenAI `tools` array.
    pub tools: Option<Value>,
    pub tool_choice: Option<ToolChoice>,
    pub response_format: Option<ResponseFormat>,
}

/// A rendered prompt.
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    pub ids: Vec<u32>,
    /// Leading ids that render identically once the reply is appended (the
    /// conversation without the generation prompt): a safe place to keep a
    /// state checkpoint.
    pub stable_len: usize,
    /// Whether the reply starts in the thinking channel (for Jinja
    /// templates: whether the generation prompt leaves a `<think>` open;
    /// for harmony always true: the reply opens with a channel header,
    /// analysis first).
    pub thinking: bool,
}

/// The chat formats fathom speaks.
pub enum ChatFormat {
    /// Kimi's XTML (its tokenizer has the `<|open|>` special).
    Xtml,
    /// A Hugging Face Jinja template.
    Jinja(Box<ChatTemplate>),
    /// gpt-oss's harmony (its tokenizer has the `<|channel|>` and
    /// `<|message|>` specials): rendered through the checkpoint's Jinja
    /// template when it ships one, else natively ([`crate::render_harmony`]).
    Harmony(Option<Box<ChatTemplate>>),
}

impl ChatFormat {
    /// The format of the model in `dir`, or `None` when it has no chat format.
    pub fn detect(dir: &Path, tok: &dyn Tokenizer) -> Result<Option<Self>, ChatError> {
        if tok.special_id(crate::OPEN).is_some() {
            return Ok(Some(ChatFormat::Xtml));
        }
        let template = ChatTemplate::from_model_dir(dir)?.map(Box::new);
        if tok.special_id(CHANNEL).is_some() && tok.special_id(MESSAGE).is_some() {
            return Ok(Some(ChatFormat::Harmony(template)));
        }
        Ok(template.map(ChatFormat::Jinja))
    }

    /// Stop ids for a chat reply: the model's end-of-sequence ids `eos`
    /// plus the tokens that end a reply in this format where the
    /// vocabulary has them (harmony: `<|return|>`, `<|call|>`,
    /// `<|endoftext|>`; checkpoints name only some of them as EOS).
    pub fn stop_ids(&self, tok: &dyn Tokenizer, eos: &[u32]) -> Vec<u32> {
        let mut ids = eos.to_vec();
        if let ChatFormat::Harmony(_) = self {
            for id in REPLY_STOPS.iter().filter_map(|s| tok.special_id(s)) {
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
        }
        ids
    }

    /// The assistant message a finished reply (its text, specials spelled
    /// out, stop token excluded) adds to the conversation. Harmony replies
    /// are split into content, reasoning and tool calls, since their
    /// channel markup must not come back as text; other formats keep the
    /// text as the content, as the model wrote it.
    pub fn reply_message(&self, text: &str, thinking: bool) -> Message {
        if !matches!(self, ChatFormat::Harmony(_)) {
            return Message::new("assistant", text);
        }
        let mut p = self.reply_parser(thinking);
        let mut deltas = p.push(text);
        deltas.extend(p.finish());
        let (mut content, mut reasoning) = (String::new(), String::new());
        let mut calls = Vec::new();
        for d in deltas {
            match d {
                ReplyDelta::Content(t) => content.push_str(&t),
                ReplyDelta::Reasoning(t) => reasoning.push_str(&t),
                ReplyDelta::ToolCall {
                    index,
                    name,
                    arguments,
                } => calls.push(ToolCall {
                    id: Some(format!("call_{index}")),
                    kind: Some("function".into()),
                    function: FunctionCall {
                        name,
                        arguments: Value::String(arguments),
                    },
                }),
            }
        }
        Message {
            role: "assistant".into(),
            content: Some(Content::Text(content)),
            reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
            tool_calls: calls,
            ..Message::default()
        }
    }

    /// Short name for logs and `/v1/models`.
    pub fn name(&self) -> &'static str {
        match self {
            ChatFormat::Xtml => "xtml",
            ChatFormat::Jinja(_) => "jinja",
            ChatFormat::Harmony(_) => "harmony",
        }
    }

    /// Renders `messages` to ids (with the generation prompt).
    pub fn prompt(
        &self,
        tok: &dyn Tokenizer,
        messages: &[Message],
        o: &ChatOptions,
    ) -> Result<ChatPrompt, ChatError> {
        let full = self.segments(messages, o, true)?;
        let base = self.segments(messages, o, false)?;
        let ids = encode_segments(tok, &full);
        let stable = encode_segments(tok, &base);
        let stable_len = if ids.starts_with(&stable) && stable.len() < ids.len() {
            stable.len()
        } else {
            0
        };
        let thinking = match self {
            ChatFormat::Xtml => o.thinking.unwrap_or(true),
            ChatFormat::Jinja(_) => {
                // Look at the generation prompt alone where it can be told
                // apart, so that a `<think>` in earlier turns cannot count.
                let full = segments_to_string(&full);
                let base = segments_to_string(&base);
                let tail = full.strip_prefix(base.as_str()).unwrap_or(&full);
                prompt_opens_think(tail)
            }
            ChatFormat::Harmony(_) => true,
        };
        Ok(ChatPrompt {
            ids,
            stable_len,
            thinking,
        })
    }

    fn segments(
        &self,
        messages: &[Message],
        o: &ChatOptions,
        generation: bool,
    ) -> Result<Vec<Segment>, ChatError> {
        match self {
            ChatFormat::Xtml => {
                let k = K3Options {
                    thinking: o.thinking.unwrap_or(true),
                    add_generation_prompt: generation,
                    tools: o.tools.clone(),
                    tool_choice: o.tool_choice,
                    response_format: o.response_format.clone(),
                    ..K3Options::default()
                };
                render_k3(messages, &k)
            }
            ChatFormat::Jinja(t) => jinja_segments(t, messages, o, generation, false),
            ChatFormat::Harmony(Some(t)) => jinja_segments(t, messages, o, generation, true),
            ChatFormat::Harmony(None) => {
                let h = HarmonyOptions {
                    reasoning: ReasoningEffort::from_thinking(o.thinking),
                    add_generation_prompt: generation,
                    tools: o.tools.clone(),
                    tool_choice: o.tool_choice,
                    response_format: o.response_format.clone(),
                };
                render_harmony(messages, &h)
            }
        }
    }

    /// Where the answer starts after a thinking block (markup), if the
    /// format has channels.
    pub fn answer_marker(&self) -> Option<&'static str> {
        match self {
            ChatFormat::Xtml => Some("<|open|>response<|sep|>"),
            ChatFormat::Jinja(_) => None,
            ChatFormat::Harmony(_) => Some("<|channel|>final<|message|>"),
        }
    }

    /// A parser for one reply (fed the reply's text, specials spelled out).
    /// `thinking`: the reply starts in the thinking channel; pass
    /// [`ChatPrompt::thinking`] of the prompt it answers.
    pub fn reply_parser(&self, thinking: bool) -> Box<dyn ReplyParser> {
        match self {
            ChatFormat::Xtml => Box::new(XtmlReply::new(thinking)),
            ChatFormat::Jinja(_) => Box::new(TagReply::new(thinking)),
            ChatFormat::Harmony(_) => Box::new(HarmonyReply::new()),
        }
    }

    /// A parser for the reply to a prompt rendered elsewhere (its text,
    /// specials spelled out): for Jinja templates the reply starts as
    /// reasoning when `prompt_text` ends inside an open `<think>` block;
    /// for XTML `thinking` decides, as in [`ChatFormat::reply_parser`].
    pub fn reply_parser_for(&self, prompt_text: &str, thinking: bool) -> Box<dyn ReplyParser> {
        match self {
            ChatFormat::Xtml => Box::new(XtmlReply::new(thinking)),
            ChatFormat::Jinja(_) => Box::new(TagReply::new(prompt_opens_think(prompt_text))),
            ChatFormat::Harmony(_) => Box::new(HarmonyReply::new()),
        }
    }
}

/// Renders through a Jinja template. `harmony`: also pass
/// `reasoning_effort` (low when thinking is off, else medium) and each
/// assistant's reasoning as `thinking`, the names gpt-oss templates read.
fn jinja_segments(
    t: &ChatTemplate,
    messages: &[Message],
    o: &ChatOptions,
    generation: bool,
    harmony: bool,
) -> Result<Vec<Segment>, ChatError> {
    let mut msgs = serde_json::to_value(messages)
        .map_err(|e| ChatError::Template(format!("messages cannot be serialised: {e}")))?;
    // The switches templates read: `enable_thinking` (Qwen3,
    // DeepSeek) and `thinking`, and the request's tools.
    let mut extra = serde_json::Map::new();
    if let Some(on) = o.thinking {
        extra.insert("enable_thinking".into(), Value::Bool(on));
        extra.insert("thinking".into(), Value::Bool(on));
    }
    if let Some(tools) = &o.tools {
        extra.insert("tools".into(), tools.clone());
    }
    if harmony {
        let effort = ReasoningEffort::from_thinking(o.thinking).as_str();
        extra.insert("reasoning_effort".into(), Value::String(effort.into()));
        for m in msgs.as_array_mut().into_iter().flatten() {
            if let Some(m) = m.as_object_mut()
                && let Some(r) = m.get("reasoning_content").cloned()
            {
                m.entry("thinking").or_insert(r);
            }
        }
    }
    t.render_segments_with(&msgs, generation, extra)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReplyDelta;

    /// One id per byte: enough to render and compare prompts.
    struct Bytes;

    impl Tokenizer for Bytes {
        fn encode(&self, text: &str) -> Vec<u32> {
            text.bytes().map(u32::from).collect()
        }
        fn encode_trusted(&self, text: &str) -> Vec<u32> {
            self.encode(text)
        }
        fn decode(&self, ids: &[u32]) -> String {
            String::from_utf8_lossy(&ids.iter().map(|&i| i as u8).collect::<Vec<_>>()).into()
        }
        fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
            Some(vec![id as u8])
        }
        fn special_id(&self, _: &str) -> Option<u32> {
            None
        }
        fn is_special(&self, _: u32) -> bool {
            false
        }
        fn vocab_size(&self) -> usize {
            256
        }
    }

    fn jinja(generation_prompt: &str) -> ChatFormat {
        let src = format!(
            "{{% for m in messages %}}<{{{{ m.role }}}}>{{{{ m.content }}}}\n{{% endfor %}}\
             {{% if add_generation_prompt %}}{generation_prompt}{{% endif %}}"
        );
        ChatFormat::Jinja(Box::new(ChatTemplate::new(&src).unwrap()))
    }

    fn user(text: &str) -> Message {
        serde_json::from_value(serde_json::json!({"role": "user", "content": text})).unwrap()
    }

    #[test]
    fn jinja_prompt_thinking_follows_an_open_think_in_the_generation_prompt() {
        let o = ChatOptions::default();
        let open = jinja("<assistant><think>\n");
        let p = open.prompt(&Bytes, &[user("hi")], &o).unwrap();
        assert!(p.thinking);
        let mut r = open.reply_parser(p.thinking);
        let mut got = r.push("hmm</think>Hello");
        got.extend(r.finish());
        assert_eq!(
            got,
            vec![
                ReplyDelta::Reasoning("hmm".into()),
                ReplyDelta::Content("Hello".into())
            ]
        );

        let closed = jinja("<assistant><think>\n\n</think>\n\n");
        assert!(!closed.prompt(&Bytes, &[user("hi")], &o).unwrap().thinking);
        let plain = jinja("<assistant>");
        // A `<think>` in an earlier turn does not count.
        assert!(
            !plain
                .prompt(&Bytes, &[user("say <think>")], &o)
                .unwrap()
                .thinking
        );

        let mut r = plain.reply_parser_for("<assistant><think>\n", false);
        assert_eq!(r.push("a</think>"), vec![ReplyDelta::Reasoning("a".into())]);
    }

    #[test]
    fn thinking_and_tools_reach_the_template() {
        let t = jinja(
            "<assistant>{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}\
             {% if tools %}[{{ tools | length }} tools]{% endif %}",
        );
        let text = |o: &ChatOptions| {
            let p = t.prompt(&Bytes, &[user("hi")], o).unwrap();
            (Bytes.decode(&p.ids), p.thinking)
        };
        let (on, _) = text(&ChatOptions::default());
        assert!(on.ends_with("<assistant>"), "{on:?}");
        let off = ChatOptions {
            thinking: Some(false),
            ..Default::default()
        };
        let (off_text, thinking) = text(&off);
        assert!(off_text.ends_with("<think>\n\n</think>\n"), "{off_text:?}");
        assert!(!thinking, "a closed think block is not open");
        let tools = ChatOptions {
            tools: Some(serde_json::json!([{"type": "function"}, {"type": "function"}])),
            ..Default::default()
        };
        assert!(text(&tools).0.ends_with("[2 tools]"));
    }
}
