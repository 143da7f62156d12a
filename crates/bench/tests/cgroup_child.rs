//! A child memory cgroup for one process: only that process enters it, the
//! limit is set, the peak is readable and the directory is gone afterwards.
//! Skips (with a message) where this process may not create cgroups.

use std::time::Duration;

use fathom_bench::cgroup::{self, Child, Version};
use fathom_bench::runner::{Launch, launch};

#[test]
fn child_process_runs_in_its_own_capped_cgroup() {
    let parent = match cgroup::own() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("skipped: {e:#}");
            return;
        }
    };
    // Probe writability with a throwaway child.
    match Child::create(&parent, 256 << 20) {
        Ok(c) => c.remove().unwrap(),
        Err(e) => {
            eprintln!("skipped: cgroups are not writable here: {e:#}");
            return;
        }
    }
    let before = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let f = launch(&Launch {
        program: "sh".into(),
        args: vec![
            "-c".into(),
            "cat /proc/self/cgroup; head -c 20000000 /dev/zero | tail -c 1 >/dev/null".into(),
        ],
        env: vec![],
        cap: Some((&parent, 256 << 20)),
        timeout: Duration::from_secs(30),
    })
    .unwrap();
    assert!(f.success(), "{}", f.failure());
    let line = f
        .stdout
        .lines()
        .find(|l| match parent.version {
            Version::V1 => l
                .split(':')
                .nth(1)
                .is_some_and(|c| c.split(',').any(|c| c == "memory")),
            Version::V2 => l.starts_with("0::"),
        })
        .unwrap();
    assert!(
        line.contains("/fathom-bench-"),
        "child not in its cgroup: {line}"
    );
    // fathom itself never moved.
    assert_eq!(
        std::fs::read_to_string("/proc/self/cgroup").unwrap(),
        before
    );
    let usage = f.cgroup.expect("usage read");
    let peak = usage.peak_bytes.expect("peak readable");
    assert!(peak > 0 && peak <= 256 << 20, "peak {peak}");
    // Removed: no fathom-bench-<our pid>-* directory is left.
    let ours = format!("fathom-bench-{}-", std::process::id());
    let left: Vec<_> = std::fs::read_dir(&parent.dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(&ours))
        .collect();
    assert!(left.is_empty(), "cgroups left behind: {left:?}");
}
