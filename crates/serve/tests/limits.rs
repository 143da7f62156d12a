//! What a client cannot do to the server: hold it with half-sent requests,
//! fill every connection, reach it through a foreign Host name, make it
//! tokenize a prompt far over the context, or stall it with long
//! preparations.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use fathom_chat::{ChatFormat, ChatOptions, Message};
use fathom_tokenizer::Tokenizer;
use serde_json::{Value, json};

/// Sends `req` on a new connection and reads the answer to its end.
fn raw(addr: SocketAddr, req: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

fn get(addr: SocketAddr, path: &str, host: &str) -> String {
    raw(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
    )
}

/// The status code of a raw answer.
fn status(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"))
}

/// The JSON body of a raw answer.
fn body(answer: &str) -> Value {
    let b = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(b.trim()).unwrap_or_else(|e| panic!("{b:?}: {e}"))
}

/// A figure from `/metrics`.
fn metric(addr: SocketAddr, name: &str) -> f64 {
    let m = get(addr, "/metrics", "127.0.0.1");
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {m}"))
}

/// Whether the server has closed `s` (end of stream or reset), waiting up
/// to `wait` for it.
fn closed(mut s: &TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false;
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn half_sent_requests_cannot_lock_the_server_out() {
    let (lm, _) = need_model!();
    let mut cfg = config();
    cfg.max_connections = 32;
    cfg.header_timeout = Duration::from_secs(3);
    let (server, _) = start(cfg, lm);
    let addr = server.addr;
    // 300 requests that never finish their headers: the cap holds 32.
    let slow: Vec<TcpStream> = (0..300)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: ")
                .unwrap();
            s
        })
        .collect();
    // Health still answers: each new connection closes the longest-idle one.
    let h = get(addr, "/health", "127.0.0.1");
    assert_eq!(status(&h), 200, "{h}");
    assert_eq!(body(&h)["status"], "ok");
    let evicted = metric(addr, "fathom_evicted_connections_total");
    assert!(evicted >= 268.0, "{evicted} idle connections closed");
    assert!(metric(addr, "fathom_open_connections") <= 32.0);
    assert_eq!(metric(addr, "fathom_refused_connections_total"), 0.0);
    // The server closed the oldest; the newest it closes at the header timeout.
    let gone = slow[..268]
        .iter()
        .filter(|s| closed(s, Duration::from_secs(30)))
        .count();
    assert_eq!(gone, 268);
    let last = slow.last().unwrap();
    assert!(
        closed(last, Duration::from_secs(60)),
        "the header timeout left it open"
    );
    server.stop().unwrap();
}

/// Starts a streamed completion on a raw connection and reads until its
/// first event: the connection is then busy answering it.
fn busy_stream(addr: SocketAddr) -> TcpStream {
    let b = json!({"prompt": "def f(x):", "max_tokens": 2000, "temperature": 0, "stream": true})
        .to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}",
        b.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "closed before streaming: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

#[test]
fn with_every_connection_answering_new_ones_get_503_at_once() {
    let (lm, _) = need_model!();
    let mut cfg = config();
    cfg.max_connections = 4;
    cfg.max_seqs = 4;
    let (server, _) = start(cfg, lm);
    let addr = server.addr;
    let streams: Vec<TcpStream> = (0..4).map(|_| busy_stream(addr)).collect();
    let a = get(addr, "/health", "127.0.0.1");
    assert_eq!(status(&a), 503, "{a}");
    assert_eq!(body(&a)["error"]["code"], "too_many_connections");
    assert!(a.to_ascii_lowercase().contains("retry-after: 1"), "{a}");
    // The streams go away; the slots come back.
    drop(streams);
    let mut answered = false;
    for _ in 0..200 {
        let h = get(addr, "/health", "127.0.0.1");
        if status(&h) == 200 {
            answered = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(answered, "the slots never came back");
    assert!(metric(addr, "fathom_refused_connections_total") >= 1.0);
    server.stop().unwrap();
}

#[test]
fn a_loopback_server_answers_loopback_and_allowed_host_names_only() {
    let (lm, _) = need_model!();
    let mut cfg = config();
    cfg.allowed_hosts = vec!["proxy.test".into()];
    let (server, _) = start(cfg, lm.clone());
    let addr = server.addr;
    let port = addr.port();
    for host in [
        format!("localhost:{port}"),
        format!("127.0.0.1:{port}"),
        format!("[::1]:{port}"),
        "LOCALHOST".to_string(),
        "proxy.test".to_string(),
        "Proxy.Test:443".to_string(),
    ] {
        let a = get(addr, "/health", &host);
        assert_eq!(status(&a), 200, "{host}: {a}");
    }
    // A name an attacker's DNS points at 127.0.0.1 (DNS rebinding).
    for path in ["/health", "/", "/v1/models"] {
        let a = get(addr, path, &format!("evil.test:{port}"));
        assert_eq!(status(&a), 403, "{path}: {a}");
        let e = body(&a);
        assert_eq!(e["error"]["code"], "host_not_allowed");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("\"evil.test\"") && msg.contains("--allowed-host evil.test"),
            "{msg}"
        );
    }
    let b = json!({"prompt": "x", "max_tokens": 1}).to_string();
    let a = raw(
        addr,
        &format!(
            "POST /v1/completions HTTP/1.1\r\nHost: localhost.evil.test\r\nConnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{b}",
            b.len()
        ),
    );
    assert_eq!(status(&a), 403, "{a}");
    let a = raw(addr, "GET /health HTTP/1.0\r\n\r\n");
    assert_eq!(status(&a), 400, "{a}");
    assert!(
        body(&a)["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no Host")
    );
    server.stop().unwrap();
    // Bound to every address without --allowed-host: any name.
    let mut cfg = config();
    cfg.host = "0.0.0.0".into();
    let (server, _) = start(cfg, lm);
    let a = get(
        SocketAddr::from(([127, 0, 0, 1], server.addr.port())),
        "/health",
        "evil.test",
    );
    assert_eq!(status(&a), 200, "{a}");
    server.stop().unwrap();
}

/// Texts this long or longer are "long" to [`Counting`].
const LONG: usize = 64 << 10;

/// The model's tokenizer, counting the texts it encodes; a long text
/// takes `linger` more to encode, and the long texts being encoded at once
/// are counted.
struct Counting {
    inner: Arc<dyn Tokenizer>,
    encoded: AtomicUsize,
    linger: Duration,
    /// Long texts being encoded now.
    busy: AtomicUsize,
    /// The most long texts encoded at once.
    most: AtomicUsize,
}

impl Counting {
    fn new(inner: Arc<dyn Tokenizer>, linger: Duration) -> Arc<Counting> {
        Arc::new(Counting {
            inner,
            encoded: AtomicUsize::new(0),
            linger,
            busy: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
        })
    }

    fn count(&self, text: &str, encode: impl FnOnce() -> Vec<u32>) -> Vec<u32> {
        self.encoded.fetch_add(1, Ordering::SeqCst);
        if text.len() < LONG {
            return encode();
        }
        let now = self.busy.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(self.linger);
        let ids = encode();
        self.busy.fetch_sub(1, Ordering::SeqCst);
        ids
    }
}

impl Tokenizer for Counting {
    fn encode(&self, text: &str) -> Vec<u32> {
        self.count(text, || self.inner.encode(text))
    }
    fn encode_trusted(&self, text: &str) -> Vec<u32> {
        self.count(text, || self.inner.encode_trusted(text))
    }
    fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids)
    }
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.inner.token_bytes(id)
    }
    fn special_id(&self, name: &str) -> Option<u32> {
        self.inner.special_id(name)
    }
    fn is_special(&self, id: u32) -> bool {
        self.inner.is_special(id)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
}

#[test]
fn a_prompt_far_over_the_context_is_refused_before_it_is_tokenized() {
    let (lm, tok) = need_model!();
    let per = fathom_serve::max_token_bytes(&model_dir().unwrap(), tok.as_ref())
        .expect("a tiktoken tokenizer keeps every byte");
    let counting = Counting::new(tok, Duration::ZERO);
    let mut cfg = config();
    cfg.max_body = 32 << 20;
    let (server, url) = start_with(cfg, lm, counting.clone());
    let big = "x = 1\n".repeat(2_000_000);
    let at_least = big.len().div_ceil(per);
    rt().block_on(async {
        let before = counting.encoded.load(Ordering::SeqCst);
        let (st, v) = post(&url, "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": big}], "max_tokens": 4})).await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(
            v["error"]["message"],
            format!("the prompt has at least {at_least} tokens ({} bytes of text, at most {per} bytes a token); the context holds 4096: shorten it", big.len())
        );
        let (st, v) = post(&url, "/v1/completions", json!({"prompt": big, "max_tokens": 4})).await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], "prompt");
        assert!(v["error"]["message"].as_str().unwrap().starts_with("the prompt has at least"));
        assert_eq!(counting.encoded.load(Ordering::SeqCst), before, "a refused prompt was tokenized");
        // Under the bound, a prompt is tokenized and refused by its count.
        let under = "x = 1\n".repeat(per * 4095 / 6);
        let (st, v) = post(&url, "/v1/completions", json!({"prompt": under, "max_tokens": 4})).await;
        assert_eq!(st, 400, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.starts_with("the prompt has ") && !msg.contains("at least"), "{msg}");
        assert!(counting.encoded.load(Ordering::SeqCst) > before);
        let (st, _) = post(&url, "/v1/completions", json!({"prompt": "def f(x):", "max_tokens": 2})).await;
        assert_eq!(st, 200);
    });
    server.stop().unwrap();
}

#[test]
fn long_preparations_run_off_the_http_threads_a_bounded_number_at_once() {
    let (lm, tok) = need_model!();
    let dir = model_dir().unwrap();
    let per = fathom_serve::max_token_bytes(&dir, tok.as_ref())
        .expect("a tiktoken tokenizer keeps every byte");
    // The server's bound on preparations at once: half the cores, at least two.
    let slots = std::thread::available_parallelism().map_or(2, |n| (n.get() / 2).max(2));
    // Each long text takes a second more to encode; a chat prompt is
    // encoded twice (whole, and without the generation prompt).
    let counting = Counting::new(tok.clone(), Duration::from_secs(1));
    let mut cfg = config();
    cfg.max_body = 32 << 20;
    let (server, url) = start_with(cfg, lm, counting.clone());
    let addr = server.addr;
    // Just under the length refused before tokenizing: each is tokenized,
    // then refused by its token count.
    let text = "x = 1\n".repeat(per * 4095 / 6);
    assert!(text.len() >= LONG, "{} bytes", text.len());
    let format = ChatFormat::detect(&dir, tok.as_ref()).unwrap().unwrap();
    let n = format
        .prompt(
            tok.as_ref(),
            &[Message::new("user", text.as_str())],
            &ChatOptions::default(),
        )
        .unwrap()
        .ids
        .len();
    assert!(n > 4096, "{n} tokens");
    let want = format!("the prompt has {n} tokens; the context holds 4096: shorten it");
    let body = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 4});
    let big: Vec<_> = (0..slots + 4)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            std::thread::spawn(move || rt().block_on(post(&url, "/v1/chat/completions", body)))
        })
        .collect();
    let t = Instant::now();
    while counting.busy.load(Ordering::SeqCst) < slots {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the slots never filled"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // While they are prepared, /health answers at once; run on the HTTP
    // threads, the preparations would hold both for seconds at a time.
    let mut during = 0;
    while !big.iter().all(|h| h.is_finished()) {
        let busy = counting.busy.load(Ordering::SeqCst);
        let t = Instant::now();
        let h = get(addr, "/health", "127.0.0.1");
        let took = t.elapsed();
        assert_eq!(status(&h), 200, "{h}");
        assert!(
            took < Duration::from_secs(1),
            "/health took {took:?} beside {busy} preparations"
        );
        if busy > 0 && counting.busy.load(Ordering::SeqCst) > 0 {
            during += 1;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        during >= 10,
        "/health asked {during} times during preparations"
    );
    for h in big {
        let (st, v) = h.join().unwrap();
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], "messages");
        assert_eq!(v["error"]["message"], want);
    }
    assert_eq!(counting.most.load(Ordering::SeqCst), slots);
    assert_eq!(counting.busy.load(Ordering::SeqCst), 0);
    server.stop().unwrap();
}

#[test]
fn a_body_that_stops_arriving_gets_408() {
    let (lm, _) = need_model!();
    let mut cfg = config();
    cfg.body_timeout = Duration::from_secs(1);
    let (server, _) = start(cfg, lm);
    let a = raw(
        server.addr,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\": ",
    );
    assert_eq!(status(&a), 408, "{a}");
    assert_eq!(body(&a)["error"]["code"], "body_timeout");
    server.stop().unwrap();
}
