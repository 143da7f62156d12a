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

    pub fn overloaded(queued: usize) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("the queue is full ({queued} requests waiting): retry later"),
        );
        e.code = Some("queue_full");
        e.retry_after = Some(1);
        e
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, message);
        e.code = Some("unavailable");
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
