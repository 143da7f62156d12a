//! Request bodies of the OpenAI endpoints, and their checks.
//!
//! Unknown fields are ignored (clients send many); a known field with a
//! wrong type or value is a 400 naming it.

use fathom_chat::Message;
use fathom_engine::SamplingParams;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// Most stop strings per request (OpenAI's limit), and their longest length.
pub const MAX_STOP: usize = 4;
pub const MAX_STOP_CHARS: usize = 256;
/// Most completions per request.
pub const MAX_N: u32 = 8;

/// Parses a JSON body: the shared fields and the endpoint's own; errors
/// name the field path.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<(Common, T), ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    Ok((fields(&v)?, fields(&v)?))
}

fn fields<T: DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            // A missing field: serde names it in the message.
            let missing = inner.to_string();
            let field = missing.split('`').nth(1).unwrap_or("body").to_string();
            ApiError::invalid(&field, format!("the request lacks a field: {missing}"))
        } else {
            let top = path.split(['.', '[']).next().unwrap_or(&path).to_string();
            ApiError::invalid(&top, format!("`{path}`: {inner}"))
        }
    })
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Fields chat and completions share.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub n: Option<u32>,
    pub seed: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub stop: Option<Stop>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
}

/// `prompt`: text, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
}

/// What generation a request asks for, checked.
#[derive(Debug, Clone)]
pub struct GenSettings {
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    pub n: u32,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

impl Common {
    /// Checks the shared fields; `logprobs` is how many top entries to report.
    pub fn settings(&self, logprobs: Option<usize>) -> Result<GenSettings, ApiError> {
        let d = SamplingParams::default();
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be ≥ 0 (or -1 = off), got {k}"),
                ));
            }
        };
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k,
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: self.seed.map_or(0, |s| s as u64),
            logprobs,
        };
        if let Err(e) = sampling.validate() {
            return Err(ApiError::invalid(e.field(), e.to_string()));
        }
        let n = self.n.unwrap_or(1);
        if n == 0 || n > MAX_N {
            return Err(ApiError::invalid(
                "n",
                format!("n must be in 1..={MAX_N}, got {n}"),
            ));
        }
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) | (None, Some(m)) => {
                if m == 0 {
                    return Err(ApiError::invalid(
                        "max_tokens",
                        "max_tokens must be at least 1",
                    ));
                }
                Some(usize::try_from(m).unwrap_or(usize::MAX))
            }
            (None, None) => None,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP {
            return Err(ApiError::invalid(
                "stop",
                format!("at most {MAX_STOP} stop strings, got {}", stop.len()),
            ));
        }
        if let Some(s) = stop
            .iter()
            .find(|s| s.is_empty() || s.chars().count() > MAX_STOP_CHARS)
        {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "stop strings must have 1..={MAX_STOP_CHARS} characters, got {}",
                    s.chars().count()
                ),
            ));
        }
        Ok(GenSettings {
            sampling,
            max_tokens,
            n,
            stop,
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
        })
    }
}
