//! `fathom serve`: an OpenAI-compatible HTTP server over the step engine.
//!
//! One engine thread owns the model and decodes every running request
//! together (continuous batching); HTTP handlers validate, render and
//! tokenize, queue a job, and turn the engine's per-request messages into
//! JSON or server-sent events. The server speaks only the family-neutral
//! model interface and the model's chat format.

mod answer;
mod api;
mod bound;
mod conn;
mod constraint;
mod disk;
mod error;
mod generate;
mod handlers;
pub mod load;
mod metrics;
mod prefix;
mod respond;
mod routes;
mod tools;
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result};
use fathom_chat::ChatFormat;
use fathom_model::CausalLm;
use fathom_tokenizer::Tokenizer;

pub use bound::max_token_bytes;
pub use error::ApiError;
pub use metrics::Metrics;
pub use prefix::{PrefixCache, fingerprint};

/// Everything the server is told at start.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The id clients name in `model` (and `/v1/models` lists).
    pub model_id: String,
    pub host: String,
    pub port: u16,
    /// Sequences decoded together at most.
    pub max_seqs: usize,
    /// Requests waiting for a slot at most (beyond: 429).
    pub max_queue: usize,
    /// Most new positions per engine step (prefill chunks fit in it).
    pub max_step_tokens: usize,
    /// Longest prompt + completion a request may ask for.
    pub context: usize,
    pub api_key: Option<String>,
    pub cors_origins: Vec<String>,
    /// Largest request body, bytes.
    pub max_body: usize,
    /// Open connections at most (beyond: the longest-idle is closed, or
    /// the new one refused).
    pub max_connections: usize,
    /// A request's headers must be complete within this of the connection
    /// opening or answering its previous request (also the keep-alive
    /// idle timeout).
    pub header_timeout: Duration,
    /// A request's body must arrive within this once its headers have.
    pub body_timeout: Duration,
    /// Host names answered besides the loopback ones; when bound to a
    /// loopback address, requests naming any other Host get 403.
    pub allowed_hosts: Vec<String>,
    pub shutdown_timeout: Duration,
    /// Prompt tokens between saved prefix states (0 = only chat turns).
    pub prefix_block: usize,
    /// RAM for saved prefix states (0 = no prefix cache).
    pub prefix_budget: u64,
    pub state_cache_dir: Option<PathBuf>,
    /// Bytes of saved states kept in `state_cache_dir` at most (least
    /// recently used removed first); `None`: a tenth of the free space
    /// there at start, at most [`DEFAULT_STATE_CACHE_MAX`].
    pub state_cache_max: Option<u64>,
    /// Run the engine on a thread of the global compute pool, so each
    /// parallel product of a step forks from a pool thread instead of waking
    /// and waiting on the engine's own thread (a fixed cost per product that
    /// dominates small models). The idle engine then holds one pool thread:
    /// only for a process that runs one server (`fathom serve`), never for
    /// several in one process, whose engines could hold every pool thread.
    pub engine_on_pool: bool,
}

/// Cap on the default `state_cache_max`.
pub const DEFAULT_STATE_CACHE_MAX: u64 = 20 << 30;

/// A loaded model and what goes with it.
pub struct Loaded {
    pub lm: Arc<dyn CausalLm>,
    pub tokenizer: Arc<dyn Tokenizer>,
    pub chat: Option<ChatFormat>,
    /// BOS put before completion prompts given as text.
    pub bos: Option<u32>,
    /// Identity for saved prefix states.
    pub fingerprint: [u8; 32],
    /// The most bytes of text one token covers, when the tokenizer keeps
    /// every byte ([`max_token_bytes`]): a prompt far over the context is
    /// then refused before it is tokenized.
    pub max_token_bytes: Option<usize>,
}

/// Ready to serve.
pub(crate) struct Ready {
    pub loaded: Loaded,
    pub tx: std::sync::Mutex<std::sync::mpsc::Sender<worker::Cmd>>,
    pub trie: OnceLock<Arc<fathom_constrain::TokenTrie>>,
    /// Every special id and stop id (text before an enforced tool call
    /// may contain none).
    pub banned: OnceLock<Arc<Vec<u32>>>,
}

pub(crate) struct AppState {
    pub cfg: ServeConfig,
    pub ready: OnceLock<Ready>,
    pub load_error: OnceLock<String>,
    pub metrics: Arc<Metrics>,
    pub queued: worker::QueueDepth,
    pub next_id: AtomicU64,
    /// Random per process: response ids differ across restarts.
    pub id_salt: u64,
    /// When the server started (`created` of `/v1/models`).
    pub started: u64,
    /// Bounds the rendering and tokenizing that runs at once (off the
    /// HTTP threads).
    pub prep: Arc<tokio::sync::Semaphore>,
    pub hosts: routes::HostPolicy,
    /// Set at shutdown: new requests get 503.
    pub stopping: std::sync::atomic::AtomicBool,
}

impl AppState {
    pub fn ready(&self) -> Result<&Ready, ApiError> {
        match (self.ready.get(), self.load_error.get()) {
            (Some(r), _) => Ok(r),
            (None, Some(e)) => Err(ApiError::unavailable(format!(
                "the model failed to load: {e}"
            ))),
            (None, None) => Err(ApiError::unavailable("the model is still loading")),
        }
    }

    /// A response id unique to this response: a bijective mix of a
    /// per-process counter under a random salt.
    pub fn request_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:016x}", mix(self.id_salt.wrapping_add(n)))
    }
}

/// The splitmix64 finaliser: a bijection on `u64`.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Rendering and tokenizing jobs at once: half the cores, at least two
/// (so one long prompt does not hold every other request back).
fn prep_slots() -> usize {
    std::thread::available_parallelism().map_or(2, |n| (n.get() / 2).max(2))
}

/// A running server: its address and how to stop it.
pub struct Server {
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Server {
    /// Asks the server to stop (as SIGTERM does) and waits for it.
    pub fn stop(mut self) -> Result<()> {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        self.wait()
    }

    /// Waits until the server has stopped (after a signal or [`Server::stop`]).
    pub fn wait(mut self) -> Result<()> {
        match self.done.take().map(|h| h.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => anyhow::bail!("the server thread panicked"),
            None => Ok(()),
        }
    }
}

/// Binds, then loads the model with `load` in the background (`/health`
/// says 503 until it is ready), and serves until SIGINT/SIGTERM or
/// [`Server::stop`]. `signals` installs the signal handlers.
pub fn start(
    cfg: ServeConfig,
    load: Box<dyn FnOnce() -> Result<Loaded> + Send>,
    signals: bool,
) -> Result<Server> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(&addr))
        .with_context(|| format!("cannot listen on {addr} (--host/--port)"))?;
    let local = listener.local_addr()?;
    let cfg_on_pool = cfg.engine_on_pool;
    let limits = conn::Limits {
        max_connections: cfg.max_connections,
        header_timeout: cfg.header_timeout,
    };
    let id_salt = {
        use std::hash::{BuildHasher, Hasher};
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    let hosts = routes::HostPolicy::new(&cfg.host, &cfg.allowed_hosts);
    let state = Arc::new(AppState {
        metrics: Arc::new(Metrics::new(&cfg.model_id)),
        cfg,
        ready: OnceLock::new(),
        load_error: OnceLock::new(),
        queued: Arc::new(AtomicUsize::new(0)),
        next_id: AtomicU64::new(0),
        id_salt,
        started: unix_now(),
        prep: Arc::new(tokio::sync::Semaphore::new(prep_slots())),
        hosts,
        stopping: Default::default(),
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (fail_tx, fail_rx) = tokio::sync::oneshot::channel::<()>();
    let st = state.clone();
    let on_pool = cfg_on_pool;
    let worker = std::thread::Builder::new()
        .name("fathom-engine".into())
        .spawn(move || {
            if on_pool {
                rayon::scope(|_| generate::load_and_run(st, load, fail_tx))
            } else {
                generate::load_and_run(st, load, fail_tx)
            }
        })
        .context("cannot start the engine thread")?;
    let st = state.clone();
    let done = std::thread::Builder::new()
        .name("fathom-http".into())
        .spawn(move || -> Result<()> {
            let app = routes::router(st.clone());
            let metrics = st.metrics.clone();
            rt.block_on(async move {
                let stop = async move {
                    tokio::select! {
                        _ = stop_rx => {}
                        _ = fail_rx => {}
                        _ = signal(signals) => {}
                    }
                    tracing::info!("shutting down: no new requests; finishing what runs");
                    generate::begin_shutdown(&st);
                };
                conn::serve(listener, app, limits, metrics, stop).await
            });
            if worker.join().is_err() {
                anyhow::bail!("the engine thread panicked");
            }
            if let Some(e) = state.load_error.get() {
                anyhow::bail!("the model failed to load: {e}");
            }
            Ok(())
        })
        .context("cannot start the HTTP thread")?;
    Ok(Server {
        addr: local,
        shutdown: Some(stop_tx),
        done: Some(done),
    })
}

/// Resolves on SIGINT or SIGTERM (never when `enabled` is false).
async fn signal(enabled: bool) {
    if !enabled {
        return std::future::pending().await;
    }
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}
