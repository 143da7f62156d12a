//! From a checked request to the engine and back: loading, queueing,
//! shutdown, and collecting a job's messages.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use fathom_engine::Decoder;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::error::ApiError;
use crate::prefix::{Disk, PrefixCache};
use crate::worker::{self, Cmd, Job, Msg, WorkerConfig};
use crate::{AppState, Loaded, Ready};

/// The engine thread: loads the model, then runs the engine until shutdown.
pub(crate) fn load_and_run(
    st: Arc<AppState>,
    load: Box<dyn FnOnce() -> anyhow::Result<Loaded> + Send>,
    fail: tokio::sync::oneshot::Sender<()>,
) {
    let t0 = Instant::now();
    let loaded = match load() {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("cannot load the model: {e:#}");
            let _ = st.load_error.set(format!("{e:#}"));
            let _ = fail.send(());
            return;
        }
    };
    let disk = st.cfg.state_cache_dir.as_ref().and_then(|d| {
        match Disk::open(d, loaded.fingerprint, st.cfg.state_cache_max) {
            Ok((disk, opened)) => {
                opened.log(d);
                tracing::info!(
                    dir = %d.display(),
                    files = disk.len(),
                    bytes = disk.bytes(),
                    max = disk.max(),
                    "prefix states on disk"
                );
                Some(disk)
            }
            Err(e) => {
                tracing::warn!(dir = %d.display(), "prefix states will not be saved: {e}");
                None
            }
        }
    });
    let prefix = PrefixCache::new(st.cfg.prefix_block, st.cfg.prefix_budget, disk);
    let (tx, rx) = std::sync::mpsc::channel();
    let lm = loaded.lm.clone();
    let tok = loaded.tokenizer.clone();
    let decoder: Decoder = Arc::new(move |ids: &[u32]| tok.decode(ids));
    let ready = Ready {
        loaded,
        tx: Mutex::new(tx),
        trie: OnceLock::new(),
        banned: OnceLock::new(),
    };
    if st.ready.set(ready).is_err() || st.stopping.load(Ordering::SeqCst) {
        return;
    }
    tracing::info!(load_s = t0.elapsed().as_secs_f64(), "model ready");
    let cfg = WorkerConfig {
        max_seqs: st.cfg.max_seqs,
        max_step_tokens: st.cfg.max_step_tokens,
    };
    worker::run(
        lm,
        decoder,
        cfg,
        rx,
        prefix,
        st.metrics.clone(),
        st.queued.clone(),
    );
}

/// Stops admitting requests; what runs finishes or is cancelled at the timeout.
pub(crate) fn begin_shutdown(st: &AppState) {
    st.stopping.store(true, Ordering::SeqCst);
    if let Some(r) = st.ready.get() {
        let deadline = Instant::now() + st.cfg.shutdown_timeout;
        let tx = r.tx.lock().unwrap_or_else(|p| p.into_inner());
        let _ = tx.send(Cmd::Shutdown { deadline });
    }
}

/// Queues a job (429 when the queue is full); returns its message stream.
pub(crate) fn submit(
    st: &AppState,
    ready: &Ready,
    id: String,
    reqs: Vec<fathom_engine::Request>,
    stable_len: usize,
) -> Result<UnboundedReceiver<Msg>, ApiError> {
    if st.stopping.load(Ordering::SeqCst) {
        return Err(ApiError::shutting_down("the server is shutting down"));
    }
    let q = st.queued.fetch_add(1, Ordering::SeqCst);
    if q >= st.cfg.max_queue {
        st.queued.fetch_sub(1, Ordering::SeqCst);
        return Err(ApiError::overloaded(q, st.metrics.retry_after(q)));
    }
    st.metrics.queued(q + 1);
    let (tx, rx) = unbounded_channel();
    let job = Job {
        id,
        reqs,
        stable_len,
        tx,
        arrived: Instant::now(),
    };
    let sent = ready
        .tx
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send(Cmd::Job(Box::new(job)));
    if sent.is_err() {
        st.queued.fetch_sub(1, Ordering::SeqCst);
        if st.stopping.load(Ordering::SeqCst) {
            return Err(ApiError::shutting_down("the server is shutting down"));
        }
        return Err(ApiError::unavailable("the engine has stopped"));
    }
    Ok(rx)
}
