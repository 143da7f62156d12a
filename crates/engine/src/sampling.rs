//! Token sampling: turns one row of model logits into the next token.
//!
//! [`sample`] is a pure function of its arguments. The random draw comes
//! from [`uniform`], a counter-based hash of `(seed, choice, position)`, not
//! from a stateful generator, so a token can be recomputed at any time (after
//! a preemption, on another worker, by a speculative verifier) and two
//! completions of one request differ only through `choice`.
//!
//! # Processing order
//!
//! 1. Repetition penalty (CTRL / Hugging Face style): for each distinct
//!    token in `prompt ∪ generated`, a logit `> 0` is divided by
//!    `repetition_penalty`, any other logit is multiplied by it.
//! 2. Presence and frequency penalties (OpenAI style), over `generated`
//!    only: `logit -= presence · [count > 0] + frequency · count`.
//! 3. If `temperature == 0`: return [`argmax`] of the penalised logits (with
//!    no penalties this is exactly `argmax(logits)`).
//! 4. Divide by the temperature (in f64).
//! 5. Top-k: keep the `k` largest. Candidates are ordered by a total,
//!    deterministic order: value descending, then token id ascending, so a
//!    tie at the boundary keeps the lower id.
//! 6. Softmax over the survivors (f64, max-subtracted).
//! 7. Top-p: keep the smallest prefix (in that order) whose cumulative
//!    probability is `>= top_p`; at least one token is always kept.
//! 8. Min-p: drop tokens whose probability is `< min_p · max probability`.
//! 9. Renormalise, draw `u = uniform(seed, choice, position)` and walk the
//!    survivors in order: the first whose cumulative probability exceeds
//!    `u` is chosen (the last survivor if rounding leaves `u` above the
//!    total).
//!
//! Steps 1–2 work in f32 on a copy of the logits (no copy when no penalty
//! applies); everything from step 4 on is f64 in this fixed order, so
//! results are bit-reproducible. On a vocabulary of [`PARALLEL_FROM`]
//! logits or more the element-wise passes (scaling, `exp`, the division,
//! the sort, the best-n scan) run on rayon's pool, while every sum still
//! runs on one thread in rank or index order and the sort is on a total
//! order of unique keys: the thread count never changes a bit.
//!
//! # Non-finite logits
//!
//! NaN counts as `-inf`: it is never chosen unless every logit is NaN or
//! `-inf`, and then the answer is token 0 (greedy and sampled alike).
//! `+inf` counts as the largest value: such tokens share all probability.
//! Tokens whose probability underflows to exactly 0 are never drawn.
//!
//! # Log-probabilities
//!
//! [`Sampled::logprob`] and [`Sampled::top`] describe the *raw* model
//! distribution: the log-softmax of the logits as given, before penalties,
//! temperature and filters (the OpenAI convention differs between servers;
//! this one does not depend on the sampling settings). It is computed in
//! f64 (max-subtracted log-sum-exp) and reported as f32.
//!
//! # Cost
//!
//! With `top_k > 0` only the `k` best candidates are sorted (selection, then
//! a sort of `k`); with `top_k == 0` the vocabulary is sorted once. The
//! log-sum-exp for the reported log-probability is one more pass. On a
//! 163,840-token vocabulary these cost milliseconds on one thread — more
//! than a GPU's decode step — hence the parallel passes.

use std::borrow::Cow;
use std::fmt;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Logits from which the sampler's element-wise passes run on rayon's
/// pool (below it a pool's fixed cost outweighs the work).
pub(crate) const PARALLEL_FROM: usize = 1 << 15;

/// Whether a pass over `n` values runs on the pool.
fn parallel(n: usize) -> bool {
    n >= PARALLEL_FROM
}

/// Highest accepted temperature.
pub const MAX_TEMPERATURE: f32 = 100.0;
/// Most top log-probabilities one token may report.
pub const MAX_LOGPROBS: usize = 20;

/// How the next token is chosen. Defaults: greedy, every filter off.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise a finite number in `(0, 100]`.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Nucleus sampling threshold in `(0, 1]`; 1 = off.
    pub top_p: f32,
    /// Drop tokens below `min_p · max probability`; in `[0, 1]`, 0 = off.
    pub min_p: f32,
    /// CTRL-style penalty over prompt and generated tokens; `> 0`, 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over generated tokens, in `[-2, 2]`.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over generated tokens, in `[-2, 2]`.
    pub frequency_penalty: f32,
    /// Seed of the counter-based draw (see [`uniform`]).
    pub seed: u64,
    /// Number of top log-probabilities to report (at most 20); `None` = none.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Checks every field; the error names the field, the bad value and the
    /// allowed range. NaN is rejected for every float field.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !(0.0..=MAX_TEMPERATURE).contains(&t) {
            return Err(invalid("temperature", "a finite number in [0, 100]", t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", "a number in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid("min_p", "a number in [0, 1]", self.min_p));
        }
        let rp = self.repetition_penalty;
        if !(rp.is_finite() && rp > 0.0) {
            let rule = "a finite number > 0 (1 = off)";
            return Err(invalid("repetition_penalty", rule, rp));
        }
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(invalid(field, "a number in [-2, 2]", v));
            }
        }
        match self.logprobs {
            Some(n) if n > MAX_LOGPROBS => Err(invalid("logprobs", "at most 20", n)),
            _ => Ok(()),
        }
    }

    /// True when the choice is the argmax (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// A rejected [`SamplingParams`] field.
#[derive(Debug, Clone, PartialEq)]
pub enum SamplingError {
    /// `field` is out of range; `msg` names it, the value and the range.
    Invalid { field: &'static str, msg: String },
}

impl SamplingError {
    /// The offending field's name (as in the JSON request).
    pub fn field(&self) -> &'static str {
        match self {
            Self::Invalid { field, .. } => field,
        }
    }
}

impl fmt::Display for SamplingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid { msg, .. } => f.write_str(msg),
        }
    }
}

impl std::error::Error for SamplingError {}

fn invalid(field: &'static str, rule: &str, got: impl fmt::Display) -> SamplingError {
    let msg = format!("{field} must be {rule}, got {got}");
    SamplingError::Invalid { field, msg }
}

/// One chosen token and its log-probabilities.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sampled {
    pub token: u32,
    /// log-softmax of the RAW model logits (before penalties/temperature/filters) at `token`.
    /// `None` when params.logprobs is None: the sum over the whole
    /// vocabulary is then not computed (milliseconds a token at K3's size).
    pub logprob: Option<f32>,
    /// The `logprobs` most likely tokens under the same raw log-softmax, best first, ties -> lower id.
    /// Empty when params.logprobs is None.
    pub top: Vec<(u32, f32)>,
}

/// Picks the next token. Pure function: the result depends only on its arguments.
/// `prompt` and `generated` are the sequence's tokens so far (for penalties).
/// `choice` is the completion index (n > 1 completions of one request differ by it),
/// `position` the absolute position in the sequence of the token being chosen.
///
/// Token ids outside `logits` in `prompt`/`generated` are ignored. The
/// parameters are expected to have passed [`SamplingParams::validate`].
pub fn sample(
    params: &SamplingParams,
    logits: &[f32],
    prompt: &[u32],
    generated: &[u32],
    choice: u32,
    position: u64,
) -> Sampled {
    let penalised = apply_penalties(params, logits, prompt, generated);
    let token = if params.is_greedy() {
        argmax(&penalised)
    } else {
        let u = uniform(params.seed, choice, position);
        draw(params, &penalised, u)
    };
    match params.logprobs {
        Some(n) => report(logits, token, n),
        None => Sampled {
            token,
            logprob: None,
            top: Vec::new(),
        },
    }
}

/// Index of the largest value; ties (and equal values) go to the LOWER index; i.e. a value replaces the
/// best only if strictly greater. This must be exactly what greedy uses.
///
/// NaN never replaces anything (it counts as `-inf`); an empty slice, or one
/// of only NaN / `-inf`, gives 0.
pub fn argmax(x: &[f32]) -> u32 {
    fathom_kernels::ops::argmax(x)
}

const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output finalizer: a bijection on `u64` with good avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The uniform draw in [0, 1) for (seed, choice, position): a counter-based hash (SplitMix64-style finalizer
/// chained over the three inputs), 53 random bits -> f64. Never a stateful RNG.
///
/// Each chaining step is a bijection of the running hash for a fixed input,
/// so for a fixed `(seed, choice)` different positions give different
/// 64-bit hashes. This function is part of the reproducibility contract:
/// changing it changes every seeded completion.
pub fn uniform(seed: u64, choice: u32, position: u64) -> f64 {
    let mut h = mix64(seed.wrapping_add(GOLDEN_GAMMA));
    h = mix64(h ^ mix64(u64::from(choice).wrapping_add(GOLDEN_GAMMA.wrapping_mul(2))));
    h = mix64(h ^ mix64(position.wrapping_add(GOLDEN_GAMMA.wrapping_mul(3))));
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Steps 1–2: the logits after repetition, presence and frequency
/// penalties; borrowed unchanged when no penalty applies.
fn apply_penalties<'a>(
    params: &SamplingParams,
    logits: &'a [f32],
    prompt: &[u32],
    generated: &[u32],
) -> Cow<'a, [f32]> {
    let repetition =
        params.repetition_penalty != 1.0 && !(prompt.is_empty() && generated.is_empty());
    let occurrence = (params.presence_penalty != 0.0 || params.frequency_penalty != 0.0)
        && !generated.is_empty();
    if !repetition && !occurrence {
        return Cow::Borrowed(logits);
    }
    let mut out = logits.to_vec();
    if repetition {
        repetition_penalty(&mut out, params.repetition_penalty, prompt, generated);
    }
    if occurrence {
        let (presence, frequency) = (params.presence_penalty, params.frequency_penalty);
        occurrence_penalty(&mut out, presence, frequency, generated);
    }
    Cow::Owned(out)
}

/// Step 1: once per distinct token of `prompt ∪ generated`.
fn repetition_penalty(logits: &mut [f32], penalty: f32, prompt: &[u32], generated: &[u32]) {
    let mut seen = vec![false; logits.len()];
    for &t in prompt.iter().chain(generated) {
        let t = t as usize;
        if t < logits.len() && !seen[t] {
            seen[t] = true;
            let l = logits[t];
            logits[t] = if l > 0.0 { l / penalty } else { l * penalty };
        }
    }
}

/// Step 2: `logit -= presence · [count > 0] + frequency · count`.
fn occurrence_penalty(logits: &mut [f32], presence: f32, frequency: f32, generated: &[u32]) {
    let mut sorted = generated.to_vec();
    sorted.sort_unstable();
    for run in sorted.chunk_by(|a, b| a == b) {
        if let Some(l) = logits.get_mut(run[0] as usize) {
            *l -= presence + frequency * run.len() as f32;
        }
    }
}

/// A candidate as `(rank_key(value), id)`: the tuple's natural order is the
/// deterministic total order of the module, value descending, then id
/// ascending. Integer keys make the full-vocabulary sort a few times faster
/// than comparing floats.
type Ranked = (u64, u32);

/// Order-reversing bijection from non-NaN `f64` to `u64`: a larger value
/// gets a smaller key. `-0.0` is folded into `+0.0` so the two tie.
fn rank_key(v: f64) -> u64 {
    let bits = (v + 0.0).to_bits();
    let ascending = if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    };
    !ascending
}

/// Inverse of [`rank_key`].
fn rank_value(key: u64) -> f64 {
    let ascending = !key;
    let bits = if ascending >> 63 == 1 {
        ascending & !(1 << 63)
    } else {
        !ascending
    };
    f64::from_bits(bits)
}

/// NaN → `-inf`, `+inf` → `f64::MAX` (so max-subtraction stays finite).
fn order_key(v: f64) -> f64 {
    if v.is_nan() {
        f64::NEG_INFINITY
    } else if v == f64::INFINITY {
        f64::MAX
    } else {
        v
    }
}

/// Steps 4–9 for a positive temperature.
fn draw(params: &SamplingParams, logits: &[f32], u: f64) -> u32 {
    draw_in(params, logits, u, parallel(logits.len()))
}

/// [`draw`] with its element-wise passes on the pool or not (`par`): the
/// same token either way.
fn draw_in(params: &SamplingParams, logits: &[f32], u: f64, par: bool) -> u32 {
    let ranked = ranked_candidates(logits, f64::from(params.temperature), params.top_k, par);
    if ranked.is_empty() {
        return 0; // every logit is NaN or -inf
    }
    // After top-k the candidates may be few: the pool only for many.
    let probs = softmax_sorted(&ranked, par && parallel(ranked.len()));
    let keep = nucleus_len(&probs, params.top_p)
        .min(min_p_len(&probs, params.min_p))
        .min(positive_len(&probs))
        .max(1);
    let total: f64 = probs[..keep].iter().sum();
    let mut cumulative = 0.0;
    for (&(_, token), &p) in ranked[..keep].iter().zip(&probs) {
        cumulative += p / total;
        if cumulative > u {
            return token;
        }
    }
    ranked[keep - 1].1
}

/// Steps 4–5: scaled logits of the finite-or-`+inf` tokens, top-k applied,
/// sorted best first (keys are unique, so an unstable sort, parallel or
/// not, gives one order).
fn ranked_candidates(logits: &[f32], temperature: f64, top_k: usize, par: bool) -> Vec<Ranked> {
    let key = |(i, &l): (usize, &f32)| {
        let v = order_key(f64::from(l) / temperature);
        (v > f64::NEG_INFINITY).then(|| (rank_key(v), i as u32))
    };
    let mut ranked: Vec<Ranked> = if par {
        logits.par_iter().enumerate().filter_map(key).collect()
    } else {
        logits.iter().enumerate().filter_map(key).collect()
    };
    if top_k > 0 && top_k < ranked.len() {
        ranked.select_nth_unstable(top_k - 1);
        ranked.truncate(top_k);
    }
    if par && parallel(ranked.len()) {
        ranked.par_sort_unstable();
    } else {
        ranked.sort_unstable();
    }
    ranked
}

/// Step 6: probabilities of candidates already sorted best first (the sum
/// on one thread in rank order).
fn softmax_sorted(ranked: &[Ranked], par: bool) -> Vec<f64> {
    let max = rank_value(ranked[0].0);
    let term = |&(key, _): &Ranked| (rank_value(key) - max).exp();
    let mut probs: Vec<f64> = if par {
        ranked.par_iter().map(term).collect()
    } else {
        ranked.iter().map(term).collect()
    };
    let sum: f64 = probs.iter().sum();
    if par {
        probs.par_iter_mut().for_each(|p| *p /= sum);
    } else {
        probs.iter_mut().for_each(|p| *p /= sum);
    }
    probs
}

/// Step 7: length of the smallest prefix whose cumulative probability
/// reaches `top_p` (at least 1).
fn nucleus_len(probs: &[f64], top_p: f32) -> usize {
    if top_p >= 1.0 {
        return probs.len();
    }
    let top_p = f64::from(top_p);
    let mut cumulative = 0.0;
    for (i, &p) in probs.iter().enumerate() {
        cumulative += p;
        if cumulative >= top_p {
            return i + 1;
        }
    }
    probs.len()
}

/// Step 8: number of tokens with probability `>= min_p · max` (a prefix,
/// since `probs` is non-increasing).
fn min_p_len(probs: &[f64], min_p: f32) -> usize {
    if min_p <= 0.0 {
        return probs.len();
    }
    let threshold = f64::from(min_p) * probs[0];
    probs.partition_point(|&p| p >= threshold)
}

/// Tokens whose probability did not underflow to zero (a prefix).
fn positive_len(probs: &[f64]) -> usize {
    probs.partition_point(|&p| p > 0.0)
}

/// The raw log-softmax at `token` and at the `top_n` best tokens.
fn report(logits: &[f32], token: u32, top_n: usize) -> Sampled {
    report_in(logits, token, top_n, parallel(logits.len()))
}

/// [`report`] with its passes on the pool or not (`par`): the same bits.
fn report_in(logits: &[f32], token: u32, top_n: usize, par: bool) -> Sampled {
    let lsm = LogSoftmax::new(logits, par);
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| lsm.at(l));
    let top = top_tokens(logits, top_n, par)
        .into_iter()
        .map(|t| (t, lsm.at(logits[t as usize])))
        .collect();
    Sampled {
        token,
        logprob: Some(logprob),
        top,
    }
}

/// `log_softmax(x) = (x - max) - ln Σ exp(x_j - max)`, in f64 (the sum on
/// one thread in index order).
struct LogSoftmax {
    max: f64,
    log_sum: f64,
}

impl LogSoftmax {
    fn new(logits: &[f32], par: bool) -> Self {
        let key = |&l: &f32| order_key(f64::from(l));
        // Exact whatever the grouping (no NaN after `order_key`; a zero's
        // sign cannot change `at` or a term).
        let max = if par {
            logits
                .par_iter()
                .map(key)
                .reduce(|| f64::NEG_INFINITY, f64::max)
        } else {
            logits.iter().map(key).fold(f64::NEG_INFINITY, f64::max)
        };
        if max == f64::NEG_INFINITY {
            return Self { max, log_sum: 0.0 };
        }
        let term = |l: &f32| (key(l) - max).exp();
        let sum: f64 = if par {
            let terms: Vec<f64> = logits.par_iter().map(term).collect();
            terms.iter().sum()
        } else {
            logits.iter().map(term).sum()
        };
        Self {
            max,
            log_sum: sum.ln(),
        }
    }

    /// `-inf` when every logit is NaN or `-inf`.
    fn at(&self, logit: f32) -> f32 {
        if self.max == f64::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        ((order_key(f64::from(logit)) - self.max) - self.log_sum) as f32
    }
}

/// The `n` best raw logits' ids in [`Ranked`] order (n is at most
/// [`MAX_LOGPROBS`] after validation); with `par`, the best `n` of each
/// slice of [`PARALLEL_FROM`] on the pool, then the best `n` of those (a
/// total order: the same ids).
fn top_tokens(logits: &[f32], n: usize, par: bool) -> Vec<u32> {
    if n == 0 {
        return Vec::new();
    }
    let best = if par {
        let mut all: Vec<Ranked> = logits
            .par_chunks(PARALLEL_FROM)
            .enumerate()
            .flat_map_iter(|(c, part)| best_of(part, c * PARALLEL_FROM, n))
            .collect();
        all.sort_unstable();
        all.truncate(n);
        all
    } else {
        best_of(logits, 0, n)
    };
    best.into_iter().map(|(_, t)| t).collect()
}

/// The `n` best of `logits` (ids from `base`) in [`Ranked`] order, in one
/// pass with a small sorted buffer.
fn best_of(logits: &[f32], base: usize, n: usize) -> Vec<Ranked> {
    let mut best: Vec<Ranked> = Vec::with_capacity(n + 1);
    for (i, &l) in logits.iter().enumerate() {
        let c = (rank_key(order_key(f64::from(l))), (base + i) as u32);
        if best.len() == n && c >= best[n - 1] {
            continue;
        }
        let at = best.partition_point(|b| *b < c);
        best.insert(at, c);
        best.truncate(n);
    }
    best
}

#[cfg(test)]
#[path = "sampling_tests.rs"]
mod tests;
