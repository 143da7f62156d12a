//! The token embedding: a table held in RAM, or left in the checkpoint and
//! read a row at a time as a pass asks for its tokens.
//!
//! A pass reads one row of the embedding per position, so when the spine
//! does not fit its budget the embedding is the first weight to leave RAM
//! (`fathom_stream::spine_tiers`): K3's is 2.35 GB, of which a token reads
//! 14 kB. Both forms give the same f32 rows (`fathom_weights::convert`:
//! bf16 widened exactly, f16 and f32 as [`Linear::load`] reads them).

use std::sync::Arc;

use fathom_weights::{Checkpoint, TensorLoc, convert};

use crate::error::{ModelError, Result};
use crate::linear::Linear;

/// The token embedding `[vocab, hidden]`.
#[derive(Debug)]
pub enum Embedding {
    /// The whole table in RAM.
    Resident(Linear),
    /// Rows read from the checkpoint on demand.
    OnDisk(RowsOnDisk),
}

/// Where an embedding left in the checkpoint lies.
pub struct RowsOnDisk {
    ck: Arc<Checkpoint>,
    name: String,
    loc: TensorLoc,
    rows: usize,
    cols: usize,
}

impl std::fmt::Debug for RowsOnDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowsOnDisk")
            .field("name", &self.name)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl Embedding {
    /// Tensor `name` of `ck`: read whole (`on_disk` false, as
    /// [`Linear::load`] reads it) or left in the checkpoint. A table that
    /// is not a float matrix is refused either way, naming it.
    pub fn load(ck: &Arc<Checkpoint>, name: &str, on_disk: bool) -> Result<Self> {
        let loc = ck
            .get(name)
            .ok_or_else(|| ModelError::Weights(fathom_weights::WeightsError::Missing(name.into())))?
            .clone();
        if !on_disk {
            return Linear::load(ck, name, &loc).map(Embedding::Resident);
        }
        let [rows, cols] = loc.shape[..] else {
            return Err(ModelError::Tensor(format!(
                "{name}: expected a matrix, found {:?}",
                loc.shape
            )));
        };
        if convert::to_f32(loc.dtype, &[]).is_none() {
            return Err(ModelError::Tensor(format!(
                "{name}: {:?} is not a float dtype",
                loc.dtype
            )));
        }
        Ok(Embedding::OnDisk(RowsOnDisk {
            ck: ck.clone(),
            name: name.to_string(),
            loc,
            rows,
            cols,
        }))
    }

    /// The rows of `tokens`, `[tokens.len(), hidden]`; an id past the table
    /// or a failed read is the error (naming the file).
    pub fn rows(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (rows, cols) = match self {
            Embedding::Resident(t) => (t.rows, t.cols),
            Embedding::OnDisk(d) => (d.rows, d.cols),
        };
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= rows) {
            return Err(ModelError::TokenOutOfRange { id, vocab: rows });
        }
        let mut out = vec![0f32; tokens.len() * cols];
        for (&id, row) in tokens.iter().zip(out.chunks_exact_mut(cols.max(1))) {
            match self {
                Embedding::Resident(t) => t.row_into(id as usize, row),
                Embedding::OnDisk(d) => d.read_row(id, row)?,
            }
        }
        Ok(out)
    }

    /// The table when it is in RAM (a head tied to the embedding).
    pub fn resident(&self) -> Option<&Linear> {
        match self {
            Embedding::Resident(t) => Some(t),
            Embedding::OnDisk(_) => None,
        }
    }

    /// Whether rows are read from the checkpoint as asked.
    pub fn on_disk(&self) -> bool {
        matches!(self, Embedding::OnDisk(_))
    }
}

impl RowsOnDisk {
    /// Row `id` (inside the table: the caller checks) into `out`.
    fn read_row(&self, id: u32, out: &mut [f32]) -> Result<()> {
        let width = self.loc.len as usize / self.rows.max(1);
        let mut bytes = vec![0u8; width];
        let at = self.loc.offset + (id as usize * width) as u64;
        self.ck
            .read_into(self.loc.shard, at, &mut bytes)
            .map_err(|e| ModelError::Tensor(format!("{}: row {id}: {e}", self.name)))?;
        let row = convert::to_f32(self.loc.dtype, &bytes).ok_or_else(|| {
            ModelError::Tensor(format!(
                "{}: {:?} is not a float dtype",
                self.name, self.loc.dtype
            ))
        })?;
        out.copy_from_slice(&row);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-tensor checkpoint of `dtype` (bf16 or f32) in a fresh directory.
    fn table(dtype: &str, rows: usize, cols: usize) -> (std::path::PathBuf, Arc<Checkpoint>) {
        crate::testing::one_matrix("embedding", "model.embed_tokens.weight", dtype, rows, cols)
    }

    #[test]
    fn rows_read_on_demand_equal_the_resident_table() {
        for dtype in ["BF16", "F32"] {
            let (d, ck) = table(dtype, 37, 24);
            let name = "model.embed_tokens.weight";
            let resident = Embedding::load(&ck, name, false).unwrap();
            let on_disk = Embedding::load(&ck, name, true).unwrap();
            assert!(!resident.on_disk() && on_disk.on_disk());
            let tokens = [0, 36, 5, 5, 17];
            let want = resident.rows(&tokens).unwrap();
            assert_eq!(want.len(), tokens.len() * 24);
            let got = on_disk.rows(&tokens).unwrap();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{dtype}"
            );
            for e in [&resident, &on_disk] {
                let err = e.rows(&[3, 37]).unwrap_err().to_string();
                assert_eq!(err, "token id 37 is outside the vocabulary (size 37)");
            }
            let _ = std::fs::remove_dir_all(d);
        }
    }
}
