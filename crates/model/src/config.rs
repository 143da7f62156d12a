//! A checkpoint's `config.json`, read and parsed once per load, and what a
//! family offers the registry ([`Architecture`]) and how a load is asked
//! for ([`LoadOptions`]).
//!
//! Everything that needs the configuration before or while loading — the
//! registry's choice of family, the family's typed spec, the RAM ledger's
//! memory facts, the declared context, the heat files' model digest — reads
//! it from one [`ModelConfig`], never from the file again.

use std::path::{Path, PathBuf};

use serde_json::Value;

use std::sync::Arc;

use fathom_weights::Checkpoint;

use crate::error::Result;
use crate::experts::{ExpertSource, ExpertTable};
use crate::fields::Fields;
use crate::linear::Spine;
use crate::lm::CausalLm;
use crate::memory::MemoryFacts;

/// The largest `config.json` read (real ones are a few kB; a multimodal
/// model's with its processor settings stays well under a megabyte).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

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
    /// The checkpoint, already opened (one with remote shards); `None`:
    /// opened from the configuration's directory.
    pub checkpoint: Option<Arc<Checkpoint>>,
    /// Which decoder layers of the spine stay resident; the others are
    /// read from the checkpoint for every pass (default: all resident).
    pub layers: crate::tiers::LayerPlan,
}

/// One supported architecture (made by [`crate::family::architecture`]).
#[derive(Debug)]
pub struct Architecture {
    pub family: &'static str,
    /// `model_type` values it reads.
    pub model_types: &'static [&'static str],
    /// `architectures` entries it reads.
    pub architectures: &'static [&'static str],
    pub load: fn(&ModelConfig, LoadOptions) -> Result<Arc<dyn CausalLm>>,
    /// What the RAM ledger needs, from config.json alone.
    pub memory: fn(&ModelConfig) -> Result<crate::memory::MemoryFacts>,
    /// Where every routed expert of a checkpoint lies (bench ceilings, tools).
    pub experts: fn(&ModelConfig, &Checkpoint) -> Result<ExpertTable>,
    /// Every disagreement between a checkpoint and the tensor table.
    pub check: fn(&ModelConfig, &Checkpoint) -> Result<Vec<String>>,
    /// The layer plan and components, when the family draws them.
    pub anatomy: fn(&ModelConfig) -> Result<Option<crate::anatomy::Anatomy>>,
    /// Whether its checkpoints may carry a multi-token-prediction layer
    /// that `--draft mtp` reads.
    pub mtp: bool,
}

/// A parsed `config.json` and the directory it came from.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    dir: PathBuf,
    bytes: Vec<u8>,
    root: Value,
    arch: &'static Architecture,
}

impl ModelConfig {
    /// A configuration whose family `arch` was named from `root`
    /// ([`crate::registry`] reads and names).
    pub(crate) fn parsed(
        dir: &Path,
        bytes: Vec<u8>,
        root: Value,
        arch: &'static Architecture,
    ) -> Self {
        ModelConfig {
            dir: dir.to_path_buf(),
            bytes,
            root,
            arch,
        }
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
