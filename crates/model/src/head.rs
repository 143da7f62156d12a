//! The output head: a matrix held in RAM, or left in the checkpoint and
//! read in row blocks for every pass.
//!
//! Every pass reads the whole head (K3's is 2.35 GB), so it is the last
//! spine weight to leave RAM: once no decoder layer can stay resident
//! (`fathom_stream::spine_tiers`). Its row blocks
//! are read ahead through the same ring as streamed layers
//! ([`crate::tiers::Layers`]), block after block, the first block of the
//! next pass read while that pass's layers compute. Each logit is one row's
//! product, whose reduction order does not depend on which other rows are
//! in the matrix, so the logits are those of the resident head, bit for
//! bit (tested in every family's streamed golden test).

use std::sync::Arc;

use fathom_weights::{Checkpoint, Dtype, TensorLoc, convert, int8_spine};

use crate::error::{ModelError, Result};
use crate::linear::{Linear, Spine, WeightData};
use crate::tiers::{HeadPlace, LayerPlan, Layers, SpineReads};

/// Row blocks are at most this many bytes (as read), at least one row.
pub const BLOCK_BYTES: u64 = 64 << 20;

/// A head is read in at least this many blocks (where it has the rows), so
/// its ring holds a fraction of it.
pub const MIN_BLOCKS: usize = 8;

/// Blocks the head's ring holds: the one computed and the one being read.
pub const HEAD_RING: usize = 2;

/// The rows of a block of a head of `rows` rows, each `row_bytes` long
/// where it is read: at most [`BLOCK_BYTES`], at most an eighth of the head.
pub fn block_rows(rows: usize, row_bytes: u64) -> usize {
    let by_bytes = (BLOCK_BYTES / row_bytes.max(1)) as usize;
    by_bytes.min(rows.div_ceil(MIN_BLOCKS)).max(1)
}

/// The output projection `[vocab, hidden]`.
#[derive(Debug)]
pub enum LmHead {
    Resident(Linear),
    OnDisk(BlocksOnDisk),
}

/// A head read in row blocks for every pass.
pub struct BlocksOnDisk {
    name: String,
    rows: usize,
    cols: usize,
    block_rows: usize,
    blocks: Layers<Linear>,
}

impl std::fmt::Debug for BlocksOnDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlocksOnDisk")
            .field("name", &self.name)
            .field("rows", &self.rows)
            .field("block_rows", &self.block_rows)
            .finish()
    }
}

impl LmHead {
    /// Matrix `name` of `ck` in `spine` precision: bound whole by `bind`
    /// (the family's binder, so an int8 spine file is read as a load reads
    /// it), or, with `on_disk`, left in the checkpoint and read in row
    /// blocks. A head read in blocks must be a float matrix (or held in
    /// the int8 spine file); anything else is refused, naming it.
    pub fn load(
        ck: &Arc<Checkpoint>,
        name: &str,
        spine: Spine,
        place: HeadPlace,
        bind: impl FnOnce() -> Result<Linear>,
    ) -> Result<Self> {
        if place != HeadPlace::Disk {
            let mut l = match place {
                HeadPlace::Device => crate::linear::loading_held(bind)?,
                _ => bind()?,
            };
            if spine == Spine::Int8 {
                l.quantize_int8();
            }
            return Ok(LmHead::Resident(l));
        }
        let source = BlockSource::new(ck, name, spine)?;
        let block_rows = block_rows(source.rows, source.row_bytes());
        Self::in_blocks(source, block_rows)
    }

    /// A head read from `source` in blocks of `block_rows` rows.
    fn in_blocks(source: BlockSource, block_rows: usize) -> Result<Self> {
        let (rows, cols, name) = (source.rows, source.cols, source.name.clone());
        let n = rows.div_ceil(block_rows);
        let source = Arc::new(source);
        let blocks = Layers::load(
            n,
            &LayerPlan::streamed(0, HEAD_RING),
            Arc::new(move |b| source.block(b * block_rows..((b + 1) * block_rows).min(rows))),
        )?;
        Ok(LmHead::OnDisk(BlocksOnDisk {
            name,
            rows,
            cols,
            block_rows,
            blocks,
        }))
    }

    /// `y[T, vocab] = x[T, hidden] Wᵀ`; a failed block read is the error.
    pub fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        match self {
            LmHead::Resident(l) => Ok(l.forward(x, t)),
            LmHead::OnDisk(d) => d.forward(x, t),
        }
    }

    /// Quantises a resident head to per-row int8 (a head on disk is read
    /// in the precision it was loaded for).
    pub fn quantize_int8(&mut self) {
        if let LmHead::Resident(l) = self {
            l.quantize_int8();
        }
    }

    /// The matrix when it is in RAM.
    pub fn resident(&self) -> Option<&Linear> {
        match self {
            LmHead::Resident(l) => Some(l),
            LmHead::OnDisk(_) => None,
        }
    }

    /// What reading the head's blocks has cost (zero when resident).
    pub fn reads(&self) -> SpineReads {
        match self {
            LmHead::Resident(_) => SpineReads::default(),
            LmHead::OnDisk(d) => d.blocks.reads(),
        }
    }
}

/// The matrix a family's logits come from: its head, or the embedding
/// table it is tied to (always resident).
#[derive(Debug, Clone, Copy)]
pub enum HeadRef<'a> {
    Head(&'a LmHead),
    Tied(&'a Linear),
}

impl HeadRef<'_> {
    /// `y[T, vocab] = x[T, hidden] Wᵀ`; a failed block read is the error.
    pub fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        match self {
            HeadRef::Head(h) => h.forward(x, t),
            HeadRef::Tied(l) => Ok(l.forward(x, t)),
        }
    }
}

impl BlocksOnDisk {
    fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        debug_assert_eq!(x.len(), t * self.cols);
        let _pass = self.blocks.pass();
        let mut y = vec![0f32; t * self.rows];
        for b in 0..self.blocks.len() {
            // The ring names the block as a layer; the source's error
            // names the tensor, its rows and the file.
            let block = self.blocks.get(b).map_err(|e| match e {
                ModelError::Spine { msg, .. } => ModelError::SpineHead(msg),
                e => e,
            })?;
            let r0 = b * self.block_rows;
            let part = block.forward(x, t);
            for (p, row) in part.chunks_exact(block.rows).enumerate() {
                y[p * self.rows + r0..p * self.rows + r0 + block.rows].copy_from_slice(row);
            }
        }
        Ok(y)
    }
}

/// Where a head's rows lie: as stored, or as int8 codes and row scales in
/// the int8 spine file.
struct BlockSource {
    ck: Arc<Checkpoint>,
    name: String,
    rows: usize,
    cols: usize,
    stored: TensorLoc,
    /// `(codes, scales)` from the int8 spine file.
    int8_file: Option<(TensorLoc, TensorLoc)>,
    /// Quantise each block after reading it as stored.
    quantise: bool,
}

impl BlockSource {
    fn new(ck: &Arc<Checkpoint>, name: &str, spine: Spine) -> Result<Self> {
        let get = |n: &str| {
            ck.get(n)
                .cloned()
                .ok_or_else(|| ModelError::Weights(fathom_weights::WeightsError::Missing(n.into())))
        };
        let stored = get(name)?;
        let [rows, cols] = stored.shape[..] else {
            return Err(ModelError::Tensor(format!(
                "{name}: expected a matrix, found {:?}",
                stored.shape
            )));
        };
        let int8 = spine == Spine::Int8;
        let int8_file = match ck.get(&int8_spine::q_name(name)) {
            Some(q) if int8 => Some((q.clone(), get(&int8_spine::scale_name(name))?)),
            _ => None,
        };
        if int8_file.is_none() && convert::to_f32(stored.dtype, &[]).is_none() {
            return Err(ModelError::Tensor(format!(
                "{name}: a {:?} head cannot be read in row blocks: give a --ram-budget that keeps it resident",
                stored.dtype
            )));
        }
        Ok(BlockSource {
            ck: ck.clone(),
            name: name.to_string(),
            rows,
            cols,
            stored,
            quantise: int8 && int8_file.is_none(),
            int8_file,
        })
    }

    /// Bytes a row takes where it is read from.
    fn row_bytes(&self) -> u64 {
        match &self.int8_file {
            Some((q, _)) => q.len / self.rows.max(1) as u64 + 4,
            None => self.stored.len / self.rows.max(1) as u64,
        }
    }

    /// Rows `r` of tensor `loc`, as a location of their own.
    fn rows_of(&self, loc: &TensorLoc, r: &std::ops::Range<usize>) -> TensorLoc {
        let width = loc.len / self.rows.max(1) as u64;
        let mut shape = loc.shape.clone();
        shape[0] = r.len();
        TensorLoc {
            shard: loc.shard,
            offset: loc.offset + r.start as u64 * width,
            len: r.len() as u64 * width,
            dtype: loc.dtype,
            shape,
        }
    }

    /// Rows `r` of tensor `loc` (named `what`) as bytes.
    fn read_rows(
        &self,
        loc: &TensorLoc,
        what: &str,
        r: &std::ops::Range<usize>,
    ) -> Result<Vec<u8>> {
        self.ck
            .read(&self.rows_of(loc, r))
            .map_err(|e| ModelError::Tensor(format!("{what}: rows {r:?}: {e}")))
    }

    /// Rows `r` as a matrix in the head's precision.
    fn block(&self, r: std::ops::Range<usize>) -> Result<Linear> {
        let data = if let Some((q, scale)) = &self.int8_file {
            let (qn, sn) = (
                int8_spine::q_name(&self.name),
                int8_spine::scale_name(&self.name),
            );
            let q: Vec<i8> = self
                .read_rows(q, &qn, &r)?
                .into_iter()
                .map(|b| b as i8)
                .collect();
            let scale = convert::to_f32(Dtype::F32, &self.read_rows(scale, &sn, &r)?)
                .expect("f32 converts to f32");
            WeightData::Int8 {
                q: q.into(),
                scale: scale.into(),
            }
        } else if self.stored.dtype == Dtype::BF16 {
            // Read straight into the block's storage (no second copy).
            let w = self
                .ck
                .read_u16(&self.rows_of(&self.stored, &r))
                .map_err(|e| ModelError::Tensor(format!("{}: rows {r:?}: {e}", self.name)))?;
            WeightData::Bf16(w.into())
        } else {
            let bytes = self.read_rows(&self.stored, &self.name, &r)?;
            let dt = self.stored.dtype;
            WeightData::F32(
                convert::to_f32(dt, &bytes)
                    .expect("checked when bound")
                    .into(),
            )
        };
        let mut l = Linear {
            rows: r.len(),
            cols: self.cols,
            data,
        };
        if self.quantise {
            l.quantize_int8();
        }
        Ok(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint of one `[rows, cols]` head of `dtype` (BF16 or F32).
    fn head(
        tag: &str,
        dtype: &str,
        rows: usize,
        cols: usize,
    ) -> (std::path::PathBuf, Arc<Checkpoint>) {
        crate::testing::one_matrix(&format!("head-{tag}"), "lm_head.weight", dtype, rows, cols)
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn blocks_read_for_every_pass_give_the_resident_logits() {
        let (rows, cols, t) = (37, 24, 3);
        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        for (dtype, spine) in [
            ("BF16", Spine::Bf16),
            ("F32", Spine::Bf16),
            ("BF16", Spine::Int8),
        ] {
            let tag = format!("{dtype}-{}", spine.name());
            let (d, ck) = head(&tag, dtype, rows, cols);
            let name = "lm_head.weight";
            let loc = ck.get(name).unwrap().clone();
            let resident = LmHead::load(&ck, name, spine, HeadPlace::Ram, || {
                Linear::load(&ck, name, &loc)
            })
            .unwrap();
            let want = resident.forward(&x, t).unwrap();
            assert_eq!(want.len(), t * rows);
            assert_eq!(resident.reads(), SpineReads::default());
            // The default blocks (an eighth of the rows), and uneven ones.
            let default =
                LmHead::load(&ck, name, spine, HeadPlace::Disk, || unreachable!()).unwrap();
            let LmHead::OnDisk(b) = &default else {
                panic!("{tag}: not on disk")
            };
            assert_eq!((b.block_rows, b.blocks.len()), (5, 8), "{tag}");
            let uneven =
                LmHead::in_blocks(BlockSource::new(&ck, name, spine).unwrap(), 10).unwrap();
            for h in [&default, &uneven] {
                assert!(h.resident().is_none());
                for pass in 0..3 {
                    let got = h.forward(&x, t).unwrap();
                    assert_eq!(bits(&got), bits(&want), "{tag}, pass {pass}");
                }
                let r = h.reads();
                assert_eq!(r.passes, 3, "{tag}");
                // Each pass reads the whole head once; the reader may be
                // one block ahead.
                let per = loc.len;
                assert!(
                    r.bytes_read >= 3 * per && r.bytes_read <= 3 * per + per / 2,
                    "{tag}: {r:?}"
                );
            }
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn a_block_that_cannot_be_read_fails_the_pass_naming_the_tensor() {
        let (d, ck) = head("cut", "BF16", 40, 16);
        let h = LmHead::load(
            &ck,
            "lm_head.weight",
            Spine::Bf16,
            HeadPlace::Disk,
            || unreachable!(),
        )
        .unwrap();
        let x = vec![0.5f32; 16];
        assert_eq!(h.forward(&x, 1).unwrap().len(), 40);
        // The file loses its last rows: the pass that reaches them fails.
        let f = d.join("model.safetensors");
        let len = std::fs::metadata(&f).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .set_len(len - 200)
            .unwrap();
        let e = (0..3)
            .find_map(|_| h.forward(&x, 1).err())
            .expect("a pass over the cut rows fails")
            .to_string();
        assert!(
            e.starts_with("spine head: tensor lm_head.weight: rows "),
            "{e}"
        );
        assert!(e.contains(f.to_str().unwrap()), "{e}");
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn blocks_are_an_eighth_of_the_head_at_most_64_mib() {
        assert_eq!(block_rows(37, 48), 5);
        assert_eq!(block_rows(3, 48), 1);
        // K3's head: 163,840 rows of 14,336 bytes: 4,681 rows (67.1 MB).
        assert_eq!(block_rows(163_840, 14_336), 4_681);
        assert_eq!(block_rows(0, 8), 1);
    }
}
