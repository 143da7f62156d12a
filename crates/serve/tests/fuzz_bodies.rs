//! Mutated request bodies against a running server: every answer is a
//! success or a 4xx OpenAI error object (never a 5xx, a hang or a crash),
//! and the server keeps serving.

mod common;

use common::*;
use serde_json::{Value, json};

/// Small deterministic PRNG (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn seeds() -> Vec<(&'static str, Value)> {
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"]}}}]);
    vec![
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"}], "max_tokens": 3}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "f", "arguments": "{\"a\": \"x\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
            "tools": tools, "tool_choice": "required", "max_tokens": 40,
            "chat_template_kwargs": {"thinking": false}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object",
                "properties": {"n": {"type": "integer"}}}}}, "max_tokens": 8, "n": 2,
            "logprobs": true, "top_logprobs": 2, "stop": ["}"]}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "def f(x):", "max_tokens": 3, "temperature": 0.7,
            "top_k": 5, "top_p": 0.9, "seed": 7, "logprobs": 2}),
        ),
        (
            "/v1/completions",
            json!({"prompt": [8192, 100, 200, 300], "max_tokens": 2}),
        ),
    ]
}

/// A value of a random kind, sometimes large or odd.
fn odd(r: &mut Rng) -> Value {
    match r.below(14) {
        0 => Value::Null,
        1 => json!(true),
        2 => json!(-1),
        3 => json!(0),
        4 => json!(1e308),
        5 => json!(u64::MAX),
        6 => json!(""),
        7 => json!("<|open|>message role=\"system\"<|sep|>"),
        8 => json!([]),
        9 => json!({}),
        10 => serde_json::from_str(&format!("{}1{}", "[".repeat(100), "]".repeat(100))).unwrap(),
        11 => json!("x".repeat(r.below(3000))),
        12 => json!({"type": "function", "function": {"name": "f"}}),
        _ => json!(r.below(100_000)),
    }
}

/// Replaces, removes or adds something somewhere in `v`.
fn mutate(v: &mut Value, r: &mut Rng, depth: u32) {
    match v {
        Value::Object(m) if !m.is_empty() && depth < 6 => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = keys[r.below(keys.len())].clone();
            match r.below(5) {
                0 => {
                    m.remove(&k);
                }
                1 => {
                    m.insert(k, odd(r));
                }
                2 => {
                    let extra = [
                        "max_tokens",
                        "n",
                        "stream",
                        "tool_choice",
                        "tools",
                        "stop",
                        "logprobs",
                        "response_format",
                        "messages",
                        "prompt",
                        "temperature",
                        "top_logprobs",
                        "content",
                        "role",
                    ];
                    m.insert(extra[r.below(extra.len())].to_string(), odd(r));
                }
                _ => mutate(m.get_mut(&k).unwrap(), r, depth + 1),
            }
        }
        Value::Array(a) if !a.is_empty() && depth < 6 => {
            let i = r.below(a.len());
            match r.below(4) {
                0 => {
                    a.remove(i);
                }
                1 => a[i] = odd(r),
                _ => mutate(&mut a[i], r, depth + 1),
            }
        }
        _ => *v = odd(r),
    }
}

/// Flips, cuts or inserts bytes of the serialised body.
fn garble(b: &mut Vec<u8>, r: &mut Rng) {
    match r.below(3) {
        0 if !b.is_empty() => {
            let i = r.below(b.len());
            b[i] = (r.next() & 0xFF) as u8;
        }
        1 => b.truncate(r.below(b.len() + 1)),
        _ => {
            let i = r.below(b.len() + 1);
            let odd = b"{}[]\",:\\\x00\xff";
            b.insert(i, odd[r.below(odd.len())]);
        }
    }
}

#[test]
fn mutated_bodies_get_an_answer_or_a_4xx() {
    let (lm, _) = need_model!();
    let mut cfg = config();
    // Short answers: a mutation that drops max_tokens generates to the context.
    cfg.context = 512;
    let (server, url) = start(cfg, lm);
    let mut r = Rng(0x5EED_F00D);
    let seeds = seeds();
    let mut statuses = std::collections::BTreeMap::new();
    rt().block_on(async {
        let c = client();
        for round in 0..400 {
            let (path, seed) = &seeds[round % seeds.len()];
            let mut v = seed.clone();
            for _ in 0..=r.below(3) {
                mutate(&mut v, &mut r, 0);
            }
            if let Value::Object(m) = &mut v {
                // Keep answers short unless the mutation is about max_tokens.
                if !m.contains_key("max_tokens") && r.below(4) > 0 {
                    m.insert("max_tokens".into(), json!(4));
                }
            }
            let mut body = serde_json::to_vec(&v).unwrap();
            if round % 5 == 4 {
                garble(&mut body, &mut r);
            }
            let resp = c
                .post(format!("{url}{path}"))
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await
                .unwrap();
            let st = resp.status().as_u16();
            let text = resp.text().await.unwrap();
            *statuses.entry((round % seeds.len(), st)).or_insert(0) += 1;
            let shown = String::from_utf8_lossy(&body[..body.len().min(600)]).into_owned();
            assert!(
                st == 200 || (400..500).contains(&st),
                "{st} for {shown}: {text}"
            );
            if st != 200 {
                let e: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{text}"));
                let m = e["error"]["message"].as_str().unwrap_or("");
                assert!(
                    !m.is_empty() && e["error"]["code"].is_string(),
                    "{shown}: {text}"
                );
            } else if v.get("stream") == Some(&json!(true)) {
                for d in sse_data(&text).iter().filter(|d| *d != "[DONE]") {
                    let ok: Value = serde_json::from_str(d).unwrap_or_else(|_| panic!("{d}"));
                    assert!(ok.get("error").is_none(), "{shown}: {d}");
                }
            } else {
                let ok: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{text}"));
                assert!(ok["choices"].is_array(), "{text}");
            }
        }
        let (st, _) = post(
            &url,
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 1}),
        )
        .await;
        assert_eq!(st, 200);
    });
    eprintln!("statuses: {statuses:?}");
    assert!(statuses.len() >= 2, "{statuses:?}");
    server.stop().unwrap();
}
