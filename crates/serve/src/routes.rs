//! The HTTP surface: routes, authentication, CORS, body limits, and the
//! small endpoints (page, health, models, metrics, stats).

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;

use crate::AppState;
use crate::error::ApiError;

const PAGE: &str = include_str!("page/index.html");

pub(crate) fn router(st: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(crate::handlers::chat))
        .route("/v1/completions", post(crate::handlers::completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/stats", get(stats))
        .route_layer(middleware::from_fn_with_state(st.clone(), auth));
    let mut app = Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .merge(api)
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(st.clone(), host_check))
        .with_state(st.clone());
    if !st.cfg.cors_origins.is_empty() {
        let origins: Vec<HeaderValue> = st
            .cfg
            .cors_origins
            .iter()
            .filter_map(|o| HeaderValue::from_str(o).ok())
            .collect();
        let cors = tower_http::cors::CorsLayer::new()
            .allow_origin(origins)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]);
        app = app.layer(cors);
    }
    app
}

/// Answers only requests whose `Host` the server serves (see [`HostPolicy`]).
async fn host_check(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()));
    if let Err(e) = st.hosts.check(host) {
        st.metrics
            .request(endpoint(req.uri().path()), e.status.as_u16());
        tracing::info!(host = host.unwrap_or(""), "refused: {}", e.message);
        return e.into_response();
    }
    next.run(req).await
}

/// Which `Host` names the server answers to. Bound to a loopback address,
/// it answers loopback names only (so a web page whose name an attacker
/// points at 127.0.0.1, DNS rebinding, cannot reach it) plus
/// `--allowed-host` names; bound elsewhere, any name unless
/// `--allowed-host` names some. `*` allows any.
#[derive(Debug, Clone)]
pub(crate) struct HostPolicy {
    /// `None`: any host.
    names: Option<Vec<String>>,
}

impl HostPolicy {
    pub fn new(bind: &str, allowed: &[String]) -> HostPolicy {
        let allowed: Vec<String> = allowed.iter().map(|h| host_name(h)).collect();
        let loopback_bind = is_loopback(&host_name(bind));
        let names = if allowed.iter().any(|h| h == "*") || (!loopback_bind && allowed.is_empty()) {
            None
        } else {
            Some(allowed)
        };
        HostPolicy { names }
    }

    pub fn check(&self, host: Option<&str>) -> Result<(), ApiError> {
        let Some(names) = &self.names else {
            return Ok(());
        };
        let Some(host) = host.filter(|h| !h.is_empty()) else {
            return Err(ApiError::bad_request(
                "the request has no Host header: HTTP/1.1 requires one",
            ));
        };
        let name = host_name(host);
        if is_loopback(&name) || names.contains(&name) {
            Ok(())
        } else {
            Err(ApiError::host_not_allowed(&name))
        }
    }
}

/// A Host value's name: without the port, lowercase, without a final dot;
/// an IPv6 address keeps its brackets.
fn host_name(host: &str) -> String {
    let h = host.trim();
    let name = if h.starts_with('[') {
        h.find(']').map_or(h, |i| &h[..=i])
    } else {
        match h.rsplit_once(':') {
            Some((n, port)) if port.bytes().all(|b| b.is_ascii_digit()) && !n.contains(':') => n,
            _ => h,
        }
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// `localhost` or a loopback address (127.0.0.0/8, `[::1]`).
fn is_loopback(name: &str) -> bool {
    if name == "localhost" {
        return true;
    }
    let bare = name.trim_start_matches('[').trim_end_matches(']');
    bare.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// Requires `Authorization: Bearer <key>` (the scheme in any case) when
/// the server has a key.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer)
            .unwrap_or("");
        if !constant_time_eq(given.as_bytes(), key.as_bytes()) {
            st.metrics.request(endpoint(req.uri().path()), 401);
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// The token of a `Bearer` credential; the scheme is case-insensitive
/// (RFC 9110, section 11.1).
fn bearer(v: &str) -> Option<&str> {
    let (scheme, token) = v.trim().split_once([' ', '\t'])?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Compares without stopping at the first difference.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0xFF);
        diff |= x ^ y;
    }
    diff == 0
}

/// The metrics label of a path.
pub(crate) fn endpoint(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat",
        "/v1/completions" => "completions",
        "/v1/models" => "models",
        "/metrics" => "metrics",
        "/stats" => "stats",
        _ => "other",
    }
}

/// Reads a request body of at most `limit` bytes (413 beyond) within
/// `timeout` (408 beyond).
pub(crate) async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<axum::body::Bytes, ApiError> {
    tokio::time::timeout(timeout, read_body_within(headers, body, limit))
        .await
        .unwrap_or_else(|_| Err(ApiError::body_timeout(timeout.as_secs())))
}

async fn read_body_within(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<axum::body::Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_big = std::error::Error::source(&e)
            .is_some_and(|s| s.to_string().contains("length limit"))
            || e.to_string().contains("length limit");
        if too_big {
            ApiError::too_large(limit)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"))
        }
    })
}

async fn page() -> Html<&'static str> {
    Html(PAGE)
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    match (st.ready.get(), st.load_error.get()) {
        (Some(_), _) if st.stopping.load(std::sync::atomic::Ordering::SeqCst) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "stopping"})),
        )
            .into_response(),
        (Some(_), _) => axum::Json(json!({"status": "ok"})).into_response(),
        (None, Some(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "failed", "error": e})),
        )
            .into_response(),
        (None, None) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.request("models", 200);
    let info = st.ready.get().map(|r| r.loaded.lm.info().clone());
    axum::Json(json!({"object": "list", "data": [{
        "id": st.cfg.model_id,
        "object": "model",
        "created": st.started,
        "owned_by": "fathom",
        "max_model_len": st.cfg.context,
        "family": info.as_ref().map(|i| i.family),
    }]}))
    .into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
        .into_response()
}

async fn stats(State(st): State<Arc<AppState>>) -> Response {
    axum::Json(st.metrics.stats()).into_response()
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path().to_string();
    let mut e = ApiError::not_found("path", format!("no route for {} {path}", req.method()));
    e.code = Some("unknown_route");
    e.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_lose_port_case_and_final_dot() {
        assert_eq!(host_name("LocalHost:8000"), "localhost");
        assert_eq!(host_name("[::1]:8000"), "[::1]");
        assert_eq!(host_name("[::1]"), "[::1]");
        assert_eq!(host_name("example.test."), "example.test");
        assert_eq!(host_name("127.0.0.1"), "127.0.0.1");
        // A bare IPv6 address (no brackets) keeps its colons.
        assert_eq!(host_name("::1"), "::1");
    }

    #[test]
    fn a_loopback_bind_answers_loopback_and_allowed_names_only() {
        let p = HostPolicy::new("127.0.0.1", &["Proxy.Example:443".into()]);
        for ok in [
            "localhost",
            "localhost:8000",
            "127.0.0.1:1",
            "127.1.2.3",
            "[::1]:80",
            "proxy.example",
            "PROXY.example.:9",
        ] {
            assert!(p.check(Some(ok)).is_ok(), "{ok}");
        }
        for bad in [
            "evil.test",
            "evil.test:8000",
            "localhost.evil.test",
            "127.0.0.1.evil.test",
            "10.0.0.1",
        ] {
            let e = p.check(Some(bad)).unwrap_err();
            assert_eq!(e.status, StatusCode::FORBIDDEN, "{bad}");
            assert_eq!(e.code, Some("host_not_allowed"));
        }
        assert_eq!(p.check(None).unwrap_err().status, StatusCode::BAD_REQUEST);
        let any = HostPolicy::new("0.0.0.0", &[]);
        assert!(any.check(Some("evil.test")).is_ok());
        let star = HostPolicy::new("localhost", &["*".into()]);
        assert!(star.check(Some("evil.test")).is_ok());
        let listed = HostPolicy::new("0.0.0.0", &["api.example".into()]);
        assert!(listed.check(Some("api.example:8000")).is_ok());
        assert!(listed.check(Some("evil.test")).is_err());
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in [
            "Bearer k",
            "bearer k",
            "BEARER k",
            "BeArEr   k ",
            "bearer\tk",
        ] {
            assert_eq!(bearer(v), Some("k"), "{v:?}");
        }
        assert_eq!(bearer("Basic k"), None);
        assert_eq!(bearer("k"), None);
        assert_eq!(bearer("Bearerk"), None);
    }
}
