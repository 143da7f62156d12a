//! Matcher frames, and stepping a leaf frame on its own.

use crate::grammar::{Grammar, NodeId, ObjSpec};
use crate::string::{NumSt, StrSt, StrStep, num_complete, num_step, str_step};

/// No key-trie node: the key being typed is not a prefix of a declared name.
pub(crate) const NONE: u32 = u32::MAX;
/// The key just typed is not a declared property.
pub(crate) const ADDITIONAL: u32 = u32::MAX - 1;
/// Most consecutive structural whitespace bytes.
pub(crate) const WS_CAP: u8 = 16;

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

/// A structural whitespace byte.
pub(crate) fn is_ws(b: u8) -> bool {
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

pub(crate) fn set_used(frames: &mut [Frame], k: usize, p: u32) {
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

pub(crate) fn key_possible(spec: &ObjSpec, frames: &[Frame], k: usize) -> bool {
    spec.additional.is_some() || any_unused(spec.keys.mask(0), frames, k)
}

pub(crate) fn required_done(spec: &ObjSpec, frames: &[Frame], k: usize) -> bool {
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
            } else if alts.get(lo as usize).is_some_and(|a| a.len() == p) {
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
pub(crate) fn can_end(g: &Grammar, f: &Frame) -> bool {
    match *f {
        Frame::Num { st, .. } => num_complete(st),
        Frame::Lit { node, pos, lo, .. } => g
            .lits(node)
            .get(lo as usize)
            .is_some_and(|a| a.len() == pos as usize),
        _ => false,
    }
}
