//! `pull` against a fake Hub on 127.0.0.1 serving a synthetic checkpoint:
//! byte-identical snapshots in the shared cache layout, resume, and every
//! fault (5xx, 429, timeouts, truncated bodies, wrong Content-Range, a
//! changed file, corrupt bytes) ending in verified files or a clear error
//! with nothing corrupt kept.

mod common;

use std::path::Path;

use common::*;
use fathom_hub::fake::Fault;
use fathom_hub::{
    FileState, HubConfig, HubError, Include, Progress, PullOptions, Pulled, RepoRef, git_blob_id,
    plan, pull, resolve_model_in, sha256_hex,
};

fn opts(include: Include) -> PullOptions {
    PullOptions {
        repo: RepoRef::parse(REPO).unwrap(),
        include,
        dir: None,
        jobs: 4,
    }
}

fn go(cfg: &HubConfig, o: &PullOptions) -> Result<Pulled, HubError> {
    pull(cfg, o, &Progress::default(), &|_| {})
}

/// Requests for data of `file` (resolve or CDN), with their Range.
fn data_requests(hub: &fathom_hub::fake::FakeHub, file: &str) -> Vec<Option<String>> {
    hub.log()
        .into_iter()
        .filter(|l| !l.path.starts_with("/api/") && l.path.ends_with(&format!("/{file}")))
        .filter(|l| l.path.starts_with("/cdn/") || !file.ends_with(".safetensors"))
        .map(|l| l.range)
        .collect()
}

fn repo_dir(cache: &Path) -> std::path::PathBuf {
    cache.join("models--test-org--tiny")
}

fn partials(cache: &Path) -> Vec<String> {
    std::fs::read_dir(repo_dir(cache).join("blobs"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".incomplete"))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn pull_gives_byte_identical_snapshot_in_the_shared_layout() {
    let (hub, commit) = hub();
    let cache = scratch("identical");
    let cfg = config(&hub, &cache);
    let got = go(&cfg, &opts(Include::All)).unwrap();
    let snap = repo_dir(&cache).join("snapshots").join(&commit);
    assert_eq!(got.snapshot, snap);
    assert_eq!(got.commit, commit);
    assert_same_files(synth(), &snap);
    // Relative links into blobs/ named by the Hub's ETags.
    for (p, bytes) in synth_files() {
        let link = std::fs::read_link(snap.join(&p)).unwrap();
        let name = if p.ends_with(".safetensors") || bytes.len() >= fathom_hub::fake::LFS_FROM {
            sha256_hex(&bytes)
        } else {
            git_blob_id(&bytes)
        };
        assert_eq!(link, Path::new("../../blobs").join(&name), "{p}");
    }
    let main = std::fs::read_to_string(repo_dir(&cache).join("refs/main")).unwrap();
    assert_eq!(main, commit);
    assert_eq!(resolve_model_in(REPO, &cache).unwrap(), snap);
    assert_eq!(
        resolve_model_in(&format!("{REPO}@{commit}"), &cache).unwrap(),
        snap
    );
    assert!(partials(&cache).is_empty());

    // A second pull finds everything and fetches nothing.
    hub.clear_log();
    let p = plan(&cfg, &opts(Include::All)).unwrap();
    assert!(p.files.iter().all(|f| f.state == FileState::Have));
    assert_eq!(p.bytes_to_fetch(), 0);
    go(&cfg, &opts(Include::All)).unwrap();
    assert!(
        hub.log().iter().all(|l| l.path.starts_with("/api/")),
        "{:?}",
        hub.log()
    );
}

#[test]
fn transient_faults_are_retried_and_resumed() {
    let (hub, commit) = hub();
    let shard = &shards()[0];
    for f in [
        Fault::Status(503),
        Fault::Status(500),
        Fault::TooMany(1),
        Fault::Truncate(100_000),
        Fault::Stall(150_000),
        Fault::Truncate(0),
    ] {
        hub.push_fault(shard, f);
    }
    hub.push_fault("config.json", Fault::Truncate(10));
    let cache = scratch("transient");
    go(&config(&hub, &cache), &opts(Include::All)).unwrap();
    assert_same_files(synth(), &repo_dir(&cache).join("snapshots").join(&commit));
    let ranges = data_requests(&hub, shard);
    let size = synth_files()
        .iter()
        .find(|(p, _)| p == shard)
        .unwrap()
        .1
        .len();
    let from = |a: usize| (a > 0).then(|| format!("bytes={a}-{}", size - 1));
    // 503, 500, 429 from zero; a body cut after 100,000 bytes (what
    // arrived is kept: t of them); 150,000 more, then a stall (the idle
    // timeout); a body cut at once; then the rest.
    assert_eq!(ranges.len(), 7, "{ranges:?}");
    assert_eq!(ranges[..4], [None, None, None, None]);
    let t = ranges[4].as_deref().map_or(0, |r| {
        r["bytes=".len()..r.find('-').unwrap()].parse().unwrap()
    });
    assert!(t <= 100_000, "{ranges:?}");
    assert_eq!(ranges[5..], [from(t + 150_000), from(t + 150_000)]);
    let cfg_len = synth_files()
        .iter()
        .find(|(p, _)| p == "config.json")
        .unwrap()
        .1
        .len();
    let cfg_ranges = data_requests(&hub, "config.json");
    assert_eq!(cfg_ranges.len(), 2, "{cfg_ranges:?}");
    assert!(
        cfg_ranges[1].is_none() || cfg_ranges[1] == Some(format!("bytes=10-{}", cfg_len - 1)),
        "{cfg_ranges:?}"
    );
}

#[test]
fn retries_are_bounded() {
    let (hub, _) = hub();
    let shard = &shards()[1];
    for _ in 0..3 {
        hub.push_fault(shard, Fault::Status(503));
    }
    let cache = scratch("bounded");
    let mut cfg = config(&hub, &cache);
    cfg.tries = 3;
    let e = go(&cfg, &opts(Include::All)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("{shard}: gave up after 3 tries: {shard}: HTTP 503")
    );
    assert!(!repo_dir(&cache).join("snapshots").exists());
    assert!(!repo_dir(&cache).join("refs").exists());

    hub.push_fault(shard, Fault::TooMany(3600));
    let e = go(&cfg, &opts(Include::All)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{shard}: the server asks to wait 3600 s (more than the 5 s fathom waits): try again later"
        )
    );
}

#[test]
fn wrong_content_range_is_refused_and_the_partial_kept_for_resume() {
    let (hub, commit) = hub();
    let shard = &shards()[0];
    let size = synth_files()
        .iter()
        .find(|(p, _)| p == shard)
        .unwrap()
        .1
        .len();
    hub.push_fault(shard, Fault::Stall(5000));
    hub.push_fault(shard, Fault::WrongContentRange);
    let cache = scratch("content-range");
    let cfg = config(&hub, &cache);
    let e = go(&cfg, &opts(Include::All)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{shard}: asked for bytes 5000-{} and the server answered 206 bytes 5001-{}/{size}: refused (nothing written)",
            size - 1,
            size - 1
        )
    );
    let sha = sha256_hex(&synth_files().iter().find(|(p, _)| p == shard).unwrap().1);
    let part = repo_dir(&cache)
        .join("blobs")
        .join(format!("{sha}.incomplete"));
    assert_eq!(std::fs::metadata(&part).unwrap().len(), 5000);
    let p = plan(&cfg, &opts(Include::All)).unwrap();
    let pf = p.files.iter().find(|f| &f.file.path == shard).unwrap();
    assert_eq!(pf.state, FileState::Partial(5000));

    hub.clear_log();
    go(&cfg, &opts(Include::All)).unwrap();
    assert_eq!(
        data_requests(&hub, shard),
        [Some(format!("bytes=5000-{}", size - 1))]
    );
    assert_same_files(synth(), &repo_dir(&cache).join("snapshots").join(&commit));
}

#[test]
fn a_server_ignoring_range_restarts_the_file() {
    let (hub, commit) = hub();
    let shard = &shards()[1];
    hub.push_fault(shard, Fault::Truncate(7000));
    hub.push_fault(shard, Fault::IgnoreRange);
    let cache = scratch("ignore-range");
    go(&config(&hub, &cache), &opts(Include::All)).unwrap();
    assert_same_files(synth(), &repo_dir(&cache).join("snapshots").join(&commit));
}

#[test]
fn corrupt_bytes_are_never_kept() {
    let (hub, commit) = hub();
    let shard = &shards()[0];
    let bytes = &synth_files()
        .iter()
        .find(|(p, _)| p == shard)
        .unwrap()
        .1
        .clone();
    hub.push_fault(shard, Fault::Corrupt);
    let cache = scratch("corrupt");
    let cfg = config(&hub, &cache);
    let e = go(&cfg, &opts(Include::All)).unwrap_err();
    let mut bad = bytes.clone();
    bad[0] ^= 0xff;
    assert_eq!(
        e.to_string(),
        format!(
            "{shard}: downloaded bytes have SHA-256 {}, the Hub lists {}: discarded; run the command again",
            sha256_hex(&bad),
            sha256_hex(bytes)
        )
    );
    // No partial of the corrupt file (another file stopped mid-download
    // keeps its partial, to resume).
    let partial = format!("{}.incomplete", sha256_hex(bytes));
    assert!(
        !partials(&cache).contains(&partial),
        "{:?}",
        partials(&cache)
    );
    assert!(
        !repo_dir(&cache)
            .join("blobs")
            .join(sha256_hex(bytes))
            .exists()
    );
    go(&cfg, &opts(Include::All)).unwrap();
    assert_same_files(synth(), &repo_dir(&cache).join("snapshots").join(&commit));
}

#[test]
fn a_partial_from_an_earlier_run_resumes_or_is_redone_when_wrong() {
    let (hub, commit) = hub();
    let shard = shards()[0].clone();
    let bytes = synth_files()
        .into_iter()
        .find(|(p, _)| *p == shard)
        .unwrap()
        .1;
    let n = bytes.len();
    for (name, prefix, want) in [
        (
            "resume-good",
            bytes[..3000].to_vec(),
            vec![Some(format!("bytes=3000-{}", n - 1))],
        ),
        // Bytes that never reached the disk intact: the digest fails, one
        // fresh download follows.
        (
            "resume-bad",
            vec![0u8; 3000],
            vec![Some(format!("bytes=3000-{}", n - 1)), None],
        ),
    ] {
        let cache = scratch(name);
        let blobs = repo_dir(&cache).join("blobs");
        std::fs::create_dir_all(&blobs).unwrap();
        std::fs::write(
            blobs.join(format!("{}.incomplete", sha256_hex(&bytes))),
            prefix,
        )
        .unwrap();
        hub.clear_log();
        go(&config(&hub, &cache), &opts(Include::All)).unwrap();
        assert_eq!(data_requests(&hub, &shard), want, "{name}");
        assert_same_files(synth(), &repo_dir(&cache).join("snapshots").join(&commit));
    }
}

#[test]
fn a_file_changed_under_the_same_name_restarts_from_a_fresh_listing() {
    let (hub, first) = hub();
    let shard = shards()[1].clone();
    let mut changed = synth_files()
        .into_iter()
        .find(|(p, _)| *p == shard)
        .unwrap()
        .1;
    changed[100] ^= 1;
    hub.push_fault(&shard, Fault::Truncate(4000));
    hub.push_fault(&shard, Fault::Replace(changed.clone()));
    let cache = scratch("changed");
    let got = go(&config(&hub, &cache), &opts(Include::All)).unwrap();
    assert_ne!(got.commit, first);
    assert_eq!(std::fs::read(got.snapshot.join(&shard)).unwrap(), changed);
    // The old contents' partial went with the restart.
    assert!(partials(&cache).is_empty(), "{:?}", partials(&cache));
}

#[test]
fn token_goes_to_the_endpoint_only() {
    let (hub, commit) = hub();
    hub.require_token(Some("s3cret"));
    hub.cdn_elsewhere(true);
    let cache = scratch("token");
    let mut cfg = config(&hub, &cache);
    let e = go(&cfg, &opts(Include::All)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "listing of {REPO}@main: HTTP 401 (Invalid credentials in Authorization header): the repository is gated or private; accept its terms on the Hub and set HF_TOKEN to a token that may read it"
        )
    );
    cfg.token = Some("s3cret".into());
    hub.clear_log();
    go(&cfg, &opts(Include::All)).unwrap();
    assert_same_files(synth(), &repo_dir(&cache).join("snapshots").join(&commit));
    let log = hub.log();
    assert!(log.iter().any(|l| l.path.starts_with("/cdn/")));
    for l in log {
        let want = (!l.path.starts_with("/cdn/")).then(|| "Bearer s3cret".to_string());
        assert_eq!(l.auth, want, "{}", l.path);
    }
}

#[test]
fn missing_repository_and_unpulled_model_say_what_to_do() {
    let (hub, _) = hub();
    let cache = scratch("missing");
    let cfg = config(&hub, &cache);
    let mut o = opts(Include::All);
    o.repo = RepoRef::parse("test-org/nothing").unwrap();
    let e = go(&cfg, &o).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "listing of test-org/nothing@main: HTTP 404 (Repository not found): no such repository, revision or file at {} (check the name, the @REVISION and HF_ENDPOINT; a private repository needs HF_TOKEN)",
            hub.endpoint()
        )
    );
    let e = resolve_model_in("moonshotai/Kimi-K3", &cache).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "no such directory: moonshotai/Kimi-K3; as a Hub repository, moonshotai/Kimi-K3 is not pulled into {}: run `fathom pull moonshotai/Kimi-K3`",
            cache.display()
        )
    );
    let e = resolve_model_in("./no/such/dir", &cache).unwrap_err();
    assert_eq!(e.to_string(), "no such directory: ./no/such/dir");
    // An existing path is itself.
    assert_eq!(
        resolve_model_in(cache.to_str().unwrap(), &cache).unwrap(),
        cache
    );
}

#[test]
fn spine_leaves_out_shards_of_routed_experts_only() {
    let hub = fathom_hub::fake::FakeHub::start();
    let index = br#"{"metadata":{},"weight_map":{
        "model.embed_tokens.weight":"model-00001-of-000003.safetensors",
        "model.layers.1.mlp.experts.0.up_proj.weight":"model-00002-of-000003.safetensors",
        "model.layers.1.mlp.experts.1.up_proj.weight":"model-00002-of-000003.safetensors",
        "model.layers.1.mlp.experts.2.up_proj.weight":"model-00003-of-000003.safetensors",
        "lm_head.weight":"model-00003-of-000003.safetensors"}}"#;
    let files = vec![
        ("config.json".to_string(), b"{}".to_vec()),
        ("model.safetensors.index.json".to_string(), index.to_vec()),
        (
            "model-00001-of-000003.safetensors".to_string(),
            vec![1u8; 1000],
        ),
        (
            "model-00002-of-000003.safetensors".to_string(),
            vec![2u8; 5000],
        ),
        (
            "model-00003-of-000003.safetensors".to_string(),
            vec![3u8; 3000],
        ),
        ("pytorch_model.bin".to_string(), vec![4u8; 700]),
    ];
    let commit = hub.set_repo(REPO, files);
    let cache = scratch("spine");
    let cfg = config(&hub, &cache);
    let p = plan(&cfg, &opts(Include::Spine)).unwrap();
    let names: Vec<&str> = p.files.iter().map(|f| f.file.path.as_str()).collect();
    assert_eq!(
        names,
        [
            "config.json",
            "model-00001-of-000003.safetensors",
            "model-00003-of-000003.safetensors",
            "model.safetensors.index.json"
        ]
    );
    assert_eq!(p.bytes_to_fetch(), 2 + 1000 + 3000 + index.len() as u64);
    // Planning read the index into memory, wrote nothing.
    assert!(!cache.join("models--test-org--tiny").exists());
    hub.clear_log();
    let got = go(&cfg, &opts(Include::Spine)).unwrap();
    assert_eq!(got.files, 4);
    let snap = repo_dir(&cache).join("snapshots").join(&commit);
    assert!(!snap.join("model-00002-of-000003.safetensors").exists());
    assert_eq!(
        std::fs::read(snap.join("model-00003-of-000003.safetensors")).unwrap(),
        vec![3u8; 3000]
    );
    // The index was fetched once, while planning; its bytes were kept.
    let index_gets = hub
        .log()
        .iter()
        .filter(|l| l.path.ends_with("index.json"))
        .count();
    assert_eq!(index_gets, 1);
}

#[test]
fn a_file_locked_by_another_download_is_reported() {
    let (hub, _) = hub();
    let cache = scratch("locked");
    let (p, bytes) = synth_files()
        .into_iter()
        .find(|(p, _)| p.ends_with(".safetensors"))
        .unwrap();
    let locks = cache.join(".locks/models--test-org--tiny");
    std::fs::create_dir_all(&locks).unwrap();
    let lock_path = locks.join(format!("{}.lock", sha256_hex(&bytes)));
    let held = std::fs::File::create(&lock_path).unwrap();
    held.lock().unwrap();
    let e = go(&config(&hub, &cache), &opts(Include::All)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{} is locked by another download (fathom pull or another Hub client): wait for it or stop it",
            lock_path.display()
        ),
        "{p}"
    );
}

#[test]
fn pull_into_a_directory_of_its_own() {
    let (hub, commit) = hub();
    let d = scratch("own-dir");
    let cfg = config(&hub, &scratch("own-dir-cache"));
    let mut o = opts(Include::All);
    o.dir = Some(d.clone());
    let got = go(&cfg, &o).unwrap();
    assert_eq!(got.snapshot, d);
    assert_same_files(synth(), &d);
    let src = fathom_hub::source_of(&d).unwrap();
    assert_eq!(
        (src.repo.as_str(), src.commit.as_str()),
        (REPO, commit.as_str())
    );
    let link = std::fs::read_link(d.join("config.json")).unwrap();
    assert!(link.starts_with(".fathom/blobs"), "{link:?}");
}
