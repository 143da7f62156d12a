//! `fathom pull` as a user runs it, against a fake Hub on 127.0.0.1
//! serving a synthetic checkpoint: the snapshot is byte-identical and runs
//! to the same ids as the source; a run killed with SIGKILL mid-download
//! resumes; a full disk (a file-size limit) is reported and resumed.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use fathom_hub::fake::FakeHub;

const REPO: &str = "test-org/tiny";

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("pull-cli")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A synthetic K3 checkpoint (tiny shapes, two shards) in `dir`.
fn synth(dir: &Path) {
    let plan = fathom_synth::Plan::new(
        &fathom_synth::Dims::tiny(),
        9,
        fathom_synth::DEFAULT_SHARD_SIZE,
    )
    .unwrap();
    fathom_synth::write_model(&plan, dir, &fathom_synth::WriteOptions::default(), &|_| {}).unwrap();
}

fn served(name: &str) -> (FakeHub, PathBuf, PathBuf) {
    let base = scratch(name);
    let src = base.join("src");
    synth(&src);
    let hub = FakeHub::start();
    hub.set_repo_dir(REPO, &src);
    (hub, src, base.join("hf"))
}

/// `fathom` with the Hub environment pointing at `hub` and `home`.
fn cmd(hub: &FakeHub, home: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_fathom"));
    c.args(args)
        .env("HF_ENDPOINT", hub.endpoint())
        .env("HF_HOME", home)
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_TOKEN");
    c
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn assert_same_files(src: &Path, dir: &Path) {
    for e in std::fs::read_dir(src).unwrap().flatten() {
        let n = e.file_name();
        assert!(
            std::fs::read(e.path()).unwrap() == std::fs::read(dir.join(&n)).unwrap(),
            "{n:?} differs"
        );
    }
}

fn partials(home: &Path) -> Vec<(PathBuf, u64)> {
    let blobs = home.join("hub/models--test-org--tiny/blobs");
    std::fs::read_dir(blobs)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".incomplete"))
                .map(|e| (e.path(), e.metadata().unwrap().len()))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether some request for a shard asked for a range starting past 0.
fn resumed(hub: &FakeHub) -> bool {
    hub.log().iter().any(|l| {
        l.path.ends_with(".safetensors")
            && l.range
                .as_deref()
                .is_some_and(|r| !r.starts_with("bytes=0-"))
    })
}

#[test]
fn pull_then_run_gives_the_source_ids() {
    let (hub, src, home) = served("run");
    let dry = ok(cmd(&hub, &home, &["pull", REPO, "--dry-run"])
        .output()
        .unwrap());
    let last = dry.lines().last().unwrap();
    assert!(
        last.starts_with("9 files, ") && last.contains("disk needed: "),
        "{dry}"
    );
    assert!(
        dry.lines()
            .filter(|l| l.trim_start().starts_with("get "))
            .count()
            == 9,
        "{dry}"
    );
    assert!(!home.join("hub").exists(), "a dry run writes nothing");

    let out = cmd(&hub, &home, &["pull", REPO]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let snap = PathBuf::from(ok(out).trim());
    assert!(snap.starts_with(home.join("hub/models--test-org--tiny/snapshots")));
    assert_same_files(&src, &snap);
    assert!(
        err.contains("pulled test-org/tiny@main (9 files, commit "),
        "{err}"
    );

    let run = |model: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_fathom"))
            .args([
                "run",
                "--model",
                model,
                "--prompt-ids",
                "5,17,400,23",
                "--max-new",
                "6",
                "--json",
            ])
            .env("HF_HOME", &home)
            .env_remove("HF_HUB_CACHE")
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(ok(out).trim()).unwrap();
        v["output_ids"].clone()
    };
    let want = run(src.to_str().unwrap());
    assert_eq!(want.as_array().unwrap().len(), 6);
    assert_eq!(run(snap.to_str().unwrap()), want);

    // A second pull downloads nothing.
    hub.clear_log();
    ok(cmd(&hub, &home, &["pull", REPO]).output().unwrap());
    assert!(hub.log().iter().all(|l| l.path.starts_with("/api/")));
}

#[test]
fn a_pull_killed_mid_download_resumes() {
    let (hub, src, home) = served("kill");
    hub.throttle(Some((16 << 10, Duration::from_millis(10))));
    let mut child = cmd(&hub, &home, &["pull", REPO])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !partials(&home).iter().any(|(_, n)| *n > 100_000) {
        assert!(Instant::now() < deadline, "no partial grew past 100 kB");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the pull ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(!home.join("hub/models--test-org--tiny/refs/main").exists());

    hub.throttle(None);
    hub.clear_log();
    let snap = PathBuf::from(ok(cmd(&hub, &home, &["pull", REPO]).output().unwrap()).trim());
    assert!(resumed(&hub), "{:?}", hub.log());
    assert_same_files(&src, &snap);
    assert!(partials(&home).is_empty());
}

#[test]
fn a_full_disk_is_reported_and_the_pull_resumes() {
    let (hub, src, home) = served("disk-full");
    // The file-size limit (RLIMIT_FSIZE, 512-byte blocks) makes writes
    // past 1 MiB fail with EFBIG, as a full disk fails with ENOSPC;
    // SIGXFSZ is ignored so the write returns the error.
    let bin = env!("CARGO_BIN_EXE_fathom");
    let out = Command::new("sh")
        .args([
            "-c",
            "trap '' XFSZ; ulimit -f 2048; exec \"$0\" \"$@\"",
            bin,
            "pull",
            REPO,
            "--jobs",
            "1",
        ])
        .env("HF_ENDPOINT", hub.endpoint())
        .env("HF_HOME", &home)
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_TOKEN")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let parts = partials(&home);
    assert_eq!(parts.len(), 1, "{parts:?}");
    let (part, n) = &parts[0];
    assert!(*n > 0 && *n <= 2 << 20, "{n}");
    assert!(
        err.contains(&format!(
            "error: cannot write {}: no space left (disk full or file-size limit): free ",
            part.display()
        )) && err.contains("what was written so far is kept and resumed"),
        "{err}"
    );
    hub.clear_log();
    let snap = PathBuf::from(ok(cmd(&hub, &home, &["pull", REPO]).output().unwrap()).trim());
    assert!(resumed(&hub), "{:?}", hub.log());
    assert_same_files(&src, &snap);
}

#[test]
fn bad_and_unknown_repositories_say_what_to_do() {
    let hub = FakeHub::start();
    let home = scratch("bad-ids");
    let out = cmd(&hub, &home, &["pull", "k3"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "error: \"k3\" is not a Hub repository id: give ORG/NAME or ORG/NAME@REVISION (no '/')\n"
    );
    let out = cmd(&hub, &home, &["pull", "no-org/no-model"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!(
            "error: listing of no-org/no-model@main: HTTP 404 (Repository not found): no such repository, revision or file at {} (check the name, the @REVISION and HF_ENDPOINT; a private repository needs HF_TOKEN)\n",
            hub.endpoint()
        )
    );
}

#[test]
fn token_and_cache_come_from_the_environment() {
    let (hub, src, home) = served("env");
    hub.require_token(Some("tok-123"));
    let cache = home.join("elsewhere");
    let out = cmd(&hub, &home, &["pull", REPO])
        .env("HF_HUB_CACHE", &cache)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("HTTP 401"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cmd(&hub, &home, &["pull", REPO])
        .env("HF_HUB_CACHE", &cache)
        .env("HF_TOKEN", "tok-123")
        .output()
        .unwrap();
    let snap = PathBuf::from(ok(out).trim());
    assert!(
        snap.starts_with(cache.join("models--test-org--tiny/snapshots")),
        "{snap:?}"
    );
    assert_same_files(&src, &snap);
    assert!(!home.join("hub").exists());
    // The token file `huggingface-cli login` writes serves as well.
    std::fs::write(home.join("token"), "tok-123\n").unwrap();
    let out = cmd(&hub, &home, &["pull", REPO, "--dry-run"])
        .output()
        .unwrap();
    assert!(ok(out).lines().last().unwrap().starts_with("9 files, "));
    let auth = hub.log().last().unwrap().auth.clone();
    assert_eq!(auth.as_deref(), Some("Bearer tok-123"));
}

/// A model whose routed experts live in shards of their own, pulled with
/// `--include spine`, runs with its experts fetched on demand: the same
/// ids as the whole model; the plan line says why; a second run asks the
/// network nothing; a disk budget below one expert is refused; a full
/// disk while storing a span fails the run saying so.
#[test]
fn a_spine_pull_runs_with_experts_fetched_on_demand() {
    let base = scratch("remote");
    let whole = base.join("whole");
    synth(&whole);
    let src = base.join("src");
    fathom_hub::fake::split_experts(&whole, &src, 3);
    let hub = FakeHub::start();
    hub.set_repo_dir(REPO, &src);
    let home = base.join("hf");
    let snap = PathBuf::from(
        ok(cmd(&hub, &home, &["pull", REPO, "--include", "spine"])
            .output()
            .unwrap())
        .trim(),
    );
    assert!(!snap.join("model-experts-00001.safetensors").exists());
    let args = |model: &str, extra: &[&str]| -> Vec<String> {
        let mut args = vec![
            "run",
            "--model",
            model,
            "--prompt-ids",
            "5,17,400,23",
            "--max-new",
            "6",
            "--json",
            "--stats",
        ];
        args.extend(extra);
        args.into_iter().map(String::from).collect()
    };
    let run = |model: &str, extra: &[&str]| {
        let a = args(model, extra);
        cmd(
            &hub,
            &home,
            &a.iter().map(String::as_str).collect::<Vec<_>>(),
        )
        .env("XDG_CACHE_HOME", base.join("xdg"))
        .output()
        .unwrap()
    };
    let ids = |out: Output| {
        let v: serde_json::Value = serde_json::from_str(ok(out).trim()).unwrap();
        v["output_ids"].clone()
    };
    let want = ids(run(src.to_str().unwrap(), &[]));
    assert_eq!(want.as_array().unwrap().len(), 6);

    hub.clear_log();
    let out = run(REPO, &[]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        err.contains("; experts remote (expert shards are not on disk)"),
        "{err}"
    );
    assert_eq!(ids(out), want);
    assert!(hub.log().iter().any(|l| l.path.starts_with("/cdn/")));

    hub.clear_log();
    let out = run(REPO, &["--experts", "remote", "--disk-budget", "1GB"]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(err.contains("; experts remote\n"), "{err}");
    assert_eq!(ids(out), want);
    assert!(hub.log().is_empty(), "the second run asked the network");

    // Refused before any span is stored (the headers are, in a new store).
    let full = base.join("xdg-full");
    let a = args(REPO, &["--experts", "remote", "--disk-budget", "999"]);
    let out = cmd(
        &hub,
        &home,
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .env("XDG_CACHE_HOME", &full)
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        err.contains("--disk-budget 999 B cannot hold one routed expert: layer ")
            && err.contains("give at least --disk-budget "),
        "{err}"
    );
    // Files of at most 4 KiB (RLIMIT_FSIZE, SIGXFSZ ignored): an expert
    // span (about 10 kB) cannot be stored, as on a full disk.
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg("trap '' XFSZ; ulimit -f 8; exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_fathom"))
        .args(args(REPO, &["--experts", "remote"]))
        .env("HF_ENDPOINT", hub.endpoint())
        .env("HF_HOME", &home)
        .env("XDG_CACHE_HOME", &full)
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_TOKEN");
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("cannot write {}", full.display()))
            && err.contains(
                "no space left (disk full or file-size limit): lower --disk-budget or free space there"
            ),
        "{err}"
    );
}
