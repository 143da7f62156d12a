//! `POST /v1/chat/completions` and `POST /v1/completions`: check, render,
//! tokenize, queue, and answer (JSON or server-sent events).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use fathom_chat::{ChatOptions, ResponseFormat, ToolChoice};
use fathom_constrain::Grammar;
use fathom_engine::Request;
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::{self, ChatRequest, Common, CompletionRequest, GenSettings, Prompt};
use crate::constraint::JsonConstraint;
use crate::error::ApiError;
use crate::respond::{Api, Output};
use crate::routes::read_body;
use crate::worker::Msg;
use crate::{AppState, Ready};

/// A checked request, ready to queue.
struct Prepared {
    api: Api,
    prompt: Vec<u32>,
    stable_len: usize,
    settings: GenSettings,
    max_new: usize,
    /// Chat replies start in the thinking channel.
    thinking: bool,
    /// The grammar and the ids after which it applies.
    json: Option<(Arc<Grammar>, Vec<u32>)>,
}

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
async fn handle<R: serde::de::DeserializeOwned>(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
    ep: &'static str,
    prepare: fn(&AppState, &Ready, Common, R) -> Result<Prepared, ApiError>,
) -> Response {
    let resp = async {
        let bytes = read_body(&headers, body, st.cfg.max_body).await?;
        let ready = st.ready()?;
        let (common, req): (Common, R) = api::parse(&bytes)?;
        let p = prepare(&st, ready, common, req)?;
        run(&st, ready, p).await
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

/// The completion budget: what was asked, within the context.
fn budget(
    st: &AppState,
    ready: &Ready,
    prompt: usize,
    asked: Option<usize>,
) -> Result<usize, ApiError> {
    let declared = ready
        .loaded
        .lm
        .info()
        .max_position_embeddings
        .unwrap_or(usize::MAX);
    let context = st.cfg.context.min(declared);
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
    opts.tool_choice = tool_choice(req.tool_choice.as_ref())?;
    let json = response_format(req.response_format.as_ref())?;
    opts.response_format = json.as_ref().map(|(f, _)| f.clone());
    let rendered = format
        .prompt(ready.loaded.tokenizer.as_ref(), &req.messages, &opts)
        .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    let max_new = budget(st, ready, rendered.ids.len(), settings.max_tokens)?;
    let json = json.map(|(_, g)| {
        let trigger = match format.answer_marker().filter(|_| rendered.thinking) {
            Some(m) => ready.loaded.tokenizer.encode_trusted(m),
            None => Vec::new(),
        };
        (g, trigger)
    });
    Ok(Prepared {
        api: Api::Chat,
        prompt: rendered.ids,
        stable_len: rendered.stable_len,
        settings,
        max_new,
        thinking: rendered.thinking,
        json,
    })
}

fn tool_choice(v: Option<&Value>) -> Result<Option<ToolChoice>, ApiError> {
    match v {
        None => Ok(None),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(Some(ToolChoice::Auto)),
            "required" => Ok(Some(ToolChoice::Required)),
            "none" => Ok(Some(ToolChoice::None)),
            other => Err(ApiError::invalid(
                "tool_choice",
                format!("tool_choice {other:?}: use auto, required or none"),
            )),
        },
        Some(_) => Err(ApiError::invalid(
            "tool_choice",
            "tool_choice naming one function is not supported: use auto, required or none",
        )),
    }
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
    let text = |t: &str| {
        let mut ids = tok.encode(t);
        if let Some(b) = ready.loaded.bos
            && ids.first() != Some(&b)
        {
            ids.insert(0, b);
        }
        ids
    };
    let prompt = match &req.prompt {
        Prompt::Text(t) => text(t),
        Prompt::Texts(v) if v.len() == 1 => text(&v[0]),
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
        json: None,
    })
}

/// Queues the request and answers it.
async fn run(st: &Arc<AppState>, ready: &Ready, p: Prepared) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let lm = &ready.loaded.lm;
    let info = lm.info();
    let prefix = if p.api == Api::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let id = st.request_id(prefix);
    let trie = p.json.as_ref().map(|_| {
        ready
            .trie
            .get_or_init(|| {
                Arc::new(crate::constraint::trie(
                    ready.loaded.tokenizer.as_ref(),
                    info.vocab_size,
                ))
            })
            .clone()
    });
    // A chat reply also ends at its format's closing tokens (harmony's
    // `<|return|>` and `<|call|>`).
    let stop_ids = match (p.api, ready.loaded.chat.as_ref()) {
        (Api::Chat, Some(f)) => f.stop_ids(ready.loaded.tokenizer.as_ref(), &info.eos_token_ids),
        _ => info.eos_token_ids.clone(),
    };
    let mut reqs = Vec::new();
    let mut parsers = Vec::new();
    for choice in 0..p.settings.n {
        let mut r = Request::new(p.prompt.clone(), p.max_new);
        r.sampling = p.settings.sampling.clone();
        r.choice = choice;
        r.stop_ids = stop_ids.clone();
        r.stop_strings = p.settings.stop.clone();
        if let (Some((g, trigger)), Some(trie)) = (&p.json, &trie) {
            let c = JsonConstraint::new(
                g,
                trie.clone(),
                ready.loaded.tokenizer.clone(),
                trigger.clone(),
                stop_ids.clone(),
                info.vocab_size,
            );
            r.constraint = Some(Box::new(c));
        }
        reqs.push(r);
        parsers.push(match (p.api, ready.loaded.chat.as_ref()) {
            (Api::Chat, Some(f)) => Some(f.reply_parser(p.thinking)),
            _ => None,
        });
    }
    let rx = crate::generate::submit(st, ready, id.clone(), reqs, p.stable_len)?;
    let out = Output::new(
        p.api,
        id.clone(),
        st.created,
        st.cfg.model_id.clone(),
        parsers,
        p.prompt.len(),
        p.settings.sampling.logprobs.is_some(),
        ready.loaded.tokenizer.clone(),
    );
    let log = Log {
        id,
        arrived,
        st: st.clone(),
    };
    if p.settings.stream {
        Ok(stream(rx, out, p.settings.include_usage, log).into_response())
    } else {
        collect(rx, out, log)
            .await
            .map(|v| axum::Json(v).into_response())
    }
}

/// Logs a request's figures when it ends.
struct Log {
    id: String,
    arrived: Instant,
    st: Arc<AppState>,
}

impl Log {
    fn done(&self, out: &Output, admitted: Option<Instant>, first: Option<Instant>) {
        let usage = out.usage();
        let total = self.arrived.elapsed().as_secs_f64();
        let ttft = first.map(|f| f.duration_since(self.arrived).as_secs_f64());
        let generated = usage["completion_tokens"].as_u64().unwrap_or(0);
        let decode_s = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
        tracing::info!(
            request_id = %self.id,
            prompt_tokens = out.prompt_tokens,
            cached_tokens = out.cached,
            completion_tokens = generated,
            queue_s = admitted.map_or(0.0, |a| a.duration_since(self.arrived).as_secs_f64()),
            ttft_s = ttft.unwrap_or(0.0),
            total_s = total,
            tok_s = if decode_s > 0.0 { generated.saturating_sub(1) as f64 / decode_s } else { 0.0 },
            "request done"
        );
        let _ = &self.st;
    }
}

/// Notes when a request joined the engine and when its first token came.
fn mark(msg: &Msg, admitted: &mut Option<Instant>, first: &mut Option<Instant>) {
    match msg {
        Msg::Started { .. } => *admitted = Some(Instant::now()),
        Msg::Token { .. } if first.is_none() => *first = Some(Instant::now()),
        _ => {}
    }
}

async fn collect(
    mut rx: UnboundedReceiver<Msg>,
    mut out: Output,
    log: Log,
) -> Result<Value, ApiError> {
    let (mut admitted, mut first) = (None, None);
    while !out.all_done() {
        let Some(msg) = rx.recv().await else {
            return Err(ApiError::internal(
                "the engine stopped before the request finished",
            ));
        };
        mark(&msg, &mut admitted, &mut first);
        out.on(msg);
    }
    log.done(&out, admitted, first);
    out.response()
}

fn stream(
    mut rx: UnboundedReceiver<Msg>,
    mut out: Output,
    usage: bool,
    log: Log,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let (tx, events) = tokio::sync::mpsc::channel::<Event>(64);
    tokio::spawn(async move {
        let (mut admitted, mut first) = (None, None);
        while !out.all_done() {
            // A client that goes away is noticed at once (not only when a
            // chunk is sent): dropping `rx` cancels the sequence, even while
            // it waits in the queue.
            let msg = tokio::select! {
                _ = tx.closed() => return,
                m = rx.recv() => m,
            };
            let Some(msg) = msg else {
                let e = ApiError::internal("the engine stopped before the request finished");
                let _ = tx.send(Event::default().data(e.body().to_string())).await;
                return;
            };
            mark(&msg, &mut admitted, &mut first);
            for chunk in out.on(msg) {
                if tx
                    .send(Event::default().data(chunk.to_string()))
                    .await
                    .is_err()
                {
                    // The client went away: dropping `rx` cancels the sequence.
                    return;
                }
            }
        }
        if usage {
            let _ = tx
                .send(Event::default().data(out.usage_chunk().to_string()))
                .await;
        }
        let _ = tx.send(Event::default().data("[DONE]")).await;
        log.done(&out, admitted, first);
    });
    let s = futures_util::stream::unfold(events, |mut ev| async move {
        ev.recv().await.map(|e| (Ok(e), ev))
    });
    Sse::new(s).keep_alive(KeepAlive::default())
}
