//! `fathom serve`: the OpenAI-compatible HTTP server.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use fathom_chat::ChatFormat;
use fathom_serve::{Loaded, ServeConfig};
use fathom_weights::units::parse_size;

use crate::common::{SpineArg, tokenizer, wants_bos};
use crate::load::{MemoryArgs, check_model_dir, load_model_config};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Serve a model over an OpenAI-compatible HTTP API (and a chat page at /).
#[derive(Args)]
pub struct ServeArgs {
    /// Model directory, or ORG/NAME[@REV] pulled by `fathom pull` (config.json, shards, tokenizer).
    #[arg(long, value_parser = fathom_hub::resolve_model)]
    model: PathBuf,
    /// Address to listen on; the default accepts local connections only.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed once listening).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients use (default: the directory's name).
    #[arg(long)]
    model_id: Option<String>,
    /// Sequences decoded together at most (continuous batching).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    max_seqs: u32,
    /// Requests waiting for a slot at most; beyond, 429 with Retry-After.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    max_queue: u32,
    /// New positions per engine step at most (long prompts are prefilled in chunks of it).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    max_step_tokens: u32,
    /// Require `Authorization: Bearer KEY` on the API.
    #[arg(long, env = "FATHOM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Allow browser requests from this origin (repeatable); CORS is off without it.
    #[arg(long)]
    cors_origin: Vec<String>,
    /// Largest request body.
    #[arg(long, default_value = "16MiB", value_parser = parse_size)]
    max_body: u64,
    /// Open connections at most; beyond, the longest-idle one is closed, or the new one gets 503 when none is idle.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_connections: u32,
    /// Seconds for a request's headers to arrive, from the connection opening or answering its last request (also the keep-alive idle timeout).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    header_timeout: u64,
    /// Seconds for a request's body to arrive once its headers have.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    body_timeout: u64,
    /// Also answer requests whose Host is NAME (repeatable; `*` = any). Bound to a loopback address, only loopback names are answered otherwise.
    #[arg(long, value_name = "NAME")]
    allowed_host: Vec<String>,
    /// Seconds to finish running requests after SIGINT/SIGTERM before cancelling them.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Prompt tokens between saved prefix states (0: save only at chat-turn boundaries).
    #[arg(long, default_value_t = 256)]
    prefix_block: usize,
    /// RAM for saved prefix states (default: a tenth of the RAM budget; 0 turns reuse off).
    #[arg(long, value_parser = parse_size)]
    prefix_cache: Option<u64>,
    /// Keep saved prefix states in this directory too, across restarts.
    #[arg(long)]
    state_cache_dir: Option<PathBuf>,
    /// Bytes of saved states in --state-cache-dir at most, least recently used removed first (default: a tenth of the free space there, at most 20 GiB).
    #[arg(long, value_parser = parse_size)]
    state_cache_max: Option<u64>,
    /// Precision of the resident spine matrices (int8 is lossy).
    #[arg(long, value_enum, default_value_t = SpineArg::Bf16)]
    spine: SpineArg,
    /// Log lines as text or JSON (RUST_LOG filters, default info).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(flatten)]
    mem: MemoryArgs,
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
}

pub fn run(a: ServeArgs) -> Result<()> {
    init_logs(a.log_format);
    check_model_dir(&a.model)?;
    if a.api_key.as_deref().is_some_and(str::is_empty) {
        bail!("--api-key (or FATHOM_API_KEY) is empty: give a key or leave it unset");
    }
    if let Some(h) = a
        .allowed_host
        .iter()
        .find(|h| h.is_empty() || h.contains(|c: char| c.is_whitespace() || c == '/' || c == ','))
    {
        bail!(
            "--allowed-host {h:?} is not a host name: give one name per flag (e.g. --allowed-host api.example.com)"
        );
    }
    let max_body = usize::try_from(a.max_body)
        .unwrap_or(usize::MAX)
        .clamp(1024, 1 << 30);
    let req = a.mem.request();
    let (budget, _) = req.budget()?;
    let prefix_budget = a.prefix_cache.unwrap_or(budget / 10);
    let model_id = a.model_id.clone().unwrap_or_else(|| {
        a.model
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "fathom".into())
    });
    let config = fathom_runtime::read_config(&a.model)?;
    let fix = "give a smaller --prefix-cache";
    // Every admitted sequence's state for the context fits the budget too
    // (the latent cache's RAM share, the rest on disk).
    let mem = req
        .set_aside(prefix_budget, "--prefix-cache", fix)?
        .with_sequences(a.max_seqs as usize - 1);
    let spine = a.spine.spine();
    let step = a.max_step_tokens as usize;
    // The budget rule before the server starts: the context it serves.
    let plan = crate::load::plan(&config, &mem, step, spine)?;
    let cfg = ServeConfig {
        model_id,
        host: a.host.clone(),
        port: a.port,
        max_seqs: a.max_seqs as usize,
        max_queue: a.max_queue as usize,
        max_step_tokens: a.max_step_tokens as usize,
        context: plan.context,
        api_key: a.api_key.clone(),
        cors_origins: a.cors_origin.clone(),
        max_body,
        max_connections: a.max_connections as usize,
        header_timeout: Duration::from_secs(a.header_timeout),
        body_timeout: Duration::from_secs(a.body_timeout),
        allowed_hosts: a.allowed_host.clone(),
        shutdown_timeout: Duration::from_secs(a.shutdown_timeout),
        prefix_block: a.prefix_block,
        prefix_budget,
        state_cache_dir: a.state_cache_dir.clone(),
        state_cache_max: a.state_cache_max,
        engine_on_pool: true,
    };
    let dir = a.model.clone();
    let max_seqs = a.max_seqs as usize;
    let load = Box::new(move || -> Result<Loaded> {
        let Some(tok) = tokenizer(&dir)? else {
            bail!(
                "{} ships no tokenizer (tiktoken.model or tokenizer.json): the server needs one",
                dir.display()
            );
        };
        let chat = ChatFormat::detect(&dir, tok.as_ref())?;
        let (lm, info) = load_model_config(config, &mem, step, spine)?;
        if let Some(l) = &info.ledger {
            tracing::info!(
                "RAM ledger: {}; prefix states {} (--prefix-cache); state of {} more sequences reserved",
                l.describe(),
                fathom_weights::units::format_bytes(prefix_budget),
                max_seqs - 1
            );
        }
        tracing::info!(
            experts = info.experts,
            load_s = info.load_s,
            context = info.context,
            context_source = %info.context_source,
            chat = chat.as_ref().map(|c| c.name()),
            "model loaded"
        );
        let bos = wants_bos(&dir, lm.info().bos_token_id);
        let fingerprint = fathom_serve::fingerprint(&dir)
            .with_context(|| format!("cannot read {}", dir.display()))?;
        let max_token_bytes = fathom_serve::max_token_bytes(&dir, tok.as_ref());
        Ok(Loaded {
            lm,
            tokenizer: tok,
            chat,
            bos,
            fingerprint,
            max_token_bytes,
        })
    });
    let server = fathom_serve::start(cfg, load, true)?;
    tracing::info!(
        "listening on http://{} (chat page at /, API under /v1)",
        server.addr
    );
    server.wait()
}
