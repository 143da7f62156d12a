//! The byte-pair merge loop, with tiktoken's exact semantics.
//!
//! A piece that is itself in the rank table becomes that one token. Otherwise the
//! piece starts as single bytes and, repeatedly, the adjacent pair whose concatenation
//! has the lowest rank is merged (leftmost on ties) until no adjacent pair is in the
//! table. The resulting parts, looked up in the table, are the token ids.
//!
//! Two implementations of that one rule:
//! - [`merge_short`]: tiktoken's linear re-scan, O(n·m) for n bytes and m merges but
//!   allocation-light; used for ordinary pieces (words are short).
//! - [`merge_long`]: a min-heap of candidate pairs over a linked list of parts,
//!   O(n log n); used past [`SHORT_PIECE_MAX`] bytes so that a megabyte of one
//!   character class cannot go quadratic.
//!
//! The heap orders candidates by `(rank, start)`, which is exactly "lowest rank,
//! leftmost on ties"; stale candidates (a side already merged) are detected on pop.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::hash::RankMap;

/// Pieces up to this many bytes use the linear re-scan.
pub const SHORT_PIECE_MAX: usize = 128;

/// Encodes one pre-tokenized piece, appending token ids to `out`.
pub fn encode_piece(ranks: &RankMap, piece: &[u8], out: &mut Vec<u32>) {
    if let Some(&id) = ranks.get(piece) {
        out.push(id);
        return;
    }
    let bounds = if piece.len() <= SHORT_PIECE_MAX {
        merge_short(ranks, piece)
    } else {
        merge_long(ranks, piece)
    };
    for w in bounds.windows(2) {
        // Every part is a merge result or a single byte, so it is in the table; the
        // constructor checked that all 256 single bytes are present.
        out.push(ranks.get(&piece[w[0]..w[1]]).copied().unwrap_or(u32::MAX));
    }
}

fn pair_rank(ranks: &RankMap, piece: &[u8], start: usize, end: usize) -> u32 {
    ranks.get(&piece[start..end]).copied().unwrap_or(u32::MAX)
}

/// Linear re-scan. Returns the part boundaries (`n_parts + 1` offsets).
pub fn merge_short(ranks: &RankMap, piece: &[u8]) -> Vec<usize> {
    // parts[i] = (start offset, rank of the pair starting at part i)
    let mut parts: Vec<(usize, u32)> = Vec::with_capacity(piece.len() + 1);
    for i in 0..piece.len() + 1 {
        parts.push((i, u32::MAX));
    }
    let rank_at = |parts: &[(usize, u32)], i: usize| -> u32 {
        if i + 2 < parts.len() {
            pair_rank(ranks, piece, parts[i].0, parts[i + 2].0)
        } else {
            u32::MAX
        }
    };
    for i in 0..parts.len().saturating_sub(2) {
        parts[i].1 = rank_at(&parts, i);
    }
    // Leftmost minimum: `min_by_key` keeps the first of equal keys.
    while let Some((i, &(_, rank))) = parts[..parts.len() - 1]
        .iter()
        .enumerate()
        .min_by_key(|(_, p)| p.1)
    {
        if rank == u32::MAX {
            break;
        }
        parts.remove(i + 1);
        parts[i].1 = rank_at(&parts, i);
        if i > 0 {
            parts[i - 1].1 = rank_at(&parts, i - 1);
        }
    }
    parts.into_iter().map(|(start, _)| start).collect()
}

/// Heap-driven merge. Returns the part boundaries (`n_parts + 1` offsets).
pub fn merge_long(ranks: &RankMap, piece: &[u8]) -> Vec<usize> {
    let n = piece.len();
    // Parts are identified by their start offset; `next[s]` is the start of the
    // following part (n for the last), `prev[s]` of the preceding one. `alive[s]` is
    // false once the part starting at `s` has been absorbed by its left neighbour.
    let mut next: Vec<usize> = (1..=n).collect();
    let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect();
    let mut alive = vec![true; n];
    // Candidate: (rank, left start, end of right part). A candidate is current iff the
    // left part is alive and its right neighbour still ends at the recorded offset
    // (parts only grow, so equal bounds mean the same bytes and the same rank).
    let mut heap: BinaryHeap<Reverse<(u32, usize, usize)>> = BinaryHeap::with_capacity(n);
    let push = |heap: &mut BinaryHeap<Reverse<(u32, usize, usize)>>, next: &[usize], s: usize| {
        let mid = next[s];
        if mid < n {
            let end = next[mid];
            let rank = pair_rank(ranks, piece, s, end);
            if rank != u32::MAX {
                heap.push(Reverse((rank, s, end)));
            }
        }
    };
    for s in 0..n {
        push(&mut heap, &next, s);
    }
    while let Some(Reverse((_, s, end))) = heap.pop() {
        if !alive[s] {
            continue;
        }
        let mid = next[s];
        if mid >= n || next[mid] != end {
            continue;
        }
        // Merge the part at `mid` into the part at `s`.
        alive[mid] = false;
        next[s] = end;
        if end < n {
            prev[end] = s;
        }
        push(&mut heap, &next, s);
        if s > 0 {
            push(&mut heap, &next, prev[s]);
        }
    }
    let mut bounds = Vec::new();
    let mut s = 0;
    while s < n {
        bounds.push(s);
        s = next[s];
    }
    bounds.push(n);
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ranks::parse_rank_file;
    use std::path::Path;

    fn k3_ranks() -> RankMap {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3-code-small/tiktoken.model");
        let text = std::fs::read_to_string(&path).unwrap();
        let ranks = parse_rank_file(&text, &path).unwrap();
        ranks
            .into_iter()
            .enumerate()
            .map(|(i, b)| (b, i as u32))
            .collect()
    }

    /// Deterministic xorshift so the test needs no extra crates.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// The heap merge and the linear re-scan are the same function: compare them on
    /// random pieces drawn from a small alphabet (many merges, many rank ties).
    #[test]
    fn heap_and_scan_agree() {
        let ranks = k3_ranks();
        let alphabets: [&[u8]; 4] = [b"ab ", b"def _(self)", b"    \n", b"e\xe4\xb8\xad"];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for round in 0..400 {
            let alphabet = alphabets[round % alphabets.len()];
            let len = 2 + (next(&mut state) % 200) as usize;
            let piece: Vec<u8> = (0..len)
                .map(|_| alphabet[(next(&mut state) % alphabet.len() as u64) as usize])
                .collect();
            assert_eq!(
                merge_short(&ranks, &piece),
                merge_long(&ranks, &piece),
                "piece {piece:?}"
            );
        }
    }

    /// Ties resolve leftmost: with "ab" ranked, "aba" keeps the left pair.
    #[test]
    fn ties_merge_leftmost() {
        let mut ranks = RankMap::default();
        for b in 0..=255u8 {
            ranks.insert(vec![b], b as u32);
        }
        ranks.insert(b"aa".to_vec(), 256);
        for f in [merge_short, merge_long] {
            assert_eq!(f(&ranks, b"aaa"), vec![0, 2, 3]);
            assert_eq!(f(&ranks, b"aaaaa"), vec![0, 2, 4, 5]);
        }
    }
}
