//! The paged attention cache every family keeps its per-token rows in.
//!
//! A [`PagedRows`] holds a sequence's rows for one layer (K3's MLA latents,
//! a GQA layer's keys or values) in blocks of [`BLOCK_ROWS`] rows. Blocks
//! are shared between a state and its forks, snapshots and prefix
//! checkpoints and copied only when written (copy-on-write), so a fork
//! costs a block table, not the rows.
//!
//! All blocks of a model come from one [`KvPool`], which counts the RAM they
//! hold against a share of the RAM budget (`--kv-ram`). A block that fills
//! while the pool is over its share is written to a [`KvSpill`] (a file under
//! `--kv-dir`, implemented by the I/O crate: the model never does I/O itself)
//! and dropped from RAM; attention then reads the spilled blocks back a
//! window at a time, in block order, the next window requested before the
//! current one is used. Rows may be kept as bf16 (`--kv-dtype bf16`, half
//! the bytes, lossy: the rows are rounded when stored); every path — RAM,
//! disk, any window — gives the attention kernel the same values, so where
//! a block lives never changes a result.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{ModelError, Result};

/// Rows per block: one attention split, so the kernel reads blocks in place.
pub const BLOCK_ROWS: usize = fathom_kernels::attention::SPLIT;

/// Blocks handed to attention at a time (bounds what a spilled cache reads
/// into RAM per step: one window being used, one being read).
pub const WINDOW_BLOCKS: usize = 64;

/// How cached rows are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// Exactly the rows computed.
    #[default]
    F32,
    /// Rounded to bf16 (half the bytes; changes logits slightly).
    Bf16,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
        }
    }
}

/// Where full blocks go when the pool is over its RAM share.
pub trait KvSpill: Send + Sync {
    /// Stores one block's bytes; returns the slot it lives in.
    fn write(&self, bytes: &[u8]) -> std::io::Result<u64>;
    /// Starts reading `(slot, bytes)` in order; [`KvPending::wait`] gives them.
    fn read(&self, slots: Vec<(u64, usize)>) -> Box<dyn KvPending>;
    /// The slot is no longer used.
    fn free(&self, slot: u64);
    /// Where the blocks live (for messages).
    fn location(&self) -> String;
}

/// A read in flight.
pub trait KvPending: Send {
    fn wait(self: Box<Self>) -> std::io::Result<Vec<Vec<u8>>>;
}

/// How a model's cache pool is set up.
#[derive(Clone, Default)]
pub struct KvConfig {
    /// RAM the blocks may hold before full ones spill (`None`: no limit).
    pub ram_limit: Option<u64>,
    pub dtype: KvDtype,
    pub spill: Option<Arc<dyn KvSpill>>,
}

/// Counters of a pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvStats {
    /// Bytes of blocks in RAM now.
    pub ram_bytes: u64,
    /// Bytes of blocks on disk now.
    pub disk_bytes: u64,
    /// Blocks written to disk so far.
    pub blocks_spilled: u64,
    /// Bytes read back from disk so far.
    pub bytes_read: u64,
}

/// The blocks of one model: RAM accounting, dtype, spill target.
pub struct KvPool {
    cfg: KvConfig,
    ram: AtomicU64,
    disk: AtomicU64,
    spilled: AtomicU64,
    read: AtomicU64,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("ram_limit", &self.cfg.ram_limit)
            .field("dtype", &self.cfg.dtype)
            .field("stats", &self.stats())
            .finish()
    }
}

impl KvPool {
    pub fn new(cfg: KvConfig) -> Arc<Self> {
        Arc::new(KvPool {
            cfg,
            ram: AtomicU64::new(0),
            disk: AtomicU64::new(0),
            spilled: AtomicU64::new(0),
            read: AtomicU64::new(0),
        })
    }
    /// fp32 rows in RAM without limit.
    pub fn unlimited() -> Arc<Self> {
        Self::new(KvConfig::default())
    }
    pub fn dtype(&self) -> KvDtype {
        self.cfg.dtype
    }
    pub fn stats(&self) -> KvStats {
        KvStats {
            ram_bytes: self.ram.load(Ordering::Relaxed),
            disk_bytes: self.disk.load(Ordering::Relaxed),
            blocks_spilled: self.spilled.load(Ordering::Relaxed),
            bytes_read: self.read.load(Ordering::Relaxed),
        }
    }
    fn over_share(&self) -> bool {
        self.cfg
            .ram_limit
            .is_some_and(|l| self.ram.load(Ordering::Relaxed) > l)
    }
}

/// A block's rows in RAM.
#[derive(Debug)]
enum Data {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

/// A block in RAM, counted in its pool while it lives.
#[derive(Debug)]
struct RamBlock {
    data: Data,
    counted: u64,
    pool: Arc<KvPool>,
    /// Handed out as stable (`PagedRows::ram_blocks`): a device may hold a
    /// copy, forgotten before the bytes change or go.
    lent: std::sync::atomic::AtomicBool,
}

impl RamBlock {
    fn new(pool: &Arc<KvPool>, width: usize) -> Self {
        let n = BLOCK_ROWS * width;
        let data = match pool.dtype() {
            KvDtype::F32 => Data::F32(Vec::with_capacity(n)),
            KvDtype::Bf16 => Data::Bf16(Vec::with_capacity(n)),
        };
        Self::counted(data, pool, width)
    }
    fn counted(data: Data, pool: &Arc<KvPool>, width: usize) -> Self {
        let counted = (BLOCK_ROWS * width * pool.dtype().bytes()) as u64;
        pool.ram.fetch_add(counted, Ordering::Relaxed);
        RamBlock {
            data,
            counted,
            pool: pool.clone(),
            lent: false.into(),
        }
    }
    fn append(&mut self, rows: &[f32]) {
        match &mut self.data {
            Data::F32(v) => v.extend_from_slice(rows),
            Data::Bf16(v) => v.extend(
                rows.iter()
                    .map(|&x| fathom_weights::convert::f32_to_bf16_bits(x)),
            ),
        }
    }
    fn truncate(&mut self, floats: usize) {
        self.forget();
        match &mut self.data {
            Data::F32(v) => v.truncate(floats),
            Data::Bf16(v) => v.truncate(floats),
        }
    }
    fn to_bytes(&self) -> Vec<u8> {
        match &self.data {
            Data::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

impl Clone for RamBlock {
    fn clone(&self) -> Self {
        let width = (self.counted as usize / self.pool.dtype().bytes()) / BLOCK_ROWS;
        let data = match &self.data {
            Data::F32(v) => Data::F32(v.clone()),
            Data::Bf16(v) => Data::Bf16(v.clone()),
        };
        Self::counted(data, &self.pool, width)
    }
}

impl RamBlock {
    /// Its bytes are about to change or go: a device copy made while it
    /// was handed out as stable is dropped.
    fn forget(&self) {
        if self.lent.swap(false, Ordering::Relaxed)
            && let Data::F32(v) = &self.data
        {
            fathom_kernels::backend::forget(v);
        }
    }
}

impl Drop for RamBlock {
    fn drop(&mut self) {
        self.forget();
        self.pool.ram.fetch_sub(self.counted, Ordering::Relaxed);
    }
}

/// A full block written to the pool's spill target.
#[derive(Debug)]
struct DiskBlock {
    slot: u64,
    bytes: usize,
    pool: Arc<KvPool>,
}

impl Drop for DiskBlock {
    fn drop(&mut self) {
        if let Some(s) = &self.pool.cfg.spill {
            s.free(self.slot);
        }
        self.pool
            .disk
            .fetch_sub(self.bytes as u64, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone)]
enum Block {
    Ram(Arc<RamBlock>),
    Disk(Arc<DiskBlock>),
}

/// One layer's rows of one sequence, `[len, width]`, in blocks.
#[derive(Debug, Clone)]
pub struct PagedRows {
    blocks: Vec<Block>,
    len: usize,
    pub width: usize,
    pool: Arc<KvPool>,
}

fn io_err(pool: &KvPool, what: &str, e: std::io::Error) -> ModelError {
    let at = pool
        .cfg
        .spill
        .as_ref()
        .map(|s| s.location())
        .unwrap_or_default();
    ModelError::Cache(format!("attention cache: {what} {at}: {e}"))
}

impl PagedRows {
    pub fn new(width: usize, pool: &Arc<KvPool>) -> Self {
        PagedRows {
            blocks: Vec::new(),
            len: 0,
            width,
            pool: pool.clone(),
        }
    }
    /// Rows held.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Floats held (`len · width`).
    pub fn floats(&self) -> usize {
        self.len * self.width
    }
    /// Bytes of this sequence's rows (wherever they live).
    pub fn bytes(&self) -> usize {
        self.floats() * self.pool.dtype().bytes()
    }

    /// Appends rows (`[k, width]`). A block that fills while the pool is
    /// over its RAM share is spilled; with nowhere to spill that is an error
    /// naming the share (the caller's state is then undone by the step).
    pub fn push_rows(&mut self, rows: &[f32]) -> Result<()> {
        let w = self.width;
        debug_assert_eq!(rows.len() % w.max(1), 0);
        let mut rest = rows;
        while !rest.is_empty() {
            if self.len.is_multiple_of(BLOCK_ROWS) {
                self.blocks
                    .push(Block::Ram(Arc::new(RamBlock::new(&self.pool, w))));
            }
            let take = ((BLOCK_ROWS - self.len % BLOCK_ROWS) * w).min(rest.len());
            self.last_in_ram()?.append(&rest[..take]);
            rest = &rest[take..];
            self.len += take / w;
            if self.len.is_multiple_of(BLOCK_ROWS) && self.pool.over_share() {
                self.spill_last()?;
            }
        }
        Ok(())
    }

    /// The last block, writable (read back from disk or copied if shared).
    fn last_in_ram(&mut self) -> Result<&mut RamBlock> {
        let valid = (self.len - (self.blocks.len() - 1) * BLOCK_ROWS) * self.width;
        if let Some(Block::Disk(d)) = self.blocks.last() {
            let d = d.clone();
            let bytes = self.read_blocks(vec![(d.slot, d.bytes)])?.wait();
            let bytes = bytes.map_err(|e| io_err(&self.pool, "read from", e))?;
            let rows = decode(self.pool.dtype(), &bytes[0]);
            let mut b = RamBlock::new(&self.pool, self.width);
            b.append(&rows[..valid]);
            *self.blocks.last_mut().expect("checked above") = Block::Ram(Arc::new(b));
        }
        match self.blocks.last_mut() {
            Some(Block::Ram(r)) => Ok(Arc::make_mut(r)),
            _ => unreachable!("the last block was just put in RAM"),
        }
    }

    /// Writes the (full) last block to the spill target and drops it from RAM.
    fn spill_last(&mut self) -> Result<()> {
        let Some(Block::Ram(r)) = self.blocks.last() else {
            return Ok(());
        };
        if Arc::strong_count(r) > 1 {
            // Shared with a fork: spilling would not free it.
            return Ok(());
        }
        let Some(spill) = self.pool.cfg.spill.clone() else {
            let share = self.pool.cfg.ram_limit.unwrap_or(0);
            return Err(ModelError::State(format!(
                "the attention cache needs more than its RAM share (--kv-ram {}) and has no \
                 directory to spill to: give --kv-dir, raise --kv-ram or lower --context",
                fathom_weights::units::format_bytes(share)
            )));
        };
        let bytes = r.to_bytes();
        let slot = spill
            .write(&bytes)
            .map_err(|e| io_err(&self.pool, "write to", e))?;
        self.pool
            .disk
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.pool.spilled.fetch_add(1, Ordering::Relaxed);
        *self.blocks.last_mut().expect("checked above") = Block::Disk(Arc::new(DiskBlock {
            slot,
            bytes: bytes.len(),
            pool: self.pool.clone(),
        }));
        Ok(())
    }

    /// Keeps the first `n` rows (a shared or spilled last block stays as it
    /// is until written: only `len` says which of its rows count).
    pub fn truncate(&mut self, n: usize) {
        if n >= self.len {
            return;
        }
        self.blocks.truncate(n.div_ceil(BLOCK_ROWS));
        if !n.is_multiple_of(BLOCK_ROWS)
            && let Some(Block::Ram(r)) = self.blocks.last_mut()
        {
            Arc::make_mut(r).truncate((n % BLOCK_ROWS) * self.width);
        }
        self.len = n;
    }

    fn read_blocks(&self, slots: Vec<(u64, usize)>) -> Result<Box<dyn KvPending>> {
        let spill =
            self.pool.cfg.spill.as_ref().ok_or_else(|| {
                ModelError::State("a spilled block without a spill target".into())
            })?;
        let n: usize = slots.iter().map(|s| s.1).sum();
        self.pool.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(spill.read(slots))
    }

    /// Hands the first `rows` rows to `f` a window of blocks at a time, in
    /// order: `f(first_block, blocks)`, each block `[≤ BLOCK_ROWS, width]`
    /// fp32. Spilled blocks of the next window are read while `f` works.
    pub fn windows(&self, rows: usize, f: impl FnMut(usize, &[&[f32]])) -> Result<()> {
        self.windows_from(0, rows, f)
    }

    /// [`PagedRows::windows`] from block `first` on (the blocks before are
    /// neither read nor handed out: sliding-window attention).
    pub fn windows_from(
        &self,
        first: usize,
        rows: usize,
        mut f: impl FnMut(usize, &[&[f32]]),
    ) -> Result<()> {
        assert!(rows <= self.len, "asked for rows the cache does not hold");
        let nb = rows.div_ceil(BLOCK_ROWS);
        let starts: Vec<usize> = (first.min(nb)..nb).step_by(WINDOW_BLOCKS).collect();
        let disk_of = |a: usize| -> Vec<(u64, usize)> {
            self.blocks[a..(a + WINDOW_BLOCKS).min(nb)]
                .iter()
                .filter_map(|b| match b {
                    Block::Disk(d) => Some((d.slot, d.bytes)),
                    Block::Ram(_) => None,
                })
                .collect()
        };
        let start_read = |a: usize| -> Result<Option<Box<dyn KvPending>>> {
            let slots = disk_of(a);
            if slots.is_empty() {
                Ok(None)
            } else {
                self.read_blocks(slots).map(Some)
            }
        };
        let mut pending = match starts.first() {
            Some(&a) => start_read(a)?,
            None => None,
        };
        for (wi, &a) in starts.iter().enumerate() {
            let next = match starts.get(wi + 1) {
                Some(&b) => start_read(b)?,
                None => None,
            };
            let read = match pending.take() {
                Some(p) => p.wait().map_err(|e| io_err(&self.pool, "read from", e))?,
                None => Vec::new(),
            };
            self.window(a, nb, rows, read, &mut f);
            pending = next;
        }
        Ok(())
    }

    /// One window: blocks `a..` (up to [`WINDOW_BLOCKS`]) as fp32 slices.
    fn window(
        &self,
        a: usize,
        nb: usize,
        rows: usize,
        read: Vec<Vec<u8>>,
        f: &mut impl FnMut(usize, &[&[f32]]),
    ) {
        let b = (a + WINDOW_BLOCKS).min(nb);
        let dtype = self.pool.dtype();
        let mut read = read.into_iter();
        // Blocks that are not fp32 in RAM are widened into owned rows first.
        let owned: Vec<Option<Vec<f32>>> = self.blocks[a..b]
            .iter()
            .map(|blk| match blk {
                Block::Ram(r) => match &r.data {
                    Data::F32(_) => None,
                    Data::Bf16(v) => Some(v.iter().map(|&x| bf16(x)).collect()),
                },
                Block::Disk(_) => Some(decode(dtype, &read.next().unwrap_or_default())),
            })
            .collect();
        let slices: Vec<&[f32]> = self.blocks[a..b]
            .iter()
            .zip(&owned)
            .enumerate()
            .map(|(i, (blk, own))| {
                let valid = (rows - (a + i) * BLOCK_ROWS).min(BLOCK_ROWS) * self.width;
                match (blk, own) {
                    (_, Some(v)) => &v[..valid],
                    (Block::Ram(r), None) => match &r.data {
                        Data::F32(v) => &v[..valid],
                        Data::Bf16(_) => unreachable!("bf16 blocks are widened"),
                    },
                    (Block::Disk(_), None) => unreachable!("disk blocks are read"),
                }
            })
            .collect();
        f(a, &slices);
    }

    /// The first `rows` rows as the blocks [`PagedRows::windows`] hands out,
    /// all at once, and how many leading ones are full: those keep their
    /// bytes at their address until the block is truncated or dropped,
    /// which calls `fathom_kernels::backend::forget` on them (so a device
    /// may keep copies). `None` unless every block is fp32 in RAM (a bf16
    /// cache, or one with spilled blocks, goes through `windows`).
    pub fn ram_blocks(&self, rows: usize) -> Option<(Vec<&[f32]>, usize)> {
        assert!(rows <= self.len, "asked for rows the cache does not hold");
        let full_len = BLOCK_ROWS * self.width;
        let mut out = Vec::with_capacity(rows.div_ceil(BLOCK_ROWS));
        let mut full = 0;
        for (i, b) in self.blocks[..rows.div_ceil(BLOCK_ROWS)].iter().enumerate() {
            let Block::Ram(r) = b else { return None };
            let Data::F32(v) = &r.data else { return None };
            let valid = (rows - i * BLOCK_ROWS).min(BLOCK_ROWS) * self.width;
            if full == i && valid == full_len && v.len() == full_len {
                r.lent.store(true, Ordering::Relaxed);
                full += 1;
            }
            out.push(&v[..valid]);
        }
        Some((out, full))
    }

    /// Every row, contiguous fp32 (for saving a state).
    pub fn to_rows(&self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.floats());
        self.windows(self.len, |_, blocks| {
            for b in blocks {
                out.extend_from_slice(b);
            }
        })?;
        Ok(out)
    }

    /// Bytes of this cache's blocks in RAM and on disk (shared blocks
    /// counted in full).
    pub fn placement(&self) -> (u64, u64) {
        let (mut ram, mut disk) = (0u64, 0u64);
        for b in &self.blocks {
            match b {
                Block::Ram(r) => ram += r.counted,
                Block::Disk(d) => disk += d.bytes as u64,
            }
        }
        (ram, disk)
    }

    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }
}

#[inline]
fn bf16(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

/// A spilled block's bytes as fp32 rows.
fn decode(dtype: KvDtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        KvDtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        KvDtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| bf16(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
    }
}

/// Each sequence's cached rows before a step as a device call takes them
/// (`fathom_kernels::backend::MlaSeqWork`: its blocks from block
/// `first(p0)` on, `p0` the rows cached, with its queries `segs[i]`), and
/// every query's row count (causal: its own position and all before).
/// `None` unless every cache is fp32 in RAM ([`PagedRows::ram_blocks`]).
pub fn step_blocks<'a>(
    caches: &'a [&mut PagedRows],
    segs: &[crate::batch::Segment],
    first: impl Fn(usize) -> usize,
) -> Option<(Vec<fathom_kernels::backend::MlaSeqWork<'a>>, Vec<usize>)> {
    let mut seqs = Vec::with_capacity(caches.len());
    let mut ns = Vec::new();
    for (cache, seg) in caches.iter().zip(segs) {
        let p0 = cache.len();
        let (blocks, stable) = cache.ram_blocks(p0)?;
        let first = first(p0).min(blocks.len());
        seqs.push(fathom_kernels::backend::MlaSeqWork {
            blocks: blocks[first..].to_vec(),
            stable: stable.saturating_sub(first),
            queries: seg.clone(),
            first,
        });
        ns.extend((0..seg.len()).map(|i| p0 + i + 1));
    }
    Some((seqs, ns))
}

/// Appends a device call's new rows `rows` (`w` wide, the step's rows in
/// order) to each sequence's cache.
pub fn push_step_rows(
    caches: &mut [&mut PagedRows],
    segs: &[crate::batch::Segment],
    rows: &[f32],
    w: usize,
) -> Result<()> {
    for (cache, seg) in caches.iter_mut().zip(segs) {
        cache.push_rows(&rows[seg.start * w..seg.end * w])?;
    }
    Ok(())
}
