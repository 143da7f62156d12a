//! The named presets of `fathom synth`, user overrides, and the search that
//! picks a layer (or expert) count for a target size.
//!
//! Each preset is a released model's shape in its released precision (see
//! `families/`); its `config.json` is parsed back by the family's loader
//! code before anything is planned, so a synthetic checkpoint is described
//! by exactly the code that will load it.

use crate::error::{Result, SynthError};
use crate::families::{deepseek, gpt_oss, kimi_linear, qwen3};
use crate::model::Model;

pub use crate::families::k3::{Dims, full_attn_layers};

/// The named starting points of `fathom synth --preset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// k3-tiny's shapes (hidden 128, 9 layers, 32 experts) with a vocabulary
    /// big enough for a real tokenizer (1024 ranks + 256 specials).
    Tiny,
    /// The released Kimi K3 shapes (docs/k3-model.md §1). 93 layers is ~1.5 TB;
    /// `--layers 3` checks the byte layout at ~35 GB.
    K3,
    /// Real expert count (896) and top-16 with narrower widths, so that
    /// 10–60 GB models with K3's routing fan-out are quick to make.
    K3Mini,
    /// DeepSeek-V3 (671B): FP8 E4M3 with 128×128 block scales.
    DeepseekV3,
    /// Kimi K2 Instruct (1T): DeepSeek-V3's layout, 384 experts, FP8.
    KimiK2,
    /// Kimi K2 Thinking: K2's shapes with INT4 (group 32) routed experts.
    KimiK2Thinking,
    /// Qwen3-235B-A22B, bf16.
    Qwen3_235b,
    /// Qwen3-30B-A3B, bf16.
    Qwen3_30b,
    /// gpt-oss-120b: MXFP4 experts, bf16 elsewhere.
    GptOss120b,
    /// gpt-oss-20b: MXFP4 experts, bf16 elsewhere.
    GptOss20b,
    /// Kimi-Linear-48B-A3B: KDA/MLA hybrid, bf16.
    KimiLinear,
}

impl Preset {
    pub const ALL: [Preset; 11] = [
        Preset::Tiny,
        Preset::K3,
        Preset::K3Mini,
        Preset::DeepseekV3,
        Preset::KimiK2,
        Preset::KimiK2Thinking,
        Preset::Qwen3_235b,
        Preset::Qwen3_30b,
        Preset::GptOss120b,
        Preset::GptOss20b,
        Preset::KimiLinear,
    ];

    pub const NAMES: [&'static str; 11] = [
        "tiny",
        "k3",
        "k3-mini",
        "deepseek-v3",
        "kimi-k2",
        "kimi-k2-thinking",
        "qwen3-235b",
        "qwen3-30b",
        "gpt-oss-120b",
        "gpt-oss-20b",
        "kimi-linear",
    ];

    pub fn name(self) -> &'static str {
        let i = Preset::ALL.iter().position(|&p| p == self).unwrap_or(0);
        Preset::NAMES[i]
    }

    pub fn from_name(name: &str) -> Result<Self> {
        match Preset::NAMES.iter().position(|&n| n == name) {
            Some(i) => Ok(Preset::ALL[i]),
            None => Err(SynthError::Invalid(format!(
                "--preset {name:?}: unknown preset (choose one of {})",
                Preset::NAMES.join(", ")
            ))),
        }
    }

    /// The K3 shapes of a K3 preset (`tiny`, `k3`, `k3-mini`); `None` for
    /// the other families.
    pub fn dims(self) -> Option<Dims> {
        Some(match self {
            Preset::Tiny => Dims::tiny(),
            Preset::K3 => Dims::k3(),
            Preset::K3Mini => Dims::k3_mini(),
            _ => return None,
        })
    }

    /// The preset's model, before overrides.
    pub fn model(self) -> Model {
        if let Some(d) = self.dims() {
            return Model::K3(d);
        }
        match self {
            Preset::DeepseekV3 => Model::DeepseekV3(deepseek::DeepseekDims::deepseek_v3()),
            Preset::KimiK2 => Model::DeepseekV3(deepseek::DeepseekDims::kimi_k2()),
            Preset::KimiK2Thinking => Model::DeepseekV3(deepseek::DeepseekDims::kimi_k2_thinking()),
            Preset::Qwen3_235b => Model::Qwen3Moe(qwen3::Qwen3Dims::qwen3_235b()),
            Preset::Qwen3_30b => Model::Qwen3Moe(qwen3::Qwen3Dims::qwen3_30b()),
            Preset::GptOss120b => Model::GptOss(gpt_oss::GptOssDims::gpt_oss_120b()),
            Preset::GptOss20b => Model::GptOss(gpt_oss::GptOssDims::gpt_oss_20b()),
            _ => Model::KimiLinear(kimi_linear::KimiLinearDims::kimi_linear_48b()),
        }
    }
}

/// What the user fixed on the command line.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub layers: Option<usize>,
    pub experts: Option<usize>,
    pub top_k: Option<usize>,
    /// Hidden size; the other widths scale with it (non-K3 presets).
    pub hidden: Option<usize>,
    /// Vocabulary size (the synthetic tokenizer's ranks + 256 specials).
    pub vocab: Option<usize>,
    /// Aim for this many bytes of tensor data by choosing the layer count
    /// (and, below the fewest layers with a MoE layer, the expert count).
    pub target_size: Option<u64>,
}

/// The model chosen for a preset and overrides, and what the size search did.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub model: Model,
    /// Human-readable account of choices made for `--target-size`.
    pub note: Option<String>,
}

/// Applies the overrides to a preset, searching sizes if asked.
pub fn resolve(preset: Preset, o: &Overrides) -> Result<Resolved> {
    let mut m = preset.model();
    if let Some(h) = o.hidden {
        m.shape_mut().scale_to_hidden(h)?;
    }
    let mut k = m.knobs();
    k.num_layers = o.layers.unwrap_or(k.num_layers);
    k.num_experts = o.experts.unwrap_or(k.num_experts);
    k.top_k = o.top_k.unwrap_or(k.top_k);
    k.vocab_size = o.vocab.unwrap_or(k.vocab_size);
    m.shape_mut().set_knobs(k);
    m.validate()?;
    let Some(target) = o.target_size else {
        // The family's own checks, before anything is planned.
        m.data_bytes()?;
        return Ok(Resolved {
            model: m,
            note: None,
        });
    };
    if o.layers.is_some() && o.experts.is_some() {
        return Err(SynthError::Invalid(
            "--target-size needs --layers or --experts left free to choose".into(),
        ));
    }
    let with = |m: &Model, layers: Option<usize>, experts: Option<usize>| {
        let mut x = m.clone();
        let mut k = x.knobs();
        k.num_layers = layers.unwrap_or(k.num_layers);
        k.num_experts = experts.unwrap_or(k.num_experts);
        x.shape_mut().set_knobs(k);
        x
    };
    let note;
    if o.layers.is_none() {
        // Total size grows with the layer count: largest count that fits,
        // then the neighbour above if it lands closer.
        let min = m.shape().dense_layers() + 1;
        let size_at = |l: usize| with(&m, Some(l), None).data_bytes();
        let (mut lo, mut hi) = (min, 2 * min);
        while size_at(hi)? <= target && hi < 1 << 14 {
            lo = hi;
            hi *= 2;
        }
        let lo = largest_fitting(lo, hi, target, size_at)?;
        let pick = if size_at(lo)?.abs_diff(target) <= size_at(lo + 1)?.abs_diff(target) {
            lo
        } else {
            lo + 1
        };
        if size_at(min)? > target && o.experts.is_none() {
            m = with(&m, Some(min), None);
            let e = search_experts(&m, target)?;
            m = with(&m, None, Some(e));
            note = Some(format!(
                "{min} layers (the fewest with a MoE layer) and {e} experts"
            ));
        } else {
            m = with(&m, Some(pick.max(min)), None);
            note = Some(format!("{} layers", m.num_layers()));
        }
    } else {
        let e = search_experts(&m, target)?;
        m = with(&m, None, Some(e));
        note = Some(format!("{e} experts"));
    }
    Ok(Resolved { model: m, note })
}

/// Largest expert count in `top_k..=num_experts` whose model fits `target`
/// (at least `top_k`).
fn search_experts(m: &Model, target: u64) -> Result<usize> {
    let size_at = |e: usize| {
        let mut x = m.clone();
        let mut k = x.knobs();
        k.num_experts = e;
        x.shape_mut().set_knobs(k);
        x.data_bytes()
    };
    let (lo, hi) = (m.top_k(), m.num_experts());
    if size_at(hi)? <= target {
        return Ok(hi);
    }
    largest_fitting(lo, hi, target, size_at)
}

/// Bisects `lo .. hi` for the largest count whose size fits `target`, sizes
/// growing with the count and `size_at(hi)` over it; `lo` when none above it fits.
fn largest_fitting(
    mut lo: usize,
    mut hi: usize,
    target: u64,
    size_at: impl Fn(usize) -> Result<u64>,
) -> Result<usize> {
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if size_at(mid)? <= target {
            lo = mid
        } else {
            hi = mid
        }
    }
    Ok(lo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_model::kimi_k3::config::AttnKind;

    #[test]
    fn layer_rule_matches_k3_and_tiny() {
        assert_eq!(full_attn_layers(9), vec![4, 8, 9]);
        let k3 = full_attn_layers(93);
        assert_eq!(k3.len(), 24);
        assert_eq!(&k3[k3.len() - 2..], &[92, 93]);
        let s = Preset::K3.dims().unwrap().spec().unwrap();
        assert_eq!(s.attn_kinds[3], AttnKind::Mla);
        assert_eq!(s.attn_kinds[91], AttnKind::Mla);
        assert_eq!(s.attn_kinds[90], AttnKind::Kda);
        assert_eq!(s.bos_token_id, Some(163_584));
        assert_eq!(s.eos_token_id, Some(163_586));
    }

    #[test]
    fn every_preset_counts_the_bytes_it_plans() {
        for p in Preset::ALL {
            assert_eq!(Preset::from_name(p.name()).unwrap(), p);
            let o = Overrides {
                layers: Some(p.model().shape().dense_layers() + 1),
                experts: Some(8),
                top_k: Some(2),
                vocab: Some(1280),
                ..Default::default()
            };
            let m = resolve(p, &o).unwrap().model;
            let plan = crate::Plan::new(&m, 0, crate::DEFAULT_SHARD_SIZE).unwrap();
            assert_eq!(m.data_bytes().unwrap(), plan.data_bytes, "{}", p.name());
            let files: u64 = plan.shards.iter().map(|s| s.len).sum();
            assert!(files > plan.data_bytes, "{}", p.name());
        }
    }

    #[test]
    fn overrides_are_checked() {
        let o = Overrides {
            top_k: Some(40),
            ..Default::default()
        };
        let e = resolve(Preset::Tiny, &o).unwrap_err().to_string();
        assert!(e.contains("--top-k 40"), "{e}");
        assert!(Preset::from_name("huge").is_err());
    }

    #[test]
    fn target_size_picks_layers_near_the_target() {
        let one = Preset::K3Mini.dims().unwrap();
        let o = Overrides {
            target_size: Some(10_000_000_000),
            ..Default::default()
        };
        let r = resolve(Preset::K3Mini, &o).unwrap();
        let got = r.model.data_bytes().unwrap();
        let per_layer = one.num_experts as u64 * 1_253_376;
        assert!(got.abs_diff(10_000_000_000) <= per_layer, "{got}");
        // Below two layers' worth the expert count shrinks instead.
        let mut small = Preset::Tiny.dims().unwrap();
        small.num_layers = 2;
        small.num_experts = 10;
        let o = Overrides {
            target_size: Some(small.data_bytes().unwrap() + 100),
            ..Default::default()
        };
        let r = resolve(Preset::Tiny, &o).unwrap();
        assert_eq!(r.model.num_layers(), 2);
        assert_eq!(r.model.num_experts(), 10);
    }
}
