//! A load generator for `fathom bench-serve`: the same streamed requests
//! sent by N concurrent clients, or one after another, over loopback;
//! aggregate tok/s, time to first token and inter-token latency.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use serde_json::{Value, json};

/// One request's timeline.
#[derive(Debug, Clone)]
struct Timed {
    text: String,
    tokens: u64,
    ttft_s: f64,
    gaps_s: Vec<f64>,
}

/// Figures of one load run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoadResult {
    pub clients: usize,
    pub concurrent: bool,
    pub requests: usize,
    pub wall_s: f64,
    pub tokens: u64,
    pub tok_s: f64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub itl_p50_s: f64,
    pub itl_p99_s: f64,
    #[serde(skip)]
    pub texts: Vec<String>,
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

async fn one(c: &reqwest::Client, url: &str, prompt: &str, max_new: usize) -> Result<Timed> {
    let body = json!({"prompt": prompt, "max_tokens": max_new, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}});
    let t0 = Instant::now();
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await?;
    if !r.status().is_success() {
        bail!(
            "the server answered {}: {}",
            r.status(),
            r.text().await.unwrap_or_default()
        );
    }
    let mut s = r.bytes_stream();
    let mut buf = String::new();
    let mut t = Timed {
        text: String::new(),
        tokens: 0,
        ttft_s: 0.0,
        gaps_s: Vec::new(),
    };
    let mut last: Option<Instant> = None;
    while let Some(chunk) = s.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(end) = buf.find("\n\n") {
            let ev: String = buf.drain(..end + 2).collect();
            let Some(data) = ev.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).context("a stream chunk is not JSON")?;
            if let Some(e) = v.get("error") {
                bail!("the request failed: {e}");
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                t.tokens = n;
            }
            if let Some(text) = v["choices"][0]["text"].as_str() {
                let now = Instant::now();
                match last {
                    None => t.ttft_s = now.duration_since(t0).as_secs_f64(),
                    Some(l) => t.gaps_s.push(now.duration_since(l).as_secs_f64()),
                }
                last = Some(now);
                t.text.push_str(text);
            }
        }
    }
    Ok(t)
}

/// Sends one request per prompt: all at once (`concurrent`) or in turn.
pub fn run(url: &str, prompts: &[String], max_new: usize, concurrent: bool) -> Result<LoadResult> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let c = reqwest::Client::builder()
        .timeout(Duration::from_secs(3600))
        .build()?;
    let t0 = Instant::now();
    let timed: Vec<Timed> = rt.block_on(async {
        if concurrent {
            let tasks: Vec<_> = prompts
                .iter()
                .map(|p| {
                    let (c, url, p) = (c.clone(), url.to_string(), p.clone());
                    tokio::spawn(async move { one(&c, &url, &p, max_new).await })
                })
                .collect();
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await??);
            }
            Ok::<_, anyhow::Error>(out)
        } else {
            let mut out = Vec::new();
            for p in prompts {
                out.push(one(&c, url, p, max_new).await?);
            }
            Ok(out)
        }
    })?;
    let wall_s = t0.elapsed().as_secs_f64();
    let tokens: u64 = timed.iter().map(|t| t.tokens).sum();
    let mut ttft: Vec<f64> = timed.iter().map(|t| t.ttft_s).collect();
    let mut itl: Vec<f64> = timed
        .iter()
        .flat_map(|t| t.gaps_s.iter().copied())
        .collect();
    Ok(LoadResult {
        clients: if concurrent { prompts.len() } else { 1 },
        concurrent,
        requests: prompts.len(),
        wall_s,
        tokens,
        tok_s: tokens as f64 / wall_s.max(1e-9),
        ttft_p50_s: percentile(&mut ttft, 0.5),
        ttft_p99_s: percentile(&mut ttft, 0.99),
        itl_p50_s: percentile(&mut itl, 0.5),
        itl_p99_s: percentile(&mut itl, 0.99),
        texts: timed.into_iter().map(|t| t.text).collect(),
    })
}
