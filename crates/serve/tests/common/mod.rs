//! Shared by the server tests: the model, a server on a free loopback
//! port, solo reference runs, and a small SSE reader.
#![allow(dead_code)]

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use fathom_chat::{ChatFormat, ChatOptions, Message, ReplyDelta};
use fathom_engine::{Decoder, Request, SamplingParams, generate};
use fathom_model::experts::ExpertStats;
use fathom_model::{CausalLm, ModelError, ModelInfo, SeqState, StepError, StepInput};
use fathom_serve::{Loaded, ServeConfig, Server};
use fathom_tokenizer::Tokenizer;
use serde_json::Value;

pub fn model_dir() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/models/k3-code-small");
    p.join("config.json").is_file().then_some(p)
}

/// The model and its tokenizer.
pub type ModelAndTokenizer = (Arc<dyn CausalLm>, Arc<dyn Tokenizer>);

/// The model, or `None` (the caller prints why it skips).
pub fn model() -> Option<ModelAndTokenizer> {
    static M: OnceLock<Option<ModelAndTokenizer>> = OnceLock::new();
    M.get_or_init(|| {
        let dir = model_dir()?;
        let lm = fathom_model::load(&dir, Default::default()).expect("k3-code-small loads");
        let tok: Arc<dyn Tokenizer> = fathom_tokenizer::load_from_dir(&dir)
            .unwrap()
            .unwrap()
            .into();
        Some((lm, tok))
    })
    .clone()
}

#[macro_export]
macro_rules! need_model {
    () => {
        match common::model() {
            Some(m) => m,
            None => {
                eprintln!("skipped: shared/models/k3-code-small is not beside the repository");
                return;
            }
        }
    };
}

pub fn config() -> ServeConfig {
    ServeConfig {
        model_id: "k3-code-small".into(),
        host: "127.0.0.1".into(),
        port: 0,
        max_seqs: 8,
        max_queue: 64,
        max_step_tokens: 64,
        context: 4096,
        api_key: None,
        cors_origins: Vec::new(),
        max_body: 1 << 20,
        max_connections: 256,
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(60),
        allowed_hosts: Vec::new(),
        shutdown_timeout: Duration::from_secs(20),
        prefix_block: 32,
        prefix_budget: 256 << 20,
        state_cache_dir: None,
        state_cache_max: None,
        // Several servers run in one test process.
        engine_on_pool: false,
    }
}

/// Starts a server over `lm` (which may wrap the model).
pub fn start(cfg: ServeConfig, lm: Arc<dyn CausalLm>) -> (Server, String) {
    let (_, tok) = model().expect("checked by the caller");
    start_with(cfg, lm, tok)
}

/// Starts a server over `lm` and `tok` (either may wrap the model's).
pub fn start_with(
    cfg: ServeConfig,
    lm: Arc<dyn CausalLm>,
    tok: Arc<dyn Tokenizer>,
) -> (Server, String) {
    let dir = model_dir().unwrap();
    let load = Box::new(move || {
        let chat = ChatFormat::detect(&dir, tok.as_ref())?;
        Ok(Loaded {
            bos: lm.info().bos_token_id,
            lm,
            max_token_bytes: fathom_serve::max_token_bytes(&dir, tok.as_ref()),
            tokenizer: tok,
            chat,
            fingerprint: fathom_serve::fingerprint(&dir)?,
        })
    });
    let server = fathom_serve::start(cfg, load, false).expect("server starts");
    let url = format!("http://{}", server.addr);
    wait_ready(&url);
    (server, url)
}

fn wait_ready(url: &str) {
    let rt = rt();
    rt.block_on(async {
        for _ in 0..300 {
            if let Ok(r) = reqwest::get(format!("{url}/health")).await
                && r.status() == 200
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the server did not become ready within 15 s");
    });
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

/// POSTs JSON; returns status and body.
pub async fn post(url: &str, path: &str, body: Value) -> (u16, Value) {
    let r = client()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// POSTs a streaming request; returns every `data:` payload (`[DONE]` included).
pub async fn post_stream(url: &str, path: &str, body: Value) -> Vec<String> {
    let r = client()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "stream request refused");
    let text = r.text().await.unwrap();
    sse_data(&text)
}

pub fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|ev| {
            ev.lines()
                .find_map(|l| l.strip_prefix("data: "))
                .map(str::to_string)
        })
        .collect()
}

/// Concatenates `choices[0].<field>` (or `delta.<field>` for chat) over chunks.
pub fn joined(chunks: &[String], field: &str) -> String {
    let mut s = String::new();
    for c in chunks.iter().filter(|c| *c != "[DONE]") {
        let v: Value = serde_json::from_str(c).unwrap();
        for ch in v["choices"].as_array().unwrap() {
            let x = if ch.get("delta").is_some() {
                &ch["delta"][field]
            } else {
                &ch[field]
            };
            if let Some(t) = x.as_str() {
                s.push_str(t);
            }
        }
    }
    s
}

pub fn decoder(tok: &Arc<dyn Tokenizer>) -> Decoder {
    let t = tok.clone();
    Arc::new(move |ids: &[u32]| t.decode(ids))
}

/// A solo run: the reference every served output must equal.
pub fn solo(
    prompt: Vec<u32>,
    max_new: usize,
    sampling: SamplingParams,
    stop: &[String],
) -> (String, Vec<u32>, String) {
    let (lm, tok) = model().unwrap();
    let mut req = Request::new(prompt, max_new);
    req.sampling = sampling;
    req.stop_ids = lm.info().eos_token_ids.clone();
    req.stop_strings = stop.to_vec();
    let f = generate(&lm, req, Some(decoder(&tok)), |_| ControlFlow::Continue(())).unwrap();
    (f.text.unwrap(), f.output_ids, f.reason.name().to_string())
}

/// Completion prompt ids as the server builds them (BOS + text).
pub fn completion_ids(text: &str) -> Vec<u32> {
    let (lm, tok) = model().unwrap();
    let mut ids = tok.encode(text);
    ids.insert(0, lm.info().bos_token_id.unwrap());
    ids
}

/// Chat prompt ids and the content of a solo reply (thinking off).
pub fn solo_chat(user: &str, max_new: usize, sampling: SamplingParams) -> String {
    let (_, tok) = model().unwrap();
    let dir = model_dir().unwrap();
    let f = ChatFormat::detect(&dir, tok.as_ref()).unwrap().unwrap();
    let opts = ChatOptions {
        thinking: Some(false),
        ..Default::default()
    };
    let p = f
        .prompt(tok.as_ref(), &[Message::new("user", user)], &opts)
        .unwrap();
    let (text, _, _) = solo(p.ids, max_new, sampling, &[]);
    let mut parser = f.reply_parser(false);
    let mut d = parser.push(&text);
    d.extend(parser.finish());
    d.into_iter()
        .filter_map(|x| match x {
            ReplyDelta::Content(t) => Some(t),
            _ => None,
        })
        .collect()
}

pub fn greedy() -> SamplingParams {
    SamplingParams::default()
}

/// A model whose step fails for any sequence fed `poison`, as a sequence's
/// own fault (like non-finite logits); everything else is the real model.
pub struct Poisoned {
    pub inner: Arc<dyn CausalLm>,
    pub poison: u32,
    pub failed: AtomicBool,
}

impl CausalLm for Poisoned {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }
    fn new_state(&self) -> Box<dyn SeqState> {
        self.inner.new_state()
    }
    fn step(&self, batch: &mut [StepInput<'_>]) -> Result<Vec<Vec<f32>>, StepError> {
        if let Some(i) = batch.iter().position(|b| b.tokens.contains(&self.poison)) {
            self.failed.store(true, Ordering::SeqCst);
            return Err(StepError {
                seq: Some(i),
                error: ModelError::NonFinite {
                    what: "logits (injected)".into(),
                },
            });
        }
        self.inner.step(batch)
    }
    fn expert_stats(&self) -> ExpertStats {
        self.inner.expert_stats()
    }
    fn kv_stats(&self) -> fathom_model::KvStats {
        self.inner.kv_stats()
    }
    fn spine_reads(&self) -> fathom_model::SpineReads {
        self.inner.spine_reads()
    }
    fn decode_state(&self, bytes: &[u8]) -> fathom_model::Result<Box<dyn SeqState>> {
        self.inner.decode_state(bytes)
    }
}
