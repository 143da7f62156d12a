//! Chat rendering for fathom: conversations to prompt segments to token ids.
//!
//! - [`render_k3`]: Kimi K3's "XTML" format, written natively because the released model
//!   ships Python (`encoding_k3.py`), not a Jinja template.
//! - [`ChatTemplate`]: Hugging Face Jinja templates (other model families).
//!
//! Renderers return [`Segment`]s so that template markup (trusted: special tokens
//! recognised) and caller content (untrusted: encoded as plain text) never mix;
//! [`encode_segments`] turns them into ids with a [`fathom_tokenizer::Tokenizer`].

mod clock;
mod error;
mod format;
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
