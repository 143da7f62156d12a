//! `RemoteExpertStore` against a fake Hub: spans of a shard that was not
//! pulled are fetched by exact Range requests, kept within the disk
//! budget (least recently used out first), reused after a restart without
//! the network, and hashed when they cover the shard whole (a mismatch
//! evicts them). Anything but a 206 with exactly the asked Content-Range
//! is refused.

mod common;

use std::path::PathBuf;

use common::*;
use fathom_hub::fake::{FakeHub, Fault};
use fathom_hub::{
    Include, Progress, PullOptions, RemoteExpertStore, RemoteOptions, RepoRef, StoreStats, pull,
};

struct Setup {
    hub: FakeHub,
    snapshot: PathBuf,
    store: PathBuf,
    shard: String,
    bytes: Vec<u8>,
}

/// Pulls the synth repo and removes its first shard from the snapshot.
fn setup(name: &str) -> Setup {
    let (hub, _) = hub();
    let base = scratch(name);
    let cfg = config(&hub, &base.join("cache"));
    let o = PullOptions {
        repo: RepoRef::parse(REPO).unwrap(),
        include: Include::All,
        dir: None,
        jobs: 2,
    };
    let got = pull(&cfg, &o, &Progress::default(), &|_| {}).unwrap();
    let shard = shards()[0].clone();
    std::fs::remove_file(got.snapshot.join(&shard)).unwrap();
    let bytes = synth_files()
        .into_iter()
        .find(|(p, _)| *p == shard)
        .unwrap()
        .1;
    hub.clear_log();
    Setup {
        hub,
        snapshot: got.snapshot,
        store: base.join("store"),
        shard,
        bytes,
    }
}

fn open(s: &Setup, budget: u64) -> RemoteExpertStore {
    RemoteExpertStore::open(RemoteOptions {
        config: config(&s.hub, &s.snapshot),
        model_dir: s.snapshot.clone(),
        store_dir: Some(s.store.clone()),
        disk_budget: budget,
    })
    .unwrap()
}

/// Data requests so far (CDN hops), with their Range.
fn ranges(hub: &FakeHub) -> Vec<Option<String>> {
    hub.log()
        .into_iter()
        .filter(|l| l.path.starts_with("/cdn/"))
        .map(|l| l.range)
        .collect()
}

#[test]
fn spans_are_fetched_exactly_and_reused_after_a_restart() {
    let s = setup("remote-reuse");
    {
        let st = open(&s, 1 << 20);
        assert!(!st.is_local(&s.shard));
        assert_eq!(st.file_size(&s.shard), Some(s.bytes.len() as u64));
        assert_eq!(st.local_span(&s.shard, 1000, 500).unwrap(), None);
        assert_eq!(
            st.fetch_span(&s.shard, 1000, 500).unwrap(),
            &s.bytes[1000..1500]
        );
        // Inside a stored span: no request.
        assert_eq!(
            st.fetch_span(&s.shard, 1100, 10).unwrap(),
            &s.bytes[1100..1110]
        );
        let n = u64::from_le_bytes(s.bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(st.fetch_header(&s.shard).unwrap(), &s.bytes[..8 + n]);
        assert_eq!(
            ranges(&s.hub),
            [
                Some("bytes=1000-1499".to_string()),
                Some("bytes=0-7".to_string()),
                Some(format!("bytes=8-{}", 8 + n - 1))
            ]
        );
        assert_eq!(
            st.stats(),
            StoreStats {
                hits: 1,
                fetches: 3,
                fetched_bytes: 500 + 8 + n as u64,
                evicted: 0,
                // Headers are kept apart, outside the budget.
                stored_bytes: 500
            }
        );
        // A file the snapshot has whole is read from it.
        let other = &shards()[1];
        assert!(st.is_local(other));
        let want = synth_files()
            .into_iter()
            .find(|(p, _)| p == other)
            .unwrap()
            .1;
        assert_eq!(st.fetch_span(other, 10, 20).unwrap(), &want[10..30]);
    }
    s.hub.clear_log();
    let st = open(&s, 1 << 20);
    assert_eq!(
        st.local_span(&s.shard, 1000, 500).unwrap().unwrap(),
        &s.bytes[1000..1500]
    );
    assert_eq!(
        st.fetch_span(&s.shard, 1000, 500).unwrap(),
        &s.bytes[1000..1500]
    );
    let n = u64::from_le_bytes(s.bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(st.fetch_header(&s.shard).unwrap(), &s.bytes[..8 + n]);
    assert!(s.hub.log().is_empty(), "{:?}", s.hub.log());
}

#[test]
fn the_store_is_used_and_dropped_inside_an_async_runtime() {
    let s = setup("remote-async");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let got = rt.block_on(async {
        let st = open(&s, 1 << 20);
        let b = st.fetch_span(&s.shard, 64, 100).unwrap();
        drop(st);
        b
    });
    assert_eq!(got, &s.bytes[64..164]);
    assert_eq!(ranges(&s.hub), [Some("bytes=64-163".to_string())]);
}

#[test]
fn the_disk_budget_evicts_least_recently_used_spans() {
    let s = setup("remote-budget");
    let st = open(&s, 3000);
    for i in 0..3u64 {
        st.fetch_span(&s.shard, i * 1000, 1000).unwrap();
    }
    // Use the first again: the second is now the oldest.
    st.local_span(&s.shard, 0, 1000).unwrap().unwrap();
    st.fetch_span(&s.shard, 5000, 1000).unwrap();
    assert_eq!(st.local_span(&s.shard, 1000, 1000).unwrap(), None);
    assert!(st.local_span(&s.shard, 0, 1000).unwrap().is_some());
    assert!(st.local_span(&s.shard, 2000, 1000).unwrap().is_some());
    let stats = st.stats();
    assert_eq!((stats.evicted, stats.stored_bytes), (1, 3000));
    let e = st.fetch_span(&s.shard, 0, 4000).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: a span of 4000 bytes is larger than the disk budget (3000 bytes) or 4294967296: raise --disk-budget",
            s.shard
        )
    );
    drop(st);
    // Reopened with a smaller budget: down to it at once.
    let st = open(&s, 1500);
    assert_eq!(st.stats().stored_bytes, 1000);
}

#[test]
fn a_whole_shard_is_hashed_and_a_mismatch_evicts_it() {
    let s = setup("remote-whole");
    let len = s.bytes.len() as u64;
    let step = 1 << 20;
    let st = open(&s, 64 << 20);
    let mut off = 0;
    while off < len {
        let n = step.min(len - off);
        st.fetch_span(&s.shard, off, n).unwrap();
        off += n;
    }
    assert_eq!(st.verified_files(), [s.shard.clone()]);
    drop(st);
    std::fs::remove_dir_all(&s.store).unwrap();

    // One corrupt span: the last fetch completes the shard, the hash
    // fails, every span of it goes.
    s.hub.push_fault(&s.shard, Fault::Corrupt);
    let st = open(&s, 64 << 20);
    let mut off = 0;
    let mut last = None;
    while off < len {
        let n = step.min(len - off);
        last = Some(st.fetch_span(&s.shard, off, n));
        off += n;
    }
    let e = last.unwrap().unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("{}: downloaded bytes have SHA-256 ", s.shard))
            && e.contains("over its fetched spans (all evicted)"),
        "{e}"
    );
    assert!(st.verified_files().is_empty());
    assert_eq!(st.stats().stored_bytes, 0);
    assert_eq!(st.local_span(&s.shard, 0, 10).unwrap(), None);
}

/// Fetches `[8 + n, len)` of the shard in 64 KiB spans; the last result.
fn fetch_after_header(s: &Setup, st: &RemoteExpertStore, n: u64) -> fathom_hub::Result<Vec<u8>> {
    let len = s.bytes.len() as u64;
    let mut off = 8 + n;
    let mut last = Ok(Vec::new());
    while off < len {
        let k = (64 << 10).min(len - off);
        last = st.fetch_span(&s.shard, off, k);
        off += k;
    }
    last
}

#[test]
fn a_kept_header_and_spans_make_a_whole_shard() {
    let s = setup("remote-header-whole");
    let n = u64::from_le_bytes(s.bytes[..8].try_into().unwrap());
    let st = open(&s, 64 << 20);
    st.fetch_header(&s.shard).unwrap();
    fetch_after_header(&s, &st, n).unwrap();
    assert_eq!(st.verified_files(), [s.shard.clone()]);
    drop(st);
    std::fs::remove_dir_all(&s.store).unwrap();

    // A corrupt span: the shard fails whole, and its header goes too.
    let st = open(&s, 64 << 20);
    st.fetch_header(&s.shard).unwrap();
    s.hub.push_fault(&s.shard, Fault::Corrupt);
    let e = fetch_after_header(&s, &st, n).unwrap_err().to_string();
    assert!(e.contains("over its fetched spans (all evicted)"), "{e}");
    assert_eq!(st.stats().stored_bytes, 0);
    s.hub.clear_log();
    assert_eq!(
        st.fetch_header(&s.shard).unwrap(),
        &s.bytes[..8 + n as usize]
    );
    assert_eq!(ranges(&s.hub).len(), 2, "the header was fetched again");
}

#[test]
fn anything_but_the_exact_range_is_refused() {
    let s = setup("remote-refuse");
    let st = open(&s, 1 << 20);
    s.hub.push_fault(&s.shard, Fault::WrongContentRange);
    let e = st.fetch_span(&s.shard, 100, 50).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: asked for bytes 100-149 and the server answered 206 bytes 101-149/{}: refused (nothing written)",
            s.shard,
            s.bytes.len()
        )
    );
    s.hub.push_fault(&s.shard, Fault::IgnoreRange);
    let e = st.fetch_span(&s.shard, 100, 50).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: asked for bytes 100-149 and the server answered 200 without Content-Range: refused (nothing written)",
            s.shard
        )
    );
    assert_eq!(st.stats().stored_bytes, 0);
    // Transient faults are retried; the span then arrives.
    for f in [
        Fault::Status(502),
        Fault::Truncate(10),
        Fault::Stall(20),
        Fault::TooMany(0),
    ] {
        s.hub.push_fault(&s.shard, f);
    }
    assert_eq!(
        st.fetch_span(&s.shard, 100, 50).unwrap(),
        &s.bytes[100..150]
    );
    let e = st.fetch_span("nope.safetensors", 0, 1).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("nope.safetensors is not a file of test-org/tiny@"),
        "{e}"
    );
    let e = st
        .fetch_span(&s.shard, s.bytes.len() as u64 - 5, 10)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: bytes {}..+10 are not inside its {} bytes",
            s.shard,
            s.bytes.len() - 5,
            s.bytes.len()
        )
    );
}

#[test]
fn a_store_in_use_is_refused() {
    let s = setup("remote-lock");
    let _first = open(&s, 1 << 20);
    let e = RemoteExpertStore::open(RemoteOptions {
        config: config(&s.hub, &s.snapshot),
        model_dir: s.snapshot.clone(),
        store_dir: Some(s.store.clone()),
        disk_budget: 1 << 20,
    })
    .err()
    .unwrap();
    assert_eq!(
        e.to_string(),
        format!(
            "the span store {} is in use by another fathom process: stop it, or give this one another store directory",
            s.store.display()
        )
    );
}

#[test]
fn the_store_is_shared_between_io_threads() {
    fn shared<T: Send + Sync>() {}
    shared::<RemoteExpertStore>();
    let s = setup("remote-threads");
    let st = open(&s, 1 << 20);
    std::thread::scope(|sc| {
        for i in 0..4u64 {
            let (st, s) = (&st, &s);
            sc.spawn(move || {
                let off = 20_000 + i * 3000;
                assert_eq!(
                    st.fetch_span(&s.shard, off, 3000).unwrap(),
                    &s.bytes[off as usize..off as usize + 3000]
                );
            });
        }
    });
    assert_eq!(st.stats().stored_bytes, 12_000);
}
