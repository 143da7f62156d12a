//! The step-wise engine: sequences are submitted and cancelled at any time;
//! every [`Engine::step`] picks the work (continuous batching under a
//! per-step token budget, prefill chunks riding along with decodes), runs
//! one batched model step, samples, and reports per-sequence [`Event`]s.
//!
//! What a sequence produces depends only on its own request: the model's
//! step is batch-invariant, sampling draws depend on (seed, choice,
//! position), and a draft is accepted only where it equals the token the
//! full model samples there. So batch composition, prefill chunking and
//! drafting never change output.

use std::sync::Arc;
use std::time::Instant;

use fathom_model::experts::ExpertStats;
use fathom_model::{CausalLm, Logits, ModelError, SeqState, StepInput};

use crate::constraint::Constraint;
use crate::draft::Drafter;
use crate::report::{EngineStats, SeqStats};
use crate::sampling::{Sampled, SamplingParams};
use crate::speculative::{DraftOptions, DraftStats, Policy};
use crate::stop::StopMatcher;

pub type SeqId = u64;

/// Turns token ids into text (the model's tokenizer).
pub type Decoder = Arc<dyn Fn(&[u32]) -> String + Send + Sync>;

/// A sequence to generate.
pub struct Request {
    /// Every prompt token (≥ 1).
    pub prompt: Vec<u32>,
    /// A state that has already consumed `prompt[..n]` (prefix reuse), with `n`.
    pub state: Option<(Box<dyn SeqState>, usize)>,
    pub max_new: usize,
    pub sampling: SamplingParams,
    /// Completion index within its request (`n > 1` completions differ by it).
    pub choice: u32,
    /// Tokens that end generation (kept in the output).
    pub stop_ids: Vec<u32>,
    /// Strings that end generation (cut from the text).
    pub stop_strings: Vec<String>,
    pub drafter: Option<Box<dyn Drafter>>,
    pub draft: DraftOptions,
    /// Masks the logits before each choice (structured output).
    pub constraint: Option<Box<dyn Constraint>>,
    /// Prompt lengths after which the state is reported ([`Event::Checkpoint`],
    /// for prefix caches); prefill chunks end there.
    pub checkpoints: Vec<usize>,
}

impl Request {
    pub fn new(prompt: Vec<u32>, max_new: usize) -> Self {
        Request {
            prompt,
            state: None,
            max_new,
            sampling: SamplingParams::default(),
            choice: 0,
            stop_ids: Vec::new(),
            stop_strings: Vec::new(),
            drafter: None,
            draft: DraftOptions::default(),
            constraint: None,
            checkpoints: Vec::new(),
        }
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_new` tokens.
    Length,
    Cancelled,
    /// The sequence failed (the message says why); the others went on.
    Error(String),
}

impl FinishReason {
    /// The OpenAI-style name.
    pub fn name(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error(_) => "error",
        }
    }
}

/// One generated token.
#[derive(Debug, Clone)]
pub struct TokenEvent {
    pub sampled: Sampled,
    /// Text released with this token (stop strings held back and cut).
    pub text: String,
}

/// A finished sequence.
pub struct Finished {
    pub reason: FinishReason,
    pub output_ids: Vec<u32>,
    /// Whole text (without a stop string), when there is a decoder.
    pub text: Option<String>,
    /// Text released at the end that no token event carried.
    pub text_tail: String,
    pub stats: SeqStats,
    pub draft: Option<DraftStats>,
    /// The state, having consumed `consumed` (prompt and generated tokens
    /// but the last, which was never fed).
    pub state: Box<dyn SeqState>,
    pub consumed: Vec<u32>,
}

pub enum Event {
    Token {
        seq: SeqId,
        token: TokenEvent,
    },
    /// The state after the prompt's first `tokens.len()` tokens (a requested checkpoint).
    Checkpoint {
        seq: SeqId,
        tokens: Vec<u32>,
        state: Box<dyn SeqState>,
    },
    Finished {
        seq: SeqId,
        done: Box<Finished>,
    },
}

/// How the engine schedules.
#[derive(Debug, Clone, Copy)]
pub struct EngineOptions {
    /// Most new positions per step, over all sequences (prefill is chunked to fit).
    pub max_step_tokens: usize,
    /// Most sequences per step.
    pub max_batch: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_step_tokens: 512,
            max_batch: 64,
        }
    }
}

pub(crate) struct Seq {
    pub id: SeqId,
    pub req: Request,
    pub state: Box<dyn SeqState>,
    /// Prompt tokens the state has consumed, and how many it came with.
    pub fed: usize,
    pub fed0: usize,
    pub out: Vec<u32>,
    pub policy: Policy,
    pub dstats: Option<DraftStats>,
    pub text: String,
    pub decoded: usize,
    pub stop: StopMatcher,
    pub cancelled: bool,
    /// Set when the sequence has ended; `reap` reports and removes it.
    pub done: Option<FinishReason>,
    pub submitted: Instant,
    pub prefilled: Option<Instant>,
    pub first_token: Option<Instant>,
}

impl Seq {
    /// Tokens the sequence consists of so far (prompt and generated).
    pub fn context(&self) -> Vec<u32> {
        let mut c = self.req.prompt.clone();
        c.extend_from_slice(&self.out);
        c
    }
}

/// One sequence's part of the planned step.
pub(crate) struct Work {
    pub seq: usize,
    pub tokens: Vec<u32>,
    pub logits: Logits,
    /// Proposed tokens (after the pending one), for decode work.
    pub drafts: Vec<u32>,
    pub decode: bool,
    pub draft_s: f64,
}

/// The step engine over one model.
pub struct Engine {
    pub(crate) lm: Arc<dyn CausalLm>,
    pub(crate) seqs: Vec<Seq>,
    next_id: SeqId,
    pub(crate) opts: EngineOptions,
    pub(crate) decoder: Option<Decoder>,
    pub(crate) stats: EngineStats,
    pub(crate) started: Option<(Instant, ExpertStats)>,
}

/// A request the engine refuses, with the reason.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("{0}")]
    Sampling(#[from] crate::sampling::SamplingError),
    #[error("empty prompt: at least one token is needed")]
    EmptyPrompt,
    #[error("token id {id} is outside the model's vocabulary (0..{vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error(
        "the given state has consumed {fed} tokens but the prompt has {len}: it must leave at least one prompt token to feed"
    )]
    StateTooLong { fed: usize, len: usize },
}

impl Engine {
    pub fn new(lm: Arc<dyn CausalLm>, opts: EngineOptions, decoder: Option<Decoder>) -> Self {
        Engine {
            lm,
            seqs: Vec::new(),
            next_id: 0,
            opts,
            decoder,
            stats: EngineStats::default(),
            started: None,
        }
    }

    pub fn model(&self) -> &Arc<dyn CausalLm> {
        &self.lm
    }

    /// Queues a sequence; it joins the next step.
    pub fn submit(&mut self, mut req: Request) -> Result<SeqId, SubmitError> {
        req.sampling.validate()?;
        let vocab = self.lm.info().vocab_size;
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some(&id) = req.prompt.iter().find(|&&i| i as usize >= vocab) {
            return Err(SubmitError::TokenOutOfRange { id, vocab });
        }
        let (state, fed) = match req.state.take() {
            Some((s, fed)) if fed >= req.prompt.len() => {
                drop(s);
                return Err(SubmitError::StateTooLong {
                    fed,
                    len: req.prompt.len(),
                });
            }
            Some((s, fed)) => (s, fed),
            None => (self.lm.new_state(), 0),
        };
        let id = self.next_id;
        self.next_id += 1;
        let dstats = req.drafter.as_ref().map(|d| DraftStats {
            drafter: d.name(),
            ..Default::default()
        });
        self.seqs.push(Seq {
            id,
            policy: Policy::new(req.draft),
            stop: StopMatcher::new(req.stop_strings.clone()),
            req,
            state,
            fed,
            fed0: fed,
            out: Vec::new(),
            dstats,
            text: String::new(),
            decoded: 0,
            cancelled: false,
            done: None,
            submitted: Instant::now(),
            prefilled: None,
            first_token: None,
        });
        Ok(id)
    }

    /// Ends a sequence at the next step (its `Finished` says `Cancelled`).
    pub fn cancel(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.iter_mut().find(|s| s.id == id) {
            s.cancelled = true;
        }
    }

    /// Sequences not yet finished.
    pub fn running(&self) -> usize {
        self.seqs.len()
    }

    /// Sequences still reading their prompt.
    pub fn prefilling(&self) -> usize {
        self.seqs
            .iter()
            .filter(|s| s.fed < s.req.prompt.len())
            .count()
    }

    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Counters since the first step.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats.clone();
        if let Some((t0, e0)) = &self.started {
            s.wall_s = t0.elapsed().as_secs_f64();
            s.experts = self.lm.expert_stats().since(e0);
        }
        s
    }

    /// Runs one step; returns what happened to each sequence.
    pub fn step(&mut self) -> Vec<Event> {
        let mut events = Vec::new();
        self.finish_cancelled(&mut events);
        if self.seqs.is_empty() {
            return events;
        }
        if self.started.is_none() {
            self.started = Some((Instant::now(), self.lm.expert_stats()));
        }
        let plan = crate::plan::plan(self);
        let t = Instant::now();
        let results = self.execute(&plan);
        let step_s = t.elapsed().as_secs_f64();
        for (w, logits) in plan.iter().zip(results) {
            if let Some(logits) = logits {
                crate::plan::absorb(self, w, &logits, step_s, &mut events);
            }
        }
        self.reap(&mut events);
        events
    }

    fn finish_cancelled(&mut self, events: &mut Vec<Event>) {
        for s in self
            .seqs
            .iter_mut()
            .filter(|s| s.cancelled && s.done.is_none())
        {
            s.done = Some(FinishReason::Cancelled);
        }
        self.reap(events);
    }

    /// Fails sequence `i` (by index) with `e`.
    pub(crate) fn fail(&mut self, i: usize, e: &ModelError) {
        self.seqs[i].done = Some(FinishReason::Error(e.to_string()));
    }

    /// Reports and removes every ended sequence.
    fn reap(&mut self, events: &mut Vec<Event>) {
        let mut i = 0;
        while i < self.seqs.len() {
            if self.seqs[i].done.is_some() {
                let s = self.seqs.remove(i);
                events.push(crate::plan::finish(self, s));
            } else {
                i += 1;
            }
        }
    }

    /// Runs the plan through the model; a sequence at fault ends with an
    /// error and the step is re-run for the others. Returns per work item
    /// its logits, or `None` where its sequence failed.
    fn execute(&mut self, plan: &[Work]) -> Vec<Option<Vec<f32>>> {
        let mut active: Vec<usize> = (0..plan.len()).collect();
        let mut out: Vec<Option<Vec<f32>>> = vec![None; plan.len()];
        while !active.is_empty() {
            match self.run_step(plan, &active) {
                Ok(rows) => {
                    for (&a, r) in active.iter().zip(rows) {
                        out[a] = Some(r);
                    }
                    break;
                }
                Err(e) => match e.seq {
                    Some(j) => {
                        let a = active.remove(j);
                        self.fail(plan[a].seq, &e.error);
                    }
                    None if active.len() == 1 => {
                        self.fail(plan[active[0]].seq, &e.error);
                        break;
                    }
                    None => {
                        // Not attributable: each sequence alone.
                        for &a in &active {
                            match self.run_step(plan, &[a]) {
                                Ok(mut r) => out[a] = r.pop(),
                                Err(e) => self.fail(plan[a].seq, &e.error),
                            }
                        }
                        break;
                    }
                },
            }
        }
        out
    }

    fn run_step(
        &mut self,
        plan: &[Work],
        active: &[usize],
    ) -> Result<Vec<Vec<f32>>, fathom_model::StepError> {
        let want: Vec<usize> = active.iter().map(|&a| plan[a].seq).collect();
        let mut states: Vec<Option<&mut Box<dyn SeqState>>> =
            self.seqs.iter_mut().map(|s| Some(&mut s.state)).collect();
        let mut batch: Vec<StepInput<'_>> = Vec::with_capacity(active.len());
        for (&a, &si) in active.iter().zip(&want) {
            let st = states[si].take().expect("one work item per sequence");
            batch.push(StepInput {
                state: st.as_mut(),
                tokens: &plan[a].tokens,
                logits: plan[a].logits,
            });
        }
        let r = self.lm.step(&mut batch);
        if r.is_ok() {
            self.stats.steps += 1;
            self.stats.batch_sum += active.len() as u64;
            self.stats.rows += active
                .iter()
                .map(|&a| plan[a].tokens.len() as u64)
                .sum::<u64>();
        }
        r
    }
}
