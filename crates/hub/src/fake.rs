//! A stand-in for the Hub on 127.0.0.1, for tests: the revision listing,
//! `resolve/REV/PATH` (LFS files answer with a 302 to a CDN path, as the
//! Hub does), Range requests, the Hub's headers, a token check, and
//! faults injected per file. Every request is logged.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::verify::{git_blob_id, hex, sha256_hex};

pub use crate::fake_split::split_experts;

/// Files this large or named `*.safetensors` are stored as LFS files.
pub const LFS_FROM: usize = 64 << 10;

/// A misbehaviour for the next data request of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Answer this status (500, 503, …) with no body.
    Status(u16),
    /// 429 with `Retry-After: N`.
    TooMany(u64),
    /// Send this many body bytes, then drop the connection (most often
    /// all of them arrive; a loaded machine may deliver fewer).
    Truncate(u64),
    /// Send this many body bytes, then nothing (the connection stays open).
    Stall(u64),
    /// A 206 whose Content-Range starts one byte later than asked.
    WrongContentRange,
    /// A 200 with the whole file, whatever the Range.
    IgnoreRange,
    /// Flip the first byte of the body.
    Corrupt,
    /// Before answering `resolve`, the file's contents become these bytes
    /// (a new commit): a file changed under the same name mid-download.
    Replace(Vec<u8>),
}

/// One request as the server saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logged {
    pub path: String,
    pub range: Option<String>,
    pub auth: Option<String>,
}

struct FakeFile {
    bytes: Arc<Vec<u8>>,
    sha256: String,
    oid: String,
    lfs: bool,
}

#[derive(Default)]
struct Repo {
    commit: String,
    files: BTreeMap<String, FakeFile>,
}

#[derive(Default)]
struct Inner {
    repos: HashMap<String, Repo>,
    faults: HashMap<String, VecDeque<Fault>>,
    log: Vec<Logged>,
    token: Option<String>,
    /// Body chunk size and the pause after each chunk.
    throttle: Option<(usize, Duration)>,
    /// Redirect LFS files to `http://localhost:PORT` (another origin).
    cdn_elsewhere: Option<u16>,
}

impl Inner {
    fn set_repo(&mut self, id: &str, files: Vec<(String, Vec<u8>)>) -> String {
        let mut repo = Repo::default();
        for (p, b) in files {
            let lfs = p.ends_with(".safetensors") || b.len() >= LFS_FROM;
            repo.files.insert(
                p,
                FakeFile {
                    sha256: sha256_hex(&b),
                    oid: git_blob_id(&b),
                    bytes: Arc::new(b),
                    lfs,
                },
            );
        }
        let mut h = Sha256::new();
        for (p, f) in &repo.files {
            h.update(format!("{p}\0{}\n", f.sha256).as_bytes());
        }
        repo.commit = hex(&h.finalize())[..40].to_string();
        let c = repo.commit.clone();
        self.repos.insert(id.to_string(), repo);
        c
    }

    fn set_file(&mut self, id: &str, path: &str, bytes: Vec<u8>) -> String {
        let mut files: Vec<(String, Vec<u8>)> = self.repos[id]
            .files
            .iter()
            .filter(|(p, _)| p.as_str() != path)
            .map(|(p, f)| (p.clone(), f.bytes.to_vec()))
            .collect();
        files.push((path.to_string(), bytes));
        self.set_repo(id, files)
    }
}

type Shared = Arc<Mutex<Inner>>;

/// The running server; stops when dropped.
pub struct FakeHub {
    addr: SocketAddr,
    state: Shared,
    rt: Option<tokio::runtime::Runtime>,
}

impl FakeHub {
    /// Starts on an ephemeral port of 127.0.0.1.
    pub fn start() -> FakeHub {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let addr = std_listener.local_addr().expect("address");
        let state: Shared = Arc::default();
        let app = Router::new()
            .route("/api/models/{org}/{name}/revision/{rev}", get(listing))
            .route("/{org}/{name}/resolve/{rev}/{*path}", get(resolve))
            .route("/cdn/{org}/{name}/{sha}/{*path}", get(cdn))
            .with_state(state.clone());
        rt.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(std_listener).expect("listener");
            let _ = axum::serve(listener, app).await;
        });
        FakeHub {
            addr,
            state,
            rt: Some(rt),
        }
    }

    /// `http://127.0.0.1:PORT`, for `HF_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Serves `files` as repository `id` (`ORG/NAME`), replacing what it
    /// had; returns the new commit id.
    pub fn set_repo(&self, id: &str, files: Vec<(String, Vec<u8>)>) -> String {
        self.state.lock().unwrap().set_repo(id, files)
    }

    /// Serves every regular file of `dir` (recursively) as repository `id`.
    pub fn set_repo_dir(&self, id: &str, dir: &Path) -> String {
        let mut files = Vec::new();
        collect(dir, dir, &mut files);
        self.set_repo(id, files)
    }

    /// Changes one file of `id` (a new commit); returns it.
    pub fn set_file(&self, id: &str, path: &str, bytes: Vec<u8>) -> String {
        self.state.lock().unwrap().set_file(id, path, bytes)
    }

    /// Redirects LFS downloads to `localhost` instead of `127.0.0.1`: the
    /// same server under another origin, which must not see the token.
    pub fn cdn_elsewhere(&self, on: bool) {
        self.state.lock().unwrap().cdn_elsewhere = on.then_some(self.addr.port());
    }

    /// Queues `fault` for the next data request of `path`.
    pub fn push_fault(&self, path: &str, fault: Fault) {
        let mut st = self.state.lock().unwrap();
        st.faults
            .entry(path.to_string())
            .or_default()
            .push_back(fault);
    }

    /// Drops every queued fault.
    pub fn clear_faults(&self) {
        self.state.lock().unwrap().faults.clear();
    }

    /// Requires `Authorization: Bearer TOKEN` on the listing and resolve.
    pub fn require_token(&self, token: Option<&str>) {
        self.state.lock().unwrap().token = token.map(str::to_string);
    }

    /// Sends bodies in `chunk`-byte pieces with `pause` after each
    /// (`None`: at once).
    pub fn throttle(&self, t: Option<(usize, Duration)>) {
        self.state.lock().unwrap().throttle = t;
    }

    /// Requests so far.
    pub fn log(&self) -> Vec<Logged> {
        self.state.lock().unwrap().log.clone()
    }

    pub fn clear_log(&self) {
        self.state.lock().unwrap().log.clear();
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read dir")
        .flatten()
        .collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        if p.is_dir() {
            collect(root, &p, out);
        } else if p.is_file() {
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            out.push((rel, std::fs::read(&p).expect("read file")));
        }
    }
}

fn log(st: &Shared, path: String, h: &HeaderMap) -> Option<Response> {
    let get = |n: header::HeaderName| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
    let auth = get(header::AUTHORIZATION);
    let mut s = st.lock().unwrap();
    s.log.push(Logged {
        path: path.clone(),
        range: get(header::RANGE),
        auth: auth.clone(),
    });
    match &s.token {
        Some(t)
            if !path.starts_with("/cdn/") && auth.as_deref() != Some(&format!("Bearer {t}")) =>
        {
            Some(
                (
                    StatusCode::UNAUTHORIZED,
                    "Invalid credentials in Authorization header",
                )
                    .into_response(),
            )
        }
        _ => None,
    }
}

async fn listing(
    State(st): State<Shared>,
    UrlPath((org, name, rev)): UrlPath<(String, String, String)>,
    Query(q): Query<HashMap<String, String>>,
    h: HeaderMap,
) -> Response {
    if let Some(r) = log(&st, format!("/api/models/{org}/{name}/revision/{rev}"), &h) {
        return r;
    }
    let s = st.lock().unwrap();
    let Some(repo) = s.repos.get(&format!("{org}/{name}")) else {
        return (StatusCode::NOT_FOUND, "Repository not found").into_response();
    };
    if rev != "main" && rev != repo.commit {
        return (StatusCode::NOT_FOUND, "Revision not found").into_response();
    }
    let blobs = q.get("blobs").is_some_and(|v| v == "true");
    let siblings: Vec<_> = repo
        .files
        .iter()
        .map(|(p, f)| {
            if !blobs {
                return json!({ "rfilename": p });
            }
            let mut v = json!({ "rfilename": p, "size": f.bytes.len(), "blobId": f.oid });
            if f.lfs {
                v["lfs"] = json!({ "sha256": f.sha256, "size": f.bytes.len(), "pointerSize": 134 });
            }
            v
        })
        .collect();
    let body = json!({ "id": format!("{org}/{name}"), "sha": repo.commit, "siblings": siblings });
    axum::Json(body).into_response()
}

fn find(
    st: &Shared,
    id: &str,
    rev: Option<&str>,
    path: &str,
) -> Result<(String, Arc<Vec<u8>>, String, String, bool), Response> {
    let s = st.lock().unwrap();
    let Some(repo) = s.repos.get(id) else {
        return Err((StatusCode::NOT_FOUND, "Repository not found").into_response());
    };
    // Any commit id gets the current contents: files change in place here.
    if rev.is_some_and(|r| r != "main" && !crate::repo::is_commit(r)) {
        return Err((StatusCode::NOT_FOUND, "Revision not found").into_response());
    }
    let Some(f) = repo.files.get(path) else {
        return Err((StatusCode::NOT_FOUND, "Entry not found").into_response());
    };
    Ok((
        repo.commit.clone(),
        f.bytes.clone(),
        f.sha256.clone(),
        f.oid.clone(),
        f.lfs,
    ))
}

async fn resolve(
    State(st): State<Shared>,
    UrlPath((org, name, rev, path)): UrlPath<(String, String, String, String)>,
    h: HeaderMap,
) -> Response {
    if let Some(r) = log(&st, format!("/{org}/{name}/resolve/{rev}/{path}"), &h) {
        return r;
    }
    {
        let mut s = st.lock().unwrap();
        let q = s.faults.get_mut(&path);
        if let Some(Fault::Replace(_)) = q.as_ref().and_then(|q| q.front())
            && let Some(Fault::Replace(b)) = q.and_then(VecDeque::pop_front)
        {
            s.set_file(&format!("{org}/{name}"), &path, b);
        }
    }
    let (commit, bytes, sha, oid, lfs) =
        match find(&st, &format!("{org}/{name}"), Some(&rev), &path) {
            Ok(x) => x,
            Err(r) => return r,
        };
    if lfs {
        let mut r = Response::new(Body::empty());
        *r.status_mut() = StatusCode::FOUND;
        let hs = r.headers_mut();
        let host = match st.lock().unwrap().cdn_elsewhere {
            Some(port) => format!("http://localhost:{port}"),
            None => String::new(),
        };
        let loc = format!("{host}/cdn/{org}/{name}/{sha}/{path}");
        hs.insert(header::LOCATION, HeaderValue::from_str(&loc).unwrap());
        hs.insert("x-repo-commit", HeaderValue::from_str(&commit).unwrap());
        hs.insert(
            "x-linked-etag",
            HeaderValue::from_str(&format!("\"{sha}\"")).unwrap(),
        );
        hs.insert("x-linked-size", HeaderValue::from(bytes.len() as u64));
        hs.insert(
            header::ETAG,
            HeaderValue::from_str(&format!("\"{oid}\"")).unwrap(),
        );
        return r;
    }
    let mut r = serve(&st, &path, bytes, &h);
    let hs = r.headers_mut();
    hs.insert("x-repo-commit", HeaderValue::from_str(&commit).unwrap());
    hs.insert(
        header::ETAG,
        HeaderValue::from_str(&format!("\"{oid}\"")).unwrap(),
    );
    r
}

async fn cdn(
    State(st): State<Shared>,
    UrlPath((org, name, sha, path)): UrlPath<(String, String, String, String)>,
    h: HeaderMap,
) -> Response {
    if let Some(r) = log(&st, format!("/cdn/{org}/{name}/{sha}/{path}"), &h) {
        return r;
    }
    let (_, bytes, now, _, _) = match find(&st, &format!("{org}/{name}"), None, &path) {
        Ok(x) => x,
        Err(r) => return r,
    };
    if now != sha {
        return (StatusCode::NOT_FOUND, "no such object").into_response();
    }
    let mut r = serve(&st, &path, bytes, &h);
    // A CDN's own ETag, not the file's digest.
    r.headers_mut()
        .insert(header::ETAG, HeaderValue::from_static("\"cdn-1\""));
    r
}

/// `bytes=A-B` or `bytes=A-`, inside `len`.
fn parse_range(v: &str, len: u64) -> Option<(u64, u64)> {
    let (a, b) = v.strip_prefix("bytes=")?.split_once('-')?;
    let a: u64 = a.parse().ok()?;
    let b: u64 = if b.is_empty() {
        len.checked_sub(1)?
    } else {
        b.parse().ok()?
    };
    (a <= b && b < len).then_some((a, b.min(len - 1)))
}

/// The file's bytes (or the asked range), with the next fault applied.
fn serve(st: &Shared, path: &str, bytes: Arc<Vec<u8>>, h: &HeaderMap) -> Response {
    let (fault, throttle) = {
        let mut s = st.lock().unwrap();
        let f = s.faults.get_mut(path).and_then(VecDeque::pop_front);
        (f, s.throttle)
    };
    let len = bytes.len() as u64;
    match fault {
        Some(Fault::Status(code)) => return StatusCode::from_u16(code).unwrap().into_response(),
        Some(Fault::TooMany(secs)) => {
            let mut r = StatusCode::TOO_MANY_REQUESTS.into_response();
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
            return r;
        }
        _ => {}
    }
    let asked = h.get(header::RANGE).and_then(|v| v.to_str().ok());
    let range = match asked {
        Some(v) if fault != Some(Fault::IgnoreRange) => match parse_range(v, len) {
            Some(r) => Some(r),
            None => {
                let mut r = StatusCode::RANGE_NOT_SATISFIABLE.into_response();
                r.headers_mut().insert(
                    header::CONTENT_RANGE,
                    HeaderValue::from_str(&format!("bytes */{len}")).unwrap(),
                );
                return r;
            }
        },
        _ => None,
    };
    let (start, end) = range.unwrap_or((0, len.saturating_sub(1)));
    let mut body: Vec<u8> = if len == 0 {
        Vec::new()
    } else {
        bytes[start as usize..=end as usize].to_vec()
    };
    if fault == Some(Fault::Corrupt)
        && let Some(b) = body.first_mut()
    {
        *b ^= 0xff;
    }
    let n = body.len() as u64;
    let (cut, stall) = match fault {
        Some(Fault::Truncate(k)) => (Some(k.min(n)), false),
        Some(Fault::Stall(k)) => (Some(k.min(n)), true),
        _ => (None, false),
    };
    let mut r = Response::new(stream_body(body, cut, stall, throttle));
    let hs = r.headers_mut();
    hs.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    hs.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if range.is_some() {
        *r.status_mut() = StatusCode::PARTIAL_CONTENT;
        let shown = if fault == Some(Fault::WrongContentRange) {
            start + 1
        } else {
            start
        };
        let cr = format!("bytes {shown}-{end}/{len}");
        r.headers_mut()
            .insert(header::CONTENT_RANGE, HeaderValue::from_str(&cr).unwrap());
    }
    r
}

/// The body in pieces: all of it, or `cut` bytes then an error (the
/// connection drops) or a stall.
fn stream_body(
    body: Vec<u8>,
    cut: Option<u64>,
    stall: bool,
    throttle: Option<(usize, Duration)>,
) -> Body {
    let (chunk, pause) = throttle.unwrap_or((64 << 10, Duration::ZERO));
    let limit = cut.unwrap_or(body.len() as u64) as usize;
    let body = Arc::new(body);
    let stream = futures_util::stream::unfold(0usize, move |pos| {
        let body = body.clone();
        async move {
            if pos >= limit {
                if pos >= body.len() {
                    return None;
                }
                // A stall never ends; a cut waits a moment first so the
                // bytes before it leave the server's buffers.
                let wait = if stall { 3600_000 } else { 200 };
                tokio::time::sleep(Duration::from_millis(wait)).await;
                return Some((Err(std::io::Error::other("cut")), usize::MAX));
            }
            if pos > 0 && !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            let end = (pos + chunk).min(limit);
            Some((
                Ok::<Bytes, std::io::Error>(Bytes::copy_from_slice(&body[pos..end])),
                end,
            ))
        }
    });
    Body::from_stream(stream)
}
