//! Latent-cache blocks beyond the RAM share go to a spill target and come
//! back bit-exact: a model whose cache lives mostly "on disk" gives the same
//! logits as one that keeps everything in RAM, through prefill, decode,
//! snapshots, speculative rollbacks, forks and saved states.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use fathom_model::kimi_k3::state::BLOCK_ROWS;
use fathom_model::kv::{KvConfig, KvDtype, KvPending, KvSpill};
use fathom_model::{CausalLm, LoadOptions, Logits};

/// A spill target in memory that counts what it holds.
#[derive(Default)]
struct MemSpill {
    slots: Mutex<HashMap<u64, Vec<u8>>>,
    next: AtomicU64,
    /// Fail every write after this many (`u64::MAX`: never).
    fail_after: AtomicU64,
}

struct Ready(std::io::Result<Vec<Vec<u8>>>);
impl KvPending for Ready {
    fn wait(self: Box<Self>) -> std::io::Result<Vec<Vec<u8>>> {
        self.0
    }
}

impl KvSpill for MemSpill {
    fn write(&self, bytes: &[u8]) -> std::io::Result<u64> {
        let slot = self.next.fetch_add(1, Ordering::SeqCst);
        if slot >= self.fail_after.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("disk full (injected)"));
        }
        self.slots.lock().unwrap().insert(slot, bytes.to_vec());
        Ok(slot)
    }
    fn read(&self, slots: Vec<(u64, usize)>) -> Box<dyn KvPending> {
        let m = self.slots.lock().unwrap();
        Box::new(Ready(Ok(slots.iter().map(|(s, _)| m[s].clone()).collect())))
    }
    fn free(&self, slot: u64) {
        self.slots.lock().unwrap().remove(&slot);
    }
    fn location(&self) -> String {
        "(memory)".into()
    }
}

fn dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3-tiny/checkpoint")
}

fn model(kv: KvConfig) -> Arc<dyn CausalLm> {
    model_at(&dir(), kv)
}

fn model_at(dir: &std::path::Path, kv: KvConfig) -> Arc<dyn CausalLm> {
    let opts = LoadOptions {
        kv,
        ..Default::default()
    };
    fathom_model::load(dir, opts).unwrap()
}

fn spilling(dtype: KvDtype) -> (Arc<dyn CausalLm>, Arc<MemSpill>) {
    let spill = Arc::new(MemSpill {
        fail_after: AtomicU64::new(u64::MAX),
        ..Default::default()
    });
    let m = model(KvConfig {
        ram_limit: Some(0),
        dtype,
        spill: Some(spill.clone()),
    });
    (m, spill)
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11 + 5) % 1000 + 3)
        .collect()
}

/// Prefill in uneven chunks, then greedy decode; every logit row.
fn run(m: &dyn CausalLm, prompt: &[u32], new: usize) -> Vec<Vec<f32>> {
    let mut st = m.new_state();
    let mut out = Vec::new();
    for chunk in prompt.chunks(97) {
        out.push(m.forward(st.as_mut(), chunk, Logits::Last).unwrap());
    }
    for _ in 0..new {
        let last = out.last().unwrap();
        let next = (0..last.len())
            .max_by(|&a, &b| last[a].total_cmp(&last[b]).then(b.cmp(&a)))
            .unwrap() as u32;
        out.push(m.forward(st.as_mut(), &[next], Logits::Last).unwrap());
    }
    out
}

#[test]
fn spilled_cache_gives_the_in_ram_logits_bit_for_bit() {
    let prompt = tokens(3 * BLOCK_ROWS + 17, 1);
    let ram = run(model(KvConfig::default()).as_ref(), &prompt, 6);
    let (m, spill) = spilling(KvDtype::F32);
    let disk = run(m.as_ref(), &prompt, 6);
    assert_eq!(ram, disk);
    let st = m.kv_stats();
    assert!(st.blocks_spilled >= 3, "{st:?}");
    assert!(st.bytes_read > 0, "{st:?}");
    assert_eq!(
        st.disk_bytes, 0,
        "the sequence ended: its blocks were freed"
    );
    assert!(
        spill.slots.lock().unwrap().is_empty(),
        "every slot was freed"
    );
}

#[test]
fn snapshots_rollbacks_forks_and_saved_states_work_on_spilled_blocks() {
    let (m, _spill) = spilling(KvDtype::F32);
    let long = tokens(2 * BLOCK_ROWS + 40, 2);
    let mut a = m.new_state();
    m.forward(a.as_mut(), &long, Logits::None).unwrap();
    assert!(m.kv_stats().disk_bytes > 0);
    // Roll back into a spilled block, then continue: like a fresh run.
    let snap = a.snapshot();
    m.forward(a.as_mut(), &tokens(BLOCK_ROWS, 3), Logits::None)
        .unwrap();
    a.restore(snap.as_ref()).unwrap();
    let mut b = m.new_state();
    m.forward(b.as_mut(), &long[..BLOCK_ROWS + 5], Logits::None)
        .unwrap();
    b.begin_pass();
    m.forward(b.as_mut(), &long[BLOCK_ROWS + 5..], Logits::None)
        .unwrap();
    b.keep(long.len() - BLOCK_ROWS - 5).unwrap();
    let saved = a.encode().unwrap();
    let mut c = m.decode_state(&saved).unwrap();
    let mut f = a.fork();
    let tail = [11, 12, 13];
    let la = m.forward(a.as_mut(), &tail, Logits::All).unwrap();
    let lb = m.forward(b.as_mut(), &tail, Logits::All).unwrap();
    let lc = m.forward(c.as_mut(), &tail, Logits::All).unwrap();
    let lf = m.forward(f.as_mut(), &tail, Logits::All).unwrap();
    let plain = model(KvConfig::default());
    let mut p = plain.new_state();
    let mut all = long.clone();
    all.extend_from_slice(&tail);
    let lp = plain.forward(p.as_mut(), &all, Logits::All).unwrap();
    let v = plain.info().vocab_size;
    let want = &lp[long.len() * v..];
    for (name, got) in [
        ("restored", &la),
        ("kept", &lb),
        ("decoded", &lc),
        ("fork", &lf),
    ] {
        assert_eq!(&got[..], want, "{name}");
    }
}

#[test]
fn a_failing_spill_is_an_error_and_the_state_is_unchanged() {
    let (m, spill) = spilling(KvDtype::F32);
    spill.fail_after.store(1, Ordering::SeqCst);
    let mut st = m.new_state();
    let err = m
        .forward(st.as_mut(), &tokens(3 * BLOCK_ROWS, 4), Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("attention cache") && err.contains("disk full"),
        "{err}"
    );
    assert_eq!(st.pos(), 0, "the failed step changed nothing");
}

#[test]
fn no_spill_target_beyond_the_share_names_the_fix() {
    let m = model(KvConfig {
        ram_limit: Some(0),
        dtype: KvDtype::F32,
        spill: None,
    });
    let mut st = m.new_state();
    let err = m
        .forward(st.as_mut(), &tokens(BLOCK_ROWS + 1, 5), Logits::Last)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--kv-ram") && err.contains("--kv-dir"),
        "{err}"
    );
}

#[test]
fn bf16_rows_are_the_same_wherever_they_live() {
    let prompt = tokens(2 * BLOCK_ROWS + 9, 6);
    let bf16_ram = run(
        model(KvConfig {
            dtype: KvDtype::Bf16,
            ..Default::default()
        })
        .as_ref(),
        &prompt,
        4,
    );
    let (m, _) = spilling(KvDtype::Bf16);
    assert_eq!(bf16_ram, run(m.as_ref(), &prompt, 4));
    // Lossy: bf16 rows change the prompt's logits (slightly) against fp32
    // (the greedy continuations may then differ: not compared here).
    let f32_ram = run(model(KvConfig::default()).as_ref(), &prompt, 4);
    let rows = prompt.len().div_ceil(97);
    let diff = f32_ram[..rows]
        .iter()
        .flatten()
        .zip(bf16_ram[..rows].iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = f32_ram[..rows]
        .iter()
        .flatten()
        .fold(0f32, |m, x| m.max(x.abs()));
    println!("bf16 latent cache: max prompt-logit difference {diff} (largest |logit| {scale})");
    assert!(
        diff > 0.0 && diff < 0.15 * scale,
        "max logit difference {diff} of {scale}"
    );
}

#[test]
fn every_family_spills_alike() {
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    for fixture in [
        "qwen3_moe-tiny",
        "kimi_linear-tiny",
        "deepseek_v3-tiny",
        "gpt_oss-tiny",
    ] {
        let d = data.join(fixture);
        let prompt = tokens(2 * BLOCK_ROWS + 30, 7);
        let ram = run(model_at(&d, KvConfig::default()).as_ref(), &prompt, 4);
        let spill = Arc::new(MemSpill {
            fail_after: AtomicU64::new(u64::MAX),
            ..Default::default()
        });
        let m = model_at(
            &d,
            KvConfig {
                ram_limit: Some(0),
                dtype: KvDtype::F32,
                spill: Some(spill.clone()),
            },
        );
        assert_eq!(ram, run(m.as_ref(), &prompt, 4), "{fixture}");
        assert!(
            m.kv_stats().blocks_spilled >= 2,
            "{fixture}: {:?}",
            m.kv_stats()
        );
    }
}
