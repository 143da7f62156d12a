//! Paged per-layer caches: rows of a fixed width in blocks of one attention
//! split, shared copy-on-write between a sequence state and its forks.

use std::sync::Arc;

/// Rows per cache block: one attention split, so the kernels read blocks
/// in place.
pub const BLOCK_ROWS: usize = fathom_kernels::attention::SPLIT;

/// A per-layer cache of fixed-width rows (K3's latent rows, a GQA layer's
/// key/value rows), in blocks of [`BLOCK_ROWS`] rows. Blocks are shared
/// between a state and its forks (prefix checkpoints, snapshots) and copied
/// only when written, so a fork costs a block table, not the rows.
#[derive(Debug, Clone, Default)]
pub struct PagedRows {
    blocks: Vec<Arc<Vec<f32>>>,
    len: usize,
    pub width: usize,
}

impl PagedRows {
    pub fn new(width: usize) -> Self {
        PagedRows {
            blocks: Vec::new(),
            len: 0,
            width,
        }
    }
    /// Rows held.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Appends rows (`[k, width]`).
    pub fn push_rows(&mut self, rows: &[f32]) {
        let w = self.width;
        debug_assert_eq!(rows.len() % w, 0);
        let mut rest = rows;
        while !rest.is_empty() {
            if self.len.is_multiple_of(BLOCK_ROWS) {
                self.blocks
                    .push(Arc::new(Vec::with_capacity(BLOCK_ROWS * w)));
            }
            let last = Arc::make_mut(self.blocks.last_mut().expect("a block was just ensured"));
            let take = ((BLOCK_ROWS - self.len % BLOCK_ROWS) * w).min(rest.len());
            last.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            self.len += take / w;
        }
    }
    /// Keeps the first `n` rows (a shared last block is copied first).
    pub fn truncate(&mut self, n: usize) {
        if n >= self.len {
            return;
        }
        self.blocks.truncate(n.div_ceil(BLOCK_ROWS));
        if !n.is_multiple_of(BLOCK_ROWS) {
            let last = Arc::make_mut(self.blocks.last_mut().expect("n > 0 keeps a block"));
            last.truncate((n % BLOCK_ROWS) * self.width);
        }
        self.len = n;
    }
    /// The rows as blocks (every block but the last full).
    pub fn blocks(&self) -> Vec<&[f32]> {
        self.blocks.iter().map(|b| b.as_slice()).collect()
    }
    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        let b = &self.blocks[r / BLOCK_ROWS];
        let i = r % BLOCK_ROWS;
        &b[i * self.width..(i + 1) * self.width]
    }
    /// Every row, contiguous (for saving).
    pub fn to_rows(&self) -> Vec<f32> {
        self.blocks.iter().flat_map(|b| b.iter().copied()).collect()
    }
    /// Floats held (`len · width`).
    pub fn floats(&self) -> usize {
        self.len * self.width
    }
}
