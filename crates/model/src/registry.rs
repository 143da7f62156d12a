//! The architecture registry: `config.json` → the family that reads it.
//!
//! The top-level `model_type` decides (K3's nested `text_config` says
//! `kimi_linear`, its precursor's type; only the top level counts), then
//! `architectures`. The file is read and parsed once ([`ModelConfig`]);
//! each family builds its own typed spec from the parsed JSON.

use std::path::Path;
use std::sync::Arc;

use fathom_weights::Checkpoint;

pub use crate::config::{Architecture, LoadOptions, MakeSource, resident_source};
use crate::config::{MAX_CONFIG_BYTES, ModelConfig};
use crate::error::{ModelError, Result};
use crate::experts::ExpertTable;
use crate::family::architecture;
use crate::lm::CausalLm;
use crate::memory::MemoryFacts;

/// Reading a configuration names its family from [`ARCHITECTURES`], so
/// the readers live beside the list.
impl ModelConfig {
    /// Reads `dir/config.json` (at most [`MAX_CONFIG_BYTES`]), parses it and
    /// names the family that reads it.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let len = std::fs::metadata(&path)
            .map_err(|e| config_file_err(format!("cannot read {}: {e}", path.display())))?
            .len();
        if len > MAX_CONFIG_BYTES {
            return Err(config_file_err(format!(
                "{} is {len} bytes: larger than any model configuration (at most {MAX_CONFIG_BYTES})",
                path.display()
            )));
        }
        let bytes = std::fs::read(&path)
            .map_err(|e| config_file_err(format!("cannot read {}: {e}", path.display())))?;
        Self::from_bytes(dir, bytes)
    }

    /// A configuration from `bytes`, as if read from `dir/config.json`.
    pub fn from_bytes(dir: &Path, bytes: Vec<u8>) -> Result<Self> {
        let root: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| config_file_err(format!("config.json is not valid JSON: {e}")))?;
        let arch = detect_value(&root)?;
        Ok(ModelConfig::parsed(dir, bytes, root, arch))
    }
}

fn config_file_err(msg: String) -> ModelError {
    ModelError::Config {
        field: "(file)".into(),
        msg,
    }
}

/// What the RAM ledger needs for the model in `dir`, from its config.json.
pub fn memory_facts(dir: &Path) -> Result<MemoryFacts> {
    ModelConfig::read(dir)?.memory_facts()
}

/// Every architecture fathom runs.
pub const ARCHITECTURES: &[Architecture] = &[
    architecture::<crate::kimi_k3::KimiK3>(),
    architecture::<crate::kimi_linear::KimiLinear>(),
    architecture::<crate::qwen3_moe::Qwen3Moe>(),
    architecture::<crate::deepseek_v3::DeepseekV3>(),
    architecture::<crate::gpt_oss::GptOss>(),
];

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
    let root: serde_json::Value = serde_json::from_str(text).map_err(|e| ModelError::Config {
        field: "(file)".into(),
        msg: format!("not valid JSON: {e}"),
    })?;
    detect_value(&root)
}

/// The architecture for a parsed `config.json`: the top-level
/// `model_type`, else the first known `architectures` entry.
pub fn detect_value(root: &serde_json::Value) -> Result<&'static Architecture> {
    let model_type = root.get("model_type").and_then(|v| v.as_str());
    if let Some(mt) = model_type {
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
    let names: Vec<&str> = root
        .get("architectures")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|n| n.as_str()).collect())
        .unwrap_or_default();
    names
        .iter()
        .find_map(|n| ARCHITECTURES.iter().find(|a| a.architectures.contains(n)))
        .ok_or_else(|| {
            ModelError::Unsupported(format!(
                "config.json names no model_type and no known architecture ({names:?}); supported: {}",
                supported()
            ))
        })
}

/// Where every routed expert of the checkpoint `ck` lies, whatever the family.
pub fn expert_table(config: &ModelConfig, ck: &Checkpoint) -> Result<ExpertTable> {
    (config.architecture().experts)(config, ck)
}

/// Loads the model in `dir` with the family its `config.json` names.
pub fn load(dir: &Path, opts: LoadOptions) -> Result<Arc<dyn CausalLm>> {
    load_config(&ModelConfig::read(dir)?, opts)
}

/// Loads the model `config` describes (read once by the caller).
pub fn load_config(config: &ModelConfig, opts: LoadOptions) -> Result<Arc<dyn CausalLm>> {
    let arch = config.architecture();
    if opts.mtp && !arch.mtp {
        return Err(ModelError::Unsupported(format!(
            "--draft mtp: {} checkpoints have no multi-token-prediction layer fathom reads \
             (the DeepSeek-V3 architecture does); use --draft ngram or --draft model:DIR",
            arch.family
        )));
    }
    (arch.load)(config, opts)
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
