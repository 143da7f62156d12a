//! Errors as OpenAI error objects: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A request the server refuses or could not serve.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (429).
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: a value is wrong; `param` names the field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, message);
        e.param = Some(param.to_string());
        e.code = Some("invalid_value");
        e
    }

    /// 400 without a single field to blame.
    pub fn bad_request(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, message);
        e.code = Some("invalid_request");
        e
    }

    pub fn not_found(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::NOT_FOUND, message);
        e.param = Some(param.to_string());
        e.code = Some("model_not_found");
        e
    }

    pub fn unauthorized() -> Self {
        let mut e = Self::new(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API key: send `Authorization: Bearer <key>`",
        );
        e.code = Some("invalid_api_key");
        e
    }

    /// 429: the queue is full; `retry_after` from its measured drain rate.
    pub fn overloaded(queued: usize, retry_after: u32) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "the queue is full ({queued} requests waiting): retry in about {retry_after} s"
            ),
        );
        e.code = Some("queue_full");
        e.retry_after = Some(retry_after);
        e
    }

    /// 503 with the one code every request refused or cut short by a
    /// shutdown gets, queued or running, streamed or not.
    pub fn shutting_down(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, message);
        e.code = Some("shutting_down");
        e
    }

    /// 403: a `Host` the server does not answer to (DNS rebinding).
    pub fn host_not_allowed(host: &str) -> Self {
        let mut e = Self::new(
            StatusCode::FORBIDDEN,
            format!(
                "the Host {host:?} is not served here: connect through a loopback name \
                 (localhost, 127.0.0.1, [::1]) or start the server with --allowed-host {host}"
            ),
        );
        e.code = Some("host_not_allowed");
        e
    }

    /// 408: the body did not arrive in time.
    pub fn body_timeout(secs: u64) -> Self {
        let mut e = Self::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {secs} s (--body-timeout)"),
        );
        e.code = Some("body_timeout");
        e
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, message);
        e.code = Some("unavailable");
        e
    }

    /// 503 for a connection over `--max-connections`.
    pub fn too_many_connections() -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many open connections (--max-connections): retry later",
        );
        e.code = Some("too_many_connections");
        e.retry_after = Some(1);
        e
    }

    pub fn internal(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::INTERNAL_SERVER_ERROR, message);
        e.code = Some("internal_error");
        e
    }

    pub fn too_large(limit: usize) -> Self {
        let mut e = Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body exceeds the {limit}-byte limit (--max-body)"),
        );
        e.code = Some("body_too_large");
        e
    }

    /// OpenAI's `type` for this status.
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            500..=599 => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The error object (also sent as an SSE event mid-stream).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}
