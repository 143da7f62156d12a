//! A checkpoint's `config.json`, read and parsed once per load.
//!
//! Everything that needs the configuration before or while loading — the
//! registry's choice of family, the family's typed spec, the RAM ledger's
//! memory facts, the declared context, the heat files' model digest — reads
//! it from one [`ModelConfig`], never from the file again.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::fields::Fields;
use crate::memory::MemoryFacts;
use crate::registry::Architecture;

/// The largest `config.json` read (real ones are a few kB; a multimodal
/// model's with its processor settings stays well under a megabyte).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// A parsed `config.json` and the directory it came from.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    dir: PathBuf,
    bytes: Vec<u8>,
    root: Value,
    arch: &'static Architecture,
}

fn file_err(msg: String) -> ModelError {
    ModelError::Config {
        field: "(file)".into(),
        msg,
    }
}

impl ModelConfig {
    /// Reads `dir/config.json` (at most [`MAX_CONFIG_BYTES`]), parses it and
    /// names the family that reads it.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let len = std::fs::metadata(&path)
            .map_err(|e| file_err(format!("cannot read {}: {e}", path.display())))?
            .len();
        if len > MAX_CONFIG_BYTES {
            return Err(file_err(format!(
                "{} is {len} bytes: larger than any model configuration (at most {MAX_CONFIG_BYTES})",
                path.display()
            )));
        }
        let bytes = std::fs::read(&path)
            .map_err(|e| file_err(format!("cannot read {}: {e}", path.display())))?;
        Self::from_bytes(dir, bytes)
    }

    /// A configuration from `bytes`, as if read from `dir/config.json`.
    pub fn from_bytes(dir: &Path, bytes: Vec<u8>) -> Result<Self> {
        let root: Value = serde_json::from_slice(&bytes)
            .map_err(|e| file_err(format!("config.json is not valid JSON: {e}")))?;
        let arch = crate::registry::detect_value(&root)?;
        Ok(ModelConfig {
            dir: dir.to_path_buf(),
            bytes,
            root,
            arch,
        })
    }

    /// The checkpoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file's bytes as read (for digests).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The parsed JSON.
    pub fn json(&self) -> &Value {
        &self.root
    }

    /// The architecture that reads this configuration.
    pub fn architecture(&self) -> &'static Architecture {
        self.arch
    }

    /// The family's name (`"Kimi K3"`).
    pub fn family(&self) -> &'static str {
        self.arch.family
    }

    /// What the RAM ledger needs, by the family's typed spec.
    pub fn memory_facts(&self) -> Result<MemoryFacts> {
        (self.arch.memory)(self)
    }

    /// Every disagreement between the checkpoint `ck` and the family's
    /// tensor table, one line each (none: the checkpoint is complete).
    pub fn check_tensors(&self, ck: &fathom_weights::Checkpoint) -> Result<Vec<String>> {
        (self.arch.check)(self, ck)
    }

    /// The layer plan and components, when the family draws them.
    pub fn anatomy(&self) -> Result<Option<crate::anatomy::Anatomy>> {
        (self.arch.anatomy)(self)
    }

    /// The context the model declares (`max_position_embeddings`, at the top
    /// level or in `text_config`).
    pub fn declared_context(&self) -> Option<usize> {
        let get = |v: &Value| v.get("max_position_embeddings").and_then(Value::as_u64);
        let n = get(&self.root).or_else(|| self.root.get("text_config").and_then(get));
        n.map(|n| n.min(usize::MAX as u64) as usize)
    }
}

impl Fields<'_> {
    /// Token ids of `name`: absent (none), a number or a list of numbers,
    /// each inside the vocabulary of `vocab` tokens.
    pub(crate) fn token_ids(&self, name: &str, vocab: usize) -> Result<Vec<u32>> {
        let Some(v) = self.get(name) else {
            return Ok(Vec::new());
        };
        let list: Vec<&Value> = match v {
            Value::Array(a) => a.iter().collect(),
            other => vec![other],
        };
        list.into_iter()
            .map(|x| match x.as_u64() {
                Some(id) if (id as usize) < vocab => Ok(id as u32),
                Some(id) => Err(self.err(
                    name,
                    format!("= {id}: outside the vocabulary (vocab_size {vocab})"),
                )),
                None => Err(self.err(name, format!("= {x}: expected a token id"))),
            })
            .collect()
    }

    /// `model_type` must be `want` (the family's loader was asked to read
    /// another family's configuration).
    pub(crate) fn expect_model_type(&self, want: &str) -> Result<()> {
        let got = self.str_or("model_type", "")?;
        if got != want {
            return Err(self.err(
                "model_type",
                format!("= {got:?}: this loader reads {want:?} checkpoints"),
            ));
        }
        Ok(())
    }
}
