//! The caches' blocks of an attention call (MLA's latent rows, GQA's
//! `[K | V]` rows) as the kernels read them: one table of device
//! addresses, each sequence's blocks in order. Full blocks its owner
//! marked stable are kept with the weights (keyed by their host address);
//! every other block goes up with the call's inputs, with room for the
//! rows it holds after the step (a step's new rows are written there on
//! the device), padded with zeros to [`PAD_ROWS`] rows so a decode step's
//! call repeats for that many tokens and replays as a graph.

use fathom_kernels::attention::SPLIT;
use fathom_kernels::backend::{MatRef, MlaSeqWork, segments};

/// A block that goes up is padded to a multiple of this many rows (the
/// kernels read only the rows each query sees).
pub(super) const PAD_ROWS: usize = 16;

/// A call's blocks: where each query's cache starts in the table, and the
/// pieces that go up after the call's other inputs.
pub(super) struct Blocks<'a> {
    /// Per query, its sequence's first block in the table (as the f32 bit
    /// pattern of the kernels' `int`).
    pub boff: Vec<f32>,
    /// The blocks that go up, each followed by its zeros.
    pub pieces: Vec<&'a [f32]>,
    /// Per sequence: (kept blocks, the values each staged block takes).
    seqs: Vec<(usize, Vec<usize>)>,
}

/// The stable blocks' bytes, to be kept with the weights, in table order.
pub(super) fn kept_segments<'a>(seqs: &[MlaSeqWork<'a>]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    for s in seqs {
        for b in &s.blocks[..s.stable] {
            let m = MatRef::F32 {
                w: b,
                rows: 1,
                cols: b.len(),
            };
            out.push(segments(&m)[0]);
        }
    }
    out
}

impl<'a> Blocks<'a> {
    /// `seqs`' blocks after the step (`after[i]` rows for sequence i, from
    /// its block `first` on; rows `w` wide) for `t` queries; `zeros` holds
    /// at least [`SPLIT`] rows.
    pub fn plan(
        seqs: &'a [MlaSeqWork<'a>],
        after: &[usize],
        (t, w): (usize, usize),
        zeros: &'a [f32],
    ) -> Self {
        // The kernels index the table with boff + the cache's block index,
        // so a sequence whose blocks start at block `first` has boff
        // `first` less than where its blocks start in the table (it may be
        // negative: an int's bits).
        let int = |v: i64| f32::from_bits(v as i32 as u32);
        let mut boff = vec![0f32; t];
        let (mut at_block, mut pieces, mut plan) = (0i64, Vec::new(), Vec::new());
        for (s, &rows) in seqs.iter().zip(after) {
            boff[s.queries.clone()].fill(int(at_block - s.first as i64));
            at_block += (rows.div_ceil(SPLIT) - s.first) as i64;
            let mut rooms = Vec::new();
            for j in s.first + s.stable..rows.div_ceil(SPLIT) {
                let held = (rows - j * SPLIT).min(SPLIT);
                let room = held.next_multiple_of(PAD_ROWS).min(SPLIT) * w;
                let b = s.blocks.get(j - s.first).copied().unwrap_or(&[]);
                pieces.extend([b, &zeros[..room - b.len()]]);
                rooms.push(room);
            }
            plan.push((s.stable, rooms));
        }
        Blocks {
            boff,
            pieces,
            seqs: plan,
        }
    }

    /// The table: the kept blocks' device addresses from `kept` (in
    /// order), the staged ones from `off` values into the copy at `xp`.
    pub fn table(&self, kept: &[u64], xp: u64, mut off: usize) -> Vec<u64> {
        let mut kept = kept.iter();
        let mut table = Vec::new();
        for (stable, rooms) in &self.seqs {
            table.extend(kept.by_ref().take(*stable).copied());
            for room in rooms {
                table.push(xp + 4 * off as u64);
                off += room;
            }
        }
        table
    }
}
