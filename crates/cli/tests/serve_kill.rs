//! `fathom serve --state-cache-dir` killed (SIGKILL) while it saves prefix
//! states: restarted on the same directory, it starts, removes what the
//! interrupted saves left, keeps within `--state-cache-max`, and answers as
//! a server that never saw the directory.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

/// Prompt tokens between saved states: many saves a request.
const BLOCK: &str = "16";

/// A running `fathom serve` and what it has logged.
struct Serve {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl Serve {
    /// Starts `fathom serve` over `model` with its states in `dir` (at most
    /// `cap` bytes) and waits until `/health` answers 200.
    fn start(model: &Path, dir: &Path, cap: u64) -> Serve {
        let mut child = Command::new(env!("CARGO_BIN_EXE_fathom"))
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0", "--prefix-block", BLOCK, "--max-seqs", "4"])
            .arg("--state-cache-dir")
            .arg(dir)
            .args(["--state-cache-max", &cap.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("fathom serve starts");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(a) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(a.split(' ').next().unwrap().to_string());
                }
                lines.lock().unwrap().push(line);
            }
        });
        let addr: SocketAddr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a.parse().unwrap(),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("no listening line: {:?}", log.lock().unwrap());
            }
        };
        let s = Serve { child, addr, log };
        let t = Instant::now();
        while get_health(s.addr) != Some(200) {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "not ready within 60 s: {:?}",
                s.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    /// SIGKILL, and waits for the process to end.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// The log line that contains `needle`, if any.
    fn logged(&self, needle: &str) -> Option<String> {
        let log = self.log.lock().unwrap();
        log.iter().find(|l| l.contains(needle)).cloned()
    }
}

/// Sends `req` and reads the answer to its end.
fn exchange(addr: SocketAddr, req: &[u8]) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    s.write_all(req)?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn get_health(addr: SocketAddr) -> Option<u16> {
    let a = exchange(
        addr,
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )
    .ok()?;
    a.split(' ').nth(1)?.parse().ok()
}

/// A greedy completion of `prompt`: its status and JSON body, or the I/O
/// error of a server that went away.
fn complete(addr: SocketAddr, prompt: &str, max_tokens: usize) -> std::io::Result<(u16, Value)> {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let a = exchange(addr, req.as_bytes())?;
    let bad = || std::io::Error::other(format!("not an HTTP answer: {a:?}"));
    let status = a
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(bad)?;
    let b = a.split("\r\n\r\n").nth(1).ok_or_else(bad)?;
    let v = serde_json::from_str(b.trim()).map_err(|_| bad())?;
    Ok((status, v))
}

/// Distinct code prompts of about 150 tokens: each saves a state every
/// block of its tokens.
fn prompts() -> Vec<String> {
    (0..8)
        .map(|i| {
            let mut p = format!("# module {i}\nimport math\n\n");
            for j in 0..6 {
                p.push_str(&format!(
                    "def f{i}_{j}(x, y):\n    \"\"\"Combine x and y ({j}).\"\"\"\n    return math.sqrt(x * {i} + y * {j})\n\n"
                ));
            }
            p
        })
        .collect()
}

/// The names in `dir` that start with `prefix`.
fn named(dir: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// Bytes of saved states in `dir`.
fn saved_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "fps"))
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum()
}

/// A small generator for the kill moments (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

/// Each prompt's greedy 8-token text, and the prompt tokens it reused.
fn replies(addr: SocketAddr, prompts: &[String]) -> Vec<(String, u64)> {
    prompts
        .iter()
        .map(|p| {
            let (st, v) = complete(addr, p, 8).unwrap();
            assert_eq!(st, 200, "{v}");
            let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                cached,
            )
        })
        .collect()
}

#[test]
fn a_server_killed_while_saving_states_restarts_clean_and_answers_the_same() {
    let Some(model) = code_small() else {
        eprintln!("skipped: shared/models/k3-code-small is not beside the repository");
        return;
    };
    // On the target directory's disk, where writes and syncs take real time.
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fathom-serve-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (dir, fresh_dir) = (root.join("states"), root.join("fresh"));
    let prompts = prompts();
    // The reference: a server that never saw `dir`.
    let fresh = Serve::start(&model, &fresh_dir, 1 << 30);
    let want = replies(fresh.addr, &prompts);
    fresh.kill();
    let one_request = saved_bytes(&fresh_dir) / prompts.len() as u64;
    assert!(one_request > 0, "the fresh server saved no states");
    // Room for the states of about three requests: the rest is evicted.
    let cap = one_request * 3;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("kill moments from seed {seed}");
    let mut rng = Rng(seed);
    let mut cut_short = 0;
    for round in 0..5 {
        let s = Serve::start(&model, &dir, cap);
        if round > 0 {
            assert!(
                named(&dir, ".tmp-").is_empty(),
                "temp files left at start: {:?}",
                named(&dir, ".tmp-")
            );
        }
        let addr = s.addr;
        let clients: Vec<_> = (0..3)
            .map(|c| {
                let ps = prompts.clone();
                std::thread::spawn(move || {
                    for k in 0..ps.len() {
                        if complete(addr, &ps[(k + 2 * c + round) % ps.len()], 1).is_err() {
                            return;
                        }
                    }
                })
            })
            .collect();
        // A random moment, then the next save in progress (or, if none
        // comes within 3 s, the moment itself).
        std::thread::sleep(Duration::from_millis(rng.below(600)));
        let t = Instant::now();
        while named(&dir, ".tmp-").is_empty() && t.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_micros(200));
        }
        s.kill();
        for c in clients {
            c.join().unwrap();
        }
        cut_short += usize::from(!named(&dir, ".tmp-").is_empty());
    }
    let left = named(&dir, ".tmp-").len();
    eprintln!("{cut_short} of 5 kills cut a save short; {left} temp files left");
    // The kills land while a save is under way: its temp file is left.
    assert!(cut_short > 0, "no kill landed during a save");
    let s = Serve::start(&model, &dir, cap);
    assert!(
        named(&dir, ".tmp-").is_empty(),
        "temp files left at start: {:?}",
        named(&dir, ".tmp-")
    );
    if left > 0 {
        let line = s
            .logged("removed temp files of an interrupted save")
            .expect("the removal is logged");
        assert!(line.contains(&format!("files={left}")), "{line}");
    }
    let on_disk = saved_bytes(&dir);
    assert!(on_disk > 0, "every state was lost");
    assert!(
        on_disk <= cap,
        "{on_disk} bytes of states over the cap {cap}"
    );
    let line = s
        .logged("prefix states on disk")
        .expect("the open is logged");
    assert!(
        line.contains(&format!("bytes={on_disk} ")) && line.contains(&format!("max={cap}")),
        "{line}"
    );
    let got = replies(s.addr, &prompts);
    s.kill();
    for (i, ((text, _), (want, _))) in got.iter().zip(&want).enumerate() {
        assert_eq!(text, want, "prompt {i}");
    }
    assert!(
        got.iter().any(|g| g.1 > 0),
        "no reply started from a saved state: {got:?}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
