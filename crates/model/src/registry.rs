//! The architecture registry: `config.json` → the family that reads it.
//!
//! The top-level `model_type` decides (K3's nested `text_config` says
//! `kimi_linear`, its precursor's type; only the top level counts), then
//! `architectures`. Each
//! family parses the whole file once into its own typed spec when it loads.

use std::path::Path;
use std::sync::Arc;

use fathom_weights::Checkpoint;

use crate::error::{ModelError, Result};
use crate::experts::{ExpertSource, ExpertTable};
use crate::linear::Spine;
use crate::lm::CausalLm;

/// Builds the expert source of a model being loaded from its checkpoint and
/// expert table (resident when absent).
pub type MakeSource =
    Box<dyn FnOnce(&Arc<Checkpoint>, &ExpertTable) -> Result<Arc<dyn ExpertSource>> + Send>;

/// Every routed expert read into RAM at load (the default source).
pub fn resident_source() -> MakeSource {
    Box::new(|ck, table| Ok(Arc::new(crate::experts::ResidentExperts::load(ck, table)?)))
}

/// How to load a model.
#[derive(Default)]
pub struct LoadOptions {
    /// Precision of the resident spine.
    pub spine: Spine,
    /// Where routed experts come from; `None`: all resident.
    pub experts: Option<MakeSource>,
    /// The attention cache's RAM share, row format and spill target.
    pub kv: crate::kv::KvConfig,
    /// Also load the checkpoint's multi-token-prediction layer, for
    /// `--draft mtp` (families without one refuse it).
    pub mtp: bool,
}

/// One supported architecture.
#[derive(Debug)]
pub struct Architecture {
    pub family: &'static str,
    /// `model_type` values it reads.
    pub model_types: &'static [&'static str],
    /// `architectures` entries it reads.
    pub architectures: &'static [&'static str],
    pub load: fn(&Path, LoadOptions) -> Result<Arc<dyn CausalLm>>,
    /// What the RAM ledger needs, from config.json alone.
    pub memory: fn(&Path) -> Result<crate::memory::MemoryFacts>,
    /// Where every routed expert of a checkpoint lies (bench ceilings, tools).
    pub experts: fn(&Path, &fathom_weights::Checkpoint) -> Result<crate::experts::ExpertTable>,
    /// Whether its checkpoints may carry a multi-token-prediction layer
    /// that `--draft mtp` reads.
    pub mtp: bool,
}

/// Every architecture fathom runs.
pub const ARCHITECTURES: &[Architecture] = &[
    crate::kimi_k3::ARCHITECTURE,
    crate::kimi_linear::ARCHITECTURE,
    crate::qwen3_moe::ARCHITECTURE,
    crate::deepseek_v3::ARCHITECTURE,
    crate::gpt_oss::ARCHITECTURE,
];

#[derive(serde::Deserialize)]
struct Head {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
}

fn supported() -> String {
    ARCHITECTURES
        .iter()
        .map(|a| {
            format!(
                "{} (model_type {})",
                a.family,
                a.model_types
                    .iter()
                    .map(|t| format!("{t:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The architecture for the `config.json` text `text`.
pub fn detect_json(text: &str) -> Result<&'static Architecture> {
    let head: Head = serde_json::from_str(text).map_err(|e| ModelError::Config {
        field: "(file)".into(),
        msg: format!("not valid JSON: {e}"),
    })?;
    if let Some(mt) = head.model_type.as_deref() {
        return ARCHITECTURES
            .iter()
            .find(|a| a.model_types.contains(&mt))
            .ok_or_else(|| {
                ModelError::Unsupported(format!(
                    "config.json: model_type {mt:?} is not supported; supported: {}",
                    supported()
                ))
            });
    }
    let names = head.architectures.unwrap_or_default();
    names
        .iter()
        .find_map(|n| {
            ARCHITECTURES
                .iter()
                .find(|a| a.architectures.contains(&n.as_str()))
        })
        .ok_or_else(|| {
            ModelError::Unsupported(format!(
                "config.json names no model_type and no known architecture ({names:?}); supported: {}",
                supported()
            ))
        })
}

/// The architecture of the model in `dir`.
pub fn detect(dir: &Path) -> Result<&'static Architecture> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::Config {
        field: "(file)".into(),
        msg: format!("cannot read {}: {e}", path.display()),
    })?;
    detect_json(&text)
}

/// Where every routed expert of the checkpoint `ck` in `dir` lies, whatever
/// the family.
pub fn expert_table(
    dir: &Path,
    ck: &fathom_weights::Checkpoint,
) -> Result<crate::experts::ExpertTable> {
    (detect(dir)?.experts)(dir, ck)
}

/// The context the model in `dir` declares (`max_position_embeddings`, at
/// the top level or in `text_config`), read cheaply before loading.
pub fn declared_context(dir: &Path) -> Result<Option<usize>> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::Config {
        field: "(file)".into(),
        msg: format!("cannot read {}: {e}", path.display()),
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Config {
        field: "(file)".into(),
        msg: format!("not valid JSON: {e}"),
    })?;
    let get = |v: &serde_json::Value| v.get("max_position_embeddings").and_then(|x| x.as_u64());
    let n = get(&v).or_else(|| v.get("text_config").and_then(get));
    Ok(n.map(|n| n.min(usize::MAX as u64) as usize))
}

/// Loads the model in `dir` with the family its `config.json` names.
pub fn load(dir: &Path, opts: LoadOptions) -> Result<Arc<dyn CausalLm>> {
    let arch = detect(dir)?;
    if opts.mtp && !arch.mtp {
        return Err(ModelError::Unsupported(format!(
            "--draft mtp: {} checkpoints have no multi-token-prediction layer fathom reads \
             (the DeepSeek-V3 architecture does); use --draft ngram or --draft model:DIR",
            arch.family
        )));
    }
    (arch.load)(dir, opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_level_model_type_wins_over_text_config() {
        let k3 = r#"{"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
                     "text_config": {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}}"#;
        assert_eq!(detect_json(k3).unwrap().family, "Kimi K3");
        let by_arch = r#"{"architectures": ["KimiK3ForConditionalGeneration"]}"#;
        assert_eq!(detect_json(by_arch).unwrap().family, "Kimi K3");
        let qwen = r#"{"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}"#;
        assert_eq!(detect_json(qwen).unwrap().family, "Qwen3-MoE");
        let by_arch = r#"{"architectures": ["Qwen3MoeForCausalLM"]}"#;
        assert_eq!(detect_json(by_arch).unwrap().family, "Qwen3-MoE");
        let linear = r#"{"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]}"#;
        assert_eq!(detect_json(linear).unwrap().family, "Kimi-Linear");
        for mt in ["deepseek_v3", "kimi_k2"] {
            let ds =
                format!(r#"{{"model_type": "{mt}", "architectures": ["DeepseekV3ForCausalLM"]}}"#);
            assert_eq!(detect_json(&ds).unwrap().family, "DeepSeek-V3");
        }
        let by_arch = r#"{"architectures": ["DeepseekV3ForCausalLM"]}"#;
        assert_eq!(detect_json(by_arch).unwrap().family, "DeepSeek-V3");
        let oss = r#"{"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}"#;
        assert_eq!(detect_json(oss).unwrap().family, "GPT-OSS");
    }

    #[test]
    fn unknown_architectures_list_what_is_supported() {
        let e = detect_json(r#"{"model_type": "llama"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"llama\"") && e.contains("Kimi K3") && e.contains("kimi_k3"),
            "{e}"
        );
        let e = detect_json(r#"{"architectures": ["FooForCausalLM"]}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FooForCausalLM") && e.contains("supported"),
            "{e}"
        );
    }
}
