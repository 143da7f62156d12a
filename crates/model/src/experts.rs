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

    /// Reads the expert with as few positional reads as possible (one when adjacent).
    pub fn read(&self, spec: &K3Spec, ck: &Checkpoint) -> Result<ExpertWeights> {
        if let Some((shard, off, len)) = self.span() {
            let mut buf = AlignedBuf::zeroed(len as usize);
            ck.read_into(shard, off, &mut buf)?;
            return Ok(self.from_span(spec, off, buf));
        }
        let mut buf = Vec::with_capacity(self.bytes() as usize);
        let mut parts = [(0, 0, [0, 0]); 3];
        for (i, m) in ExpertMatrix::ALL.iter().enumerate() {
            let (p, s) = &self.parts[i];
            let po = buf.len();
            buf.extend(ck.read(p)?);
            let so = buf.len();
            buf.extend(ck.read(s)?);
            parts[i] = (po, so, m.shape(spec));
        }
        Ok(ExpertWeights {
            buf: AlignedBuf::from_slice(&buf),
            parts,
        })
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
