//! Connections: the accept loop, its cap, the header timeout, and graceful
//! shutdown.
//!
//! Every accepted connection takes a slot. A connection is *idle* while no
//! request of it is being answered: before its first request's headers
//! have arrived, and between keep-alive requests. When every slot is taken,
//! the connection idle the longest is closed to make room (half-sent
//! requests cannot hold the server: a client that sends its request at once
//! is never the one idle longest); when none is idle, the new connection is
//! answered `503` and closed at once. Each burst of that is logged once
//! when it starts and once, with its counts, when it ends.
//!
//! The header timeout closes a connection whose request headers are not
//! complete within it, counted from when it opened or answered its last
//! request: it bounds both a slow sender and a keep-alive connection's
//! idle time (hyper starts the same timer for both).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tower_service::Service;

use crate::metrics::Metrics;

/// What a connection over the cap is told before it is closed.
static REFUSAL: LazyLock<Vec<u8>> = LazyLock::new(|| {
    let body = crate::error::ApiError::too_many_connections()
        .body()
        .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         connection: close\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
});

/// The open connections and the cap on them.
pub(crate) struct Conns {
    max: usize,
    metrics: Arc<Metrics>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    open: HashMap<u64, Slot>,
    /// Refused and evicted connections of the burst under way, if one is.
    burst: Option<(u64, u64)>,
}

struct Slot {
    /// Requests being answered.
    busy: u32,
    /// When the connection last became idle (opened or answered).
    idle_since: Instant,
    kill: Option<oneshot::Sender<()>>,
}

enum Admit {
    /// A slot: its id and the signal that closes it early.
    Yes(u64, oneshot::Receiver<()>),
    Full,
}

impl Conns {
    pub fn new(max: usize, metrics: Arc<Metrics>) -> Arc<Conns> {
        Arc::new(Conns {
            max: max.max(1),
            metrics,
            inner: Mutex::new(Inner::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a slot for a new connection, closing the longest-idle one
    /// when all are taken.
    fn admit(&self) -> Admit {
        let mut g = self.lock();
        let full = g.open.len() >= self.max;
        if full {
            let oldest = g
                .open
                .iter()
                .filter(|(_, s)| s.busy == 0)
                .min_by_key(|(_, s)| s.idle_since)
                .map(|(&id, _)| id);
            let Some(victim) = oldest else {
                self.note_burst(&mut g, 1, 0);
                return Admit::Full;
            };
            if let Some(kill) = g.open.remove(&victim).and_then(|s| s.kill) {
                let _ = kill.send(());
            }
            self.metrics.conns.evicted.fetch_add(1, Ordering::Relaxed);
            self.note_burst(&mut g, 0, 1);
        } else if let Some((refused, evicted)) = g.burst.take() {
            tracing::info!(
                refused,
                closed_idle = evicted,
                "below the connection limit again"
            );
        }
        let (tx, rx) = oneshot::channel();
        g.next += 1;
        let id = g.next;
        g.open.insert(
            id,
            Slot {
                busy: 0,
                idle_since: Instant::now(),
                kill: Some(tx),
            },
        );
        self.metrics
            .conns
            .open
            .store(g.open.len(), Ordering::Relaxed);
        Admit::Yes(id, rx)
    }

    fn note_burst(&self, g: &mut Inner, refused: u64, evicted: u64) {
        if refused > 0 {
            self.metrics
                .conns
                .refused
                .fetch_add(refused, Ordering::Relaxed);
        }
        match &mut g.burst {
            Some(b) => {
                b.0 += refused;
                b.1 += evicted;
            }
            None => {
                tracing::warn!(
                    max = self.max,
                    "connection limit reached (--max-connections): closing the longest-idle \
                     connections, refusing new ones while every connection is answering a request"
                );
                g.burst = Some((refused, evicted));
            }
        }
    }

    fn close(&self, id: u64) {
        let mut g = self.lock();
        g.open.remove(&id);
        self.metrics
            .conns
            .open
            .store(g.open.len(), Ordering::Relaxed);
    }

    fn busy(self: &Arc<Self>, id: u64) -> Busy {
        if let Some(s) = self.lock().open.get_mut(&id) {
            s.busy += 1;
        }
        Busy {
            conns: self.clone(),
            id,
        }
    }
}

/// A request being answered; the connection is idle again when the last
/// one's response body is done (or dropped).
struct Busy {
    conns: Arc<Conns>,
    id: u64,
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(s) = self.conns.lock().open.get_mut(&self.id) {
            s.busy = s.busy.saturating_sub(1);
            s.idle_since = Instant::now();
        }
    }
}

/// A response body that keeps its connection busy until it ends.
struct Guarded {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for Guarded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The router as one connection's service.
#[derive(Clone)]
struct ConnService {
    app: Router,
    conns: Arc<Conns>,
    id: u64,
}

type Reply = axum::http::Response<Guarded>;

impl hyper::service::Service<axum::http::Request<Incoming>> for ConnService {
    type Response = Reply;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Reply, Infallible>> + Send>>;

    fn call(&self, req: axum::http::Request<Incoming>) -> Self::Future {
        let busy = self.conns.busy(self.id);
        let mut app = self.app.clone();
        Box::pin(async move {
            std::future::poll_fn(|cx| {
                Service::<axum::http::Request<Body>>::poll_ready(&mut app, cx)
            })
            .await?;
            let resp = app.call(req.map(Body::new)).await?;
            Ok(resp.map(|inner| Guarded { inner, _busy: busy }))
        })
    }
}

/// Limits of the connection layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

/// Serves `app` on `listener` until `stop` resolves, then lets every
/// connection finish the request it is answering.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    metrics: Arc<Metrics>,
    stop: impl Future<Output = ()>,
) {
    if let Some(n) = open_file_limit()
        && n < limits.max_connections as u64 + FILES_BESIDES
    {
        tracing::warn!(
            open_file_limit = n,
            max_connections = limits.max_connections,
            "the open-file limit is below --max-connections plus {FILES_BESIDES} for the model and \
             caches: raise it (ulimit -n) or lower --max-connections"
        );
    }
    let conns = Conns::new(limits.max_connections, metrics);
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut accept_failing = false;
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => r,
            _ = &mut stop => break,
        };
        let stream = match stream {
            Ok((s, _)) => {
                accept_failing = false;
                s
            }
            Err(e) => {
                // Out of file descriptors, most likely: wait instead of spinning.
                if !accept_failing {
                    tracing::warn!(
                        "cannot accept connections: {e} (raise the open-file limit or lower --max-connections)"
                    );
                    accept_failing = true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (id, kill) = match conns.admit() {
            Admit::Yes(id, kill) => (id, kill),
            Admit::Full => {
                refuse(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let svc = ConnService {
            app: app.clone(),
            conns: conns.clone(),
            id,
        };
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), svc));
        let conns = conns.clone();
        tokio::spawn(async move {
            tokio::select! {
                r = conn => {
                    if let Err(e) = r {
                        tracing::debug!("connection closed: {e}");
                    }
                }
                // Evicted: dropping the connection closes its socket.
                _ = kill => {}
            }
            conns.close(id);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Files the process keeps open besides connections (model shards, state
/// files, the listener), with room to spare.
const FILES_BESIDES: u64 = 64;

/// The soft limit on open files, if it can be read.
fn open_file_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid, writable rlimit the call fills; nothing else
    // refers to it.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    (rc == 0).then_some(r.rlim_cur as u64)
}

/// Tells a connection over the cap why, without waiting on it, and closes it.
fn refuse(stream: TcpStream) {
    // A fresh socket's send buffer is empty: the write completes or fails at once.
    let _ = stream.try_write(&REFUSAL);
}
