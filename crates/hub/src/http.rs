//! One HTTP client for the Hub: redirects followed by hand (so the Hub's
//! own headers are seen before the CDN's, and the token never leaves the
//! endpoint's host), failures sorted into transient and final, and a
//! bounded retry loop with exponential backoff and `Retry-After`.

use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use reqwest::blocking::{Client, Response};
use reqwest::header::{AUTHORIZATION, HeaderMap, LOCATION, RANGE};

use crate::config::HubConfig;
use crate::error::{HubError, Result};

/// Redirect hops followed before giving up.
const MAX_REDIRECTS: usize = 5;

/// How one attempt failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Worth another try; `progressed` when the attempt moved the work on
    /// (bytes kept), which restarts the count of tries.
    Transient { msg: String, progressed: bool },
    /// A 429: try again after this many seconds (none given: the backoff).
    RetryAfter { secs: Option<u64>, msg: String },
    /// No retry helps.
    Fatal(HubError),
}

impl Failure {
    pub(crate) fn transient(msg: impl Into<String>) -> Failure {
        Failure::Transient {
            msg: msg.into(),
            progressed: false,
        }
    }
}

impl From<HubError> for Failure {
    fn from(e: HubError) -> Self {
        Failure::Fatal(e)
    }
}

/// The headers of an answer that fathom reads.
#[derive(Debug, Default, Clone)]
pub(crate) struct Head {
    pub status: u16,
    /// `X-Linked-Etag` (an LFS file's SHA-256) seen on any hop, else the
    /// final `ETag`; quotes and `W/` removed.
    pub etag: Option<String>,
    /// `X-Repo-Commit` seen on any hop.
    pub commit: Option<String>,
    /// `X-Linked-Size` seen on any hop.
    pub linked_size: Option<u64>,
    pub content_range: Option<String>,
    pub content_length: Option<u64>,
}

/// The shared client, its configuration and the stop flag of a pull.
pub(crate) struct Http {
    client: Client,
    pub cfg: HubConfig,
    origin: reqwest::Url,
    stop: Arc<AtomicBool>,
}

fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name)?.to_str().ok().map(|s| s.trim().to_string())
}

/// `W/"abc"` → `abc`.
pub(crate) fn clean_etag(s: &str) -> String {
    s.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

impl Http {
    pub(crate) fn new(cfg: &HubConfig, stop: Arc<AtomicBool>) -> Result<Http> {
        let origin = reqwest::Url::parse(&cfg.endpoint).map_err(|e| HubError::Refused {
            what: format!("HF_ENDPOINT {:?}", cfg.endpoint),
            why: format!("not a URL ({e}): give e.g. https://host or http://127.0.0.1:8080"),
        })?;
        let client = Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(cfg.idle_timeout)
            .timeout(cfg.idle_timeout)
            .user_agent(concat!("fathom/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| HubError::protocol("HTTP client", e.to_string()))?;
        Ok(Http {
            client,
            cfg: cfg.clone(),
            origin,
            stop,
        })
    }

    pub(crate) fn endpoint(&self) -> &str {
        &self.cfg.endpoint
    }

    pub(crate) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    pub(crate) fn stop_all(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// One GET of `url` with an optional inclusive byte range, following
    /// redirects; returns the final answer's headers and body reader for
    /// a 2xx, a [`Failure`] otherwise.
    pub(crate) fn get(
        &self,
        what: &str,
        url: &str,
        range: Option<(u64, u64)>,
    ) -> Result<(Head, Response), Failure> {
        let mut url = reqwest::Url::parse(url)
            .map_err(|e| HubError::protocol(what, format!("bad URL {url:?}: {e}")))?;
        let mut head = Head::default();
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.client.get(url.clone());
            if let Some((a, b)) = range {
                req = req.header(RANGE, format!("bytes={a}-{b}"));
            }
            if let Some(t) = &self.cfg.token
                && url.origin() == self.origin.origin()
            {
                req = req.header(AUTHORIZATION, format!("Bearer {t}"));
            }
            let resp = req
                .send()
                .map_err(|e| Failure::transient(format!("{what}: {}", describe(&e))))?;
            let h = resp.headers();
            if let Some(e) = header(h, "x-linked-etag") {
                head.etag = Some(clean_etag(&e));
            }
            if let Some(c) = header(h, "x-repo-commit") {
                head.commit = Some(c);
            }
            if let Some(s) = header(h, "x-linked-size").and_then(|s| s.parse().ok()) {
                head.linked_size = Some(s);
            }
            let status = resp.status().as_u16();
            if resp.status().is_redirection() {
                let loc = header(h, LOCATION.as_str()).ok_or_else(|| {
                    HubError::protocol(what, format!("{status} without a Location"))
                })?;
                url = url.join(&loc).map_err(|e| {
                    HubError::protocol(what, format!("bad redirect Location {loc:?}: {e}"))
                })?;
                continue;
            }
            if !resp.status().is_success() {
                return Err(self.failed(what, resp));
            }
            head.status = status;
            if head.etag.is_none() {
                head.etag = header(h, "etag").map(|e| clean_etag(&e));
            }
            head.content_range = header(h, "content-range");
            head.content_length = resp.content_length();
            return Ok((head, resp));
        }
        Err(HubError::protocol(what, format!("more than {MAX_REDIRECTS} redirects")).into())
    }

    /// Sorts an error status into retry or not, with a message that says
    /// what the status means here.
    fn failed(&self, what: &str, resp: Response) -> Failure {
        let status = resp.status().as_u16();
        let retry_after = header(resp.headers(), "retry-after").and_then(|s| s.parse().ok());
        let body = snippet(resp);
        let msg = format!("{what}: HTTP {status}{body}");
        match status {
            429 => Failure::RetryAfter {
                secs: retry_after,
                msg,
            },
            408 | 500..=599 => Failure::transient(msg),
            401 | 403 => Failure::Fatal(HubError::Refused {
                what: what.to_string(),
                why: format!(
                    "HTTP {status}{body}: the repository is gated or private; accept its terms on the Hub and set HF_TOKEN to a token that may read it"
                ),
            }),
            404 => Failure::Fatal(HubError::Refused {
                what: what.to_string(),
                why: format!(
                    "HTTP 404{body}: no such repository, revision or file at {} (check the name, the @REVISION and HF_ENDPOINT; a private repository needs HF_TOKEN)",
                    self.cfg.endpoint
                ),
            }),
            _ => Failure::Fatal(HubError::protocol(what, format!("HTTP {status}{body}"))),
        }
    }

    /// Runs `attempt` until it succeeds, fails for good, or runs out of
    /// tries; sleeps the backoff (or `Retry-After`) between attempts.
    pub(crate) fn retry<T>(
        &self,
        what: &str,
        mut attempt: impl FnMut() -> Result<T, Failure>,
    ) -> Result<T> {
        let mut tries = 0u32;
        loop {
            if self.stopped() {
                return Err(HubError::Stopped);
            }
            tries += 1;
            let (wait, last) = match attempt() {
                Ok(v) => return Ok(v),
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Transient { msg, progressed }) => {
                    if progressed {
                        tries = 0;
                    }
                    (self.cfg.backoff_after(tries.max(1)), msg)
                }
                Err(Failure::RetryAfter { secs, msg }) => {
                    let max = self.cfg.max_retry_after.as_secs();
                    match secs {
                        Some(s) if s > max => {
                            return Err(HubError::TooLongWait {
                                what: what.to_string(),
                                secs: s,
                                max,
                            });
                        }
                        Some(s) => (Duration::from_secs(s), msg),
                        None => (self.cfg.backoff_after(tries), msg),
                    }
                }
            };
            if tries >= self.cfg.tries {
                return Err(HubError::GaveUp {
                    what: what.to_string(),
                    tries,
                    last,
                });
            }
            self.sleep(wait);
        }
    }

    /// Sleeps, waking early when the pull is stopped.
    fn sleep(&self, d: Duration) {
        let step = Duration::from_millis(20);
        let mut left = d;
        while !left.is_zero() && !self.stopped() {
            let s = left.min(step);
            std::thread::sleep(s);
            left -= s;
        }
    }

    /// A whole small body (a listing, a config file), at most `limit`
    /// bytes, with retries.
    pub(crate) fn get_small(&self, what: &str, url: &str, limit: u64) -> Result<(Head, Vec<u8>)> {
        self.retry(what, || {
            let (head, resp) = self.get(what, url, None)?;
            if head.content_length.is_some_and(|n| n > limit) {
                return Err(HubError::protocol(what, format!("body over {limit} bytes")).into());
            }
            let mut body = Vec::new();
            resp.take(limit + 1)
                .read_to_end(&mut body)
                .map_err(|e| Failure::transient(format!("{what}: reading the body: {e}")))?;
            if body.len() as u64 > limit {
                return Err(HubError::protocol(what, format!("body over {limit} bytes")).into());
            }
            if let Some(n) = head.content_length
                && n != body.len() as u64
            {
                return Err(Failure::transient(format!(
                    "{what}: body ended after {} of {n} bytes",
                    body.len()
                )));
            }
            Ok((head, body))
        })
    }
}

/// The first line of an error body (at most 200 bytes), for messages.
fn snippet(resp: Response) -> String {
    let mut buf = Vec::new();
    let _ = resp.take(200).read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let line = text.lines().next().unwrap_or("").trim();
    if line.is_empty() {
        String::new()
    } else {
        format!(" ({line})")
    }
}

/// A reqwest error in a few words, with its causes.
pub(crate) fn describe(e: &reqwest::Error) -> String {
    let mut s = if e.is_timeout() {
        "timed out".to_string()
    } else if e.is_connect() {
        "cannot connect".to_string()
    } else {
        e.to_string()
    };
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Parses `bytes A-B/TOTAL`.
pub(crate) fn parse_content_range(s: &str) -> Option<(u64, u64, u64)> {
    let rest = s.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    Some((a.parse().ok()?, b.parse().ok()?, total.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range_and_etags() {
        assert_eq!(parse_content_range("bytes 10-19/100"), Some((10, 19, 100)));
        assert_eq!(parse_content_range("bytes 10-19/*"), None);
        assert_eq!(parse_content_range("items 1-2/3"), None);
        assert_eq!(clean_etag("W/\"abc\""), "abc");
        assert_eq!(clean_etag("\"abc\""), "abc");
    }
}
