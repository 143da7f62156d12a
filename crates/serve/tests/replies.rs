//! What a reply is: a tool call when `tool_choice` requires one, its own id
//! and creation time, and one error code when a shutdown cuts it short.

mod common;

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use futures_util::StreamExt;
use serde_json::{Value, json};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "additionalProperties": false, "required": ["city", "unit"],
                "properties": {"city": {"type": "string", "maxLength": 12},
                               "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
        {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
    ])
}

fn ask(choice: Value, stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
           "tools": tools(), "tool_choice": choice, "max_tokens": 160, "temperature": 0,
           "stream": stream, "chat_template_kwargs": {"thinking": false}})
}

fn check_weather_args(args: &str) {
    let a: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let o = a.as_object().unwrap();
    assert_eq!(o.len(), 2, "{a}");
    assert!(
        a["city"].as_str().is_some_and(|c| c.chars().count() <= 12),
        "{a}"
    );
    assert!(
        ["celsius", "fahrenheit"].contains(&a["unit"].as_str().unwrap()),
        "{a}"
    );
}

#[test]
fn a_required_tool_choice_makes_the_reply_a_tool_call() {
    let (lm, _) = need_model!();
    let (server, url) = start(config(), lm);
    rt().block_on(async {
        // Left to itself the small code model writes no call.
        let (st, v) = post(&url, "/v1/chat/completions", ask(json!("auto"), false)).await;
        assert_eq!(st, 200, "{v}");
        assert!(
            v["choices"][0]["message"].get("tool_calls").is_none(),
            "{v}"
        );
        // Required: a call to one of the tools, with valid arguments.
        let (st, v) = post(&url, "/v1/chat/completions", ask(json!("required"), false)).await;
        assert_eq!(st, 200, "{v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{v}");
        let f = &calls[0]["function"];
        let args = f["arguments"].as_str().unwrap();
        match f["name"].as_str().unwrap() {
            "get_weather" => check_weather_args(args),
            "get_time" => assert!(serde_json::from_str::<Value>(args).unwrap().is_object()),
            other => panic!("called {other}"),
        }
        // A named function: that one.
        for name in ["get_time", "get_weather"] {
            let choice = json!({"type": "function", "function": {"name": name}});
            let (st, v) = post(&url, "/v1/chat/completions", ask(choice, false)).await;
            assert_eq!(st, 200, "{v}");
            let call = &v["choices"][0]["message"]["tool_calls"][0];
            assert_eq!(call["function"]["name"], name, "{v}");
            assert_eq!(call["type"], "function");
            if name == "get_weather" {
                check_weather_args(call["function"]["arguments"].as_str().unwrap());
            }
        }
        // Streamed: the call arrives as a tool_calls delta.
        let choice = json!({"type": "function", "function": {"name": "get_weather"}});
        let chunks = post_stream(&url, "/v1/chat/completions", ask(choice, true)).await;
        let mut calls = Vec::new();
        let mut finish = Vec::new();
        for c in chunks.iter().filter(|c| *c != "[DONE]") {
            let v: Value = serde_json::from_str(c).unwrap();
            calls.extend(
                v["choices"][0]["delta"]["tool_calls"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
            );
            if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                finish.push(f.to_string());
            }
        }
        assert_eq!(calls.len(), 1, "{chunks:?}");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        check_weather_args(calls[0]["function"]["arguments"].as_str().unwrap());
        assert_eq!(finish, ["tool_calls"]);
        // A function that is not offered, or no tools at all: 400.
        let choice = json!({"type": "function", "function": {"name": "launch"}});
        let (st, v) = post(&url, "/v1/chat/completions", ask(choice, false)).await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], "tool_choice");
        let mut b = ask(json!("required"), false);
        b.as_object_mut().unwrap().remove("tools");
        let (st, v) = post(&url, "/v1/chat/completions", b).await;
        assert_eq!(st, 400, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("no tools"),
            "{v}"
        );
    });
    server.stop().unwrap();
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[test]
fn every_response_has_its_own_id_and_creation_time() {
    let (lm, _) = need_model!();
    let mut ids = HashSet::new();
    for _ in 0..2 {
        let (server, url) = start(config(), lm.clone());
        rt().block_on(async {
            std::thread::sleep(Duration::from_millis(1100));
            for _ in 0..3 {
                let before = now();
                let (st, v) = post(&url, "/v1/completions", json!({"prompt": "x", "max_tokens": 2})).await;
                assert_eq!(st, 200);
                let created = v["created"].as_u64().unwrap();
                assert!(before <= created && created <= now(), "{created} not in [{before}, now]");
                let id = v["id"].as_str().unwrap().to_string();
                assert!(id.starts_with("cmpl-") && id.len() == 5 + 16, "{id}");
                assert!(ids.insert(id.clone()), "{id} repeated");
            }
            // A stream's chunks share their response's id.
            let chunks = post_stream(&url, "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true})).await;
            let seen: HashSet<String> = chunks.iter().filter(|c| *c != "[DONE]")
                .map(|c| serde_json::from_str::<Value>(c).unwrap()["id"].as_str().unwrap().to_string())
                .collect();
            assert_eq!(seen.len(), 1, "{seen:?}");
            let id = seen.into_iter().next().unwrap();
            assert!(id.starts_with("chatcmpl-"));
            assert!(ids.insert(id));
        });
        server.stop().unwrap();
    }
    assert_eq!(ids.len(), 8, "ids of two server runs");
}

/// The error code a stream ended with.
async fn stream_error(r: reqwest::Response) -> String {
    let mut s = r.bytes_stream();
    let mut text = String::new();
    while let Some(c) = s.next().await {
        text.push_str(&String::from_utf8_lossy(&c.unwrap()));
    }
    let errors: Vec<String> = sse_data(&text)
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["error"]["code"].as_str().map(str::to_string))
        .collect();
    assert_eq!(errors.len(), 1, "{text}");
    errors[0].clone()
}

#[test]
fn a_shutdown_ends_queued_and_running_requests_with_one_code() {
    let (lm, _) = need_model!();
    let mut cfg = config();
    cfg.max_seqs = 1;
    cfg.shutdown_timeout = Duration::from_millis(500);
    let (server, url) = start(cfg, lm);
    let rt = rt();
    let long = json!({"prompt": "def f(x):", "max_tokens": 3000, "temperature": 0, "stream": true});
    let (running, queued, plain) = rt.block_on(async {
        let c = client();
        let running = c
            .post(format!("{url}/v1/completions"))
            .json(&long)
            .send()
            .await
            .unwrap();
        let mut running = running.bytes_stream();
        let first = running.next().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("data: "));
        // The engine holds one sequence: these wait in the queue.
        let queued = c
            .post(format!("{url}/v1/completions"))
            .json(&long)
            .send()
            .await
            .unwrap();
        let mut no_stream = long.clone();
        no_stream["stream"] = json!(false);
        let plain = tokio::spawn({
            let url = url.clone();
            async move { post(&url, "/v1/completions", no_stream).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        (running, queued, plain)
    });
    let stopper = std::thread::spawn(move || server.stop().unwrap());
    rt.block_on(async {
        let mut text = String::new();
        let mut running = running;
        while let Some(c) = running.next().await {
            text.push_str(&String::from_utf8_lossy(&c.unwrap()));
        }
        let codes: Vec<String> = sse_data(&text)
            .iter()
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v["error"]["code"].as_str().map(str::to_string))
            .collect();
        assert_eq!(codes, ["shutting_down"], "running: {text}");
        assert_eq!(stream_error(queued).await, "shutting_down", "queued");
        let (st, v) = plain.await.unwrap();
        assert_eq!(st, 503, "{v}");
        assert_eq!(v["error"]["code"], "shutting_down");
    });
    stopper.join().unwrap();
}
