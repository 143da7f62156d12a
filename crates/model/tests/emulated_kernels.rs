//! Every family's fixture with every product, gated MLP, KDA step, MoE tail and MLA
//! attention on the CUDA kernels (run on the host emulator, `fathom-cuda-emu`): the
//! logits of a prompt and three decode steps keep their bits — what
//! `--device cuda` must give, checked on a machine without a GPU. Where the
//! emulator was not built the test prints why it skips.

mod common;

use std::sync::Arc;

use fathom_cuda_emu::EmuBackend;
use fathom_kernels::backend::{self, Backend};
use fathom_model::{CausalLm, Logits};

/// Prefill logits of every position, then three decode steps' logits, as bits.
fn run(model: &dyn CausalLm) -> Vec<Vec<u32>> {
    let mut st = model.new_state();
    let mut out = vec![
        model
            .forward(st.as_mut(), &[1, 20, 300, 7, 42], Logits::All)
            .unwrap(),
    ];
    for tok in [3u32, 1, 4] {
        out.push(model.forward(st.as_mut(), &[tok], Logits::Last).unwrap());
    }
    out.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn every_fixture_on_the_emulated_kernels_keeps_its_bits() {
    if !fathom_cuda_emu::available() {
        eprintln!("skipped: {}", fathom_cuda_emu::ABSENT);
        return;
    }
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
        let plain = run(model.as_ref());
        let emu = Arc::new(EmuBackend::new());
        backend::install(emu.clone());
        let on_kernels = run(model.as_ref());
        backend::uninstall();
        let st = emu.stats();
        let (glu, kda) = emu.glu_and_kda_calls();
        eprintln!(
            "{name}: {} products in {} calls ({glu} gated-MLP calls, {kda} KDA steps, {} \
             attention calls, {} MoE tails)",
            st.device_products, st.device_calls, st.device_attention, st.device_moe_tails
        );
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
            // K3: SiTU-GLU MLPs and KDA layers with a gate lower bound;
            // Kimi-Linear: SwiGLU and KDA layers with the softplus decay.
            assert!(
                glu > 0 && kda > 0,
                "{name}: gated MLPs {glu}, KDA steps {kda}"
            );
        }
    }
}
