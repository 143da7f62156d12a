//! The spine tiers' checks: layers streamed or held for the device give
//! the resident bits, and a streamed layer that cannot be read fails the
//! step and changes nothing.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use fathom_model::{CausalLm, Logits, StepInput};

use super::{argmax, data};

/// Load options with every other layer (from the first) and the head held
/// for the device, the other layers streamed.
pub fn every_other_layer_held(layers: usize) -> fathom_model::LoadOptions {
    fathom_model::LoadOptions {
        layers: fathom_model::LayerPlan {
            device: (0..layers).map(|i| i % 2 == 0).collect(),
            head_on_disk: true,
            head_on_device: true,
            ..fathom_model::LayerPlan::streamed(0, 2)
        },
        ..Default::default()
    }
}

/// Every golden prompt's logits at every position, and a few greedy
/// decode steps through the state, are the same bits from `tiered` (some
/// spine layers read for every pass) as from `resident`.
pub fn assert_tiers_bit_identical(
    resident: &dyn CausalLm,
    tiered: &dyn CausalLm,
    prompts: &[Vec<u32>],
) {
    let v = resident.info().vocab_size;
    for (i, ids) in prompts.iter().enumerate() {
        let (mut a, mut b) = (resident.new_state(), tiered.new_state());
        let la = resident.forward(a.as_mut(), ids, Logits::All).unwrap();
        let lb = tiered.forward(b.as_mut(), ids, Logits::All).unwrap();
        assert!(la == lb, "prompt {i}: prefill logits differ");
        let mut next = argmax(&la[la.len() - v..]);
        for step in 0..3 {
            let la = resident.forward(a.as_mut(), &[next], Logits::Last).unwrap();
            let lb = tiered.forward(b.as_mut(), &[next], Logits::Last).unwrap();
            assert!(la == lb, "prompt {i}: decode step {step} logits differ");
            next = argmax(&la);
        }
        assert_eq!(
            a.encode().unwrap(),
            b.encode().unwrap(),
            "prompt {i}: states"
        );
    }
}

/// A copy of fixture `name`'s model files in a fresh directory of its own
/// (a test may damage it).
pub fn fixture_copy(name: &str, tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "fathom-{tag}-{}-{}-{}",
        name.replace('/', "-"),
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(data(name)).unwrap() {
        let p = e.unwrap().path();
        let file = p.file_name().unwrap().to_string_lossy().to_string();
        if file.starts_with("golden") || p.is_dir() {
            continue;
        }
        std::fs::copy(&p, dir.join(&file)).unwrap();
    }
    dir
}

/// Every shard of `dir` cut to its header (no tensor data left), in
/// place (the same files, so an open checkpoint reads the cut ones);
/// returns the shards' bytes to put back.
pub fn cut_shards(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut kept = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if !p.to_string_lossy().ends_with(".safetensors") {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(8 + n).unwrap();
        kept.push((p, bytes));
    }
    assert!(!kept.is_empty(), "{}: no shards", dir.display());
    kept
}

/// The shards [`cut_shards`] cut, whole again (written in place).
pub fn restore_shards(kept: &[(PathBuf, Vec<u8>)]) {
    use std::io::Write;
    for (p, bytes) in kept {
        let mut f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
        f.write_all(bytes).unwrap();
    }
}

/// With every spine layer streamed (a ring of two) and the embedding's
/// rows read as asked, a spine read that fails (the shards cut after load)
/// fails the step with an error that names the shard and the tensor, and
/// changes no state: once the shards
/// are whole again the same step from the same state gives the resident
/// model's bits.
pub fn assert_spine_read_error_changes_nothing(
    resident: &dyn CausalLm,
    streamed: &dyn CausalLm,
    dir: &Path,
    warm: &[u32],
) {
    let mut a = streamed.new_state();
    streamed.forward(a.as_mut(), warm, Logits::None).unwrap();
    let before = a.encode().unwrap();
    let kept = cut_shards(dir);
    let e = streamed
        .step(&mut [StepInput {
            state: a.as_mut(),
            tokens: &[5, 6],
            logits: Logits::Last,
        }])
        .unwrap_err();
    let msg = e.to_string();
    let names_a_shard = kept
        .iter()
        .any(|(p, _)| msg.contains(p.to_string_lossy().as_ref()));
    assert_eq!(e.seq, None, "a spine read is the step's error: {msg}");
    // A layer's read, or the embedding's rows (read first, as asked).
    let layer = msg.starts_with("spine layer ") && msg.contains(": tensor ");
    let embedding = msg.starts_with("tensor ") && msg.contains("embed_tokens.weight: row ");
    assert!((layer || embedding) && names_a_shard, "{msg}");
    assert!(msg.contains(".layers.") || embedding, "{msg}");
    assert_eq!(
        a.encode().unwrap(),
        before,
        "the failed step changed the state"
    );
    restore_shards(&kept);
    let got = streamed.forward(a.as_mut(), &[5, 6], Logits::Last).unwrap();
    let mut r = resident.new_state();
    resident.forward(r.as_mut(), warm, Logits::None).unwrap();
    let want = resident.forward(r.as_mut(), &[5, 6], Logits::Last).unwrap();
    assert!(
        got == want,
        "after the failed step: logits differ from resident"
    );
    let _ = std::fs::remove_dir_all(dir);
}
