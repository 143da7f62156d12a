//! Bad input and hostile environments end in one clear error or correct
//! output: damaged and special shard files, out-of-range flags, closed
//! pipes, files that are not checkpoints, impossible demos, memory cgroups.

mod common;

use common::*;

#[test]
fn a_fifo_shard_and_out_of_range_flags_end_in_clear_errors() {
    let dir = tiny_copy("fifo");
    let shard = dir.join("model-00002-of-000002.safetensors");
    std::fs::remove_file(&shard).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&shard).status();
    if made.is_ok_and(|s| s.success()) {
        // Would hang forever on a read; refused before opening instead.
        fails_with(
            &["run", "--model", dir.to_str().unwrap(), "--prompt-ids", "1"],
            "not a regular file",
        );
    } else {
        eprintln!("skipped the FIFO case: mkfifo is not available");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    let ck = tiny().join("checkpoint");
    let ck = ck.to_str().unwrap();
    fails_with(
        &[
            "run",
            "--model",
            ck,
            "--prompt-ids",
            "1",
            "--threads",
            "100000",
        ],
        "--threads 100000: give 1 to",
    );
    fails_with(
        &[
            "run",
            "--model",
            ck,
            "--prompt-ids",
            "1",
            "--io-threads",
            "100000",
        ],
        "100000 is not in 1..=256",
    );
    fails_with(
        &[
            "run",
            "--model",
            ck,
            "--prompt-ids",
            "1",
            "--ram-budget",
            "1000TB",
        ],
        "is more than the",
    );
    fails_with(
        &["inspect", ck, "--context", "18446744073709551615"],
        "--context",
    );
}

#[test]
fn a_closed_stdout_ends_quietly_with_141() {
    use std::io::Read;
    let ck = tiny().join("checkpoint");
    for args in [
        vec![
            "logits",
            "--model",
            ck.to_str().unwrap(),
            "--prompt-ids",
            "1,2",
            "--top",
            "1000",
        ],
        vec![
            "run",
            "--model",
            ck.to_str().unwrap(),
            "--prompt-ids",
            "1",
            "--max-new",
            "900",
            "--ignore-eos",
            "--context",
            "1000",
        ],
    ] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_fathom"))
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = [0u8; 4];
        child.stdout.take().unwrap().read_exact(&mut first).unwrap();
        // The reader is gone now; the program must notice and stop quietly.
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        // 141 (128 + SIGPIPE) when it noticed; 0 if it had already finished.
        assert!(
            matches!(out.status.code(), Some(141 | 0)),
            "{args:?}: {:?} {err}",
            out.status
        );
    }
}

#[test]
fn gguf_files_and_hugging_face_cache_roots_are_named_with_the_fix() {
    let root = std::env::temp_dir().join(format!("fathom-notmodel-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let hf = root.join("models--org--m");
    std::fs::create_dir_all(hf.join("snapshots/rev1")).unwrap();
    std::fs::create_dir_all(hf.join("blobs")).unwrap();
    let gguf = root.join("m.gguf");
    std::fs::write(&gguf, b"GGUF\x03\0\0\0rest").unwrap();
    let (h, g) = (hf.to_str().unwrap(), gguf.to_str().unwrap());
    fails_with(
        &["run", "--model", h, "--prompt-ids", "1"],
        "snapshots/<revision> (found: rev1)",
    );
    fails_with(
        &["tokenize", "--model", h, "x"],
        "Hugging Face cache repository",
    );
    fails_with(
        &["run", "--model", g, "--prompt-ids", "1"],
        "is a GGUF file: fathom reads safetensors",
    );
    fails_with(&["tokenize", "--model", g, "x"], "is a GGUF file");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn demo_refuses_impossible_models_before_writing_anything() {
    let dir = std::env::temp_dir().join(format!("fathom-demo-refuse-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let d = dir.to_str().unwrap();
    // The tiny preset cannot reach 3 GB without a header no reader accepts.
    fails_with(
        &[
            "demo",
            "--dir",
            d,
            "--preset",
            "tiny",
            "--ram-budget",
            "3GB",
        ],
        "over the 100 MB readers accept",
    );
    fails_with(
        &["demo", "--dir", d, "--ram-budget", "1000TB"],
        "is more than the",
    );
    let written = std::fs::read_dir(&dir).map(|r| r.count()).unwrap_or(0);
    assert_eq!(written, 0, "nothing may be written before refusing");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn runs_with_default_flags_stay_inside_a_memory_cgroup() {
    let Some(m) = code_small() else {
        eprintln!("skipped: shared/models/k3-code-small is not beside the repository");
        return;
    };
    let own = match fathom_bench::cgroup::own() {
        Ok(p) => p,
        Err(e) => return eprintln!("skipped: no memory cgroup to nest in: {e}"),
    };
    // 200 MB: below what the defaults would take without the cgroup (a 4096-token
    // ledger, 16 I/O threads), so the budget must come from the cgroup limit.
    let cap = 200_000_000u64;
    let child = match fathom_bench::cgroup::Child::create(&own, cap) {
        Ok(c) => c,
        Err(e) => return eprintln!("skipped: cannot create a child memory cgroup: {e}"),
    };
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_fathom"));
    cmd.args([
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "def add(a, b):",
        "--max-new",
        "16",
    ]);
    child.attach_on_exec(&mut cmd);
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let usage = child.usage();
    assert!(out.status.success(), "{err} {usage:?}");
    assert!(
        err.contains("memory-cgroup limit"),
        "the budget must come from the cgroup: {err}"
    );
    assert_eq!(usage.oom_kills.unwrap_or(0), 0, "{usage:?}");
    if let Some(peak) = usage.peak_bytes {
        assert!(peak <= cap, "peak {peak} over the {cap}-byte cap");
    }
    let _ = child.remove();
}

#[test]
fn serve_reserves_state_for_every_admitted_sequence() {
    let Some(m) = code_small() else {
        eprintln!("skipped: shared/models/k3-code-small is not beside the repository");
        return;
    };
    let m = m.to_str().unwrap();
    fails_with(
        &[
            "serve",
            "--model",
            m,
            "--port",
            "0",
            "--max-seqs",
            "256",
            "--ram-budget",
            "300MB",
        ],
        "state for 256 sequences of 4096 tokens",
    );
}

#[test]
fn corrupt_checkpoint_is_reported_with_the_file() {
    let dir = tiny_copy("corrupt");
    // Truncate the second shard.
    let shard = dir.join("model-00002-of-000002.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 1000)
        .unwrap();
    fails_with(
        &["run", "--model", dir.to_str().unwrap(), "--prompt-ids", "1"],
        "model-00002-of-000002.safetensors",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn typo_tips_name_only_close_spellings() {
    let out = fails_quietly(&["run", "--temprature", "0.5"], "--temprature");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--temperature"),
        "a close name is suggested: {err}"
    );
    let out = fails_quietly(&["inspect", "x", "--temperature", "0.5"], "--temperature");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("similar") && !err.contains("--experts"),
        "no far-fetched tip: {err}"
    );
}
