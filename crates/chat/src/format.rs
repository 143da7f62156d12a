//! A model's chat format, chosen once per model directory: how a
//! conversation becomes prompt ids and how a reply is split back into
//! reasoning, content and tool calls.

use std::path::Path;

use fathom_tokenizer::Tokenizer;
use serde_json::Value;

use crate::k3::{K3Options, ResponseFormat, ToolChoice, render_k3};
use crate::reply::{PlainReply, ReplyParser, XtmlReply};
use crate::segment::encode_segments;
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
    /// Whether the reply starts in the thinking channel.
    pub thinking: bool,
}

/// The chat formats fathom speaks.
pub enum ChatFormat {
    /// Kimi's XTML (its tokenizer has the `<|open|>` special).
    Xtml,
    /// A Hugging Face Jinja template.
    Jinja(Box<ChatTemplate>),
}

impl ChatFormat {
    /// The format of the model in `dir`, or `None` when it has no chat format.
    pub fn detect(dir: &Path, tok: &dyn Tokenizer) -> Result<Option<Self>, ChatError> {
        if tok.special_id(crate::OPEN).is_some() {
            return Ok(Some(ChatFormat::Xtml));
        }
        Ok(ChatTemplate::from_model_dir(dir)?.map(|t| ChatFormat::Jinja(Box::new(t))))
    }

    /// Short name for logs and `/v1/models`.
    pub fn name(&self) -> &'static str {
        match self {
            ChatFormat::Xtml => "xtml",
            ChatFormat::Jinja(_) => "jinja",
        }
    }

    /// Renders `messages` to ids (with the generation prompt).
    pub fn prompt(
        &self,
        tok: &dyn Tokenizer,
        messages: &[Message],
        o: &ChatOptions,
    ) -> Result<ChatPrompt, ChatError> {
        let ids = self.ids(tok, messages, o, true)?;
        let stable = self.ids(tok, messages, o, false)?;
        let stable_len = if ids.starts_with(&stable) && stable.len() < ids.len() {
            stable.len()
        } else {
            0
        };
        let thinking = match self {
            ChatFormat::Xtml => o.thinking.unwrap_or(true),
            ChatFormat::Jinja(_) => false,
        };
        Ok(ChatPrompt {
            ids,
            stable_len,
            thinking,
        })
    }

    fn ids(
        &self,
        tok: &dyn Tokenizer,
        messages: &[Message],
        o: &ChatOptions,
        generation: bool,
    ) -> Result<Vec<u32>, ChatError> {
        let segments = match self {
            ChatFormat::Xtml => {
                let k = K3Options {
                    thinking: o.thinking.unwrap_or(true),
                    add_generation_prompt: generation,
                    tools: o.tools.clone(),
                    tool_choice: o.tool_choice,
                    response_format: o.response_format.clone(),
                    ..K3Options::default()
                };
                render_k3(messages, &k)?
            }
            ChatFormat::Jinja(t) => {
                let msgs = serde_json::to_value(messages).map_err(|e| {
                    ChatError::Template(format!("messages cannot be serialised: {e}"))
                })?;
                t.render_segments(&msgs, generation)?
            }
        };
        Ok(encode_segments(tok, &segments))
    }

    /// Where the answer starts after a thinking block (markup), if the
    /// format has channels.
    pub fn answer_marker(&self) -> Option<&'static str> {
        match self {
            ChatFormat::Xtml => Some("<|open|>response<|sep|>"),
            ChatFormat::Jinja(_) => None,
        }
    }

    /// A parser for one reply (fed the reply's text, specials spelled out).
    pub fn reply_parser(&self, thinking: bool) -> Box<dyn ReplyParser> {
        match self {
            ChatFormat::Xtml => Box::new(XtmlReply::new(thinking)),
            ChatFormat::Jinja(_) => Box::new(PlainReply),
        }
    }
}
