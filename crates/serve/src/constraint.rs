//! `response_format` as a decoding constraint: the JSON grammar masks the
//! full model's logits; the model still chooses among what is allowed.

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
