//! `fathom bench-serve`: load on a `fathom serve` child over loopback — N
//! concurrent streamed clients against the same requests sent one after
//! another, per arm of server flags (resident, streamed, …). Outputs of
//! the concurrent run must equal the sequential ones (greedy), or the arm
//! is rejected.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_serve::load::{LoadResult, run as load};

/// Measure `fathom serve` under N concurrent clients vs the same requests in turn.
#[derive(Args)]
pub struct BenchServeArgs {
    /// Model directory, or ORG/NAME[@REV] pulled by `fathom pull`.
    #[arg(long, value_parser = fathom_hub::resolve_model)]
    model: PathBuf,
    /// Prompts, one per line (text; `#` lines and blank lines skipped); cycled to N requests.
    #[arg(long, value_name = "FILE")]
    prompts: PathBuf,
    /// Client counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    clients: Vec<usize>,
    /// Tokens per request (greedy; EOS may end one earlier).
    #[arg(long, default_value_t = 32)]
    max_new: usize,
    /// An arm: a name and extra `fathom serve` flags, e.g. stream="--experts stream --ram-budget 400MB". Repeatable.
    #[arg(long = "arm", value_name = "NAME=FLAGS")]
    arms: Vec<String>,
    /// Write every figure as JSON here.
    #[arg(long, value_name = "OUT")]
    json: Option<PathBuf>,
}

struct ServerChild {
    child: Child,
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        let _ = fathom_platform::process::terminate(&self.child);
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn spawn(model: &PathBuf, flags: &[String], max_seqs: usize) -> Result<(ServerChild, String)> {
    let port = free_port()?;
    let exe = std::env::current_exe()?;
    let child = Command::new(exe)
        .args(["serve", "--model"])
        .arg(model)
        .args([
            "--port",
            &port.to_string(),
            "--max-seqs",
            &max_seqs.max(1).to_string(),
        ])
        .args(["--max-queue", "1000", "--prefix-cache", "0"])
        .args(flags)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start fathom serve")?;
    let child = ServerChild { child };
    let url = format!("http://127.0.0.1:{port}");
    let t = Instant::now();
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() && health(port) {
            return Ok((child, url));
        }
        if t.elapsed() > Duration::from_secs(600) {
            bail!("fathom serve {flags:?} did not become ready in 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `GET /health` is 200 (a plain HTTP/1.0 request; no client needed).
fn health(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut b = String::new();
    let _ = s.read_to_string(&mut b);
    b.starts_with("HTTP/1.1 200") || b.starts_with("HTTP/1.0 200")
}

fn read_prompts(path: &PathBuf) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --prompts {}", path.display()))?;
    let p: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| l.replace("\\n", "\n"))
        .collect();
    if p.is_empty() {
        bail!("--prompts {} has no prompt", path.display());
    }
    Ok(p)
}

pub fn run(a: BenchServeArgs) -> Result<()> {
    let prompts = read_prompts(&a.prompts)?;
    if a.clients.iter().any(|&n| n == 0 || n > 256) {
        bail!("--clients: each count must be in 1..=256");
    }
    let arms: Vec<(String, Vec<String>)> = if a.arms.is_empty() {
        vec![("default".into(), Vec::new())]
    } else {
        a.arms
            .iter()
            .map(|s| {
                let (n, f) = s
                    .split_once('=')
                    .with_context(|| format!("--arm {s:?}: use NAME=FLAGS"))?;
                Ok((
                    n.to_string(),
                    f.split_whitespace().map(String::from).collect(),
                ))
            })
            .collect::<Result<_>>()?
    };
    let max_clients = a.clients.iter().copied().max().unwrap_or(1);
    let mut all = Vec::new();
    println!(
        "arm        N  concurrent tok/s  sequential tok/s  speedup  TTFT p50/p99 (s)  ITL p50/p99 (ms)"
    );
    for (name, flags) in &arms {
        let (_child, url) = spawn(&a.model, flags, max_clients)?;
        // Warm up (first-touch of weights and caches), not measured.
        load(&url, &prompts[..1], 4, false)?;
        for &n in &a.clients {
            let reqs: Vec<String> = prompts.iter().cycle().take(n).cloned().collect();
            let seq: LoadResult = load(&url, &reqs, a.max_new, false)?;
            let con: LoadResult = load(&url, &reqs, a.max_new, true)?;
            if seq.texts != con.texts {
                bail!(
                    "arm {name}: with {n} concurrent clients the outputs differ from the same requests in turn"
                );
            }
            println!(
                "{name:<9} {n:>3}  {:>16.1}  {:>16.1}  {:>6.2}×  {:>7.3}/{:<7.3}  {:>7.1}/{:<7.1}",
                con.tok_s,
                seq.tok_s,
                con.tok_s / seq.tok_s.max(1e-9),
                con.ttft_p50_s,
                con.ttft_p99_s,
                con.itl_p50_s * 1e3,
                con.itl_p99_s * 1e3
            );
            all.push(
                serde_json::json!({"arm": name, "flags": flags, "clients": n,
                "concurrent": con, "sequential": seq, "speedup": con.tok_s / seq.tok_s.max(1e-9)}),
            );
        }
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&all)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}
