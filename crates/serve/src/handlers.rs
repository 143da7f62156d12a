//! `POST /v1/chat/completions` and `POST /v1/completions`: read, then check,
//! render and tokenize off the HTTP threads (a bounded pool), queue, and
//! answer (see [`crate::answer`]).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use fathom_chat::{ChatOptions, ResponseFormat};
use fathom_constrain::{Grammar, TokenTrie};
use serde_json::Value;

use crate::api::{self, ChatRequest, Common, CompletionRequest, GenSettings, Prompt};
use crate::bound;
use crate::constraint::Step;
use crate::error::ApiError;
use crate::respond::Api;
use crate::routes::read_body;
use crate::tools::{self, Choice};
use crate::{AppState, Ready};

/// How every choice of a request is constrained.
pub(crate) enum Plan {
    /// A JSON document after the ids `trigger` (or at once).
    Json {
        grammar: Arc<Grammar>,
        trigger: Vec<u32>,
    },
    /// A tool call.
    Tools(Vec<Step>),
}

/// A checked request, ready to queue.
pub(crate) struct Prepared {
    pub api: Api,
    pub prompt: Vec<u32>,
    pub stable_len: usize,
    pub settings: GenSettings,
    pub max_new: usize,
    /// Chat replies start in the thinking channel.
    pub thinking: bool,
    pub plan: Option<(Plan, Arc<TokenTrie>)>,
}

type PrepareFn<R> = fn(&AppState, &Ready, Common, R) -> Result<Prepared, ApiError>;

pub(crate) async fn chat(st: State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    handle(st, headers, body, "chat", prepare_chat).await
}

pub(crate) async fn completions(
    st: State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    handle(st, headers, body, "completions", prepare_completion).await
}

/// Reads, checks and answers one generation request; counts it in the
/// metrics under `ep` and logs a refusal.
async fn handle<R: serde::de::DeserializeOwned + Send + 'static>(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
    ep: &'static str,
    prepare: PrepareFn<R>,
) -> Response {
    let resp = async {
        let bytes = read_body(&headers, body, st.cfg.max_body, st.cfg.body_timeout).await?;
        st.ready()?;
        let p = off_thread(&st, bytes, prepare).await?;
        crate::answer::run(&st, st.ready()?, p).await
    }
    .await;
    match resp {
        Ok(r) => {
            st.metrics.request(ep, r.status().as_u16());
            r
        }
        Err(e) => {
            let status = e.status.as_u16();
            tracing::info!(endpoint = ep, status, "refused: {}", e.message);
            st.metrics.request(ep, status);
            e.into_response()
        }
    }
}

/// Parses and prepares a body on the blocking pool, at most
/// [`AppState::prep`]'s permits at once (the permit goes with the work,
/// so a client that leaves does not free it early).
async fn off_thread<R: serde::de::DeserializeOwned + Send + 'static>(
    st: &Arc<AppState>,
    bytes: Bytes,
    prepare: PrepareFn<R>,
) -> Result<Prepared, ApiError> {
    let permit = st
        .prep
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::shutting_down("the server is shutting down"))?;
    let st = st.clone();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let ready = st.ready()?;
        let (common, req): (Common, R) = api::parse(&bytes)?;
        drop(bytes);
        prepare(&st, ready, common, req)
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))?
}

fn check_model(st: &AppState, c: &Common) -> Result<(), ApiError> {
    match &c.model {
        Some(m) if m != &st.cfg.model_id => Err(ApiError::not_found(
            "model",
            format!(
                "model {m:?} is not served here; this server serves {:?}",
                st.cfg.model_id
            ),
        )),
        _ => Ok(()),
    }
}

/// The context a request may fill: `--context` within the model's.
fn context(st: &AppState, ready: &Ready) -> usize {
    let declared = ready
        .loaded
        .lm
        .info()
        .max_position_embeddings
        .unwrap_or(usize::MAX);
    st.cfg.context.min(declared)
}

/// Refuses a prompt whose text alone has `at_least` tokens or more than
/// the context holds, before it is tokenized.
fn check_length(
    st: &AppState,
    ready: &Ready,
    param: &str,
    at_least: usize,
    bytes: usize,
) -> Result<(), ApiError> {
    let context = context(st, ready);
    if at_least < context {
        return Ok(());
    }
    let per = ready.loaded.max_token_bytes.unwrap_or(0);
    Err(ApiError::invalid(
        param,
        format!(
            "the prompt has at least {at_least} tokens ({bytes} bytes of text, at most {per} \
             bytes a token); the context holds {context}: shorten it"
        ),
    ))
}

/// The completion budget: what was asked, within the context.
fn budget(
    st: &AppState,
    ready: &Ready,
    prompt: usize,
    asked: Option<usize>,
) -> Result<usize, ApiError> {
    let context = context(st, ready);
    if prompt >= context {
        return Err(ApiError::invalid(
            "messages",
            format!("the prompt has {prompt} tokens; the context holds {context}: shorten it"),
        ));
    }
    match asked {
        Some(m) if prompt.saturating_add(m) > context => Err(ApiError::invalid(
            "max_tokens",
            format!(
                "the prompt ({prompt} tokens) plus max_tokens ({m}) exceeds the context of {context} tokens"
            ),
        )),
        Some(m) => Ok(m),
        None => Ok(context - prompt),
    }
}

/// The vocabulary trie for constraints (built once, on first use).
fn trie(ready: &Ready) -> Arc<TokenTrie> {
    ready
        .trie
        .get_or_init(|| {
            let vocab = ready.loaded.lm.info().vocab_size;
            Arc::new(crate::constraint::trie(
                ready.loaded.tokenizer.as_ref(),
                vocab,
            ))
        })
        .clone()
}

fn prepare_chat(
    st: &AppState,
    ready: &Ready,
    common: Common,
    req: ChatRequest,
) -> Result<Prepared, ApiError> {
    check_model(st, &common)?;
    let Some(format) = ready.loaded.chat.as_ref() else {
        return Err(ApiError::bad_request(
            "this model has no chat format (no chat template): use /v1/completions",
        ));
    };
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    if let Some(per) = ready.loaded.max_token_bytes {
        let (at_least, bytes) = bound::chat_tokens_at_least(format, &req.messages, per);
        check_length(st, ready, "messages", at_least, bytes)?;
    }
    let top = match (req.logprobs, req.top_logprobs) {
        (Some(true), t) => Some(t.unwrap_or(0) as usize),
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        }
        _ => None,
    };
    let settings = common.settings(top)?;
    let mut opts = ChatOptions {
        tools: req.tools.clone(),
        ..ChatOptions::default()
    };
    if let Some(kw) = &req.chat_template_kwargs {
        for key in ["thinking", "enable_thinking"] {
            match kw.get(key) {
                None => {}
                Some(Value::Bool(b)) => opts.thinking = Some(*b),
                Some(_) => {
                    return Err(ApiError::invalid(
                        "chat_template_kwargs",
                        format!("chat_template_kwargs.{key} must be true or false"),
                    ));
                }
            }
        }
    }
    let choice = tools::parse(req.tool_choice.as_ref())?;
    opts.tool_choice = choice.as_ref().map(Choice::for_prompt);
    let callable = match &choice {
        Some(c) if c.enforced() => Some(tools::callable(req.tools.as_ref(), c)?),
        _ => None,
    };
    let json = response_format(req.response_format.as_ref())?;
    opts.response_format = json.as_ref().map(|(f, _)| f.clone());
    let tok = ready.loaded.tokenizer.as_ref();
    let rendered = format
        .prompt(tok, &req.messages, &opts)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let max_new = budget(st, ready, rendered.ids.len(), settings.max_tokens)?;
    // An enforced tool call is the whole reply: a response format has no
    // part of it left to shape.
    let plan = match (callable, json) {
        (Some(tools), _) => {
            let info = ready.loaded.lm.info();
            let stops = format.stop_ids(tok, &info.eos_token_ids);
            let banned = ready
                .banned
                .get_or_init(|| Arc::new(tools::specials_and_stops(tok, info.vocab_size, &stops)))
                .clone();
            let reply = tools::Reply {
                format,
                tok,
                thinking: rendered.thinking,
                banned,
                stops: &stops,
            };
            Some(Plan::Tools(tools::program(&reply, &tools)?))
        }
        (None, Some((_, grammar))) => {
            let trigger = match format.answer_marker().filter(|_| rendered.thinking) {
                Some(m) => tok.encode_trusted(m),
                None => Vec::new(),
            };
            Some(Plan::Json { grammar, trigger })
        }
        (None, None) => None,
    };
    Ok(Prepared {
        api: Api::Chat,
        prompt: rendered.ids,
        stable_len: rendered.stable_len,
        settings,
        max_new,
        thinking: rendered.thinking,
        plan: plan.map(|p| (p, trie(ready))),
    })
}

type Json = Option<(ResponseFormat, Arc<Grammar>)>;

fn response_format(v: Option<&Value>) -> Result<Json, ApiError> {
    let Some(v) = v else { return Ok(None) };
    let param = "response_format";
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some((
            ResponseFormat::JsonObject,
            Arc::new(Grammar::json_object()),
        ))),
        Some("json_schema") => {
            let schema = v
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| {
                    ApiError::invalid(param, "response_format.json_schema.schema is missing")
                })?;
            let g = Grammar::from_schema(schema)
                .map_err(|e| ApiError::invalid(param, format!("response_format: {e}")))?;
            Ok(Some((
                ResponseFormat::JsonSchema(schema.clone()),
                Arc::new(g),
            )))
        }
        _ => Err(ApiError::invalid(
            param,
            "response_format.type must be text, json_object or json_schema",
        )),
    }
}

fn prepare_completion(
    st: &AppState,
    ready: &Ready,
    common: Common,
    req: CompletionRequest,
) -> Result<Prepared, ApiError> {
    check_model(st, &common)?;
    if req.echo {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let tok = ready.loaded.tokenizer.as_ref();
    let vocab = ready.loaded.lm.info().vocab_size;
    let text = |t: &str| -> Result<Vec<u32>, ApiError> {
        if let Some(per) = ready.loaded.max_token_bytes {
            check_length(
                st,
                ready,
                "prompt",
                bound::text_tokens_at_least(t, per),
                t.len(),
            )?;
        }
        let mut ids = tok.encode(t);
        if let Some(b) = ready.loaded.bos
            && ids.first() != Some(&b)
        {
            ids.insert(0, b);
        }
        Ok(ids)
    };
    let prompt = match &req.prompt {
        Prompt::Text(t) => text(t)?,
        Prompt::Texts(v) if v.len() == 1 => text(&v[0])?,
        Prompt::Texts(v) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("one prompt per request, got {}", v.len()),
            ));
        }
        Prompt::Ids(ids) => ids.clone(),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    if let Some(&id) = prompt.iter().find(|&&i| i as usize >= vocab) {
        return Err(ApiError::invalid(
            "prompt",
            format!("token id {id} is outside the vocabulary (0..{vocab})"),
        ));
    }
    let top = req.logprobs.map(|n| n as usize);
    let settings = common.settings(top)?;
    let max_new =
        budget(st, ready, prompt.len(), settings.max_tokens.or(Some(16))).map_err(|mut e| {
            if e.param.as_deref() == Some("messages") {
                e.param = Some("prompt".into());
            }
            e
        })?;
    Ok(Prepared {
        api: Api::Completion,
        prompt,
        stable_len: 0,
        settings,
        max_new,
        thinking: false,
        plan: None,
    })
}
