//! Server figures: Prometheus text for `/metrics`, JSON for `/stats` (the
//! page's live panel).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fathom_model::experts::ExpertStats;

use crate::prefix::PrefixStats;

/// Histogram bucket bounds, seconds.
const LATENCY_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
const BATCH_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];
/// The window over which the queue's drain rate is measured.
const DRAIN_WINDOW: Duration = Duration::from_secs(60);
/// Bounds of `Retry-After`, seconds.
pub const RETRY_MIN: u32 = 1;
pub const RETRY_MAX: u32 = 60;

/// Connection counts, kept by the accept loop.
#[derive(Debug, Default)]
pub struct ConnStats {
    pub open: AtomicUsize,
    /// Refused at the cap, every connection answering a request.
    pub refused: AtomicU64,
    /// Idle connections closed to make room for new ones.
    pub evicted: AtomicU64,
}

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
    /// When requests finished, over the last [`DRAIN_WINDOW`].
    finished: VecDeque<Instant>,
}

/// Everything `/metrics` and `/stats` report.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
    model: String,
    since: Instant,
    pub conns: ConnStats,
}

impl Metrics {
    pub fn new(model: &str) -> Self {
        Metrics {
            model: model.to_string(),
            since: Instant::now(),
            conns: ConnStats::default(),
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
                finished: VecDeque::new(),
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

    /// A request left the engine (all its sequences done).
    pub fn finished(&self) {
        self.finished_at(Instant::now());
    }

    fn finished_at(&self, now: Instant) {
        self.with(|m| {
            m.finished.push_back(now);
            prune(&mut m.finished, now);
        });
    }

    /// Seconds until a request refused now would likely find room in a
    /// queue of `queued`: the requests ahead of it over the rate requests
    /// finished at in the last minute (or since the start, if sooner);
    /// [`RETRY_MAX`] before any has finished; within
    /// [`RETRY_MIN`]..=[`RETRY_MAX`].
    pub fn retry_after(&self, queued: usize) -> u32 {
        self.retry_after_at(queued, Instant::now())
    }

    fn retry_after_at(&self, queued: usize, now: Instant) -> u32 {
        self.with(|m| {
            prune(&mut m.finished, now);
            let n = m.finished.len();
            if n == 0 {
                return RETRY_MAX;
            }
            let span = now
                .saturating_duration_since(self.since)
                .min(DRAIN_WINDOW)
                .as_secs_f64()
                .max(1.0);
            let rate = n as f64 / span;
            let wait = (queued as f64 + 1.0) / rate;
            (wait.ceil() as u32).clamp(RETRY_MIN, RETRY_MAX)
        })
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
                ("fathom_open_connections", "Open HTTP connections.", self.conns.open.load(Ordering::Relaxed) as f64),
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
                ("fathom_refused_connections_total", "Connections refused at --max-connections while every open one was answering.", self.conns.refused.load(Ordering::Relaxed)),
                ("fathom_evicted_connections_total", "Idle connections closed at --max-connections to make room.", self.conns.evicted.load(Ordering::Relaxed)),
                ("fathom_state_cache_disk_evicted_total", "Saved states removed from --state-cache-dir to stay within --state-cache-max.", m.prefix.disk_evicted),
                ("fathom_state_cache_disk_bytes", "Bytes of saved states in --state-cache-dir.", m.prefix.disk_bytes),
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

/// Drops finish times older than the window.
fn prune(q: &mut VecDeque<Instant>, now: Instant) {
    while q
        .front()
        .is_some_and(|&t| now.saturating_duration_since(t) > DRAIN_WINDOW)
    {
        q.pop_front();
    }
}

fn hit_rate(e: &ExpertStats) -> Option<f64> {
    (e.requested > 0).then(|| e.hits as f64 / e.requested as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_follows_the_drain_rate_within_bounds() {
        let m = Metrics::new("m");
        let t0 = m.since;
        // Nothing finished yet: the upper bound.
        assert_eq!(m.retry_after_at(3, t0 + Duration::from_secs(5)), RETRY_MAX);
        // 10 requests over 20 s: 0.5 per second; 4 ahead + this one → 10 s.
        for i in 0..10 {
            m.finished_at(t0 + Duration::from_secs(2 * i + 1));
        }
        assert_eq!(m.retry_after_at(4, t0 + Duration::from_secs(20)), 10);
        // A fast queue still says at least 1 s.
        for _ in 0..1000 {
            m.finished_at(t0 + Duration::from_secs(20));
        }
        assert_eq!(m.retry_after_at(0, t0 + Duration::from_secs(20)), RETRY_MIN);
        // A long queue is capped.
        assert_eq!(
            m.retry_after_at(1_000_000, t0 + Duration::from_secs(20)),
            RETRY_MAX
        );
        // Finishes older than the window no longer count.
        assert_eq!(
            m.retry_after_at(0, t0 + Duration::from_secs(200)),
            RETRY_MAX
        );
    }
}
