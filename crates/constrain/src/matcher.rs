//! The stack-based matcher.
//!
//! A [`Stack`] holds one frame per open value; an `anyOf` forks the stack, so
//! a [`State`] keeps every candidate stack still alive.

use std::sync::Arc;

use crate::frame::{
    ADDITIONAL, ArrSt, Frame, NONE, ObjSt, Top, can_end, is_ws, key_possible, required_done,
    set_used, step_top,
};
use crate::grammar::{
    FALSE, Grammar, NULL, Node, NodeId, T_ARR, T_BOOL, T_INT, T_NULL, T_NUM, T_OBJ, T_STR, TRUE,
};
use crate::string::{NumSt, StrSt};

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

enum Step {
    Ok,
    /// Consumed as structural whitespace.
    Ws,
    Fail,
    /// The top is a `Value` of an `anyOf` node: fork before stepping.
    Fork,
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
                    // No literal left (an empty `enum`, or every one filtered out).
                    Node::Lits(l) if l.is_empty() => return Step::Fail,
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
                Step::Ws if stack.ws < g.ws_cap => {
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
