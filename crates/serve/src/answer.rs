//! Queueing a prepared request and answering it: one JSON response, or
//! server-sent events as tokens arrive.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use fathom_engine::{Constraint, Request};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::constraint::{JsonConstraint, ToolConstraint};
use crate::error::ApiError;
use crate::handlers::{Plan, Prepared};
use crate::respond::{Api, Output, shutdown_error};
use crate::worker::Msg;
use crate::{AppState, Ready};

/// Queues the request and answers it.
pub(crate) async fn run(
    st: &Arc<AppState>,
    ready: &Ready,
    p: Prepared,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let lm = &ready.loaded.lm;
    let info = lm.info();
    let prefix = if p.api == Api::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let id = st.request_id(prefix);
    let created = crate::unix_now();
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
        r.constraint = p.plan.as_ref().map(|(plan, trie)| -> Box<dyn Constraint> {
            let tok = ready.loaded.tokenizer.clone();
            match plan {
                Plan::Json { grammar, trigger } => Box::new(JsonConstraint::new(
                    grammar,
                    trie.clone(),
                    tok,
                    trigger.clone(),
                    stop_ids.clone(),
                    info.vocab_size,
                )),
                Plan::Tools(steps) => Box::new(ToolConstraint::new(
                    steps,
                    trie.clone(),
                    tok,
                    info.vocab_size,
                )),
            }
        });
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
        created,
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
    }
}

/// The error of a request whose messages ended before it finished: the
/// shutdown's, when the server is stopping.
fn cut_short(st: &AppState) -> ApiError {
    if st.stopping.load(std::sync::atomic::Ordering::SeqCst) {
        shutdown_error()
    } else {
        ApiError::internal("the engine stopped before the request finished")
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
            return Err(cut_short(&log.st));
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
                let e = cut_short(&log.st);
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
