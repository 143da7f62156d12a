//! Chat rendering for fathom: conversations to prompt segments to token ids.
//!
//! - [`render_k3`]: Kimi K3's "XTML" format, written natively because the released model
//!   ships Python (`encoding_k3.py`), not a Jinja template.
//! - [`ChatTemplate`]: Hugging Face Jinja templates (other model families).
//! - [`render_harmony`]: gpt-oss's "harmony" format, for checkpoints that ship
//!   no template (see below).
//!
//! [`ChatFormat::detect`] picks one per model directory.
//!
//! # Harmony (gpt-oss)
//!
//! A tokenizer with the `<|channel|>` and `<|message|>` specials means
//! [`ChatFormat::Harmony`]. The prompt is rendered through the checkpoint's
//! Jinja template when it ships one (with `reasoning_effort` and each
//! assistant's reasoning as `thinking` added to the context), else by
//! [`render_harmony`]: a system message with `Reasoning: …`, a developer
//! message with the instructions (leading `system`/`developer` messages),
//! tools and response format, then the turns, and the generation prompt
//! `<|start|>assistant`. Thinking cannot be switched off in gpt-oss, so
//! `thinking: false` means `Reasoning: low`; on or unset is `medium`.
//! Replies are parsed by [`HarmonyReply`]: the analysis channel is
//! reasoning, a message addressed `to=functions.NAME` is a tool call (its
//! body the JSON arguments), everything else is content; malformed text
//! passes through as content. Generation must stop at `<|return|>` and
//! `<|call|>`, which a checkpoint's EOS list may omit:
//! [`ChatFormat::stop_ids`] adds them, and [`ChatFormat::reply_message`]
//! turns a reply back into an assistant message for the next turn.
//!
//! Renderers return [`Segment`]s so that template markup (trusted: special tokens
//! recognised) and caller content (untrusted: encoded as plain text) never mix;
//! [`encode_segments`] turns them into ids with a [`fathom_tokenizer::Tokenizer`].

mod clock;
mod error;
mod format;
mod harmony;
mod harmony_reply;
mod jinja;
mod k3;
mod message;
mod pyjson;
mod reply;
mod segment;
mod tag_reply;
mod tool_args;

pub use error::ChatError;
pub use format::{ChatFormat, ChatOptions, ChatPrompt};
pub use harmony::{HarmonyOptions, REPLY_STOPS, ReasoningEffort, render_harmony};
pub use harmony_reply::{HarmonyReply, MAX_HEADER};
pub use jinja::ChatTemplate;
pub use k3::{
    CLOSE, END_OF_MSG, K3Options, OPEN, ResponseFormat, SEP, ThinkingEffort, ToolChoice,
    escape_attr, render_k3, thinking_effort_text,
};
pub use message::{Content, ContentPart, FunctionCall, Message, ToolCall};
pub use pyjson::{PyJsonOptions, dumps as py_json_dumps};
pub use reply::{PlainReply, ReplyDelta, ReplyParser, XtmlReply};
pub use segment::{Segment, SegmentWriter, encode_segments, segments_to_string};
pub use tag_reply::{MAX_CALL_BODY, TagReply, prompt_opens_think};
