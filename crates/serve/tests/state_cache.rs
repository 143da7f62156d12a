//! `--state-cache-dir` stays within `--state-cache-max` (least recently
//! used first), drops what an interrupted save left, and reports files
//! that are not its own in one line.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use common::*;
use serde_json::json;

/// Every log line of this test binary.
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let w = buf.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || Sink(w.clone()))
            .init();
        buf
    })
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log_lines(needle: &str) -> Vec<String> {
    let b = logs().lock().unwrap();
    String::from_utf8_lossy(&b)
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

const PROMPTS: [&str; 3] = [
    "def area(width, height):\n    \"\"\"Return the area of a rectangle.\"\"\"\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv[1:]:\n        if os.path.exists(name):\n            print(name, os.path.getsize(name))\n    return 0\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
];

fn states(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "fps"))
        .map(|p| {
            let n = std::fs::metadata(&p).unwrap().len();
            (p, n)
        })
        .collect();
    v.sort();
    v
}

/// The cached prompt tokens of a greedy 2-token completion of prompt `i`.
async fn cached(url: &str, i: usize) -> u64 {
    let (st, v) = post(
        url,
        "/v1/completions",
        json!({"prompt": PROMPTS[i], "max_tokens": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[test]
fn the_state_cache_keeps_within_its_cap_least_recently_used_first() {
    let (lm, _) = need_model!();
    logs();
    for p in PROMPTS {
        let n = completion_ids(p).len();
        assert!(
            (33..=64).contains(&n),
            "{n} tokens: one checkpoint at 32 each"
        );
    }
    let dir = std::env::temp_dir().join(format!("fathom-state-cap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = config();
    cfg.state_cache_dir = Some(dir.clone());
    // How large one saved state is (every one is at position 32).
    let (server, url) = start(cfg.clone(), lm.clone());
    rt().block_on(cached(&url, 0));
    server.stop().unwrap();
    let one = states(&dir);
    assert_eq!(one.len(), 1, "{one:?}");
    let size = one[0].1;
    std::fs::remove_dir_all(&dir).unwrap();
    // Room for two.
    cfg.state_cache_max = Some(size * 5 / 2);
    let (server, url) = start(cfg.clone(), lm.clone());
    rt().block_on(async {
        assert_eq!(cached(&url, 0).await, 0);
        assert_eq!(cached(&url, 1).await, 0);
        // Prompt 0 used again (from RAM): prompt 1's state is now the oldest.
        assert_eq!(cached(&url, 0).await, 32);
        assert_eq!(cached(&url, 2).await, 0);
        let m = client()
            .get(format!("{url}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            m.contains("fathom_state_cache_disk_evicted_total 1\n"),
            "{m}"
        );
        assert!(
            m.contains(&format!("fathom_state_cache_disk_bytes {}\n", 2 * size)),
            "{m}"
        );
    });
    server.stop().unwrap();
    assert_eq!(states(&dir).len(), 2);
    assert!(states(&dir).iter().map(|s| s.1).sum::<u64>() <= size * 5 / 2);
    // After a restart (RAM empty): 0 and 2 come from disk, 1 was removed.
    let (server, url) = start(cfg.clone(), lm.clone());
    rt().block_on(async {
        assert_eq!(cached(&url, 0).await, 32);
        assert_eq!(cached(&url, 2).await, 32);
        assert_eq!(cached(&url, 1).await, 0);
    });
    server.stop().unwrap();
    // A smaller cap at start trims the directory to it.
    cfg.state_cache_max = Some(size * 3 / 2);
    let (server, _) = start(cfg, lm);
    server.stop().unwrap();
    assert_eq!(states(&dir).len(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_interrupted_save_leaves_nothing_behind_and_junk_is_one_line() {
    let (lm, _) = need_model!();
    logs();
    let dir = std::env::temp_dir().join(format!("fathom-state-junk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = config();
    cfg.state_cache_dir = Some(dir.clone());
    let (server, url) = start(cfg.clone(), lm.clone());
    rt().block_on(cached(&url, 1));
    server.stop().unwrap();
    let saved = states(&dir);
    assert_eq!(saved.len(), 1);
    // What a server killed while writing leaves: a temp file cut short
    // (the rename that publishes a state never happened).
    let bytes = std::fs::read(&saved[0].0).unwrap();
    std::fs::write(dir.join(".tmp-4000000-7"), &bytes[..bytes.len() / 3]).unwrap();
    std::fs::write(dir.join(".tmp-4000000-8"), b"").unwrap();
    // And files that are not this model's states.
    for i in 0..3000 {
        std::fs::write(dir.join(format!("junk-{i}.fps")), b"not a state").unwrap();
    }
    for i in 0..2000 {
        std::fs::write(dir.join(format!("notes-{i}.txt")), b"hello").unwrap();
    }
    let mut other = bytes.clone();
    other[20] ^= 1; // inside the model fingerprint
    std::fs::write(dir.join("0000000000000001-40.fps"), &other).unwrap();
    let (server, url) = start(cfg, lm);
    rt().block_on(async { assert_eq!(cached(&url, 1).await, 32) });
    server.stop().unwrap();
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.starts_with(".tmp-")),
        "orphans left"
    );
    assert_eq!(names.len(), 5002, "the others' files are left alone");
    let dir_s = dir.display().to_string();
    let removed: Vec<String> = log_lines("removed temp files of an interrupted save")
        .into_iter()
        .filter(|l| l.contains(&dir_s))
        .collect();
    assert_eq!(removed.len(), 1, "{removed:?}");
    assert!(removed[0].contains("files=2"), "{}", removed[0]);
    let ignored: Vec<String> = log_lines("ignored")
        .into_iter()
        .filter(|l| l.contains(&dir_s))
        .collect();
    assert_eq!(ignored.len(), 1, "{ignored:?}");
    assert!(
        ignored[0].contains("ignored 5001 files that are not this model's saved states (2000 not a .fps file, 3000 not a fathom prefix state, 1 saved for another model)"),
        "{}",
        ignored[0]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
