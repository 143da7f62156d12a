//! What one step runs (`plan`), what its logits become (`absorb`), and a
//! finished sequence's report (`finish`).
//!
//! Scheduling: decoding sequences first (one pending token each, plus
//! drafts when drafting pays), then prompts in arrival order, chunked to the
//! step's remaining token budget; a step always makes progress.

use std::time::Instant;

use fathom_model::Logits;

use crate::report::SeqStats;
use crate::sampling::{Sampled, sample};
use crate::scheduler::{Decoder, Engine, Event, FinishReason, Finished, Seq, TokenEvent, Work};

/// The work of the next step.
pub(crate) fn plan(e: &mut Engine) -> Vec<Work> {
    let max_batch = e.opts.max_batch.max(1);
    let mut budget = e.opts.max_step_tokens.max(1);
    let mut works = Vec::new();
    for (i, s) in e.seqs.iter_mut().enumerate() {
        if works.len() >= max_batch || budget == 0 {
            break;
        }
        if s.done.is_some() || s.fed < s.req.prompt.len() {
            continue;
        }
        let pending = *s
            .out
            .last()
            .expect("a decoding sequence has a pending token");
        let room = s.req.max_new - s.out.len();
        let k = s.policy.k.min(room).min(budget - 1);
        let mut drafts = Vec::new();
        let mut draft_s = 0.0;
        if s.req.drafter.is_some() && k > 0 && s.policy.drafting() {
            let t = Instant::now();
            let ctx = s.context();
            let target = s.state.as_ref();
            match s
                .req
                .drafter
                .as_mut()
                .expect("checked")
                .propose(&ctx, k, target)
            {
                Ok(mut p) => {
                    p.truncate(k);
                    drafts = p;
                }
                Err(err) => {
                    // A drafter only proposes: its failure costs speed, never
                    // the sequence. Decode on without it.
                    let name = s
                        .dstats
                        .as_ref()
                        .map_or(String::new(), |d| d.drafter.clone());
                    tracing::warn!("drafter {name} failed, drafting off: {err}");
                    s.req.drafter = None;
                }
            }
            draft_s = t.elapsed().as_secs_f64();
        }
        if !drafts.is_empty() {
            s.state.begin_pass();
        }
        let mut tokens = Vec::with_capacity(1 + drafts.len());
        tokens.push(pending);
        tokens.extend_from_slice(&drafts);
        budget = budget.saturating_sub(tokens.len());
        let logits = if drafts.is_empty() {
            Logits::Last
        } else {
            Logits::All
        };
        works.push(Work {
            seq: i,
            tokens,
            logits,
            drafts,
            decode: true,
            draft_s,
        });
    }
    for (i, s) in e.seqs.iter().enumerate() {
        if works.len() >= max_batch || (budget == 0 && !works.is_empty()) {
            break;
        }
        let len = s.req.prompt.len();
        if s.done.is_some() || s.fed >= len {
            continue;
        }
        let mut chunk = (len - s.fed).min(budget.max(1));
        if let Some(&c) = s.req.checkpoints.iter().filter(|&&c| c > s.fed).min() {
            chunk = chunk.min(c - s.fed);
        }
        budget = budget.saturating_sub(chunk);
        let logits = if s.fed + chunk == len {
            Logits::Last
        } else {
            Logits::None
        };
        works.push(Work {
            seq: i,
            tokens: s.req.prompt[s.fed..s.fed + chunk].to_vec(),
            logits,
            drafts: Vec::new(),
            decode: false,
            draft_s: 0.0,
        });
    }
    works
}

/// Takes one work item's logits: advances the prompt, or samples, checks
/// drafts and keeps exactly the accepted positions.
pub(crate) fn absorb(
    e: &mut Engine,
    w: &Work,
    logits: &[f32],
    step_s: f64,
    events: &mut Vec<Event>,
) {
    let vocab = e.lm.info().vocab_size;
    let decoder = e.decoder.clone();
    let s = &mut e.seqs[w.seq];
    if !w.decode {
        s.fed += w.tokens.len();
        if s.req.checkpoints.contains(&s.fed) {
            events.push(Event::Checkpoint {
                seq: s.id,
                tokens: s.req.prompt[..s.fed].to_vec(),
                state: s.state.fork(),
            });
        }
        if s.fed < s.req.prompt.len() {
            return;
        }
        s.prefilled = Some(Instant::now());
        if s.req.max_new == 0 {
            s.done = Some(FinishReason::Length);
            return;
        }
        if let Some(sm) = draw(s, &logits[..vocab]) {
            emit(s, sm, decoder.as_ref(), events);
        }
        return;
    }
    let k = w.drafts.len();
    let mut accepted = 0;
    for j in 0..=k {
        let Some(sm) = draw(s, &logits[j * vocab..(j + 1) * vocab]) else {
            break;
        };
        let tok = sm.token;
        let ended = emit(s, sm, decoder.as_ref(), events);
        if ended || j == k || tok != w.drafts[j] {
            break;
        }
        accepted += 1;
    }
    if k == 0 {
        s.policy.after_plain(step_s);
        if let Some(d) = s.dstats.as_mut() {
            d.plain_steps += 1;
            d.plain_s += step_s;
        }
        return;
    }
    if let Err(err) = s.state.keep(accepted + 1) {
        s.done = Some(FinishReason::Error(err.to_string()));
    }
    s.policy.after_round(k, accepted, step_s, w.draft_s);
    if let Some(d) = s.dstats.as_mut() {
        d.verify_passes += 1;
        d.proposed += k as u64;
        d.accepted += accepted as u64;
        d.verify_s += step_s;
        d.draft_s += w.draft_s;
    }
}

/// The full model's choice for the sequence's next position, among what
/// its constraint allows; `None` (and the sequence ended) when the
/// constraint allows nothing.
fn draw(s: &mut Seq, logits: &[f32]) -> Option<Sampled> {
    let r = &mut s.req;
    let pos = (r.prompt.len() + s.out.len()) as u64;
    let Some(c) = r.constraint.as_mut() else {
        return Some(sample(
            &r.sampling,
            logits,
            &r.prompt,
            &s.out,
            r.choice,
            pos,
        ));
    };
    let mut masked = logits.to_vec();
    if !c.mask(&mut masked) {
        let why = "the response format allows no token here".to_string();
        s.done = Some(FinishReason::Error(why));
        return None;
    }
    let sm = sample(&r.sampling, &masked, &r.prompt, &s.out, r.choice, pos);
    c.accept(sm.token);
    Some(sm)
}

/// Appends a chosen token, releases its text, and decides whether the
/// sequence ends; returns whether it did.
fn emit(s: &mut Seq, sm: Sampled, decoder: Option<&Decoder>, events: &mut Vec<Event>) -> bool {
    let tok = sm.token;
    s.out.push(tok);
    if s.first_token.is_none() {
        s.first_token = Some(Instant::now());
    }
    let mut piece = String::new();
    let mut stopped = false;
    // A stop token ends the sequence; its spelling is not part of the text.
    let stop_token = s.req.stop_ids.contains(&tok);
    if let Some(dec) = decoder.filter(|_| !stop_token) {
        let full = dec(&s.out);
        // An incomplete UTF-8 sequence decodes to U+FFFD: wait for the rest.
        if !full.ends_with('\u{FFFD}') {
            if let Some(new) = full.get(s.decoded..) {
                let scan = s.stop.push(new);
                piece = scan.emit;
                stopped = scan.stopped;
            }
            s.decoded = full.len();
        }
    }
    s.text.push_str(&piece);
    events.push(Event::Token {
        seq: s.id,
        token: TokenEvent {
            sampled: sm,
            text: piece,
        },
    });
    let complete = s.req.constraint.as_ref().is_some_and(|c| c.is_done());
    if stopped || complete || stop_token {
        s.done = Some(FinishReason::Stop);
    } else if s.out.len() >= s.req.max_new {
        s.done = Some(FinishReason::Length);
    }
    s.done.is_some()
}

/// The `Finished` event of an ended sequence.
pub(crate) fn finish(e: &Engine, mut s: Seq) -> Event {
    let reason = s.done.take().unwrap_or(FinishReason::Cancelled);
    let tail = if reason == FinishReason::Stop {
        String::new()
    } else {
        s.stop.finish()
    };
    s.text.push_str(&tail);
    let mut consumed = s.req.prompt[..s.fed].to_vec();
    if s.fed == s.req.prompt.len() {
        if let Some((_, fed)) = s.out.split_last() {
            consumed.extend_from_slice(fed);
        }
    }
    let stats = seq_stats(&s);
    let mut draft = s.dstats.take();
    if let Some(d) = draft.as_mut() {
        d.finish();
    }
    Event::Finished {
        seq: s.id,
        done: Box::new(Finished {
            reason,
            text: e.decoder.as_ref().map(|_| std::mem::take(&mut s.text)),
            text_tail: tail,
            output_ids: s.out,
            stats,
            draft,
            consumed,
            state: s.state,
        }),
    }
}

fn seq_stats(s: &Seq) -> SeqStats {
    let now = Instant::now();
    let since = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
    let prefill_s = s.prefilled.map_or(0.0, |p| since(s.submitted, p));
    let fed = (s.fed - s.fed0) as f64;
    let decode_s = s.first_token.map_or(0.0, |f| since(f, now));
    let steady = s.out.len().saturating_sub(1);
    SeqStats {
        prompt_tokens: s.req.prompt.len(),
        generated_tokens: s.out.len(),
        prefill_s,
        prefill_tok_s: if prefill_s > 0.0 {
            fed / prefill_s
        } else {
            0.0
        },
        first_token_s: s.first_token.map_or(0.0, |f| since(s.submitted, f)),
        decode_s,
        decode_tok_s: if steady > 0 {
            steady as f64 / decode_s.max(1e-9)
        } else {
            0.0
        },
        state_bytes: s.state.bytes(),
        peak_rss_bytes: crate::sys::peak_rss_bytes().unwrap_or(0),
    }
}
