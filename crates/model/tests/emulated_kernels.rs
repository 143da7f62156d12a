//! Every family's fixture with every product, gated MLP, KDA step, MoE tail and MLA
//! attention the CUDA backend takes on its kernels (in process, on the real
//! driver where there is one, else on the emulated driver of
//! `fathom-cuda-emu`, the kernels on the host emulator): the logits of a
//! prompt and three decode steps keep their bits — what `--device cuda`
//! must give, checked on a machine without a GPU. Where neither driver is
//! here the test prints why it skips.

mod common;

use std::sync::Arc;

use fathom_kernels::backend::{self, Backend};
use fathom_kernels_cuda::{CudaBackend, CudaError};
use fathom_model::{CausalLm, Logits};

/// Device 0 on the real driver, else on the emulated one; `None`, saying
/// why, with neither.
fn open() -> Option<Arc<CudaBackend>> {
    match CudaBackend::open(0, None) {
        Ok(b) => return Some(b),
        Err(CudaError::NoDriver) => {}
        Err(e) => {
            eprintln!("skipped: no CUDA backend here ({e})");
            return None;
        }
    }
    if let Err(why) = fathom_cuda_emu::install_driver() {
        eprintln!("skipped: no CUDA driver here and {why}");
        return None;
    }
    Some(CudaBackend::open(0, None).expect("the emulated driver opens"))
}

/// Prefill logits of every position, then three decode steps' logits, as
/// bits; and the device memory holding sequences' states at the end (the
/// KDA states a device's steps leave there), before the state is dropped.
fn run(model: &dyn CausalLm) -> (Vec<Vec<u32>>, u64) {
    let mut st = model.new_state();
    let mut out = vec![
        model
            .forward(st.as_mut(), &[1, 20, 300, 7, 42], Logits::All)
            .unwrap(),
    ];
    for tok in [3u32, 1, 4] {
        out.push(model.forward(st.as_mut(), &[tok], Logits::Last).unwrap());
    }
    let states = backend::snapshot().vram_state_bytes;
    let bits = out
        .iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect();
    (bits, states)
}

#[test]
fn every_fixture_on_the_emulated_kernels_keeps_its_bits() {
    let Some(dev) = open() else {
        return;
    };
    for name in [
        "k3-tiny/checkpoint",
        "kimi_linear-tiny",
        "qwen3_moe-tiny",
        "deepseek_v3-tiny",
        "kimi_k2-tiny",
        "gpt_oss-tiny",
    ] {
        let model = fathom_model::registry::load(&common::data(name), Default::default())
            .unwrap_or_else(|e| panic!("{name} loads: {e}"));
        backend::uninstall();
        let (plain, _) = run(model.as_ref());
        let before = dev.stats();
        backend::install(dev.clone());
        let (on_kernels, states) = run(model.as_ref());
        let st = dev.stats().since(&before);
        // Dropped while the backend is installed, so the device forgets
        // the weights' copies before another model's may take their
        // addresses.
        drop(model);
        backend::uninstall();
        eprintln!(
            "{name}: {} products in {} calls ({} attention calls, {} MoE tails, {states} bytes \
             of states on the device)",
            st.device_products, st.device_calls, st.device_attention, st.device_moe_tails
        );
        assert_eq!(st.device_errors, 0, "{name}: {:?}", st.last_error);
        assert!(
            st.device_products > 0,
            "{name}: the emulated kernels computed nothing"
        );
        for (i, (a, b)) in plain.iter().zip(&on_kernels).enumerate() {
            let first = a.iter().zip(b).position(|(x, y)| x != y);
            assert!(
                first.is_none(),
                "{name}: logits row {i} differ first at {first:?}"
            );
        }
        if !name.starts_with("qwen3") && !name.starts_with("gpt_oss") {
            // Every MLA family's attention on the emulated kernels.
            assert!(st.device_attention > 0, "{name}: no MLA attention taken");
        }
        if !name.starts_with("gpt_oss") {
            // Every gated-expert family's experts and their sums in one call.
            assert!(st.device_moe_tails > 0, "{name}: no MoE tail taken");
        }
        if name.starts_with("k3") || name.starts_with("kimi_linear") {
            // K3: KDA layers with a gate lower bound; Kimi-Linear: KDA
            // layers with the softplus decay. Their steps on the device
            // leave the sequences' states there.
            assert!(states > 0, "{name}: no KDA step on the device");
        }
    }
}
