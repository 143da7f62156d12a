//! The narrow interface between the model and wherever routed experts live.
//!
//! The model never does I/O. For each MoE layer it asks an [`ExpertSource`]
//! for exactly the experts its router chose (all of them, always: nothing
//! is skipped or substituted), and may tell the source its guess for the next
//! layer so I/O can start early. A guess only schedules work; it can never
//! change which experts are computed or their weights.
//!
//! [`ResidentExperts`] keeps every expert in RAM; the streamed and CUDA
//! sources of later issues implement the same trait.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use fathom_weights::mxfp4::Mxfp4Ref;
use fathom_weights::{AlignedBuf, Checkpoint, TensorLoc};

use crate::error::{ModelError, Result};
use crate::kimi_k3::config::K3Spec;
use crate::kimi_k3::tensors::{ExpertMatrix, expert_name};

/// One routed expert's three MXFP4 matrices, in a single byte buffer (so a
/// streamed expert is one read into one allocation).
#[derive(Debug)]
pub struct ExpertWeights {
    pub buf: AlignedBuf,
    /// For w1, w2, w3: (packed offset, scale offset) into `buf`, and `[rows, cols]`.
    pub parts: [(usize, usize, [usize; 2]); 3],
}

impl ExpertWeights {
    pub fn matrix(&self, m: ExpertMatrix) -> Mxfp4Ref<'_> {
        let i = m as usize;
        let (p, s, [r, c]) = self.parts[i];
        Mxfp4Ref {
            rows: r,
            cols: c,
            packed: &self.buf[p..p + r * c / 2],
            scales: &self.buf[s..s + r * c / 32],
        }
    }
}

/// Where one expert's six tensors are on disk.
#[derive(Debug, Clone)]
pub struct ExpertLoc {
    /// (packed, scale) locators for w1, w2, w3.
    pub parts: [(TensorLoc, TensorLoc); 3],
}

impl ExpertLoc {
    /// `(shard, offset, len)` of the smallest byte range holding all six
    /// tensors, if they share a shard and the range holds nothing else of
    /// consequence (in released files the six are adjacent).
    pub fn span(&self) -> Option<(usize, u64, u64)> {
        let locs = self.parts.iter().flat_map(|(a, b)| [a, b]);
        let shard = self.parts[0].0.shard;
        let mut lo = u64::MAX;
        let mut hi = 0;
        let mut total = 0;
        for l in locs {
            if l.shard != shard {
                return None;
            }
            lo = lo.min(l.offset);
            hi = hi.max(l.offset + l.len);
            total += l.len;
        }
        // Accept small gaps (alignment padding); refuse to read unrelated data.
        (hi - lo <= total + 4096).then_some((shard, lo, hi - lo))
    }

    /// Bytes of tensor data (excluding any gap).
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|(a, b)| a.len + b.len).sum()
    }

    /// Builds the expert from a buffer read at `span()`'s offset.
    pub fn from_span(&self, spec: &K3Spec, base: u64, buf: AlignedBuf) -> ExpertWeights {
        let mut parts = [(0, 0, [0, 0]); 3];
        for (i, m) in ExpertMatrix::ALL.iter().enumerate() {
            let (p, s) = &self.parts[i];
            parts[i] = (
                (p.offset - base) as usize,
                (s.offset - base) as usize,
                m.shape(spec),
            );
        }
        ExpertWeights { buf, parts }
    }

    /// Reads the expert through `read(shard, offset, len)`, which returns a
    /// buffer holding at least that range and the file offset of its first
    /// byte: one call for the whole span when the six tensors are adjacent
    /// (as in the released files), else one per tensor, packed into one
    /// buffer. Returns the expert and the bytes the reads returned.
    pub fn read_with<E>(
        &self,
        spec: &K3Spec,
        mut read: impl FnMut(usize, u64, u64) -> std::result::Result<(AlignedBuf, u64), E>,
    ) -> std::result::Result<(ExpertWeights, u64), E> {
        if let Some((shard, off, len)) = self.span() {
            let (buf, base) = read(shard, off, len)?;
            let n = buf.len() as u64;
            return Ok((self.from_span(spec, base, buf), n));
        }
        let mut bytes = Vec::with_capacity(self.bytes() as usize);
        let mut parts = [(0, 0, [0, 0]); 3];
        let mut n = 0;
        for (i, m) in ExpertMatrix::ALL.iter().enumerate() {
            let mut offsets = [0; 2];
            for (k, t) in [&self.parts[i].0, &self.parts[i].1].into_iter().enumerate() {
                let (b, base) = read(t.shard, t.offset, t.len)?;
                n += b.len() as u64;
                offsets[k] = bytes.len();
                bytes.extend_from_slice(&b[(t.offset - base) as usize..][..t.len as usize]);
            }
            parts[i] = (offsets[0], offsets[1], m.shape(spec));
        }
        let buf = AlignedBuf::from_slice(&bytes);
        Ok((ExpertWeights { buf, parts }, n))
    }

    /// Reads the expert from a checkpoint (buffered reads; the resident path).
    pub fn read(&self, spec: &K3Spec, ck: &Checkpoint) -> Result<ExpertWeights> {
        let (e, _) = self.read_with(spec, |shard, off, len| {
            let mut buf = AlignedBuf::zeroed(len as usize);
            ck.read_into(shard, off, &mut buf)?;
            Ok::<_, ModelError>((buf, off))
        })?;
        Ok(e)
    }
}

/// Locators of every routed expert: `[moe layer][expert]`.
#[derive(Debug, Clone)]
pub struct ExpertTable {
    /// Indexed by absolute layer; empty for dense layers.
    pub layers: Vec<Vec<ExpertLoc>>,
}

impl ExpertTable {
    pub fn from_checkpoint(spec: &K3Spec, ck: &Checkpoint) -> Result<Self> {
        let mut layers = vec![Vec::new(); spec.num_layers];
        for l in spec.moe_layers() {
            let mut v = Vec::with_capacity(spec.num_experts);
            for e in 0..spec.num_experts {
                let get = |m, part| {
                    let n = expert_name(l, e, m, part);
                    ck.get(&n).cloned().ok_or(ModelError::Weights(
                        fathom_weights::WeightsError::Missing(n),
                    ))
                };
                let mut parts = Vec::with_capacity(3);
                for m in ExpertMatrix::ALL {
                    parts.push((get(m, "weight_packed")?, get(m, "weight_scale")?));
                }
                let parts: [(TensorLoc, TensorLoc); 3] = parts.try_into().expect("three matrices");
                v.push(ExpertLoc { parts });
            }
            layers[l] = v;
        }
        Ok(ExpertTable { layers })
    }
}

/// Counters every source keeps (cumulative; diff two readings for a window).
#[derive(Debug, Default, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ExpertStats {
    /// Bytes read from storage (including prefetches that went unused).
    pub bytes_read: u64,
    /// Requested experts already in RAM (cached, or prefetched in time).
    pub hits: u64,
    /// Requested experts that had to be read (or were still being read).
    pub misses: u64,
    /// Experts named by next-layer hints.
    pub hinted: u64,
    /// Hinted experts the layer then actually asked for.
    pub hinted_used: u64,
    /// Experts asked for by the model.
    pub requested: u64,
    /// Seconds the model spent waiting for experts.
    pub wait_s: f64,
    /// Seconds of storage reads, summed over I/O threads.
    pub read_s: f64,
}

impl ExpertStats {
    /// Counters accumulated since `before`.
    pub fn since(&self, before: &ExpertStats) -> ExpertStats {
        ExpertStats {
            bytes_read: self.bytes_read - before.bytes_read,
            hits: self.hits - before.hits,
            misses: self.misses - before.misses,
            hinted: self.hinted - before.hinted,
            hinted_used: self.hinted_used - before.hinted_used,
            requested: self.requested - before.requested,
            wait_s: self.wait_s - before.wait_s,
            read_s: self.read_s - before.read_s,
        }
    }
}

/// Where the model gets routed experts from.
pub trait ExpertSource: Send + Sync {
    /// The experts `ids` of `layer`, in the order asked. Must return every one.
    fn experts(&self, layer: usize, ids: &[u32]) -> Result<Vec<Arc<ExpertWeights>>>;
    /// Starts making `ids` of `layer` available without waiting; the model
    /// calls this as soon as the router has decided, computes what does not
    /// need the experts (latent projection, shared experts), then calls
    /// [`ExpertSource::experts`] for the same ids. Default: nothing to start.
    fn request(&self, _layer: usize, _ids: &[u32]) {}
    /// A guess at the experts `layer` will ask for next. Default: ignored.
    fn hint(&self, _layer: usize, _ids: &[u32]) {}
    /// Whether [`ExpertSource::hint`] is worth computing for this source.
    fn wants_hints(&self) -> bool {
        false
    }
    fn stats(&self) -> ExpertStats;
}

/// Every expert read into RAM at load.
pub struct ResidentExperts {
    layers: Vec<Vec<Arc<ExpertWeights>>>,
    served: AtomicU64,
}

impl ResidentExperts {
    pub fn load(spec: &K3Spec, ck: &Checkpoint, table: &ExpertTable) -> Result<Self> {
        let layers = table
            .layers
            .iter()
            .map(|l| {
                l.iter()
                    .map(|e| e.read(spec, ck).map(Arc::new))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ResidentExperts {
            layers,
            served: AtomicU64::new(0),
        })
    }
}

impl ExpertSource for ResidentExperts {
    fn experts(&self, layer: usize, ids: &[u32]) -> Result<Vec<Arc<ExpertWeights>>> {
        let l = self
            .layers
            .get(layer)
            .ok_or_else(|| ModelError::Experts(format!("layer {layer} has no experts")))?;
        self.served.fetch_add(ids.len() as u64, Ordering::Relaxed);
        ids.iter()
            .map(|&e| {
                l.get(e as usize)
                    .cloned()
                    .ok_or_else(|| ModelError::Experts(format!("layer {layer} has no expert {e}")))
            })
            .collect()
    }

    fn stats(&self) -> ExpertStats {
        let served = self.served.load(Ordering::Relaxed);
        ExpertStats {
            hits: served,
            requested: served,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-tensor path (tensors scattered in the file) packs the same
    /// bytes as the one-read span path.
    #[test]
    fn scattered_and_adjacent_tensors_read_alike() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3-tiny/checkpoint");
        let spec = K3Spec::from_dir(&dir).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        let table = ExpertTable::from_checkpoint(&spec, &ck).unwrap();
        let adjacent = &table.layers[1][5];
        let want = adjacent.read(&spec, &ck).unwrap();
        // Move every tensor 10_000 bytes further than the previous one, in a
        // fake file that holds the same bytes at the new places.
        let mut scattered = adjacent.clone();
        let mut file = vec![0u8; 200_000];
        let mut at = 0u64;
        for (p, s) in scattered.parts.iter_mut() {
            for t in [p, s] {
                at += 10_000;
                let bytes = ck.read(t).unwrap();
                file[at as usize..][..bytes.len()].copy_from_slice(&bytes);
                t.offset = at;
            }
        }
        assert!(scattered.span().is_none());
        let mut reads = 0;
        let (got, _) = scattered
            .read_with(&spec, |_, off, len| {
                reads += 1;
                Ok::<_, ()>((
                    AlignedBuf::from_slice(&file[off as usize..][..len as usize]),
                    off,
                ))
            })
            .unwrap();
        assert_eq!(reads, 6);
        for m in ExpertMatrix::ALL {
            let (a, b) = (got.matrix(m), want.matrix(m));
            assert_eq!((a.packed, a.scales), (b.packed, b.scales));
        }
    }
}
