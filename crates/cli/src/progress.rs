//! Byte progress: a bar on a terminal; elsewhere (logs, CI, pipes) plain
//! lines — one when work starts, one every few seconds, one at the end —
//! with no carriage returns or terminal escapes.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fathom_weights::units::format_bytes;
use indicatif::ProgressBar;

/// Seconds between plain lines.
const EVERY: Duration = Duration::from_secs(5);

/// Progress over `total` bytes of `what` (e.g. "writing").
pub struct ByteProgress {
    bar: Option<ProgressBar>,
    what: String,
    total: u64,
    done: AtomicU64,
    start: Instant,
    last: Mutex<Instant>,
}

impl ByteProgress {
    pub fn new(total: u64, what: &str) -> Self {
        let tty = std::io::stderr().is_terminal();
        let bar = tty.then(|| fathom_runtime::byte_bar(total, what));
        if !tty {
            eprintln!("{what}: 0 B of {}", format_bytes(total));
        }
        let now = Instant::now();
        ByteProgress {
            bar,
            what: what.to_string(),
            total,
            done: AtomicU64::new(0),
            start: now,
            last: Mutex::new(now),
        }
    }

    /// `n` more bytes done.
    pub fn inc(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        if let Some(b) = &self.bar {
            b.inc(n);
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() >= EVERY {
            *last = Instant::now();
            self.line(done, "");
        }
    }

    fn line(&self, done: u64, tail: &str) {
        let secs = self.start.elapsed().as_secs_f64();
        eprintln!(
            "{}: {} of {} ({:.0} s, {}/s){tail}",
            self.what,
            format_bytes(done),
            format_bytes(self.total),
            secs,
            format_bytes((done as f64 / secs.max(1e-9)) as u64)
        );
    }

    /// Clears the bar, or says the work is done in a plain line.
    pub fn finish_and_clear(&self) {
        match &self.bar {
            Some(b) => b.finish_and_clear(),
            None => self.line(self.done.load(Ordering::Relaxed), ", done"),
        }
    }
}
