//! Helpers shared by the Hub tests: a synthetic checkpoint served by the
//! fake Hub, and a client configured for it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use fathom_hub::HubConfig;
use fathom_hub::fake::FakeHub;

pub const REPO: &str = "test-org/tiny";

/// A fresh directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("hub-tests")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The synthetic K3 checkpoint (tiny shapes, two shards), written once
/// per test binary.
pub fn synth() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join("hub-tests")
            .join(format!("synth-src-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let plan = fathom_synth::Plan::new(
            &fathom_synth::Dims::tiny(),
            5,
            fathom_synth::DEFAULT_SHARD_SIZE,
        )
        .unwrap();
        fathom_synth::write_model(&plan, &dir, &fathom_synth::WriteOptions::default(), &|_| {})
            .unwrap();
        dir
    })
}

/// The synth checkpoint's files, by path.
pub fn synth_files() -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(synth())
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// Its shards, by path.
pub fn shards() -> Vec<String> {
    synth_files()
        .into_iter()
        .map(|(p, _)| p)
        .filter(|p| p.ends_with(".safetensors"))
        .collect()
}

/// A fake Hub serving the synth checkpoint as [`REPO`].
pub fn hub() -> (FakeHub, String) {
    let hub = FakeHub::start();
    let commit = hub.set_repo(REPO, synth_files());
    (hub, commit)
}

/// A client for `hub` with its cache at `cache`: short timeouts and
/// backoff so fault tests finish quickly.
pub fn config(hub: &FakeHub, cache: &Path) -> HubConfig {
    HubConfig {
        endpoint: hub.endpoint(),
        token: None,
        cache: cache.to_path_buf(),
        idle_timeout: Duration::from_millis(700),
        tries: 6,
        backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(80),
        max_retry_after: Duration::from_secs(5),
    }
}

/// Every file of `src` is in `dir`, byte for byte, and nothing else is
/// (besides names starting with '.').
pub fn assert_same_files(src: &Path, dir: &Path) {
    let names = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.'))
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(src), names(dir));
    for n in names(src) {
        assert!(
            std::fs::read(src.join(&n)).unwrap() == std::fs::read(dir.join(&n)).unwrap(),
            "{n} differs"
        );
    }
}
