//! Server figures: Prometheus text for `/metrics`, JSON for `/stats` (the
//! page's live panel).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Instant;

use fathom_model::experts::ExpertStats;

use crate::prefix::PrefixStats;

/// Histogram bucket bounds, seconds.
const LATENCY_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
const BATCH_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    n: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            n: 0,
        }
    }
    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.n += 1;
    }
    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.n);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.n);
    }
}

#[derive(Debug)]
struct Inner {
    requests: BTreeMap<(&'static str, u16), u64>,
    queued: usize,
    running: usize,
    batch: Histogram,
    prompt_tokens: u64,
    cached_tokens: u64,
    generated_tokens: u64,
    ttft: Histogram,
    itl: Histogram,
    experts: ExpertStats,
    prefix: PrefixStats,
    /// (time, generated tokens) samples for a recent rate.
    recent: Vec<(Instant, u64)>,
}

/// Everything `/metrics` and `/stats` report.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
    model: String,
}

impl Metrics {
    pub fn new(model: &str) -> Self {
        Metrics {
            model: model.to_string(),
            inner: Mutex::new(Inner {
                requests: BTreeMap::new(),
                queued: 0,
                running: 0,
                batch: Histogram::new(&BATCH_BUCKETS),
                prompt_tokens: 0,
                cached_tokens: 0,
                generated_tokens: 0,
                ttft: Histogram::new(&LATENCY_BUCKETS),
                itl: Histogram::new(&LATENCY_BUCKETS),
                experts: ExpertStats::default(),
                prefix: PrefixStats::default(),
                recent: Vec::new(),
            }),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    pub fn request(&self, endpoint: &'static str, status: u16) {
        self.with(|m| *m.requests.entry((endpoint, status)).or_default() += 1);
    }

    /// After each engine step.
    pub fn step(
        &self,
        batch: usize,
        running: usize,
        queued: usize,
        experts: ExpertStats,
        prefix: PrefixStats,
    ) {
        self.with(|m| {
            if batch > 0 {
                m.batch.observe(batch as f64);
            }
            m.running = running;
            m.queued = queued;
            m.experts = experts;
            m.prefix = prefix;
        });
    }

    pub fn queued(&self, queued: usize) {
        self.with(|m| m.queued = queued);
    }

    pub fn prompt(&self, tokens: usize, cached: usize) {
        self.with(|m| {
            m.prompt_tokens += tokens as u64;
            m.cached_tokens += cached as u64;
        });
    }

    /// One generated token; `ttft` for a sequence's first, else `itl`.
    pub fn token(&self, ttft: Option<f64>, itl: Option<f64>) {
        self.with(|m| {
            m.generated_tokens += 1;
            if let Some(t) = ttft {
                m.ttft.observe(t);
            }
            if let Some(t) = itl {
                m.itl.observe(t);
            }
            let now = Instant::now();
            let total = m.generated_tokens;
            m.recent.push((now, total));
            m.recent
                .retain(|(t, _)| now.duration_since(*t).as_secs_f64() < 10.0);
        });
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        self.with(|m| {
            let mut o = String::new();
            let _ = writeln!(o, "# HELP fathom_requests_total Requests by endpoint and HTTP status.\n# TYPE fathom_requests_total counter");
            for ((ep, st), n) in &m.requests {
                let _ = writeln!(o, "fathom_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}");
            }
            let gauges = [
                ("fathom_queue_depth", "Requests waiting for a sequence slot.", m.queued as f64),
                ("fathom_running_sequences", "Sequences being decoded.", m.running as f64),
                ("fathom_expert_cache_hit_rate", "Share of requested experts found in RAM.", hit_rate(&m.experts).unwrap_or(0.0)),
                ("fathom_prefix_cache_bytes", "Bytes of saved prefix states in RAM.", m.prefix.bytes as f64),
                ("fathom_prefix_cache_entries", "Saved prefix states in RAM.", m.prefix.entries as f64),
            ];
            for (name, help, v) in gauges {
                let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
            }
            let counters = [
                ("fathom_prompt_tokens_total", "Prompt tokens received.", m.prompt_tokens),
                ("fathom_cached_prompt_tokens_total", "Prompt tokens served from the prefix cache.", m.cached_tokens),
                ("fathom_generated_tokens_total", "Tokens generated.", m.generated_tokens),
                ("fathom_expert_bytes_read_total", "Bytes of routed experts read from storage.", m.experts.bytes_read),
                ("fathom_expert_requests_total", "Routed experts the model asked for.", m.experts.requested),
                ("fathom_expert_hits_total", "Requested experts already in RAM.", m.experts.hits),
                ("fathom_prefix_cache_hits_total", "Requests that reused a saved prefix state.", m.prefix.hits),
                ("fathom_prefix_cache_lookups_total", "Prefix cache lookups.", m.prefix.lookups),
            ];
            for (name, help, v) in counters {
                let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
            }
            m.batch.render(&mut o, "fathom_batch_size", "Sequences per engine step.");
            m.ttft.render(&mut o, "fathom_time_to_first_token_seconds", "Request arrival to first generated token.");
            m.itl.render(&mut o, "fathom_inter_token_latency_seconds", "Time between a sequence's tokens.");
            o
        })
    }

    /// The page's live figures.
    pub fn stats(&self) -> serde_json::Value {
        self.with(|m| {
            let rate = match (m.recent.first(), m.recent.last()) {
                (Some(a), Some(b)) if b.0 > a.0 => {
                    (b.1 - a.1) as f64 / b.0.duration_since(a.0).as_secs_f64()
                }
                _ => 0.0,
            };
            let per_token = if m.generated_tokens > 0 {
                m.experts.bytes_read as f64 / (m.generated_tokens + m.prompt_tokens) as f64
            } else {
                0.0
            };
            serde_json::json!({
                "model": self.model,
                "running": m.running,
                "queued": m.queued,
                "decode_tok_s": rate,
                "expert_hit_rate": hit_rate(&m.experts),
                "expert_bytes_per_token": per_token,
                "generated_tokens": m.generated_tokens,
                "prompt_tokens": m.prompt_tokens,
                "cached_tokens": m.cached_tokens,
                "requests": m.requests.values().sum::<u64>(),
            })
        })
    }
}

fn hit_rate(e: &ExpertStats) -> Option<f64> {
    (e.requested > 0).then(|| e.hits as f64 / e.requested as f64)
}
