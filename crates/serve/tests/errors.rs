//! Every bad input gets its 4xx as an OpenAI error object, and the server
//! keeps serving; authentication, queue limits, structured output, and
//! the small endpoints.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

fn error_of(v: &Value) -> (&str, &str) {
    let e = &v["error"];
    assert!(
        e.get("type").is_some() && e.get("code").is_some() && e.get("param").is_some(),
        "not an OpenAI error: {v}"
    );
    (
        e["param"].as_str().unwrap_or(""),
        e["message"].as_str().unwrap(),
    )
}

#[test]
fn bad_inputs_get_their_4xx_and_the_server_keeps_serving() {
    let (lm, _) = need_model!();
    let mut cfg = config();
    cfg.max_body = 4096;
    cfg.context = 512;
    let (server, url) = start(cfg, lm);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, Value, u16, &str, &str)> = vec![
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            400,
            "messages",
            "empty",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            400,
            "messages",
            "invalid type",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "temperature": "hot"}),
            400,
            "temperature",
            "invalid type",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "temperature": -1}),
            400,
            "temperature",
            "temperature",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "top_p": 2}),
            400,
            "top_p",
            "top_p",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "n": 0}),
            400,
            "n",
            "n must be",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "stop": ["a", "b", "c", "d", "e"]}),
            400,
            "stop",
            "at most 4",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "model": "gpt-9"}),
            404,
            "model",
            "gpt-9",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": 100000}),
            400,
            "max_tokens",
            "100000",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "messages",
            "wizard",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "a+"}}}}),
            400,
            "response_format",
            "pattern",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "chat_template_kwargs": {"thinking": "no"}}),
            400,
            "chat_template_kwargs",
            "true or false",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 2, 999999]}),
            400,
            "prompt",
            "999999",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "echo": true}),
            400,
            "echo",
            "echo",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 600}),
            400,
            "max_tokens",
            "512",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 50}),
            400,
            "logprobs",
            "20",
        ),
    ];
    rt().block_on(async {
        for (path, body, status, param, needle) in cases {
            let (st, v) = post(&url, path, body.clone()).await;
            assert_eq!(st, status, "{body} → {v}");
            let (p, msg) = error_of(&v);
            assert_eq!(p, param, "{body} → {v}");
            assert!(msg.contains(needle), "{body}: {msg:?} lacks {needle:?}");
        }
        // Not JSON, too large, unknown route.
        let c = client();
        let r = c.post(format!("{url}/v1/chat/completions")).body("{nope").send().await.unwrap();
        assert_eq!(r.status(), 400);
        assert!(error_of(&r.json().await.unwrap()).1.contains("not valid JSON"));
        let big = json!({"prompt": "x".repeat(5000)});
        let r = c.post(format!("{url}/v1/completions")).json(&big).send().await.unwrap();
        assert_eq!(r.status(), 413);
        assert!(error_of(&r.json().await.unwrap()).1.contains("4096"));
        let r = c.get(format!("{url}/v2/nothing")).send().await.unwrap();
        assert_eq!(r.status(), 404);
        // Unknown but valid OpenAI fields are ignored; the server still answers.
        let ok = json!({"messages": msgs, "max_tokens": 3, "user": "u1", "parallel_tool_calls": false,
                        "service_tier": "auto", "metadata": {"a": "b"}, "store": false});
        let (st, v) = post(&url, "/v1/chat/completions", ok).await;
        assert_eq!(st, 200, "{v}");
        let m = c.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
        assert!(m.contains("fathom_requests_total{endpoint=\"chat\",status=\"400\"}"), "{m}");
        assert!(m.contains("fathom_time_to_first_token_seconds_bucket"), "{m}");
        assert!(m.contains("fathom_expert_cache_hit_rate"), "{m}");
    });
    server.stop().unwrap();
}

#[test]
fn api_key_cors_page_and_health() {
    let (lm, _) = need_model!();
    let mut cfg = config();
    cfg.api_key = Some("s3cret".into());
    cfg.cors_origins = vec!["http://example.test".into()];
    let (server, url) = start(cfg, lm);
    rt().block_on(async {
        let c = client();
        let body = json!({"prompt": "x", "max_tokens": 2});
        for auth in [
            None,
            Some("Bearer wrong"),
            Some("Bearer s3cre"),
            Some("s3cret"),
            Some("Basic s3cret"),
            Some("Bearers3cret"),
        ] {
            let mut r = c.post(format!("{url}/v1/completions")).json(&body);
            if let Some(a) = auth {
                r = r.header("authorization", a);
            }
            let r = r.send().await.unwrap();
            assert_eq!(r.status(), 401, "{auth:?}");
        }
        // The scheme is case-insensitive (RFC 9110).
        for auth in [
            "Bearer s3cret",
            "bearer s3cret",
            "BEARER s3cret",
            "bEaReR  s3cret ",
        ] {
            let r = c
                .post(format!("{url}/v1/completions"))
                .header("authorization", auth)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{auth:?}");
        }
        assert_eq!(
            c.get(format!("{url}/v1/models"))
                .send()
                .await
                .unwrap()
                .status(),
            401
        );
        // The page and health need no key.
        let page = c
            .get(format!("{url}/"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(page.contains("id=\"prompt\"") && page.contains("/v1/chat/completions"));
        assert_eq!(
            c.get(format!("{url}/health"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
        let r = c
            .request(reqwest::Method::OPTIONS, format!("{url}/v1/completions"))
            .header("origin", "http://example.test")
            .header("access-control-request-method", "POST")
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.headers()["access-control-allow-origin"],
            "http://example.test"
        );
    });
    server.stop().unwrap();
}

#[test]
fn a_full_queue_answers_429_with_retry_after() {
    let (lm, _) = need_model!();
    let mut cfg = config();
    cfg.max_seqs = 1;
    cfg.max_queue = 1;
    let (server, url) = start(cfg, lm);
    rt().block_on(async {
        let long = json!({"prompt": "def f(x):", "max_tokens": 400, "temperature": 0});
        let a = tokio::spawn({
            let url = url.clone();
            let long = long.clone();
            async move { post(&url, "/v1/completions", long).await.0 }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let b = tokio::spawn({
            let url = url.clone();
            let long = long.clone();
            async move { post(&url, "/v1/completions", long).await.0 }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let r = client()
            .post(format!("{url}/v1/completions"))
            .json(&long)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 429);
        // Nothing has finished yet: no drain rate, the upper bound.
        assert_eq!(r.headers()["retry-after"], "60");
        let v: Value = r.json().await.unwrap();
        assert!(error_of(&v).1.contains("retry in about 60 s"), "{v}");
        assert_eq!(a.await.unwrap(), 200);
        assert_eq!(b.await.unwrap(), 200);
        // Two requests finished: the wait now follows their rate (two per
        // the server's lifetime so far, within the bounds).
        let a = tokio::spawn({
            let url = url.clone();
            let long = long.clone();
            async move { post(&url, "/v1/completions", long).await.0 }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let b = tokio::spawn({
            let url = url.clone();
            let long = long.clone();
            async move { post(&url, "/v1/completions", long).await.0 }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let r = client()
            .post(format!("{url}/v1/completions"))
            .json(&long)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 429);
        let secs: u32 = r.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=60).contains(&secs), "{secs}");
        let v: Value = r.json().await.unwrap();
        let msg = error_of(&v).1;
        assert!(msg.contains(&format!("retry in about {secs} s")), "{msg}");
        assert_eq!(a.await.unwrap(), 200);
        assert_eq!(b.await.unwrap(), 200);
    });
    server.stop().unwrap();
}

#[test]
fn json_response_formats_constrain_the_answer() {
    let (lm, _) = need_model!();
    let (server, url) = start(config(), lm);
    rt().block_on(async {
        let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": false});
        for (format, thinking) in [
            (json!({"type": "json_object"}), false),
            (json!({"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}), false),
            (json!({"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}), true),
        ] {
            let body = json!({"messages": [{"role": "user", "content": "Give a person as JSON."}],
                "max_tokens": 120, "temperature": 0, "response_format": format,
                "chat_template_kwargs": {"thinking": thinking}});
            let (st, v) = post(&url, "/v1/chat/completions", body).await;
            assert_eq!(st, 200, "{v}");
            let content = v["choices"][0]["message"]["content"].as_str().unwrap();
            if thinking && content.is_empty() {
                // The small model never left its thinking channel within max_tokens.
                continue;
            }
            if v["choices"][0]["finish_reason"] == "stop" {
                let doc: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{content:?}: {e}"));
                assert!(doc.is_object());
                if format["type"] == "json_schema" {
                    assert!(doc["name"].is_string() && doc["age"].is_i64(), "{doc}");
                    assert_eq!(doc.as_object().unwrap().len(), 2);
                }
            } else {
                assert!(content.starts_with('{') || content.trim_start().starts_with('{'), "{content:?}");
            }
        }
    });
    server.stop().unwrap();
}
