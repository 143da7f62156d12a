//! The stack-based matcher.
//!
//! A [`Stack`] holds one frame per open value; an `anyOf` forks the stack, so
//! a [`State`] keeps every candidate stack still alive.

use std::sync::Arc;

use crate::grammar::{
    FALSE, Grammar, NULL, Node, NodeId, ObjSpec, T_ARR, T_BOOL, T_INT, T_NULL, T_NUM, T_OBJ, T_STR,
    TRUE,
};
use crate::string::{NumSt, StrSt, StrStep, num_complete, num_step, str_step};

/// No key-trie node: the key being typed is not a prefix of a declared name.
const NONE: u32 = u32::MAX;
/// The key just typed is not a declared property.
const ADDITIONAL: u32 = u32::MAX - 1;
/// Most consecutive structural whitespace bytes.
const WS_CAP: u8 = 16;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum ObjSt {
    AfterOpen,
    AfterKey,
    InValue,
    AfterValue,
    AfterComma,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum ArrSt {
    AfterOpen,
    InValue,
    AfterItem,
}

/// One open value.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Frame {
    /// A value of `node` is due (whitespace may come first).
    Value {
        node: NodeId,
    },
    /// An object; `used` holds property bits 0..64, `Bits` frames below hold the rest.
    Obj {
        node: NodeId,
        st: ObjSt,
        prop: u32,
        used: u64,
    },
    /// Further property bits of the `Obj` frame above.
    Bits(u64),
    /// A key of the `Obj` frame below; `trie` is its position in the key trie.
    Key {
        trie: u32,
        s: StrSt,
    },
    Arr {
        node: NodeId,
        st: ArrSt,
        count: u32,
    },
    /// A string value; `chars` counts characters so far.
    Str {
        node: NodeId,
        chars: u32,
        s: StrSt,
    },
    Num {
        integer: bool,
        st: NumSt,
    },
    /// Literal alternatives `lo..hi` of `node`, which share their first `pos` bytes.
    Lit {
        node: NodeId,
        pos: u32,
        lo: u32,
        hi: u32,
    },
}

/// One candidate parse.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Stack {
    pub frames: Vec<Frame>,
    /// Consecutive structural whitespace bytes just read.
    pub ws: u8,
}

impl Clone for Stack {
    fn clone(&self) -> Stack {
        Stack {
            frames: self.frames.clone(),
            ws: self.ws,
        }
    }

    fn clone_from(&mut self, src: &Stack) {
        self.frames.clone_from(&src.frames);
        self.ws = src.ws;
    }
}

/// All candidate parses; none left means the bytes were rejected.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub stacks: Vec<Stack>,
}

impl Clone for State {
    fn clone(&self) -> State {
        State {
            stacks: self.stacks.clone(),
        }
    }

    fn clone_from(&mut self, src: &State) {
        self.stacks.clone_from(&src.stacks);
    }
}

/// Result of stepping a leaf frame (string, key, number, literal) alone.
pub(crate) enum Top {
    /// Consumed; the frame becomes this one.
    Stay(Frame),
    Fail,
    /// The frame is done: pop it; `consumed` says whether it took the byte.
    Pop {
        consumed: bool,
    },
    /// The key closed, naming declared property `prop` (or [`ADDITIONAL`]).
    KeyDone {
        prop: u32,
    },
}

enum Step {
    Ok,
    /// Consumed as structural whitespace.
    Ws,
    Fail,
    /// The top is a `Value` of an `anyOf` node: fork before stepping.
    Fork,
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\r' | b'\t')
}

/// Word `w` of the used-property bits of the `Obj` frame at `k`.
fn used_word(frames: &[Frame], k: usize, w: usize) -> u64 {
    let f = if w == 0 { frames[k] } else { frames[k - w] };
    match f {
        Frame::Obj { used, .. } | Frame::Bits(used) => used,
        _ => 0,
    }
}

fn is_used(frames: &[Frame], k: usize, p: u32) -> bool {
    used_word(frames, k, p as usize / 64) & (1 << (p % 64)) != 0
}

fn set_used(frames: &mut [Frame], k: usize, p: u32) {
    let w = p as usize / 64;
    let f = if w == 0 {
        &mut frames[k]
    } else {
        &mut frames[k - w]
    };
    if let Frame::Obj { used, .. } | Frame::Bits(used) = f {
        *used |= 1 << (p % 64);
    }
}

/// Whether some property in `mask` is not yet used.
fn any_unused(mask: &[u64], frames: &[Frame], k: usize) -> bool {
    mask.iter()
        .enumerate()
        .any(|(w, &m)| m & !used_word(frames, k, w) != 0)
}

fn key_possible(spec: &ObjSpec, frames: &[Frame], k: usize) -> bool {
    spec.additional.is_some() || any_unused(spec.keys.mask(0), frames, k)
}

fn required_done(spec: &ObjSpec, frames: &[Frame], k: usize) -> bool {
    spec.required
        .iter()
        .enumerate()
        .all(|(w, &r)| r & !used_word(frames, k, w) == 0)
}

/// Steps a leaf frame `top` whose parents are `below`, without touching them.
pub(crate) fn step_top(g: &Grammar, below: &[Frame], top: Frame, b: u8) -> Top {
    match top {
        Frame::Str { node, chars, s } => {
            let spec = &g.typed(node).str_;
            match str_step(s, b) {
                StrStep::Fail => Top::Fail,
                StrStep::Close if chars >= spec.min => Top::Pop { consumed: true },
                StrStep::Close => Top::Fail,
                StrStep::Char(s, new) => {
                    if !new {
                        Top::Stay(Frame::Str { node, chars, s })
                    } else if chars < spec.max {
                        Top::Stay(Frame::Str {
                            node,
                            chars: chars + 1,
                            s,
                        })
                    } else {
                        Top::Fail
                    }
                }
            }
        }
        Frame::Key { trie, s } => {
            let k = below.len() - 1;
            let Frame::Obj { node, .. } = below[k] else {
                return Top::Fail;
            };
            let spec = &g.typed(node).obj;
            match str_step(s, b) {
                StrStep::Fail => Top::Fail,
                StrStep::Close => {
                    let term = if trie == NONE {
                        None
                    } else {
                        spec.keys.term(trie)
                    };
                    match term {
                        Some(p) if !is_used(below, k, p) => Top::KeyDone { prop: p },
                        Some(_) => Top::Fail,
                        None if spec.additional.is_some() => Top::KeyDone { prop: ADDITIONAL },
                        None => Top::Fail,
                    }
                }
                StrStep::Char(s, _) => {
                    let trie = if trie == NONE {
                        NONE
                    } else {
                        spec.keys.child(trie, b).unwrap_or(NONE)
                    };
                    if spec.additional.is_none()
                        && (trie == NONE || !any_unused(spec.keys.mask(trie), below, k))
                    {
                        return Top::Fail;
                    }
                    Top::Stay(Frame::Key { trie, s })
                }
            }
        }
        Frame::Num { integer, st } => match num_step(st, b, integer) {
            Some(st) => Top::Stay(Frame::Num { integer, st }),
            None if num_complete(st) => Top::Pop { consumed: false },
            None => Top::Fail,
        },
        Frame::Lit { node, pos, lo, hi } => {
            let alts = g.lits(node);
            let p = pos as usize;
            let range = &alts[lo as usize..hi as usize];
            let start = range.partition_point(|a| a.len() <= p || a[p] < b);
            let end = range.partition_point(|a| a.len() <= p || a[p] <= b);
            if start < end {
                let (lo2, hi2) = (lo + start as u32, lo + end as u32);
                if hi2 - lo2 == 1 && alts[lo2 as usize].len() == p + 1 {
                    Top::Pop { consumed: true }
                } else {
                    Top::Stay(Frame::Lit {
                        node,
                        pos: pos + 1,
                        lo: lo2,
                        hi: hi2,
                    })
                }
            } else if alts[lo as usize].len() == p {
                Top::Pop { consumed: false }
            } else {
                Top::Fail
            }
        }
        _ => Top::Fail,
    }
}

/// How many bytes of string content (until a closing quote) leaf `top` accepts
/// whatever they are: the characters left in a string, unbounded for a key where
/// undeclared names are allowed, 0 mid-character or for other frames.
pub(crate) fn content_budget(g: &Grammar, below: &[Frame], top: Frame) -> u32 {
    match top {
        Frame::Str { node, s, chars } if s.is_normal() => {
            g.typed(node).str_.max.saturating_sub(chars)
        }
        Frame::Key { s, .. } if s.is_normal() => match below.last() {
            Some(&Frame::Obj { node, .. }) if g.typed(node).obj.additional.is_some() => u32::MAX,
            _ => 0,
        },
        _ => 0,
    }
}

/// Whether a frame could end here (a complete number or literal).
fn can_end(g: &Grammar, f: &Frame) -> bool {
    match *f {
        Frame::Num { st, .. } => num_complete(st),
        Frame::Lit { node, pos, lo, .. } => g.lits(node)[lo as usize].len() == pos as usize,
        _ => false,
    }
}

/// Tells the parent that its child value is done.
fn child_done(frames: &mut [Frame]) {
    match frames.last_mut() {
        Some(Frame::Obj { st, .. }) => *st = ObjSt::AfterValue,
        Some(Frame::Arr { st, count, .. }) => {
            *st = ArrSt::AfterItem;
            *count = count.saturating_add(1);
        }
        _ => {}
    }
}

/// Steps one stack by byte `b`.
fn step(g: &Grammar, frames: &mut Vec<Frame>, b: u8) -> Step {
    loop {
        let n = frames.len();
        let Some(&top) = frames.last() else {
            return Step::Fail;
        };
        match top {
            Frame::Str { .. } | Frame::Key { .. } | Frame::Num { .. } | Frame::Lit { .. } => {
                match step_top(g, &frames[..n - 1], top, b) {
                    Top::Stay(f) => {
                        frames[n - 1] = f;
                        return Step::Ok;
                    }
                    Top::Fail => return Step::Fail,
                    Top::Pop { consumed } => {
                        frames.pop();
                        child_done(frames);
                        if consumed {
                            return Step::Ok;
                        }
                    }
                    Top::KeyDone { prop } => {
                        frames.pop();
                        let k = n - 2;
                        if prop != ADDITIONAL {
                            set_used(frames, k, prop);
                        }
                        if let Frame::Obj { st, prop: p, .. } = &mut frames[k] {
                            *st = ObjSt::AfterKey;
                            *p = prop;
                        }
                        return Step::Ok;
                    }
                }
            }
            Frame::Value { node } => {
                if is_ws(b) {
                    return Step::Ws;
                }
                let t = match &g.nodes[node as usize] {
                    Node::Typed(t) => t,
                    Node::AnyOf(_) => return Step::Fork,
                    Node::Lits(l) => {
                        frames[n - 1] = Frame::Lit {
                            node,
                            pos: 0,
                            lo: 0,
                            hi: l.len() as u32,
                        };
                        continue;
                    }
                    Node::Never | Node::Ref(_) => return Step::Fail,
                };
                let has = |bit: u8| t.types & bit != 0;
                let lit = |node: NodeId| Frame::Lit {
                    node,
                    pos: 0,
                    lo: 0,
                    hi: 1,
                };
                match b {
                    b'{' if has(T_OBJ) => {
                        frames.pop();
                        let init = &t.obj.init_used;
                        for w in (1..init.len()).rev() {
                            frames.push(Frame::Bits(init[w]));
                        }
                        frames.push(Frame::Obj {
                            node,
                            st: ObjSt::AfterOpen,
                            prop: NONE,
                            used: init[0],
                        });
                        return Step::Ok;
                    }
                    b'[' if has(T_ARR) => {
                        frames[n - 1] = Frame::Arr {
                            node,
                            st: ArrSt::AfterOpen,
                            count: 0,
                        };
                        return Step::Ok;
                    }
                    b'"' if has(T_STR) => {
                        frames[n - 1] = Frame::Str {
                            node,
                            chars: 0,
                            s: StrSt::default(),
                        };
                        return Step::Ok;
                    }
                    b'-' | b'0'..=b'9' if has(T_NUM | T_INT) => {
                        frames[n - 1] = Frame::Num {
                            integer: !has(T_NUM),
                            st: NumSt::Start,
                        };
                    }
                    b't' if has(T_BOOL) => frames[n - 1] = lit(TRUE),
                    b'f' if has(T_BOOL) => frames[n - 1] = lit(FALSE),
                    b'n' if has(T_NULL) => frames[n - 1] = lit(NULL),
                    _ => return Step::Fail,
                }
            }
            Frame::Obj { node, st, prop, .. } => {
                let spec = &g.typed(node).obj;
                let k = n - 1;
                return match (st, b) {
                    (
                        ObjSt::AfterOpen | ObjSt::AfterKey | ObjSt::AfterValue | ObjSt::AfterComma,
                        _,
                    ) if is_ws(b) => Step::Ws,
                    (ObjSt::AfterOpen | ObjSt::AfterComma, b'"')
                        if key_possible(spec, frames, k) =>
                    {
                        frames.push(Frame::Key {
                            trie: 0,
                            s: StrSt::default(),
                        });
                        Step::Ok
                    }
                    (ObjSt::AfterOpen | ObjSt::AfterValue, b'}')
                        if required_done(spec, frames, k) =>
                    {
                        frames.pop();
                        while let Some(Frame::Bits(_)) = frames.last() {
                            frames.pop();
                        }
                        child_done(frames);
                        Step::Ok
                    }
                    (ObjSt::AfterValue, b',') if key_possible(spec, frames, k) => {
                        if let Frame::Obj { st, .. } = &mut frames[k] {
                            *st = ObjSt::AfterComma;
                        }
                        Step::Ok
                    }
                    (ObjSt::AfterKey, b':') => {
                        let value = match prop {
                            ADDITIONAL => spec.additional.unwrap_or(crate::grammar::NEVER),
                            p => spec.props[p as usize].node,
                        };
                        if let Frame::Obj { st, .. } = &mut frames[k] {
                            *st = ObjSt::InValue;
                        }
                        frames.push(Frame::Value { node: value });
                        Step::Ok
                    }
                    _ => Step::Fail,
                };
            }
            Frame::Arr { node, st, count } => {
                let spec = &g.typed(node).arr;
                match (st, b) {
                    (ArrSt::AfterOpen | ArrSt::AfterItem, _) if is_ws(b) => return Step::Ws,
                    (ArrSt::AfterOpen | ArrSt::AfterItem, b']') if count >= spec.min => {
                        frames.pop();
                        child_done(frames);
                        return Step::Ok;
                    }
                    (ArrSt::AfterItem, b',') if count < spec.max => {
                        frames[n - 1] = Frame::Arr {
                            node,
                            st: ArrSt::InValue,
                            count,
                        };
                        frames.push(Frame::Value { node: spec.items });
                        return Step::Ok;
                    }
                    (ArrSt::AfterOpen, _) if spec.max > 0 => {
                        frames[n - 1] = Frame::Arr {
                            node,
                            st: ArrSt::InValue,
                            count,
                        };
                        frames.push(Frame::Value { node: spec.items });
                    }
                    _ => return Step::Fail,
                }
            }
            Frame::Bits(_) => return Step::Fail,
        }
    }
}

impl State {
    pub(crate) fn new(root: NodeId) -> State {
        State {
            stacks: vec![Stack {
                frames: vec![Frame::Value { node: root }],
                ws: 0,
            }],
        }
    }

    /// Feeds one byte to every stack; false when none survives.
    pub(crate) fn feed_byte(&mut self, g: &Grammar, b: u8) -> bool {
        let mut i = 0;
        while i < self.stacks.len() {
            let stack = &mut self.stacks[i];
            match step(g, &mut stack.frames, b) {
                Step::Ok => {
                    stack.ws = 0;
                    i += 1;
                }
                Step::Ws if stack.ws < WS_CAP => {
                    stack.ws += 1;
                    i += 1;
                }
                Step::Ws | Step::Fail => {
                    self.stacks.swap_remove(i);
                }
                Step::Fork => {
                    let Some(&Frame::Value { node }) = stack.frames.last() else {
                        unreachable!()
                    };
                    let Node::AnyOf(alts) = &g.nodes[node as usize] else {
                        unreachable!()
                    };
                    if alts.is_empty() {
                        self.stacks.swap_remove(i);
                        continue;
                    }
                    for &a in &alts[1..] {
                        let mut s = self.stacks[i].clone();
                        *s.frames.last_mut().unwrap() = Frame::Value { node: a };
                        self.stacks.push(s);
                    }
                    *self.stacks[i].frames.last_mut().unwrap() = Frame::Value { node: alts[0] };
                }
            }
        }
        if self.stacks.len() > 1 {
            self.dedup();
        }
        !self.stacks.is_empty()
    }

    fn dedup(&mut self) {
        let mut i = 1;
        while i < self.stacks.len() {
            if self.stacks[..i].contains(&self.stacks[i]) {
                self.stacks.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    pub(crate) fn is_complete(&self, g: &Grammar) -> bool {
        self.stacks
            .iter()
            .any(|s| s.frames.iter().all(|f| can_end(g, f)))
    }

    pub(crate) fn is_finished(&self) -> bool {
        !self.stacks.is_empty() && self.stacks.iter().all(|s| s.frames.is_empty())
    }

    /// The frames under the top of the first stack.
    pub(crate) fn below_top(&self) -> &[Frame] {
        let f = &self.stacks[0].frames;
        &f[..f.len().saturating_sub(1)]
    }

    /// The top frame when it can be stepped alone ([`step_top`]): one stack, a leaf on top.
    pub(crate) fn leaf_top(&self) -> Option<Frame> {
        let [s] = self.stacks.as_slice() else {
            return None;
        };
        match s.frames.last() {
            Some(
                f @ (Frame::Str { .. } | Frame::Key { .. } | Frame::Num { .. } | Frame::Lit { .. }),
            ) => Some(*f),
            _ => None,
        }
    }
}

/// Where a match stands; cheap to clone (clone is used per trie branch).
#[derive(Clone, Debug)]
pub struct Matcher {
    pub(crate) g: Arc<Grammar>,
    pub(crate) st: State,
}

impl Matcher {
    pub fn new(g: &Arc<Grammar>) -> Matcher {
        Matcher {
            g: Arc::clone(g),
            st: State::new(g.root),
        }
    }

    /// Feeds bytes; false if they cannot continue a valid document (the matcher is then unusable).
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.st.feed_byte(&self.g, b))
    }

    /// True when the bytes so far form a complete document (nothing more is required).
    pub fn is_complete(&self) -> bool {
        self.st.is_complete(&self.g)
    }

    /// True when no further byte can be accepted (complete and closed, e.g. after the final `}`).
    pub fn is_finished(&self) -> bool {
        self.st.is_finished()
    }
}
