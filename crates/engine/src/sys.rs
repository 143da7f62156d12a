//! Facts about this process and machine, read from /proc.

/// Peak resident set size of this process (VmHWM), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|k| k * 1024)
}

/// Current resident set size (VmRSS), in bytes.
pub fn rss_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|k| k * 1024)
}

fn status_kib(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn rss_is_readable_on_linux() {
        // RSS first: reading /proc can itself raise the peak a little.
        let rss = super::rss_bytes().unwrap();
        let peak = super::peak_rss_bytes().unwrap();
        assert!(peak >= rss && rss > 1 << 20, "rss {rss} peak {peak}");
    }
}
