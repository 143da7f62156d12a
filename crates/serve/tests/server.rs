//! `fathom serve` over real HTTP on loopback: outputs equal solo runs
//! (alone, streamed, 8 at once), prefix reuse, disconnects, injected
//! failures, shutdown.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use common::*;
use fathom_engine::SamplingParams;
use futures_util::StreamExt;
use serde_json::{Value, json};

const PROMPTS: [&str; 4] = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:",
    "fn main() {",
];

#[test]
fn completions_and_chat_equal_solo_runs_streamed_or_not() {
    let (lm, _) = need_model!();
    let (server, url) = start(config(), lm);
    let (want, ids, reason) = solo(completion_ids(PROMPTS[0]), 24, greedy(), &[]);
    let chat_want = solo_chat(PROMPTS[2], 20, greedy());
    rt().block_on(async {
        let body = json!({"model": "k3-code-small", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0});
        let (st, v) = post(&url, "/v1/completions", body.clone()).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], want);
        assert_eq!(v["choices"][0]["finish_reason"], reason);
        assert_eq!(v["usage"]["completion_tokens"], ids.len());
        assert_eq!(v["usage"]["prompt_tokens"], completion_ids(PROMPTS[0]).len());
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        sb["stream_options"] = json!({"include_usage": true});
        let chunks = post_stream(&url, "/v1/completions", sb).await;
        assert_eq!(chunks.last().unwrap(), "[DONE]");
        assert_eq!(joined(&chunks, "text"), want);
        let usage: Value = serde_json::from_str(&chunks[chunks.len() - 2]).unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["completion_tokens"], ids.len());

        let chat = json!({"messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 20,
                          "temperature": 0, "chat_template_kwargs": {"thinking": false}});
        let (st, v) = post(&url, "/v1/chat/completions", chat.clone()).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"], chat_want);
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        let mut sc = chat.clone();
        sc["stream"] = json!(true);
        let chunks = post_stream(&url, "/v1/chat/completions", sc).await;
        assert_eq!(joined(&chunks, "content"), chat_want);
        // Thinking on (the default): the reply goes to reasoning_content, never content.
        let think = json!({"messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 8, "temperature": 0});
        let (_, v) = post(&url, "/v1/chat/completions", think).await;
        let m = &v["choices"][0]["message"];
        assert!(!m["reasoning_content"].as_str().unwrap_or("").is_empty(), "{v}");
    });
    server.stop().unwrap();
}

#[test]
fn eight_concurrent_clients_each_get_their_solo_output() {
    let (lm, _) = need_model!();
    let (server, url) = start(config(), lm);
    let sampled = SamplingParams {
        temperature: 0.8,
        seed: 7,
        top_p: 0.95,
        ..Default::default()
    };
    let mut wants = Vec::new();
    for i in 0..8 {
        let p = PROMPTS[i % 4];
        let s = if i % 3 == 2 {
            sampled.clone()
        } else {
            greedy()
        };
        wants.push((p, s.clone(), solo(completion_ids(p), 16 + i, s, &[]).0));
    }
    let t = Instant::now();
    rt().block_on(async {
        let tasks: Vec<_> = wants
            .iter()
            .enumerate()
            .map(|(i, (p, s, _))| {
                let url = url.clone();
                let body = json!({"prompt": p, "max_tokens": 16 + i, "temperature": s.temperature,
                                  "top_p": s.top_p, "seed": s.seed, "stream": i % 2 == 0});
                tokio::spawn(async move {
                    if i % 2 == 0 {
                        joined(&post_stream(&url, "/v1/completions", body).await, "text")
                    } else {
                        let (st, v) = post(&url, "/v1/completions", body).await;
                        assert_eq!(st, 200, "{v}");
                        v["choices"][0]["text"].as_str().unwrap().to_string()
                    }
                })
            })
            .collect();
        for (task, (p, _, want)) in tasks.into_iter().zip(&wants) {
            assert_eq!(&task.await.unwrap(), want, "prompt {p:?}");
        }
    });
    eprintln!("8 concurrent requests in {:.2}s", t.elapsed().as_secs_f64());
    server.stop().unwrap();
}

#[test]
fn a_repeated_prefix_is_reused_with_identical_output_and_survives_restart() {
    let (lm, _) = need_model!();
    let dir = std::env::temp_dir().join(format!("fathom-prefix-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let long = "def add(a, b):\n    return a + b\n\n".repeat(12);
    let (want, _, _) = solo(completion_ids(&long), 6, greedy(), &[]);
    let body = json!({"prompt": long, "max_tokens": 6, "temperature": 0});
    let mut cfg = config();
    cfg.state_cache_dir = Some(dir.clone());
    let (server, url) = start(cfg.clone(), lm.clone());
    rt().block_on(async {
        let (_, a) = post(&url, "/v1/completions", body.clone()).await;
        assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let (_, b) = post(&url, "/v1/completions", body.clone()).await;
        let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached >= 32, "{b}");
        assert_eq!(a["choices"][0]["text"], want);
        assert_eq!(b["choices"][0]["text"], want);
    });
    server.stop().unwrap();
    // A damaged file and a foreign one are ignored; the rest is reused after a restart.
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(files.len() >= 2, "states saved: {files:?}");
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&files[0], bytes).unwrap();
    std::fs::write(dir.join("junk.fps"), b"not a state").unwrap();
    let (server, url) = start(cfg, lm);
    rt().block_on(async {
        let (_, c) = post(&url, "/v1/completions", body.clone()).await;
        assert!(
            c["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                > 0,
            "{c}"
        );
        assert_eq!(c["choices"][0]["text"], want);
    });
    server.stop().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_client_that_disconnects_is_cancelled_and_the_server_goes_on() {
    let (lm, _) = need_model!();
    let (server, url) = start(config(), lm);
    let (want, _, _) = solo(completion_ids(PROMPTS[1]), 8, greedy(), &[]);
    rt().block_on(async {
        let r = client()
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": PROMPTS[0], "max_tokens": 3000, "temperature": 0, "stream": true}))
            .send()
            .await
            .unwrap();
        let mut s = r.bytes_stream();
        let _ = s.next().await.unwrap().unwrap();
        drop(s);
        let t = Instant::now();
        loop {
            let m = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
            if m.contains("fathom_running_sequences 0") {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "the sequence was not cancelled:\n{m}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (st, v) = post(&url, "/v1/completions", json!({"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0})).await;
        assert_eq!(st, 200);
        assert_eq!(v["choices"][0]["text"], want);
    });
    server.stop().unwrap();
}

#[test]
fn a_failing_request_fails_alone_and_the_engine_keeps_serving() {
    let (lm, tok) = need_model!();
    // The poison is a token the prompt below contains; the others never do.
    let poison = tok.encode("zebra")[0];
    let flaky = Arc::new(Poisoned {
        inner: lm,
        poison,
        failed: AtomicBool::new(false),
    });
    let (server, url) = start(config(), flaky.clone());
    let (want, _, _) = solo(completion_ids(PROMPTS[0]), 12, greedy(), &[]);
    rt().block_on(async {
        let bad = tokio::spawn({
            let url = url.clone();
            async move {
                post(
                    &url,
                    "/v1/completions",
                    json!({"prompt": "zebra", "max_tokens": 4}),
                )
                .await
            }
        });
        let good = post(
            &url,
            "/v1/completions",
            json!({"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}),
        )
        .await;
        let (st, v) = bad.await.unwrap();
        assert_eq!(st, 500, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("non-finite"),
            "{v}"
        );
        assert_eq!(good.0, 200);
        assert_eq!(good.1["choices"][0]["text"], want);
        for _ in 0..2 {
            let (st, v) = post(
                &url,
                "/v1/completions",
                json!({"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}),
            )
            .await;
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["choices"][0]["text"], want);
        }
    });
    assert!(flaky.failed.load(std::sync::atomic::Ordering::SeqCst));
    server.stop().unwrap();
}

#[test]
fn shutdown_finishes_running_requests_then_refuses() {
    let (lm, _) = need_model!();
    let (server, url) = start(config(), lm);
    let (want, _, _) = solo(completion_ids(PROMPTS[3]), 40, greedy(), &[]);
    let rt = rt();
    let run = rt.spawn({
        let url = url.clone();
        async move {
            post(
                &url,
                "/v1/completions",
                json!({"prompt": PROMPTS[3], "max_tokens": 40, "temperature": 0}),
            )
            .await
        }
    });
    std::thread::sleep(Duration::from_millis(150));
    let t = Instant::now();
    server.stop().unwrap();
    assert!(t.elapsed() < Duration::from_secs(20));
    let (st, v) = rt.block_on(run).unwrap();
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want);
    let after = rt.block_on(async { reqwest::get(format!("{url}/health")).await });
    assert!(after.is_err(), "the server still answers after stop");
}

#[test]
fn stop_strings_n_and_logprobs_match_solo_runs() {
    let (lm, tok) = need_model!();
    let (server, url) = start(config(), lm);
    let (full, _, _) = solo(completion_ids(PROMPTS[0]), 24, greedy(), &[]);
    // A stop string from the middle of the greedy output: the text ends just before it.
    let chars: Vec<char> = full.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let (cut, _, reason) = solo(
        completion_ids(PROMPTS[0]),
        24,
        greedy(),
        std::slice::from_ref(&stop),
    );
    assert_eq!(reason, "stop");
    assert!(!cut.contains(&stop));
    let sampled = SamplingParams {
        temperature: 0.9,
        seed: 3,
        logprobs: Some(2),
        ..Default::default()
    };
    let mut per_choice = Vec::new();
    for choice in 0..2u32 {
        let (lm2, _) = common::model().unwrap();
        let mut r = fathom_engine::Request::new(completion_ids(PROMPTS[1]), 6);
        r.sampling = sampled.clone();
        r.choice = choice;
        r.stop_ids = lm2.info().eos_token_ids.clone();
        let mut lps = Vec::new();
        let f = fathom_engine::generate(&lm2, r, Some(decoder(&tok)), |ev| {
            lps.push(ev.sampled.logprob.expect("logprobs were asked for"));
            std::ops::ControlFlow::Continue(())
        })
        .unwrap();
        per_choice.push((f.text.unwrap(), lps));
    }
    rt().block_on(async {
        for stream in [false, true] {
            let body = json!({"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stop": stop, "stream": stream});
            let text = if stream {
                let chunks = post_stream(&url, "/v1/completions", body).await;
                // No chunk carries any part of the stop string.
                assert!(chunks.iter().all(|c| !c.contains(&stop)), "{chunks:?}");
                joined(&chunks, "text")
            } else {
                let (_, v) = post(&url, "/v1/completions", body).await;
                assert_eq!(v["choices"][0]["finish_reason"], "stop");
                v["choices"][0]["text"].as_str().unwrap().to_string()
            };
            assert_eq!(text, cut);
        }
        let body = json!({"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0.9, "seed": 3, "n": 2, "logprobs": 2});
        let (st, v) = post(&url, "/v1/completions", body).await;
        assert_eq!(st, 200, "{v}");
        for (i, (text, lps)) in per_choice.iter().enumerate() {
            let c = &v["choices"][i];
            assert_eq!(c["index"], i);
            assert_eq!(&c["text"], text);
            let got: Vec<f32> = c["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect();
            assert_eq!(&got, lps);
            assert_eq!(c["logprobs"]["top_logprobs"][0].as_object().unwrap().len(), 2);
        }
        let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": true,
                          "top_logprobs": 3, "chat_template_kwargs": {"thinking": false}});
        let (_, v) = post(&url, "/v1/chat/completions", chat).await;
        let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 3);
        assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 3);
        assert!(content[0]["logprob"].as_f64().unwrap() <= 0.0);
    });
    server.stop().unwrap();
}

#[test]
fn a_streaming_client_gone_while_queued_is_never_run() {
    let (lm, _) = need_model!();
    let mut cfg = config();
    cfg.max_seqs = 1;
    let (server, url) = start(cfg, lm);
    rt().block_on(async {
        let a = tokio::spawn({
            let url = url.clone();
            async move {
                post(
                    &url,
                    "/v1/completions",
                    json!({"prompt": "def f(x):", "max_tokens": 200, "temperature": 0}),
                )
                .await
            }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        // B waits behind A; its client leaves before anything is sent.
        let long = "import os\n".repeat(60);
        let b = client()
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": long, "max_tokens": 50, "stream": true}))
            .send()
            .await
            .unwrap();
        drop(b);
        let (st, _) = a.await.unwrap();
        assert_eq!(st, 200);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let m = client()
            .get(format!("{url}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let prompt: u64 = m
            .lines()
            .find_map(|l| l.strip_prefix("fathom_prompt_tokens_total "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(
            prompt,
            completion_ids("def f(x):").len() as u64,
            "B was admitted:\n{m}"
        );
        assert!(m.contains("fathom_queue_depth 0"), "{m}");
    });
    server.stop().unwrap();
}
