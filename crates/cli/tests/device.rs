//! `--device`: every family's fixture (and k3-code-small when it is beside
//! the repository) gives the same ids and the same log-probabilities, bit
//! for bit, on the GPU as on the CPU, resident and streamed through a small
//! expert cache, and so does the GPU listed twice in `--gpus` (the routed
//! experts split over two caches, each part of a batch on its own) and,
//! where there are two, two GPUs. Where the NVIDIA driver is absent the
//! same test runs the whole CUDA backend on the emulated driver
//! (`fathom-cuda-emu`: its `libcuda.so` and `libnvrtc.so` on the child's
//! `LD_LIBRARY_PATH`, two emulated devices), and without it `--device
//! cuda` fails before loading with the missing piece named and `--device
//! auto` runs on the CPU.

mod common;

use std::path::PathBuf;

use common::{code_small, fails_quietly, fathom_env, fixture, run_json, run_json_env};
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

/// How `--device cuda` runs here: the environment a child needs (none
/// for the real driver; the emulated driver's folder on `LD_LIBRARY_PATH`
/// and two emulated devices otherwise), and the devices there are; `Err`
/// says why neither is here.
fn cuda_env() -> Result<(Vec<(String, String)>, usize), String> {
    let real = match fathom_kernels_cuda::probe(0) {
        Ok(info) => return Ok((Vec::new(), info.devices)),
        Err(e) => e,
    };
    if !matches!(real, fathom_kernels_cuda::CudaError::NoDriver) {
        return Err(real.to_string());
    }
    let dir = fathom_cuda_emu::driver_dir()
        .ok_or_else(|| format!("{real}; the emulated driver was not built either"))?;
    let mut path = dir.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    eprintln!("no CUDA driver here: --device cuda runs on the emulated driver ({dir:?})");
    let env = vec![
        (
            "LD_LIBRARY_PATH".into(),
            path.to_string_lossy().into_owned(),
        ),
        ("FATHOM_EMU_GPUS".into(), "2".into()),
    ];
    Ok((env, 2))
}

/// [`cuda_env`], or `None` after saying why the test skips.
fn cuda_or_skip() -> Option<(Vec<(String, String)>, usize)> {
    cuda_env()
        .map_err(|why| eprintln!("skipped: no CUDA here ({why})"))
        .ok()
}

/// ids and log-probabilities of a greedy run (the parts that must not move).
fn answer(v: &Value) -> (Value, Value) {
    (v["output_ids"].clone(), v["logprobs"].clone())
}

/// ids and log-probabilities of `dir` on the CPU and with `--device
/// cuda` (with `gpu_extra` and the environment `env`).
fn both(dir: &str, extra: &[&str], gpu_extra: &[&str], env: &[(String, String)]) -> (Value, Value) {
    let cpu = run_json(&[&run_args(dir, extra)[..], &["--device", "cpu"]].concat());
    (cpu, gpu_run(dir, extra, gpu_extra, env))
}

/// The `--device cuda` half of [`both`].
fn gpu_run(dir: &str, extra: &[&str], gpu_extra: &[&str], env: &[(String, String)]) -> Value {
    let base = run_args(dir, extra);
    run_json_env(&[&base[..], &["--device", "cuda"], gpu_extra].concat(), env)
}

/// A greedy run of `dir` with `extra` flags, as JSON with log-probabilities.
fn run_args<'a>(dir: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
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
    base
}

#[test]
fn cuda_gives_the_cpu_bits_for_every_family() {
    let Some((env, gpus)) = cuda_or_skip() else {
        return;
    };
    // Every fixture resident, streamed and split over caches; the trained
    // k3-code-small (a 35 s run on the emulated driver) resident only.
    let mut dirs: Vec<(PathBuf, bool)> = FIXTURES.iter().map(|n| (fixture(n), true)).collect();
    match code_small() {
        Some(p) => dirs.push((p, false)),
        None => eprintln!("k3-code-small is not beside the repository: fixtures only"),
    }
    let streamed = ["--experts", "stream", "--context", "256"];
    for (dir, every_placement) in &dirs {
        let d = dir.to_str().unwrap();
        let placements: &[&[&str]] = if *every_placement {
            &[&[], &streamed]
        } else {
            &[&[]]
        };
        let mut streamed_cpu = None;
        for &extra in placements {
            let (cpu, gpu) = both(d, extra, &[], &env);
            assert_eq!(answer(&cpu), answer(&gpu), "{d} {extra:?}");
            let dev = &gpu["stats"]["gpu"];
            assert!(
                dev["device_products"].as_u64().unwrap() > 0,
                "{d}: nothing ran on the device: {dev}"
            );
            assert_eq!(dev["device_errors"].as_u64(), Some(0), "{d}: {dev}");
            if !d.contains("qwen3") && !d.contains("gpt_oss") {
                let calls = dev["device_attention"].as_u64().unwrap();
                assert!(calls > 0, "{d}: no MLA attention on the device: {dev}");
            }
            // Resident gated experts: some layers' experts and their sums
            // in one call.
            if !d.contains("gpt_oss") && extra.is_empty() {
                let tails = dev["device_moe_tails"].as_u64().unwrap();
                assert!(tails > 0, "{d}: no MoE tail on the device: {dev}");
            }
            // Resident, a decode step's calls repeat: replayed as graphs;
            // every expert was copied up at load, so none was missing.
            if extra.is_empty() {
                let graphs = dev["graph_launches"].as_u64().unwrap();
                assert!(graphs > 0, "{d}: no call replayed as a graph: {dev}");
                assert_eq!(dev["vram_expert_misses"].as_u64(), Some(0), "{d}: {dev}");
                assert_eq!(dev["cpu_expert_products"].as_u64(), Some(0), "{d}: {dev}");
            }
            assert_eq!(dev["graph_failures"].as_u64(), Some(0), "{d}: {dev}");
            assert!(cpu["stats"].get("gpu").is_none());
            assert_eq!(cpu["stats"]["device"], "cpu");
            assert!(
                gpu["stats"]["device"]
                    .as_str()
                    .unwrap()
                    .starts_with("cuda:0")
            );
            eprintln!("{d} {extra:?}: same bits; {dev}");
            if !extra.is_empty() {
                streamed_cpu = Some(cpu);
            }
        }
        let Some(cpu) = streamed_cpu else {
            continue;
        };
        // The experts split over two caches on the one GPU.
        let two = gpu_run(d, &streamed, &["--gpus", "0,0"], &env);
        assert_eq!(answer(&cpu), answer(&two), "{d} --gpus 0,0");
        let dev = &two["stats"]["gpu"];
        assert_eq!(dev["device_errors"].as_u64(), Some(0), "{d}: {dev}");
        let name = two["stats"]["device"].as_str().unwrap();
        assert_eq!(name.matches("cuda:0").count(), 2, "{d}: {name}");
        if gpus < 2 {
            eprintln!("{d}: one device here: --gpus 0,1 not run");
            continue;
        }
        // Two devices: each computes with its own copies only.
        let two = gpu_run(d, &streamed, &["--gpus", "0,1"], &env);
        assert_eq!(answer(&cpu), answer(&two), "{d} --gpus 0,1");
        let dev = &two["stats"]["gpu"];
        assert_eq!(dev["device_errors"].as_u64(), Some(0), "{d}: {dev}");
        let name = two["stats"]["device"].as_str().unwrap();
        assert!(
            name.contains("cuda:0") && name.contains("cuda:1"),
            "{d}: {name}"
        );
    }
}

/// `--no-cuda-graphs`: every call's operations issued one by one give the
/// bits of the calls replayed as graphs (and of the CPU), every kind of
/// call included (products, gated MLPs, MoE tails, KDA, MLA).
#[test]
fn calls_replayed_as_graphs_give_the_bits_of_calls_issued_one_by_one() {
    let Some((env, _)) = cuda_or_skip() else {
        return;
    };
    for name in ["k3-tiny/checkpoint", "deepseek_v3-tiny"] {
        let d = fixture(name);
        let d = d.to_str().unwrap();
        let (cpu, graphs) = both(d, &[], &[], &env);
        let plain = gpu_run(d, &[], &["--no-cuda-graphs"], &env);
        assert_eq!(answer(&cpu), answer(&graphs), "{name}");
        assert_eq!(answer(&graphs), answer(&plain), "{name}");
        let (g, p) = (&graphs["stats"]["gpu"], &plain["stats"]["gpu"]);
        assert!(g["graph_launches"].as_u64().unwrap() > 0, "{name}: {g}");
        assert_eq!(p["graph_launches"].as_u64(), Some(0), "{name}: {p}");
        assert_eq!(p["graph_builds"].as_u64(), Some(0), "{name}: {p}");
        for dev in [g, p] {
            assert_eq!(dev["device_errors"].as_u64(), Some(0), "{name}: {dev}");
            assert!(
                dev["device_attention"].as_u64().unwrap() > 0,
                "{name}: {dev}"
            );
        }
    }
}

/// A prompt longer than a cache block: K3's MLA layers keep the full
/// block on the device between steps and send only the partial one.
#[test]
fn a_long_prompt_keeps_the_cpu_bits_with_cache_blocks_on_the_device() {
    let Some((env, _)) = cuda_or_skip() else {
        return;
    };
    let d = fixture("k3-tiny/checkpoint");
    let ids: Vec<String> = (0..300)
        .map(|i| ((i * 7 + 3) % 200 + 1).to_string())
        .collect();
    let ids = ids.join(",");
    let base = [
        "run",
        "--model",
        d.to_str().unwrap(),
        "--prompt-ids",
        &ids,
        "--max-new",
        "6",
        "--logprobs",
        "4",
        "--json",
    ];
    let cpu = run_json(&[&base[..], &["--device", "cpu"]].concat());
    let gpu = run_json_env(&[&base[..], &["--device", "cuda"]].concat(), &env);
    assert_eq!(answer(&cpu), answer(&gpu));
    let dev = &gpu["stats"]["gpu"];
    assert_eq!(dev["device_errors"].as_u64(), Some(0), "{dev}");
    assert!(dev["device_attention"].as_u64().unwrap() > 0, "{dev}");
}

/// `fathom batch --device cuda`: three sequences of different lengths in
/// one step (one longer than a cache block), their MLA layers' attention
/// in one device call a step over every sequence's cache, give the CPU's
/// ids, for K3 and DeepSeek-V3.
#[test]
fn a_batch_on_the_device_gives_the_cpus_ids() {
    let Some((env, _)) = cuda_or_skip() else {
        return;
    };
    let long: Vec<u32> = (0..270).map(|i| (i * 7 + 3) % 200 + 1).collect();
    let prompts = [vec![1u32, 5, 9, 2, 7], long, vec![3, 1, 4, 1, 5, 9, 2, 6]];
    let lines: String = prompts
        .iter()
        .map(|p| serde_json::json!({"prompt_ids": p, "max_new": 6}).to_string() + "\n")
        .collect();
    let file = std::env::temp_dir().join(format!("fathom-dev-batch-{}.jsonl", std::process::id()));
    std::fs::write(&file, lines).unwrap();
    for name in ["k3-tiny/checkpoint", "deepseek_v3-tiny"] {
        let d = fixture(name);
        let base = [
            "batch",
            "--model",
            d.to_str().unwrap(),
            "--prompts",
            file.to_str().unwrap(),
            "--context",
            "512",
            "--json",
        ];
        let cpu = run_json(&base);
        let gpu = run_json_env(&[&base[..], &["--device", "cuda"]].concat(), &env);
        let ids = |v: &Value| -> Vec<Value> {
            v["results"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["output_ids"].clone())
                .collect()
        };
        assert_eq!(ids(&cpu), ids(&gpu), "{name}");
        let dev = &gpu["stats"]["gpu"];
        assert_eq!(dev["device_errors"].as_u64(), Some(0), "{name}: {dev}");
        assert!(
            dev["device_attention"].as_u64().unwrap() > 0,
            "{name}: {dev}"
        );
        assert!(cpu["stats"].get("gpu").is_none());
        assert!(cpu["stats"].get("gpu_decode").is_none());
        // The steady steps: after the long prompt's first token, each of
        // the steps left decodes, on the device, and within the whole run.
        let (st, steady) = (&gpu["stats"], &gpu["stats"]["gpu_decode"]);
        let (n, all) = (
            st["decode_steps"].as_u64().unwrap(),
            st["steps"].as_u64().unwrap(),
        );
        assert!(n >= 1 && n < all, "{name}: {n} of {all} steps");
        let calls = |v: &Value| v["device_calls"].as_u64().unwrap();
        assert!(
            calls(steady) >= n && calls(steady) < calls(dev),
            "{name}: {st}"
        );
    }
    let _ = std::fs::remove_file(file);
}

/// `fathom bench` with CUDA arms (resident, and streamed through a small
/// VRAM budget) beside a CPU arm: every arm's ids equal the first's (the
/// bench rejects an arm whose output differs) and the device arms report
/// their device bounds.
#[test]
fn bench_accepts_cuda_arms_beside_the_cpu() {
    let Some((env, _)) = cuda_or_skip() else {
        return;
    };
    let d = fixture("k3-tiny/checkpoint");
    let json = std::env::temp_dir().join(format!("fathom-bench-cuda-{}.json", std::process::id()));
    let args = [
        "bench",
        "--model",
        d.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3,4,5,6,7,8",
        "--max-new",
        "4",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--arm",
        "cpu=--experts resident --context 512",
        "--arm",
        "gpu=--experts resident --device cuda --context 512",
        "--arm",
        "stream=--experts stream --ram-budget 1GB --device cuda --vram-budget 2MB --context 512",
        "--json",
        json.to_str().unwrap(),
    ];
    let out = fathom_env(&args, &env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("device: memory") && text.contains("host→device"),
        "{text}"
    );
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    let arms = r["arms"].as_array().unwrap();
    assert_eq!(arms.len(), 3);
    for a in arms {
        assert_eq!(a["status"], "accepted", "{a}");
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

/// `--gpus` and `--no-cuda-graphs` errors that need no device: with the
/// CPU, and a bad list.
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
    fails_quietly(
        &[&base[..], &["--no-cuda-graphs"]].concat(),
        "--no-cuda-graphs is for --device cuda|auto",
    );
    for bad in ["0,x", "1,,2", "0"] {
        fails_quietly(
            &[&base[..], &["--device", "cuda", "--gpus", bad]].concat(),
            "a list such as 0,2",
        );
    }
}

/// GPT-OSS's MXFP4 experts (the released format, with biases and the
/// clamped SwiGLU between their two products): each product kind of a
/// layer's experts goes up as one batch, so a decode token makes three
/// calls a layer (the attention with the router's product, the experts'
/// first products, their second) and one for the head — it was one call
/// for every product of every expert — with the CPU's bits.
#[test]
fn gpt_oss_mxfp4_experts_go_up_as_one_batch_a_product_kind() {
    let Some((env, _)) = cuda_or_skip() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("fathom-gptoss-mx-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let synth = common::fathom(&[
        "synth",
        "--preset",
        "gpt-oss-20b",
        "--layers",
        "2",
        "--hidden",
        "128",
        "--vocab",
        "1024",
        "--force",
        "--out",
        d,
    ]);
    assert!(
        synth.status.success(),
        "{}",
        String::from_utf8_lossy(&synth.stderr)
    );
    let (cpu, gpu) = both(d, &["--ignore-eos"], &[], &env);
    assert_eq!(answer(&cpu), answer(&gpu));
    let g = &gpu["stats"]["gpu_decode"];
    let steps = gpu["stats"]["generated_tokens"].as_u64().unwrap() - 1;
    assert_eq!(steps, 11, "{g}");
    assert_eq!(g["device_calls"].as_u64(), Some(steps * (2 * 3 + 1)), "{g}");
    assert_eq!(g["cpu_products"].as_u64(), Some(0), "{g}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The device tier: with every layer out of RAM (`--spine-resident-layers
/// 0`) and room in VRAM, the layers are held on the device — their
/// matrices mapped from the checkpoint, copied up once, their pages then
/// dropped — instead of read for every pass, and every family gives the
/// resident CPU run's bits.
#[test]
fn layers_held_on_the_device_give_the_cpu_bits_for_every_family() {
    let Some((env, _)) = cuda_or_skip() else {
        return;
    };
    let tier = ["--spine-resident-layers", "0"];
    for name in FIXTURES {
        let dir = fixture(name);
        let d = dir.to_str().unwrap();
        let cpu = run_json(&[&run_args(d, &[])[..], &["--device", "cpu"]].concat());
        let gpu = gpu_run(d, &["--stats"], &tier, &env);
        assert_eq!(answer(&cpu), answer(&gpu), "{d}");
        let s = &gpu["stats"];
        let n = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{d}: {k}: {s}"));
        let layers = n("spine_device_layers");
        assert!(layers > 0, "{d}: {s}");
        assert_eq!(s["spine_streamed_layers"].as_u64(), Some(0), "{d}: {s}");
        assert_eq!(
            n("spine_bytes_read"),
            0,
            "{d}: nothing read for a pass: {s}"
        );
        // Each held matrix was copied up at most once (no state pushed one
        // out), its pages dropped after the copy: all but the few the
        // layers use only through copies made at load (MLA's `kv_b_proj`,
        // applied as per-head transposes, never touched at all).
        let held = s["gpu"]["h2d_held_bytes"].as_u64().unwrap();
        let planned = n("spine_device_bytes");
        assert!(
            held <= planned && held * 4 >= planned * 3,
            "{d}: {held} of {planned}: {s}"
        );
        assert_eq!(s["gpu"]["device_errors"].as_u64(), Some(0), "{d}: {s}");
        eprintln!("{d}: {layers} layers held on the device, {held} bytes copied once");
    }
    // Two devices: the spine, held layers included, on the first; the
    // routed experts split over both.
    let Some((env, gpus)) = cuda_or_skip() else {
        return;
    };
    if gpus < 2 {
        eprintln!("one device here: the device tier on --gpus 0,1 not run");
        return;
    }
    let d = fixture("k3-tiny/checkpoint");
    let d = d.to_str().unwrap();
    let cpu = run_json(&[&run_args(d, &[])[..], &["--device", "cpu"]].concat());
    let two = gpu_run(
        d,
        &["--stats"],
        &[&tier[..], &["--gpus", "0,1"]].concat(),
        &env,
    );
    assert_eq!(answer(&cpu), answer(&two), "{d} --gpus 0,1");
    let s = &two["stats"];
    assert!(s["spine_device_layers"].as_u64().unwrap_or(0) > 0, "{s}");
    assert_eq!(s["spine_bytes_read"].as_u64(), Some(0), "{s}");
}

/// The device tier with `--spine int8` beside the int8 spine file: the
/// layers' codes and scales are mapped from the file and held on the
/// device, giving the bits of the CPU reading the same file.
#[test]
fn int8_layers_held_from_the_int8_file_give_the_cpu_bits() {
    let Some((env, _)) = cuda_or_skip() else {
        return;
    };
    for name in ["k3-tiny/checkpoint", "deepseek_v3-tiny"] {
        let src = fixture(name);
        let dir = std::env::temp_dir().join(format!(
            "fathom-held-int8-{}-{}",
            name.replace('/', "-"),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for f in std::fs::read_dir(&src).unwrap() {
            let f = f.unwrap().path();
            if f.is_file() {
                std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
            }
        }
        let d = dir.to_str().unwrap();
        run_json(&["convert", "--model", d, "--spine", "int8", "--json"]);
        let int8 = ["--spine", "int8"];
        let cpu = run_json(&[&run_args(d, &int8)[..], &["--device", "cpu"]].concat());
        let gpu = gpu_run(
            d,
            &["--spine", "int8", "--stats"],
            &["--spine-resident-layers", "0"],
            &env,
        );
        assert_eq!(answer(&cpu), answer(&gpu), "{d}");
        let s = &gpu["stats"];
        assert!(
            s["spine_device_layers"].as_u64().unwrap_or(0) > 0,
            "{d}: {s}"
        );
        assert_eq!(s["spine_streamed_layers"].as_u64(), Some(0), "{d}: {s}");
        let held = s["gpu"]["h2d_held_bytes"].as_u64().unwrap();
        let planned = s["spine_device_bytes"].as_u64().unwrap();
        assert!(
            held <= planned && held * 4 >= planned * 3,
            "{d}: {held} of {planned}: {s}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
