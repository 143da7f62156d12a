//! Where the Hub is, who we are to it, where its cache lives, and how
//! patient the client is.

use std::path::PathBuf;
use std::time::Duration;

/// The public Hub, used when `HF_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// How the client reaches the Hub and how it retries.
#[derive(Clone)]
pub struct HubConfig {
    /// Base URL, no trailing slash (`HF_ENDPOINT`).
    pub endpoint: String,
    /// Sent as `Authorization: Bearer` to the endpoint's host only
    /// (`HF_TOKEN`, else the token file `huggingface-cli login` writes).
    pub token: Option<String>,
    /// The Hub cache root holding `models--ORG--NAME` folders
    /// (`HF_HUB_CACHE`, else `$HF_HOME/hub`).
    pub cache: PathBuf,
    /// Longest silence while connecting, waiting for headers or reading a
    /// body before the attempt counts as failed.
    pub idle_timeout: Duration,
    /// Attempts per request (the first included) for transient failures:
    /// connection errors, timeouts, 5xx, 429, truncated bodies.
    pub tries: u32,
    /// Wait before the second attempt; doubled each time after.
    pub backoff: Duration,
    /// Longest wait between attempts (exponential backoff stops growing).
    pub max_backoff: Duration,
    /// Longest `Retry-After` honoured; a 429 asking for more fails.
    pub max_retry_after: Duration,
}

impl std::fmt::Debug for HubConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubConfig")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .field("cache", &self.cache)
            .field("idle_timeout", &self.idle_timeout)
            .field("tries", &self.tries)
            .finish()
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `$HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else
/// `~/.cache/huggingface`.
pub fn hf_home() -> PathBuf {
    if let Some(h) = var("HF_HOME") {
        return PathBuf::from(h);
    }
    let base = var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("huggingface")
}

/// `$HF_HUB_CACHE`, else `$HF_HOME/hub`.
pub fn hub_cache() -> PathBuf {
    var("HF_HUB_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| hf_home().join("hub"))
}

/// `$HF_TOKEN`, else the first line of `$HF_HOME/token` (at most 4 KiB).
fn token() -> Option<String> {
    if let Some(t) = var("HF_TOKEN") {
        return Some(t.trim().to_string());
    }
    let path = hf_home().join("token");
    let meta = std::fs::metadata(&path).ok()?;
    if !meta.is_file() || meta.len() > 4096 {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let t = text.lines().next()?.trim();
    (!t.is_empty()).then(|| t.to_string())
}

impl HubConfig {
    /// The configuration the environment describes, with the default
    /// patience: 30 s of silence, 8 tries, backoff 0.5 s doubling to 30 s,
    /// `Retry-After` up to 5 minutes.
    pub fn from_env() -> HubConfig {
        let endpoint = var("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        HubConfig {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token: token(),
            cache: hub_cache(),
            idle_timeout: Duration::from_secs(30),
            tries: 8,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            max_retry_after: Duration::from_secs(300),
        }
    }

    /// The wait before attempt `n + 1` (n ≥ 1 failed attempts so far).
    pub fn backoff_after(&self, n: u32) -> Duration {
        let f = 1u32 << (n.saturating_sub(1)).min(20);
        self.backoff.saturating_mul(f).min(self.max_backoff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_capped() {
        let mut c = HubConfig::from_env();
        c.backoff = Duration::from_millis(500);
        c.max_backoff = Duration::from_secs(3);
        let waits: Vec<u128> = (1..=6).map(|n| c.backoff_after(n).as_millis()).collect();
        assert_eq!(waits, [500, 1000, 2000, 3000, 3000, 3000]);
        assert_eq!(c.backoff_after(u32::MAX).as_millis(), 3000);
    }
}
