//! The vocabulary as a byte trie, and the token mask computed over it.

use crate::frame::{Frame, Top, content_budget, step_top};
use crate::grammar::Grammar;
use crate::matcher::{Matcher, State};
use crate::string::{StrSt, StrStep, is_plain, str_step};

/// The vocabulary as a byte trie, built once per tokenizer.
///
/// Nodes are stored in preorder, so a node's subtree is the `size` nodes starting at it.
#[derive(Debug)]
pub struct TokenTrie {
    /// The byte on the edge into each node (unused for the root).
    bytes: Vec<u8>,
    /// Subtree sizes, the node itself included.
    sizes: Vec<u32>,
    /// Token ids of node `i` are `ids[id_start[i]..id_start[i + 1]]`.
    id_start: Vec<u32>,
    ids: Vec<u32>,
    /// Whether every byte in the node's subtree, its own edge included, is plain string text.
    plain: Vec<bool>,
    /// Whether every token in the node's subtree is string content (no closing quote,
    /// nothing invalid) when read from the start of a string or between characters.
    content: Vec<bool>,
    /// The longest token in the node's subtree, in bytes.
    max_len: Vec<u32>,
    vocab: usize,
    depth: usize,
}

impl TokenTrie {
    /// `tokens[id]` = the token's bytes, or None for tokens that must never be allowed inside JSON (special tokens, unknown ids).
    pub fn new(tokens: &[Option<Vec<u8>>]) -> TokenTrie {
        let mut sorted: Vec<(&[u8], u32)> = tokens
            .iter()
            .enumerate()
            .filter_map(|(id, t)| {
                t.as_deref()
                    .filter(|t| !t.is_empty())
                    .map(|t| (t, id as u32))
            })
            .collect();
        sorted.sort_unstable();
        let mut trie = TokenTrie {
            bytes: vec![0],
            sizes: vec![0],
            id_start: vec![0],
            ids: Vec::with_capacity(sorted.len()),
            plain: Vec::new(),
            content: Vec::new(),
            max_len: Vec::new(),
            vocab: tokens.len(),
            depth: 0,
        };
        // `path[d]` is the node at depth `d` on the path to the previous token.
        let mut path: Vec<usize> = vec![0];
        let mut prev: &[u8] = &[];
        for (t, id) in sorted {
            let common = prev.iter().zip(t).take_while(|(a, b)| a == b).count();
            while path.len() > common + 1 {
                let n = path.pop().unwrap();
                trie.sizes[n] = (trie.bytes.len() - n) as u32;
            }
            for &b in &t[common..] {
                path.push(trie.bytes.len());
                trie.bytes.push(b);
                trie.sizes.push(0);
                trie.id_start.push(trie.ids.len() as u32);
            }
            trie.ids.push(id);
            trie.depth = trie.depth.max(t.len());
            prev = t;
        }
        while let Some(n) = path.pop() {
            trie.sizes[n] = (trie.bytes.len() - n) as u32;
        }
        trie.id_start.push(trie.ids.len() as u32);
        // `odd[i]`: how many of nodes `1..i` have a non-plain edge byte.
        let mut odd = vec![0u32; trie.bytes.len() + 1];
        for i in 1..trie.bytes.len() {
            odd[i + 1] = odd[i] + !is_plain(trie.bytes[i]) as u32;
        }
        trie.plain = trie.flags(&odd);
        // The same for bytes that are not string content when read from the root.
        let mut at: Vec<(usize, Option<StrSt>)> = vec![(0, Some(StrSt::default()))];
        let mut parent = vec![0usize; trie.bytes.len()];
        trie.max_len = vec![0; trie.bytes.len()];
        for i in 1..trie.bytes.len() {
            while at
                .last()
                .is_some_and(|&(a, _)| a + trie.sizes[a] as usize <= i)
            {
                at.pop();
            }
            let (p, st) = *at.last().unwrap();
            let st = st.and_then(|s| match str_step(s, trie.bytes[i]) {
                StrStep::Char(s, _) => Some(s),
                StrStep::Close | StrStep::Fail => None,
            });
            odd[i + 1] = odd[i] + st.is_none() as u32;
            parent[i] = p;
            trie.max_len[i] = at.len() as u32;
            at.push((i, st));
        }
        for i in (1..trie.bytes.len()).rev() {
            trie.max_len[parent[i]] = trie.max_len[parent[i]].max(trie.max_len[i]);
        }
        trie.content = trie.flags(&odd);
        trie
    }

    /// Per node: whether none of the nodes in its subtree is counted in `odd` (prefix counts).
    fn flags(&self, odd: &[u32]) -> Vec<bool> {
        (0..self.bytes.len())
            .map(|n| n > 0 && odd[n + self.sizes[n] as usize] == odd[n])
            .collect()
    }

    /// Sets allowed[id] = true for every token whose bytes can all be fed to (a clone of) `m`; others false.
    ///
    /// `allowed.len()` must be the vocabulary size given to [`TokenTrie::new`]. Empty-byte tokens are never allowed.
    pub fn allowed(&self, m: &Matcher, allowed: &mut [bool]) {
        assert_eq!(
            allowed.len(),
            self.vocab,
            "mask length must equal the vocabulary size"
        );
        allowed.fill(false);
        if m.st.stacks.is_empty() {
            return;
        }
        let mut walk = Walk {
            trie: self,
            g: &m.g,
            allowed,
        };
        let mut pool = vec![State::default(); self.depth + 1];
        walk.node(0, 0, &m.st, &mut pool);
    }
}

/// One depth-first walk over the trie.
struct Walk<'a> {
    trie: &'a TokenTrie,
    g: &'a Grammar,
    allowed: &'a mut [bool],
}

impl Walk<'_> {
    fn mark(&mut self, n: usize) {
        let t = self.trie;
        for &id in &t.ids[t.id_start[n] as usize..t.id_start[n + 1] as usize] {
            self.allowed[id as usize] = true;
        }
    }

    /// Marks every token in the subtree of node `n`.
    fn mark_subtree(&mut self, n: usize) {
        let t = self.trie;
        let ids = &t.ids[t.id_start[n] as usize..t.id_start[n + t.sizes[n] as usize] as usize];
        for &id in ids {
            self.allowed[id as usize] = true;
        }
    }

    /// Visits the children of node `n`, reached with matcher state `st`.
    /// `depth`: the bytes on the path to `n`.
    fn node(&mut self, n: usize, depth: u32, st: &State, pool: &mut [State]) {
        if let Some(top) = st.leaf_top() {
            let root_budget = if n == 0 {
                content_budget(self.g, st.below_top(), top)
            } else {
                0
            };
            return self.leaf(n, depth, st, top, root_budget, pool);
        }
        let (buf, rest) = pool.split_first_mut().expect("pool deeper than the trie");
        let end = n + self.trie.sizes[n] as usize;
        let mut c = n + 1;
        while c < end {
            buf.clone_from(st);
            if buf.feed_byte(self.g, self.trie.bytes[c]) {
                self.mark(c);
                if self.trie.sizes[c] > 1 {
                    self.node(c, depth + 1, buf, rest);
                }
            }
            c += self.trie.sizes[c] as usize;
        }
    }

    /// Like [`Walk::node`], with the top frame of `base`'s only stack replaced by `top`;
    /// steps that only change that frame need no copy of the stack. Whole subtrees of
    /// string content are marked at once: `plain` ones within the current
    /// [`content_budget`], `content` ones within `root_budget` (that budget at the
    /// root, where the walk entered between characters; 0 otherwise).
    fn leaf(
        &mut self,
        n: usize,
        depth: u32,
        base: &State,
        top: Frame,
        root_budget: u32,
        pool: &mut [State],
    ) {
        let frames = &base.stacks[0].frames;
        let below = &frames[..frames.len() - 1];
        let budget = content_budget(self.g, below, top);
        let end = n + self.trie.sizes[n] as usize;
        let mut c = n + 1;
        while c < end {
            let b = self.trie.bytes[c];
            let len = self.trie.max_len[c];
            if (self.trie.content[c] && len <= root_budget)
                || (self.trie.plain[c] && len - depth <= budget)
            {
                self.mark_subtree(c);
                c += self.trie.sizes[c] as usize;
                continue;
            }
            match step_top(self.g, below, top, b) {
                Top::Fail => {}
                Top::Stay(f) => {
                    self.mark(c);
                    if self.trie.sizes[c] > 1 {
                        self.leaf(c, depth + 1, base, f, root_budget, pool);
                    }
                }
                Top::Pop { .. } | Top::KeyDone { .. } => {
                    let (buf, rest) = pool.split_first_mut().expect("pool deeper than the trie");
                    buf.clone_from(base);
                    *buf.stacks[0].frames.last_mut().unwrap() = top;
                    if buf.feed_byte(self.g, b) {
                        self.mark(c);
                        if self.trie.sizes[c] > 1 {
                            self.node(c, depth + 1, buf, rest);
                        }
                    }
                }
            }
            c += self.trie.sizes[c] as usize;
        }
    }
}
