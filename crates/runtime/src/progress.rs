//! Load progress: a bar on a terminal, plain periodic lines otherwise.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

/// Shows load progress until dropped: a bar on a terminal, otherwise a
/// plain line every few seconds (logs and CI see something too).
pub(crate) struct LoadProgress {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LoadProgress {
    pub(crate) fn start(total: u64) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let base = fathom_weights::bytes_read();
        let thread = std::thread::spawn(move || {
            let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
            let bar = if tty {
                byte_bar(total, "loading")
            } else {
                indicatif::ProgressBar::hidden()
            };
            let t0 = Instant::now();
            let mut last_line = Instant::now();
            while !s2.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let done = fathom_weights::bytes_read() - base;
                bar.set_position(done.min(total));
                if !tty && last_line.elapsed().as_secs() >= 5 {
                    last_line = Instant::now();
                    eprintln!(
                        "loading: {} of {} read ({:.0} s)",
                        fathom_weights::units::format_bytes(done),
                        fathom_weights::units::format_bytes(total),
                        t0.elapsed().as_secs_f64()
                    );
                }
            }
            bar.finish_and_clear();
        });
        LoadProgress {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for LoadProgress {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A byte-count bar on a terminal (hidden elsewhere).
pub fn byte_bar(total: u64, what: &str) -> ProgressBar {
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template(
        "{msg} [{bar:32}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} ETA {eta}",
    )
    .expect("the template is valid")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(what.to_string());
    bar
}
