//! A request's output as OpenAI JSON: streamed chunks as tokens arrive, or
//! one response at the end.

use std::sync::Arc;

use fathom_chat::{ReplyDelta, ReplyParser};
use fathom_engine::FinishReason;
use fathom_tokenizer::Tokenizer;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::worker::Msg;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Api {
    Chat,
    Completion,
}

/// A generated token, its log-probability and the top alternatives.
type TokenLp = (u32, f32, Vec<(u32, f32)>);

#[derive(Default)]
struct Choice {
    parser: Option<Box<dyn ReplyParser>>,
    content: String,
    reasoning: String,
    tool_calls: Vec<Value>,
    /// (token, logprob, top) per generated token.
    logprobs: Vec<TokenLp>,
    tokens: usize,
    finish: Option<FinishReason>,
}

/// Collects one request's messages.
pub(crate) struct Output {
    api: Api,
    id: String,
    created: u64,
    model: String,
    choices: Vec<Choice>,
    pub cached: usize,
    pub prompt_tokens: usize,
    /// Whether to report log-probabilities.
    logprobs: bool,
    tok: Arc<dyn Tokenizer>,
}

impl Output {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        api: Api,
        id: String,
        created: u64,
        model: String,
        parsers: Vec<Option<Box<dyn ReplyParser>>>,
        prompt_tokens: usize,
        logprobs: bool,
        tok: Arc<dyn Tokenizer>,
    ) -> Self {
        let choices = parsers
            .into_iter()
            .map(|parser| Choice {
                parser,
                ..Choice::default()
            })
            .collect();
        Output {
            api,
            id,
            created,
            model,
            choices,
            cached: 0,
            prompt_tokens,
            logprobs,
            tok,
        }
    }

    pub fn all_done(&self) -> bool {
        self.choices.iter().all(|c| c.finish.is_some())
    }

    /// Takes a message; returns the stream chunks it produces.
    pub fn on(&mut self, msg: Msg) -> Vec<Value> {
        match msg {
            Msg::Started { cached } => {
                self.cached = cached;
                if self.api == Api::Chat {
                    (0..self.choices.len())
                        .map(|i| {
                            self.chunk(i, json!({"role": "assistant", "content": ""}), None, None)
                        })
                        .collect()
                } else {
                    Vec::new()
                }
            }
            Msg::Token { choice, token } => {
                let i = choice as usize;
                let c = &mut self.choices[i];
                c.tokens += 1;
                let lp = (
                    token.sampled.token,
                    // Computed whenever logprobs were asked for (the only use).
                    token.sampled.logprob.unwrap_or(f32::NAN),
                    token.sampled.top.clone(),
                );
                if self.logprobs {
                    c.logprobs.push(lp.clone());
                }
                let lp = self.logprobs.then_some(lp);
                self.text(i, &token.text, lp)
            }
            Msg::Done { choice, done } => {
                let i = choice as usize;
                let mut out = self.text(i, &done.text_tail, None);
                let c = &mut self.choices[i];
                let rest = c.parser.as_mut().map(|p| p.finish()).unwrap_or_default();
                out.extend(self.deltas(i, rest, None));
                self.choices[i].finish = Some(done.reason.clone());
                match &done.reason {
                    FinishReason::Error(e) => out.push(ApiError::internal(e.clone()).body()),
                    FinishReason::Cancelled => out.push(shutdown_error().body()),
                    _ => {
                        let reason = self.finish_name(i);
                        let delta = if self.api == Api::Chat {
                            json!({})
                        } else {
                            json!("")
                        };
                        out.push(self.chunk(i, delta, None, Some(reason)));
                    }
                }
                out
            }
        }
    }

    /// Text released by the engine for choice `i`.
    fn text(&mut self, i: usize, text: &str, lp: Option<TokenLp>) -> Vec<Value> {
        let c = &mut self.choices[i];
        let deltas = match c.parser.as_mut() {
            Some(p) => p.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![ReplyDelta::Content(text.to_string())],
        };
        if deltas.is_empty() && lp.is_none() {
            return Vec::new();
        }
        self.deltas(i, deltas, lp)
    }

    fn deltas(&mut self, i: usize, deltas: Vec<ReplyDelta>, lp: Option<TokenLp>) -> Vec<Value> {
        let mut out = Vec::new();
        let mut delta = serde_json::Map::new();
        for d in deltas {
            let c = &mut self.choices[i];
            match d {
                ReplyDelta::Content(t) => {
                    c.content.push_str(&t);
                    append(&mut delta, "content", &t);
                }
                ReplyDelta::Reasoning(t) => {
                    c.reasoning.push_str(&t);
                    append(&mut delta, "reasoning_content", &t);
                }
                ReplyDelta::ToolCall {
                    index,
                    name,
                    arguments,
                } => {
                    let call = json!({
                        "index": index,
                        "id": format!("call_{}_{i}_{index}", self.id),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    });
                    c.tool_calls.push(call.clone());
                    out.push(self.chunk(i, json!({"tool_calls": [call]}), None, None));
                }
            }
        }
        if !delta.is_empty() || lp.is_some() {
            let body = match self.api {
                Api::Chat => Value::Object(delta),
                Api::Completion => delta.remove("content").unwrap_or_else(|| json!("")),
            };
            let lp = lp.map(|l| self.logprob_entry(&l));
            out.insert(0, self.chunk(i, body, lp, None));
        }
        out
    }

    fn finish_name(&self, i: usize) -> &'static str {
        let c = &self.choices[i];
        match &c.finish {
            Some(FinishReason::Length) => "length",
            _ if !c.tool_calls.is_empty() => "tool_calls",
            _ => "stop",
        }
    }

    /// One streamed chunk for choice `i`.
    fn chunk(
        &self,
        i: usize,
        delta: Value,
        logprobs: Option<Value>,
        finish: Option<&str>,
    ) -> Value {
        match self.api {
            Api::Chat => json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            }),
            Api::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": i, "text": delta, "logprobs": logprobs, "finish_reason": finish}],
            }),
        }
    }

    fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.tok.token_bytes(id).unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// One token's log-probabilities in the endpoint's shape (for a chunk).
    fn logprob_entry(&self, (id, lp, top): &TokenLp) -> Value {
        match self.api {
            Api::Chat => json!({"content": [self.chat_logprob(*id, *lp, top)]}),
            Api::Completion => {
                self.completion_logprobs(std::slice::from_ref(&(*id, *lp, top.clone())))
            }
        }
    }

    fn chat_logprob(&self, id: u32, lp: f32, top: &[(u32, f32)]) -> Value {
        let (t, b) = self.token_text(id);
        let top: Vec<Value> = top
            .iter()
            .map(|&(tid, tlp)| {
                let (tt, tb) = self.token_text(tid);
                json!({"token": tt, "logprob": tlp, "bytes": tb})
            })
            .collect();
        json!({"token": t, "logprob": lp, "bytes": b, "top_logprobs": top})
    }

    fn completion_logprobs(&self, items: &[TokenLp]) -> Value {
        let mut tokens = Vec::new();
        let mut lps = Vec::new();
        let mut tops = Vec::new();
        for (id, lp, top) in items {
            tokens.push(self.token_text(*id).0);
            lps.push(*lp);
            let m: serde_json::Map<String, Value> = top
                .iter()
                .map(|&(t, l)| (self.token_text(t).0, json!(l)))
                .collect();
            tops.push(Value::Object(m));
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops})
    }

    pub fn usage(&self) -> Value {
        let completion: usize = self.choices.iter().map(|c| c.tokens).sum();
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }

    /// The last streamed chunk when usage is asked for.
    pub fn usage_chunk(&self) -> Value {
        let object = match self.api {
            Api::Chat => "chat.completion.chunk",
            Api::Completion => "text_completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [], "usage": self.usage()})
    }

    /// The whole response, or the error of a choice that failed.
    pub fn response(&self) -> Result<Value, ApiError> {
        for c in &self.choices {
            match &c.finish {
                Some(FinishReason::Error(e)) => return Err(ApiError::internal(e.clone())),
                Some(FinishReason::Cancelled) | None => return Err(shutdown_error()),
                _ => {}
            }
        }
        let choices: Vec<Value> = (0..self.choices.len())
            .map(|i| self.choice_body(i))
            .collect();
        let object = match self.api {
            Api::Chat => "chat.completion",
            Api::Completion => "text_completion",
        };
        Ok(
            json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
                  "choices": choices, "usage": self.usage()}),
        )
    }

    fn choice_body(&self, i: usize) -> Value {
        let c = &self.choices[i];
        let finish = self.finish_name(i);
        match self.api {
            Api::Chat => {
                let mut msg = json!({"role": "assistant", "content": c.content});
                if !c.reasoning.is_empty() {
                    msg["reasoning_content"] = json!(c.reasoning);
                }
                if !c.tool_calls.is_empty() {
                    let calls: Vec<Value> = c
                        .tool_calls
                        .iter()
                        .map(|t| {
                            let mut t = t.clone();
                            t.as_object_mut().map(|o| o.remove("index"));
                            t
                        })
                        .collect();
                    msg["tool_calls"] = json!(calls);
                }
                let logprobs = self.logprobs.then(|| {
                    let content: Vec<Value> = c
                        .logprobs
                        .iter()
                        .map(|(id, lp, top)| self.chat_logprob(*id, *lp, top))
                        .collect();
                    json!({"content": content})
                });
                json!({"index": i, "message": msg, "logprobs": logprobs, "finish_reason": finish})
            }
            Api::Completion => {
                let logprobs = self.logprobs.then(|| self.completion_logprobs(&c.logprobs));
                json!({"index": i, "text": c.content, "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }
}

/// What a request the shutdown ended hears, whether it was queued or
/// running (only a shutdown cancels a sequence whose client still listens).
pub(crate) fn shutdown_error() -> ApiError {
    ApiError::shutting_down("the server is shutting down: the request was not finished")
}

fn append(m: &mut serde_json::Map<String, Value>, key: &str, t: &str) {
    match m.get_mut(key) {
        Some(Value::String(s)) => s.push_str(t),
        _ => {
            m.insert(key.to_string(), json!(t));
        }
    }
}
