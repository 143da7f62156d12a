//! What a synthetic checkpoint is, whatever its family: a shape that
//! becomes a `config.json`, and the stored tensors that config's loader
//! expects, each with the distribution its bytes are drawn from.
//!
//! Every family turns its config into tensors the same way: the JSON is
//! parsed back by the family's own spec parser (so an override that makes
//! an invalid model is refused with the loader's message), and the tensor
//! list comes from that family's `tensor_table` — synth and loader read
//! one table and cannot disagree.

use fathom_weights::Dtype;
use serde_json::Value;

use crate::error::{Result, SynthError};
use crate::families::{deepseek, gpt_oss, kimi_linear, qwen3};
use crate::init::Init;
use crate::preset::Dims;
use crate::tokenizer::NUM_SPECIALS;

/// One tensor as stored in a shard.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub init: Init,
    /// `(layer, expert)` of a routed expert stored on its own: its tensors
    /// are adjacent and never split between shards. `None` for the rest
    /// (stacked experts included).
    pub expert: Option<(usize, usize)>,
}

impl SynthTensor {
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.bitsize() as u64 / 8
    }
}

/// `(layer, e)` of a name `….layers.{layer}.….experts.{e}.…`, if it has one.
pub fn expert_of(name: &str, layer: Option<usize>) -> Option<(usize, usize)> {
    let rest = &name[name.find(".experts.")? + ".experts.".len()..];
    let e = rest.split('.').next()?.parse().ok()?;
    Some((layer?, e))
}

/// The counts every preset lets the user override.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knobs {
    pub num_layers: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub vocab_size: usize,
}

/// `Shape::knobs`, `set_knobs` and `hidden_size` for a dims struct with the
/// fields `num_layers`, `num_experts`, `top_k`, `vocab_size` and
/// `hidden_size` (every family names them so).
macro_rules! knob_fields {
    () => {
        fn knobs(&self) -> $crate::model::Knobs {
            $crate::model::Knobs {
                num_layers: self.num_layers,
                num_experts: self.num_experts,
                top_k: self.top_k,
                vocab_size: self.vocab_size,
            }
        }

        fn set_knobs(&mut self, k: $crate::model::Knobs) {
            self.num_layers = k.num_layers;
            self.num_experts = k.num_experts;
            self.top_k = k.top_k;
            self.vocab_size = k.vocab_size;
        }

        fn hidden_size(&self) -> usize {
            self.hidden_size
        }
    };
}
pub(crate) use knob_fields;

/// One family's shape.
pub trait Shape {
    /// The family, as `fathom inspect` names it.
    fn family(&self) -> &'static str;
    /// How the weights are stored, in words.
    fn precision(&self) -> &'static str;
    fn knobs(&self) -> Knobs;
    fn set_knobs(&mut self, k: Knobs);
    fn hidden_size(&self) -> usize;
    /// Sets the hidden size to `h` and scales every other width with it
    /// (head counts, ranks, intermediate sizes; head dims stay).
    fn scale_to_hidden(&mut self, h: usize) -> Result<()>;
    /// Layers before the first MoE layer (`first_k_dense_replace`).
    fn dense_layers(&self) -> usize;
    /// `config.json`, in the released layout.
    fn config_json(&self) -> Value;
    /// Every stored tensor in file order, from the family's tensor table
    /// of the parsed [`Shape::config_json`].
    fn tensors(&self) -> Result<Vec<SynthTensor>>;
    /// Bytes of all tensors (what the size search asks, many times: a
    /// family may count them without building [`Shape::tensors`]).
    fn data_bytes(&self) -> Result<u64> {
        Ok(self.tensors()?.iter().map(SynthTensor::bytes).sum())
    }
}

/// A model of any supported family.
#[derive(Debug, Clone, PartialEq)]
pub enum Model {
    K3(Dims),
    DeepseekV3(deepseek::DeepseekDims),
    Qwen3Moe(qwen3::Qwen3Dims),
    GptOss(gpt_oss::GptOssDims),
    KimiLinear(kimi_linear::KimiLinearDims),
}

impl From<Dims> for Model {
    fn from(d: Dims) -> Model {
        Model::K3(d)
    }
}

impl From<&Dims> for Model {
    fn from(d: &Dims) -> Model {
        Model::K3(d.clone())
    }
}

impl From<&Model> for Model {
    fn from(m: &Model) -> Model {
        m.clone()
    }
}

impl Model {
    pub fn shape(&self) -> &dyn Shape {
        match self {
            Model::K3(d) => d,
            Model::DeepseekV3(d) => d,
            Model::Qwen3Moe(d) => d,
            Model::GptOss(d) => d,
            Model::KimiLinear(d) => d,
        }
    }

    pub fn shape_mut(&mut self) -> &mut dyn Shape {
        match self {
            Model::K3(d) => d,
            Model::DeepseekV3(d) => d,
            Model::Qwen3Moe(d) => d,
            Model::GptOss(d) => d,
            Model::KimiLinear(d) => d,
        }
    }

    pub fn knobs(&self) -> Knobs {
        self.shape().knobs()
    }

    pub fn num_layers(&self) -> usize {
        self.knobs().num_layers
    }

    pub fn num_experts(&self) -> usize {
        self.knobs().num_experts
    }

    pub fn top_k(&self) -> usize {
        self.knobs().top_k
    }

    pub fn vocab_size(&self) -> usize {
        self.knobs().vocab_size
    }

    pub fn hidden_size(&self) -> usize {
        self.shape().hidden_size()
    }

    pub fn config_json(&self) -> Value {
        self.shape().config_json()
    }

    /// Checks the counts in terms of the synth flags (the family's config
    /// parser checks the rest when the tensors are listed).
    pub fn validate(&self) -> Result<()> {
        let k = self.knobs();
        let bad = |m: String| Err(SynthError::Invalid(m));
        let dense = self.shape().dense_layers();
        if k.num_layers <= dense {
            let what = if dense == 0 {
                "must be at least 1".to_string()
            } else {
                format!(
                    "leaves no MoE layer: this model's first {dense} layer{} dense \
                     (first_k_dense_replace); give --layers {} or more",
                    if dense == 1 { " is" } else { "s are" },
                    dense + 1
                )
            };
            return bad(format!("--layers {} {what}", k.num_layers));
        }
        if k.num_experts == 0 || k.top_k == 0 {
            return bad("--experts and --top-k must be at least 1".into());
        }
        if k.top_k > k.num_experts {
            return bad(format!(
                "--top-k {} exceeds the number of experts ({}): lower --top-k or raise --experts",
                k.top_k, k.num_experts
            ));
        }
        if k.vocab_size <= NUM_SPECIALS + 256 {
            return bad(format!(
                "--vocab {}: leaves no room for 256 byte tokens and {NUM_SPECIALS} specials \
                 (give at least {})",
                k.vocab_size,
                NUM_SPECIALS + 257
            ));
        }
        Ok(())
    }

    /// The validated tensors, in file order.
    pub fn tensors(&self) -> Result<Vec<SynthTensor>> {
        self.validate()?;
        self.shape().tensors()
    }

    /// Bytes of tensor data of the model (headers excluded).
    pub fn data_bytes(&self) -> Result<u64> {
        self.validate()?;
        self.shape().data_bytes()
    }
}

/// Id of the synthetic tokenizer's special `offset` (0 = `[BOS]`, 1 =
/// `[EOS]`, 255 = `[PAD]`; see `tokenizer.rs`) in a vocabulary of `vocab`.
pub fn special_id(vocab: usize, offset: usize) -> usize {
    vocab - NUM_SPECIALS + offset
}

/// The loader's complaint about a synthesized config, as a synth error.
pub(crate) fn config_error(family: &str, e: impl std::fmt::Display) -> SynthError {
    SynthError::Invalid(format!(
        "these flags give a {family} config.json its loader refuses: {e}"
    ))
}

/// `x` rounded to a multiple of 32, at least 32 (widths of scaled-down
/// models: INT4 groups and MXFP4 blocks are 32 wide).
pub(crate) fn round32(x: f64) -> usize {
    ((x / 32.0).round() as usize).max(1) * 32
}

/// A head count scaled by `s`, at least 1.
pub(crate) fn scale_heads(n: usize, s: f64) -> usize {
    ((n as f64 * s).round() as usize).max(1)
}

/// `--hidden` checked: a positive multiple of 32.
pub(crate) fn check_hidden(h: usize) -> Result<()> {
    if h < 32 || !h.is_multiple_of(32) {
        return Err(SynthError::Invalid(format!(
            "--hidden {h}: must be a multiple of 32 (INT4 groups and MXFP4 blocks are 32 wide), \
             at least 32"
        )));
    }
    Ok(())
}
