//! Decoding constraints: `response_format` as a JSON grammar, and an
//! enforced `tool_choice` as a program of forced tokens, a choice among
//! the tools and their arguments' grammar. Either masks the full model's
//! logits; the model still chooses among what is allowed.

use std::collections::VecDeque;
use std::sync::Arc;

use fathom_constrain::{Grammar, Matcher, TokenTrie};
use fathom_engine::Constraint;
use fathom_tokenizer::Tokenizer;

/// The vocabulary as the grammar sees it: specials never allowed.
pub(crate) fn trie(tok: &dyn Tokenizer, vocab: usize) -> TokenTrie {
    let tokens: Vec<Option<Vec<u8>>> = (0..vocab as u32)
        .map(|id| {
            if tok.is_special(id) {
                None
            } else {
                tok.token_bytes(id)
            }
        })
        .collect();
    TokenTrie::new(&tokens)
}

/// A JSON document, starting after `trigger` (the ids that open the
/// answer, e.g. after a thinking block) or right away.
pub(crate) struct JsonConstraint {
    matcher: Matcher,
    trie: Arc<TokenTrie>,
    tok: Arc<dyn Tokenizer>,
    trigger: Vec<u32>,
    seen: Vec<u32>,
    active: bool,
    allowed: Vec<bool>,
    /// End-of-sequence ids, allowed once the document is complete (a
    /// top-level number never closes by itself).
    stop_ids: Vec<u32>,
}

impl JsonConstraint {
    pub fn new(
        grammar: &Arc<Grammar>,
        trie: Arc<TokenTrie>,
        tok: Arc<dyn Tokenizer>,
        trigger: Vec<u32>,
        stop_ids: Vec<u32>,
        vocab: usize,
    ) -> Self {
        JsonConstraint {
            matcher: Matcher::new(grammar),
            trie,
            tok,
            active: trigger.is_empty(),
            trigger,
            seen: Vec::new(),
            allowed: vec![false; vocab],
            stop_ids,
        }
    }
}

impl Constraint for JsonConstraint {
    fn mask(&mut self, logits: &mut [f32]) -> bool {
        if !self.active {
            return true;
        }
        self.trie.allowed(&self.matcher, &mut self.allowed);
        if self.matcher.is_complete() {
            for &id in &self.stop_ids {
                if let Some(a) = self.allowed.get_mut(id as usize) {
                    *a = true;
                }
            }
        }
        let mut any = false;
        for (l, &ok) in logits.iter_mut().zip(&self.allowed) {
            if ok {
                any = true;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        any
    }

    fn accept(&mut self, token: u32) {
        if self.active {
            let bytes = self.tok.token_bytes(token).unwrap_or_default();
            let ok = self.matcher.feed(&bytes);
            debug_assert!(ok, "the mask allowed only tokens the grammar accepts");
            return;
        }
        self.seen.push(token);
        if self.seen.ends_with(&self.trigger) {
            self.active = true;
        }
    }

    fn is_done(&self) -> bool {
        self.active && self.matcher.is_finished()
    }
}

/// One part of a constrained reply.
#[derive(Debug, Clone)]
pub(crate) enum Step {
    /// Exactly these ids.
    Ids(Vec<u32>),
    /// Anything but `banned` ids (the trigger's ids excepted), until the
    /// reply's ids end with `trigger`: the model's free text before the
    /// constrained part (a thinking block).
    Free {
        trigger: Vec<u32>,
        banned: Arc<Vec<u32>>,
    },
    /// One of these id sequences, then that one's steps.
    Pick(Vec<(Vec<u32>, Vec<Step>)>),
    /// A JSON document of this grammar.
    Json(Arc<Grammar>),
}

/// Where a [`Step`] stands.
enum Cursor {
    Ids(Vec<u32>, usize),
    Free {
        trigger: Vec<u32>,
        banned: Arc<Vec<u32>>,
        seen: usize,
    },
    /// Alternatives still alive, and how many ids were chosen.
    Pick(Vec<(Vec<u32>, Vec<Step>)>, usize),
    Json(Matcher),
    Done,
}

/// A reply that is a tool call: runs a program of [`Step`]s.
pub(crate) struct ToolConstraint {
    cur: Cursor,
    rest: VecDeque<Step>,
    trie: Arc<TokenTrie>,
    tok: Arc<dyn Tokenizer>,
    allowed: Vec<bool>,
}

impl ToolConstraint {
    pub fn new(
        steps: &[Step],
        trie: Arc<TokenTrie>,
        tok: Arc<dyn Tokenizer>,
        vocab: usize,
    ) -> Self {
        let mut c = ToolConstraint {
            cur: Cursor::Done,
            rest: steps.iter().cloned().collect(),
            trie,
            tok,
            allowed: vec![false; vocab],
        };
        c.advance();
        c
    }

    /// Moves to the next step that is not already complete.
    fn advance(&mut self) {
        loop {
            self.cur = match self.rest.pop_front() {
                None => Cursor::Done,
                Some(Step::Ids(ids)) if ids.is_empty() => continue,
                Some(Step::Ids(ids)) => Cursor::Ids(ids, 0),
                Some(Step::Free { trigger, .. }) if trigger.is_empty() => continue,
                Some(Step::Free { trigger, banned }) => Cursor::Free {
                    trigger,
                    banned,
                    seen: 0,
                },
                Some(Step::Pick(alts)) if alts.is_empty() => Cursor::Done,
                Some(Step::Pick(alts)) => Cursor::Pick(alts, 0),
                Some(Step::Json(g)) => Cursor::Json(Matcher::new(&g)),
            };
            return;
        }
    }

    /// The id the next step must start with, when it is one fixed id.
    fn next_fixed(&self) -> Option<u32> {
        match self.rest.front() {
            Some(Step::Ids(ids)) => ids.first().copied(),
            _ => None,
        }
    }

    /// Takes a token in a Pick; moves on once one alternative is complete.
    fn pick(&mut self, token: u32) {
        let Cursor::Pick(alts, k) = &mut self.cur else {
            return;
        };
        alts.retain(|(ids, _)| ids.get(*k) == Some(&token));
        *k += 1;
        let done = alts.iter().position(|(ids, _)| ids.len() == *k);
        if let Some(i) = done {
            let (_, then) = alts.swap_remove(i);
            for s in then.into_iter().rev() {
                self.rest.push_front(s);
            }
            self.advance();
        } else if alts.is_empty() {
            self.cur = Cursor::Done;
        }
    }
}

impl Constraint for ToolConstraint {
    fn mask(&mut self, logits: &mut [f32]) -> bool {
        let only = |logits: &mut [f32], ok: &dyn Fn(u32) -> bool| {
            let mut any = false;
            for (id, l) in logits.iter_mut().enumerate() {
                if ok(id as u32) {
                    any = true;
                } else {
                    *l = f32::NEG_INFINITY;
                }
            }
            any
        };
        match &self.cur {
            Cursor::Done => false,
            Cursor::Ids(ids, i) => {
                let want = ids[*i];
                only(logits, &|id| id == want)
            }
            Cursor::Free {
                trigger,
                banned,
                seen,
            } => {
                let next = trigger[*seen];
                let first = trigger[0];
                for &b in banned.iter() {
                    if b != next && b != first {
                        if let Some(l) = logits.get_mut(b as usize) {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
                true
            }
            Cursor::Pick(alts, k) => {
                let mut ok: Vec<u32> = alts
                    .iter()
                    .filter_map(|(ids, _)| ids.get(*k).copied())
                    .collect();
                ok.sort_unstable();
                only(logits, &|id| ok.binary_search(&id).is_ok())
            }
            Cursor::Json(m) => {
                self.trie.allowed(m, &mut self.allowed);
                if m.is_complete()
                    && let Some(id) = self.next_fixed()
                    && let Some(a) = self.allowed.get_mut(id as usize)
                {
                    *a = true;
                }
                let allowed = &self.allowed;
                only(logits, &|id| {
                    allowed.get(id as usize).copied().unwrap_or(false)
                })
            }
        }
    }

    fn accept(&mut self, token: u32) {
        let next_fixed = self.next_fixed();
        match &mut self.cur {
            Cursor::Done => {}
            Cursor::Ids(ids, i) => {
                debug_assert_eq!(ids[*i], token, "the mask allowed only the forced id");
                *i += 1;
                if *i == ids.len() {
                    self.advance();
                }
            }
            Cursor::Free { trigger, seen, .. } => {
                if trigger[*seen] == token {
                    *seen += 1;
                } else {
                    *seen = usize::from(trigger[0] == token);
                }
                if *seen == trigger.len() {
                    self.advance();
                }
            }
            Cursor::Pick(..) => self.pick(token),
            Cursor::Json(m) => {
                if m.is_complete() && next_fixed == Some(token) {
                    self.advance();
                    return self.accept(token);
                }
                let bytes = self.tok.token_bytes(token).unwrap_or_default();
                let ok = m.feed(&bytes);
                debug_assert!(ok, "the mask allowed only tokens the grammar accepts");
                if m.is_finished() {
                    self.advance();
                }
            }
        }
    }

    fn is_done(&self) -> bool {
        matches!(self.cur, Cursor::Done)
    }
}
