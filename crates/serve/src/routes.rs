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

/// Requires `Authorization: Bearer <key>` when the server has a key.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !constant_time_eq(given.trim().as_bytes(), key.as_bytes()) {
            st.metrics.request(endpoint(req.uri().path()), 401);
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
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

/// Reads a request body of at most `limit` bytes (413 beyond).
pub(crate) async fn read_body(
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
        "created": st.created,
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
