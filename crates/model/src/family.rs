//! The family kit: what a model family supplies, and the one generic
//! [`Model`] that turns it into a [`CausalLm`], its loaders and its registry
//! entry.
//!
//! A family is its folder — typed spec from `config.json`, tensor table,
//! weights, step — plus an `impl Family` and one line in
//! [`crate::registry::ARCHITECTURES`]. Loading (checkpoint, spine precision,
//! expert source, attention-cache pool), the `CausalLm` methods and the
//! registry's functions live here once.

use std::path::Path;
use std::sync::Arc;

use fathom_weights::Checkpoint;

use crate::anatomy::Anatomy;
use crate::config::{Architecture, LoadOptions, MakeSource, ModelConfig, resident_source};
use crate::error::{ModelError, Result};
use crate::experts::{ExpertSource, ExpertStats, ExpertTable};
use crate::kv::KvPool;
use crate::linear::Spine;
use crate::lm::{CausalLm, Logits, ModelInfo, SelfDrafter, SeqState, StepError, StepInput};
use crate::memory::MemoryFacts;
use crate::tiers::LayerPlan;
use crate::trace::Tracer;

/// What a step returns: per entry, the logits its [`Logits`] asks for.
pub type StepResult = std::result::Result<Vec<Vec<f32>>, StepError>;

/// One model family.
pub trait Family: Sized + Send + Sync + 'static {
    /// Human name (`"Kimi K3"`).
    const NAME: &'static str;
    /// `config.json` `model_type` values it reads.
    const MODEL_TYPES: &'static [&'static str];
    /// `architectures` entries it reads (when `model_type` is absent).
    const ARCHITECTURES: &'static [&'static str];
    /// Its checkpoints may carry a multi-token-prediction layer that
    /// `--draft mtp` reads.
    const MTP: bool = false;

    /// The typed, validated configuration.
    type Spec: Send + Sync + 'static;
    /// The spine's weights.
    type Weights: Send + Sync + 'static;
    /// What else a loaded model keeps (rotary tables, state layouts, a
    /// prediction layer).
    type Parts: Send + Sync + 'static;
    /// One sequence's state.
    type State: SeqState;

    /// Parses and validates `config.json`.
    fn spec(config: &serde_json::Value) -> Result<Self::Spec>;
    /// What the RAM ledger needs, from the spec alone.
    fn memory_facts(spec: &Self::Spec) -> MemoryFacts;
    /// Where every routed expert lies (`mtp`: the prediction layer's too).
    fn expert_table(spec: &Self::Spec, ck: &Checkpoint, mtp: bool) -> Result<ExpertTable>;
    /// Every disagreement between the checkpoint and the spec's tensor
    /// table (missing, unexpected, mis-shaped, mis-typed), one line each.
    fn check_tensors(spec: &Self::Spec, ck: &Checkpoint) -> Vec<String>;
    /// The layer plan and the components, when the family draws them.
    fn anatomy(spec: &Self::Spec) -> Option<Anatomy> {
        let _ = spec;
        None
    }
    /// The spine, bound to the checkpoint's tensors, in `spine` precision;
    /// its decoder layers resident or streamed as `layers` places them.
    fn weights(
        spec: &Arc<Self::Spec>,
        ck: &Arc<Checkpoint>,
        spine: Spine,
        layers: &LayerPlan,
    ) -> Result<Self::Weights>;
    /// What reading the spine's streamed layers has cost so far.
    fn spine_reads(weights: &Self::Weights) -> crate::tiers::SpineReads;
    /// The other parts (`mtp`: load the prediction layer too).
    fn parts(spec: &Self::Spec, ck: &Arc<Checkpoint>, mtp: bool) -> Result<Self::Parts>;
    /// The model's description; the kit fills `family` and the routed
    /// experts' figures from the expert table.
    fn info(spec: &Self::Spec) -> ModelInfo;

    fn new_state(model: &Model<Self>) -> Self::State;
    /// A state from [`SeqState::encode`]'s bytes.
    fn decode_state(model: &Model<Self>, bytes: &[u8]) -> Result<Self::State>;
    /// A state as if `depth` tokens had been read (synthetic values).
    fn synthetic_state(model: &Model<Self>, depth: usize, seed: u64) -> Result<Self::State> {
        let _ = (model, depth, seed);
        Err(ModelError::Unsupported(format!(
            "{} has no synthetic states",
            Self::NAME
        )))
    }
    /// Advances every entry of `batch` (atomic), observed by `tracer`.
    fn step(
        model: &Model<Self>,
        batch: &mut [StepInput<'_>],
        tracer: Option<&mut dyn Tracer>,
    ) -> StepResult;
    /// The checkpoint's own drafter, when loaded.
    fn self_drafter(model: Arc<Model<Self>>) -> Option<Box<dyn SelfDrafter>> {
        let _ = model;
        None
    }
}

/// A loaded model of family `F`: spec, spine, a source of routed experts.
pub struct Model<F: Family> {
    pub spec: Arc<F::Spec>,
    pub weights: F::Weights,
    pub experts: Arc<dyn ExpertSource>,
    /// Locators of every routed expert (what a streamed source reads).
    pub expert_table: ExpertTable,
    /// Where every state's attention-cache blocks come from.
    pub kv: Arc<KvPool>,
    pub parts: F::Parts,
    info: ModelInfo,
}

impl<F: Family> Model<F> {
    /// Loads a model with every expert resident in RAM.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with_spine(dir, resident_source(), Spine::Bf16)
    }

    /// Loads the spine and builds the expert source with `make_source`.
    pub fn load_with(dir: &Path, make_source: MakeSource) -> Result<Self> {
        Self::load_with_spine(dir, make_source, Spine::Bf16)
    }

    /// As [`Self::load_with`], with the spine in `spine` precision.
    pub fn load_with_spine(dir: &Path, make_source: MakeSource, spine: Spine) -> Result<Self> {
        let opts = LoadOptions {
            spine,
            experts: Some(make_source),
            ..LoadOptions::default()
        };
        Self::load_config(&ModelConfig::read(dir)?, opts)
    }

    /// Loads the model `config` describes. An int8 spine is quantised a
    /// layer at a time as it is read, so the stored spine is never held
    /// whole, and before the expert source loads.
    pub fn load_config(config: &ModelConfig, opts: LoadOptions) -> Result<Self> {
        let spec = Arc::new(F::spec(config.json())?);
        let mut ck = match opts.checkpoint {
            Some(ck) => ck,
            None => Arc::new(Checkpoint::open(config.dir())?),
        };
        // An int8 spine is read from the int8 spine file where one was
        // written (`fathom convert`), else quantised as it is read.
        if opts.spine == Spine::Int8 {
            let file = ck.dir().join(fathom_weights::int8_spine::FILE_NAME);
            match Arc::get_mut(&mut ck) {
                Some(ck) => {
                    ck.attach_int8_spine()?;
                }
                None if file.exists() => {
                    return Err(ModelError::Tensor(format!(
                        "{}: the checkpoint handed in is shared, so the int8 spine file cannot be attached",
                        file.display()
                    )));
                }
                None => {}
            }
        }
        let weights = F::weights(&spec, &ck, opts.spine, &opts.layers)?;
        let parts = F::parts(&spec, &ck, opts.mtp)?;
        let expert_table = F::expert_table(&spec, &ck, opts.mtp)?;
        let make = opts.experts.unwrap_or_else(resident_source);
        let experts = make(&ck, &expert_table)?;
        let mut info = F::info(&spec);
        info.family = F::NAME;
        info.expert_bytes = expert_table.expert_bytes();
        info.moe_layers = expert_table.moe_layers();
        Ok(Model {
            spec,
            weights,
            experts,
            expert_table,
            kv: KvPool::new(opts.kv),
            parts,
            info,
        })
    }

    pub fn new_state(&self) -> F::State {
        F::new_state(self)
    }

    /// One sequence's pass.
    pub fn forward(&self, state: &mut F::State, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        self.forward_traced(state, tokens, which, None)
    }

    /// One sequence's pass, observed by `tracer` (reference comparisons).
    pub fn forward_traced(
        &self,
        state: &mut F::State,
        tokens: &[u32],
        which: Logits,
        tracer: Option<&mut dyn Tracer>,
    ) -> Result<Vec<f32>> {
        let mut b = [StepInput {
            state,
            tokens,
            logits: which,
        }];
        let mut out = F::step(self, &mut b, tracer).map_err(|e| e.error)?;
        Ok(out.pop().unwrap_or_default())
    }
}

impl<F: Family> CausalLm for Model<F> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn new_state(&self) -> Box<dyn SeqState> {
        Box::new(F::new_state(self))
    }
    fn step(&self, batch: &mut [StepInput<'_>]) -> StepResult {
        F::step(self, batch, None)
    }
    fn expert_stats(&self) -> ExpertStats {
        self.experts.stats()
    }
    fn kv_stats(&self) -> crate::kv::KvStats {
        self.kv.stats()
    }
    fn spine_reads(&self) -> crate::tiers::SpineReads {
        F::spine_reads(&self.weights)
    }
    fn decode_state(&self, bytes: &[u8]) -> Result<Box<dyn SeqState>> {
        Ok(Box::new(F::decode_state(self, bytes)?))
    }
    fn synthetic_state(&self, depth: usize, seed: u64) -> Result<Box<dyn SeqState>> {
        Ok(Box::new(F::synthetic_state(self, depth, seed)?))
    }
    fn self_drafter(self: Arc<Self>) -> Option<Box<dyn SelfDrafter>> {
        F::self_drafter(self)
    }
}

/// The registry's entry for family `F`.
pub const fn architecture<F: Family>() -> Architecture {
    Architecture {
        family: F::NAME,
        model_types: F::MODEL_TYPES,
        architectures: F::ARCHITECTURES,
        load: load_lm::<F>,
        memory: memory::<F>,
        experts: experts::<F>,
        check: check::<F>,
        anatomy: anatomy::<F>,
        mtp: F::MTP,
    }
}

fn load_lm<F: Family>(config: &ModelConfig, opts: LoadOptions) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(Model::<F>::load_config(config, opts)?))
}

fn memory<F: Family>(config: &ModelConfig) -> Result<MemoryFacts> {
    Ok(F::memory_facts(&F::spec(config.json())?))
}

fn experts<F: Family>(config: &ModelConfig, ck: &Checkpoint) -> Result<ExpertTable> {
    F::expert_table(&F::spec(config.json())?, ck, false)
}

fn check<F: Family>(config: &ModelConfig, ck: &Checkpoint) -> Result<Vec<String>> {
    Ok(F::check_tensors(&F::spec(config.json())?, ck))
}

fn anatomy<F: Family>(config: &ModelConfig) -> Result<Option<Anatomy>> {
    Ok(F::anatomy(&F::spec(config.json())?))
}

/// Reads `dir/config.json` and parses family `F`'s spec from it (tools and
/// tests; a load reads the file once through [`ModelConfig`]).
pub fn read_spec<F: Family>(dir: &Path) -> Result<F::Spec> {
    F::spec(ModelConfig::read(dir)?.json())
}

/// The [`Family`] functions most families write alike, inside their
/// `impl Family`: the spec from `Spec::from_json`, the RAM facts from the
/// folder's `memory_facts`, the expert table from `tensors::expert_table`
/// (no prediction layer), the tensor check from `tensors::check_tensors`
/// (or the function named third), the spine from `Weights::load` in the
/// asked precision and tiers, and the read counters of its `layers`.
macro_rules! plain_family_fns {
    ($spec:ty, $weights:ty) => {
        $crate::family::plain_family_fns!($spec, $weights, tensors::check_tensors);
    };
    ($spec:ty, $weights:ty, $check:path) => {
        fn check_tensors(spec: &$spec, ck: &fathom_weights::Checkpoint) -> Vec<String> {
            $check(spec, ck)
        }
        fn spec(config: &serde_json::Value) -> $crate::error::Result<$spec> {
            <$spec>::from_json(config)
        }
        fn memory_facts(spec: &$spec) -> $crate::memory::MemoryFacts {
            memory_facts(spec)
        }
        fn expert_table(
            spec: &$spec,
            ck: &fathom_weights::Checkpoint,
            _mtp: bool,
        ) -> $crate::error::Result<$crate::experts::ExpertTable> {
            tensors::expert_table(spec, ck)
        }
        fn weights(
            spec: &std::sync::Arc<$spec>,
            ck: &std::sync::Arc<fathom_weights::Checkpoint>,
            spine: $crate::linear::Spine,
            layers: &$crate::tiers::LayerPlan,
        ) -> $crate::error::Result<$weights> {
            <$weights>::load(spec, ck, spine, layers)
        }
        fn spine_reads(w: &$weights) -> $crate::tiers::SpineReads {
            w.layers.reads().with_head(w.head_reads())
        }
    };
}
pub(crate) use plain_family_fns;
