//! Running one measured process: fresh each time (so no arm inherits another's
//! warm allocator, threads or cache), optionally inside its own memory
//! cgroup, with a wall-clock limit, its output captured whole.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::cgroup;

/// What to start.
pub struct Launch<'a> {
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
    /// Parent cgroup and limit in bytes, for `--memory-cap`.
    pub cap: Option<(&'a cgroup::Place, u64)>,
    pub timeout: Duration,
}

/// How it ended.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Exit code, or `None` when killed by a signal.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub wall_s: f64,
    pub timed_out: bool,
    pub cgroup: Option<cgroup::Usage>,
}

impl Finished {
    pub fn success(&self) -> bool {
        self.code == Some(0) && !self.timed_out
    }

    /// One line saying why the process did not succeed, with its last words.
    pub fn failure(&self) -> String {
        let tail: Vec<&str> = self.stderr.lines().rev().take(3).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        let why = if self.timed_out {
            format!("killed after the {:.0} s time limit", self.wall_s)
        } else {
            match self.code {
                Some(c) => format!("exited with status {c}"),
                None => "killed by a signal".to_string(),
            }
        };
        let oom = match self.cgroup.and_then(|c| c.oom_kills) {
            Some(n) if n > 0 => format!(" ({n} OOM kill(s) in its memory cgroup)"),
            _ => String::new(),
        };
        format!("{why}{oom}: {}", tail.join(" | "))
    }
}

/// Starts the process, waits for it (killing it at the time limit), reads its
/// cgroup's peak usage and removes the cgroup.
pub fn launch(l: &Launch) -> Result<Finished> {
    let group = match l.cap {
        Some((parent, limit)) => Some(cgroup::Child::create(parent, limit)?),
        None => None,
    };
    let mut cmd = Command::new(&l.program);
    // Same process group as fathom, so Ctrl-C stops the measured process too.
    cmd.args(&l.args)
        .envs(l.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(g) = &group {
        g.attach_on_exec(&mut cmd);
    }
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", l.program.display()))?;
    // Drain both pipes on their own threads so a chatty child never blocks.
    let out = child.stdout.take().map(drain);
    let err = child.stderr.take().map(drain);
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if start.elapsed() >= l.timeout {
            timed_out = true;
            let _ = child.kill();
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let wall_s = start.elapsed().as_secs_f64();
    // A grandchild that outlives a killed child may keep a pipe open: its
    // output is not waited for past a grace period.
    let grace = Instant::now() + Duration::from_secs(2);
    let stdout = out.map(|r| join_text(r, grace)).unwrap_or_default();
    let stderr = err.map(|r| join_text(r, grace)).unwrap_or_default();
    let usage = group.as_ref().map(cgroup::Child::usage);
    if let Some(g) = group {
        g.remove()?;
    }
    Ok(Finished {
        code: status.code(),
        stdout,
        stderr,
        wall_s,
        timed_out,
        cgroup: usage,
    })
}

fn drain<R: std::io::Read + Send + 'static>(mut r: R) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        let _ = tx.send(v);
    });
    rx
}

fn join_text(rx: mpsc::Receiver<Vec<u8>>, until: Instant) -> String {
    let wait = until.saturating_duration_since(Instant::now());
    String::from_utf8_lossy(&rx.recv_timeout(wait).unwrap_or_default()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, timeout: f64) -> Finished {
        launch(&Launch {
            program: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![],
            cap: None,
            timeout: Duration::from_secs_f64(timeout),
        })
        .unwrap()
    }

    #[test]
    fn captures_both_streams_and_status() {
        let f = sh("echo out; echo err >&2; exit 3", 10.0);
        assert_eq!(
            (f.stdout.as_str(), f.stderr.as_str(), f.code),
            ("out\n", "err\n", Some(3))
        );
        assert!(!f.success());
        assert!(f.failure().contains("status 3") && f.failure().contains("err"));
    }

    #[test]
    fn kills_at_the_time_limit() {
        let f = sh("sleep 5", 0.2);
        assert!(f.timed_out && f.wall_s < 4.0, "{f:?}");
        assert!(f.failure().contains("time limit"));
    }

    #[test]
    fn missing_program_is_an_error() {
        let r = launch(&Launch {
            program: "/nonexistent/fathom-bench-test".into(),
            args: vec![],
            env: vec![],
            cap: None,
            timeout: Duration::from_secs(1),
        });
        assert!(r.is_err());
    }
}
