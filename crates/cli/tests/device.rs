//! `--device`: where CUDA is present, every family's fixture (and
//! k3-code-small when it is beside the repository) gives the same ids and
//! the same log-probabilities, bit for bit, on the GPU as on the CPU,
//! resident and streamed through a small expert cache, and so does the
//! GPU listed twice in `--gpus` (the routed experts split over two
//! caches, each part of a batch on its own). Where it is not,
//! `--device cuda` fails before loading with the missing piece named, and
//! `--device auto` runs on the CPU.

mod common;

use std::path::PathBuf;

use common::{code_small, fails_quietly, fixture, run_json};
use serde_json::Value;

const FIXTURES: [&str; 6] = [
    "k3-tiny/checkpoint",
    "qwen3_moe-tiny",
    "kimi_linear-tiny",
    "deepseek_v3-tiny",
    "kimi_k2-tiny",
    "gpt_oss-tiny",
];

fn cuda() -> Result<(), String> {
    fathom_kernels_cuda::probe(0)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// ids and log-probabilities of a greedy run (the parts that must not move).
fn answer(v: &Value) -> (Value, Value) {
    (v["output_ids"].clone(), v["logprobs"].clone())
}

fn both(dir: &str, extra: &[&str]) -> (Value, Value) {
    both_with(dir, extra, &[])
}

/// [`both`] with `gpu_extra` given to the CUDA run only.
fn both_with(dir: &str, extra: &[&str], gpu_extra: &[&str]) -> (Value, Value) {
    let mut base = vec![
        "run",
        "--model",
        dir,
        "--prompt-ids",
        "1,5,9,2,7,3,8",
        "--max-new",
        "12",
        "--logprobs",
        "4",
        "--json",
    ];
    base.extend_from_slice(extra);
    let cpu = run_json(&[&base[..], &["--device", "cpu"]].concat());
    let gpu = run_json(&[&base[..], &["--device", "cuda"], gpu_extra].concat());
    (cpu, gpu)
}

#[test]
fn cuda_gives_the_cpu_bits_for_every_family() {
    if let Err(why) = cuda() {
        eprintln!("skipped: no CUDA here ({why})");
        return;
    }
    let mut dirs: Vec<PathBuf> = FIXTURES.iter().map(|n| fixture(n)).collect();
    match code_small() {
        Some(p) => dirs.push(p),
        None => eprintln!("k3-code-small is not beside the repository: fixtures only"),
    }
    for dir in &dirs {
        let d = dir.to_str().unwrap();
        for extra in [&[][..], &["--experts", "stream", "--context", "256"][..]] {
            let (cpu, gpu) = both(d, extra);
            assert_eq!(answer(&cpu), answer(&gpu), "{d} {extra:?}");
            let dev = &gpu["stats"]["gpu"];
            assert!(
                dev["device_products"].as_u64().unwrap() > 0,
                "{d}: nothing ran on the device: {dev}"
            );
            assert_eq!(dev["device_errors"].as_u64(), Some(0), "{d}: {dev}");
            assert!(cpu["stats"].get("gpu").is_none());
            assert_eq!(cpu["stats"]["device"], "cpu");
            assert!(
                gpu["stats"]["device"]
                    .as_str()
                    .unwrap()
                    .starts_with("cuda:0")
            );
            eprintln!("{d} {extra:?}: same bits; {dev}");
        }
        // The experts split over two caches on the one GPU.
        let streamed = ["--experts", "stream", "--context", "256"];
        let (cpu, two) = both_with(d, &streamed, &["--gpus", "0,0"]);
        assert_eq!(answer(&cpu), answer(&two), "{d} --gpus 0,0");
        let dev = &two["stats"]["gpu"];
        assert_eq!(dev["device_errors"].as_u64(), Some(0), "{d}: {dev}");
        let name = two["stats"]["device"].as_str().unwrap();
        assert_eq!(name.matches("cuda:0").count(), 2, "{d}: {name}");
    }
}

#[test]
fn without_cuda_the_device_flag_says_what_is_missing() {
    let d = fixture("qwen3_moe-tiny");
    let d = d.to_str().unwrap();
    let base = [
        "run",
        "--model",
        d,
        "--prompt-ids",
        "1,5,9",
        "--max-new",
        "4",
        "--json",
    ];
    if cuda().is_ok() {
        eprintln!("skipped: CUDA is present here (the GPU test covers --device cuda)");
        return;
    }
    let out = fails_quietly(
        &[&base[..], &["--device", "cuda"]].concat(),
        "--device cuda",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("libcuda") || err.contains("NVRTC") || err.contains("no CUDA device"),
        "{err}"
    );
    assert!(
        out.stdout.is_empty(),
        "nothing is loaded or generated: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    let auto = run_json(&[&base[..], &["--device", "auto"]].concat());
    let cpu = run_json(&[&base[..], &["--device", "cpu"]].concat());
    assert_eq!(auto["output_ids"], cpu["output_ids"]);
    assert_eq!(auto["stats"]["gpu"], Value::Null);
    assert_eq!(auto["stats"]["device"], "cpu");
    fails_quietly(
        &[&base[..], &["--vram-budget", "1GB"]].concat(),
        "--vram-budget is for --device cuda|auto",
    );
    let out = fails_quietly(
        &[&base[..], &["--device", "cuda", "--gpus", "0,1"]].concat(),
        "--device cuda",
    );
    assert!(out.stdout.is_empty());
}

/// `--gpus` errors that need no device: with the CPU, and a bad list.
#[test]
fn gpus_flag_errors_name_the_fix() {
    let d = fixture("qwen3_moe-tiny");
    let base = [
        "run",
        "--model",
        d.to_str().unwrap(),
        "--prompt-ids",
        "1,5,9",
    ];
    fails_quietly(
        &[&base[..], &["--gpus", "2"]].concat(),
        "--gpus is for --device cuda|auto",
    );
    for bad in ["0,x", "1,,2", "0"] {
        fails_quietly(
            &[&base[..], &["--device", "cuda", "--gpus", bad]].concat(),
            "a list such as 0,2",
        );
    }
}
