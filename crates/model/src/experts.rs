//! The narrow interface between the model and wherever routed experts live.
//!
//! The model never does I/O. For each MoE layer it asks an [`ExpertSource`]
//! for exactly the experts its router chose (all of them, always: nothing
//! is skipped or substituted), and may tell the source its guess for the next
//! layer so I/O can start early. A guess only schedules work; it can never
//! change which experts are computed or their weights.
//!
//! [`ResidentExperts`] keeps every expert in RAM; the streamed and CUDA
//! sources of later issues implement the same trait. Experts are MXFP4
//! (K3; GPT-OSS's release, with biases), bf16 or f32 (Kimi-Linear,
//! Qwen3-MoE, DeepSeek-V3), FP8 with block scales (DeepSeek-V3 / Kimi K2's
//! release), group-scaled INT4 (Kimi K2 Thinking's release) or bf16
//! input-major with biases (GPT-OSS); [`ExpertWeights::matmul`] applies each.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use fathom_kernels::formats::{Fp8Rows, Int4Rows};
use fathom_kernels::fp8::{bf16, e4m3_is_nan};
use std::borrow::Cow;

use fathom_kernels::backend::{self, MatRef, Role, matmul_stable};
use fathom_kernels::matmul::{f32s_of_bytes, u16s_of_bytes};
use fathom_weights::mxfp4::Mxfp4Ref;
use fathom_weights::{AlignedBuf, Checkpoint, TensorLoc};

use crate::error::{ModelError, Result};

/// `[rows, cols]` of an expert's three matrices, in the order the family's
/// expert table lists them (K3, Kimi-Linear: w1, w2, w3; Qwen3-MoE: gate, up, down;
/// DeepSeek-V3: gate, down, up — the w1, w2, w3 roles; GPT-OSS: gate_up, down,
/// absent).
pub type ExpertShapes = [[usize; 2]; 3];

/// How a routed expert's matrices are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertFormat {
    /// E2M1 nibbles with an E8M0 scale per 32 columns (two tensors a matrix).
    Mxfp4,
    /// bf16, one tensor a matrix.
    Bf16,
    /// bf16 stored input-major `[in, out]` (applied as `x·W`), each matrix
    /// with a bf16 bias `[out]`: slices of GPT-OSS's stacked expert tensors.
    Bf16InputMajorBias,
    /// f32, one tensor a matrix.
    F32,
    /// E4M3 codes `[out, in]` with an f32 scale per `block` tile (the
    /// companion, `[⌈out/br⌉, ⌈in/bc⌉]`): DeepSeek-V3's `weight_scale_inv`.
    Fp8 { block: [usize; 2] },
    /// compressed-tensors pack-quantized INT4 `[out, in/8]` int32 words
    /// with a bf16 scale per `group` columns (the companion).
    Int4 { group: usize },
    /// MXFP4 `[out, in]` (GPT-OSS's released `_blocks` / `_scales` slices)
    /// in the first two slots; the third slot holds their bf16 biases
    /// (the first matrix's as its tensor, the second's as its companion).
    Mxfp4Bias,
}

/// One routed expert's three matrices, in a single byte buffer (so a
/// streamed expert is one read into one allocation).
#[derive(Debug)]
pub struct ExpertWeights {
    pub buf: AlignedBuf,
    /// For each matrix: (data offset, companion offset — the MXFP4 scales
    /// or the bias, unused for plain bf16) into `buf`, and the stored
    /// `[rows, cols]` (`[in, out]` for the input-major format).
    pub parts: [(usize, usize, [usize; 2]); 3],
    pub format: ExpertFormat,
}

impl ExpertWeights {
    /// Matrix `i` (0, 1, 2 in the table's order) of an MXFP4 expert.
    pub fn matrix(&self, i: usize) -> Mxfp4Ref<'_> {
        debug_assert!(matches!(
            self.format,
            ExpertFormat::Mxfp4 | ExpertFormat::Mxfp4Bias
        ));
        let (p, s, [r, c]) = self.parts[i];
        Mxfp4Ref {
            rows: r,
            cols: c,
            packed: &self.buf[p..p + r * c / 2],
            scales: &self.buf[s..s + r * c / 32],
        }
    }

    /// Matrix `i` applied to `x [t, in]` in its stored format: `y [t, out]
    /// = x · W_iᵀ` (`W_i` stored `[out, in]`), or `x · W_i + b_i` for the
    /// input-major biased format.
    pub fn matmul(&self, i: usize, x: &[f32], t: usize, y: &mut [f32]) {
        // A view borrowed from `buf` is stable until this expert drops (which
        // tells the seam); a copied view (an unaligned buffer) is not.
        let apply = |w: MatRef<'_>, stable: bool, y: &mut [f32]| {
            if stable {
                matmul_stable(&w, Role::Expert, x, t, y)
            } else {
                w.cpu(x, t, y)
            }
        };
        match self.format {
            ExpertFormat::Mxfp4 => apply(MatRef::Mxfp4(self.matrix(i)), true, y),
            ExpertFormat::Bf16 => {
                let (p, _, [r, c]) = self.parts[i];
                let w = u16s_of_bytes(&self.buf[p..p + 2 * r * c]);
                let m = MatRef::Bf16 {
                    w: &w,
                    rows: r,
                    cols: c,
                };
                apply(m, is_borrowed(&w), y)
            }
            ExpertFormat::Bf16InputMajorBias => {
                let (p, b, [ins, outs]) = self.parts[i];
                let w = &self.buf[p..p + 2 * ins * outs];
                fathom_kernels::matmul_bf16_in_major_bytes(x, t, w, ins, outs, y);
                self.add_bias(b, outs, y);
            }
            ExpertFormat::F32 => {
                let (p, _, [r, c]) = self.parts[i];
                let w = f32s_of_bytes(&self.buf[p..p + 4 * r * c]);
                let m = MatRef::F32 {
                    w: &w,
                    rows: r,
                    cols: c,
                };
                apply(m, is_borrowed(&w), y)
            }
            ExpertFormat::Fp8 { block } => {
                let (p, s, [r, c]) = self.parts[i];
                let grid = r.div_ceil(block[0]) * c.div_ceil(block[1]);
                let scale = f32s_of_bytes(&self.buf[s..s + 4 * grid]);
                let w = Fp8Rows::new(&self.buf[p..p + r * c], &scale, c, block, 0)
                    .expect("FP8 expert shapes are checked at load");
                apply(MatRef::Fp8(w), is_borrowed(&scale), y)
            }
            ExpertFormat::Int4 { group } => {
                let (p, s, [r, c]) = self.parts[i];
                let scale = u16s_of_bytes(&self.buf[s..s + 2 * r * c / group]);
                let w = Int4Rows::new(&self.buf[p..p + r * c / 2], &scale, r, c, group)
                    .expect("INT4 expert shapes are checked at load");
                apply(MatRef::Int4(w), is_borrowed(&scale), y)
            }
            ExpertFormat::Mxfp4Bias => {
                apply(MatRef::Mxfp4(self.matrix(i)), true, y);
                self.after_product(i, y);
            }
        }
    }

    /// Matrix `i` of an MXFP4 expert (with or without biases) as the seam
    /// takes it in a batch, borrowed from this expert's buffer (stable
    /// until the expert drops); [`ExpertWeights::after_product`] finishes
    /// its rows as [`ExpertWeights::matmul`] does. `None` for other formats.
    pub fn mxfp4_mat(&self, i: usize) -> Option<MatRef<'_>> {
        matches!(self.format, ExpertFormat::Mxfp4 | ExpertFormat::Mxfp4Bias)
            .then(|| MatRef::Mxfp4(self.matrix(i)))
    }

    /// What [`ExpertWeights::matmul`] does to matrix `i`'s product after
    /// the product itself: adds its bias (`Mxfp4Bias`: the first matrix's
    /// or the second's); nothing for the other formats' plain products.
    pub fn after_product(&self, i: usize, y: &mut [f32]) {
        if self.format == ExpertFormat::Mxfp4Bias && i < 2 {
            let (b0, b1, _) = self.parts[2];
            let bias = if i == 0 { b0 } else { b1 };
            self.add_bias(bias, self.parts[i].2[0], y);
        }
    }

    /// Matrix `i` as the backend seam sees it, when it is a plain product
    /// (no bias) on bytes borrowed from this expert's buffer — stable until
    /// the expert drops, which tells the seam. `None` otherwise.
    pub fn stable_mat(&self, i: usize) -> Option<MatRef<'_>> {
        fn borrowed<'a, T: Clone>(c: Cow<'a, [T]>) -> Option<&'a [T]> {
            match c {
                Cow::Borrowed(s) => Some(s),
                Cow::Owned(_) => None,
            }
        }
        let (p, s, [r, c]) = self.parts[i];
        Some(match self.format {
            ExpertFormat::Mxfp4 => MatRef::Mxfp4(self.matrix(i)),
            ExpertFormat::Bf16 => MatRef::Bf16 {
                w: borrowed(u16s_of_bytes(&self.buf[p..p + 2 * r * c]))?,
                rows: r,
                cols: c,
            },
            ExpertFormat::F32 => MatRef::F32 {
                w: borrowed(f32s_of_bytes(&self.buf[p..p + 4 * r * c]))?,
                rows: r,
                cols: c,
            },
            ExpertFormat::Fp8 { block } => {
                let grid = r.div_ceil(block[0]) * c.div_ceil(block[1]);
                let scale = borrowed(f32s_of_bytes(&self.buf[s..s + 4 * grid]))?;
                MatRef::Fp8(
                    Fp8Rows::new(&self.buf[p..p + r * c], scale, c, block, 0)
                        .expect("FP8 expert shapes are checked at load"),
                )
            }
            ExpertFormat::Int4 { group } => {
                let scale = borrowed(u16s_of_bytes(&self.buf[s..s + 2 * r * c / group]))?;
                MatRef::Int4(
                    Int4Rows::new(&self.buf[p..p + r * c / 2], scale, r, c, group)
                        .expect("INT4 expert shapes are checked at load"),
                )
            }
            ExpertFormat::Bf16InputMajorBias | ExpertFormat::Mxfp4Bias => return None,
        })
    }

    /// The matrices a device multiplies by, as the MoE paths hand them to
    /// the seam ([`ExpertWeights::stable_mat`]; with biases the two MXFP4
    /// ones, [`ExpertWeights::mxfp4_mat`]); none for the input-major format.
    pub fn device_mats(&self) -> Vec<MatRef<'_>> {
        match self.format {
            ExpertFormat::Mxfp4Bias => (0..2).filter_map(|i| self.mxfp4_mat(i)).collect(),
            _ => (0..3).filter_map(|i| self.stable_mat(i)).collect(),
        }
    }

    /// `y[t, :] += b` for the bf16 bias of `outs` values at `off`.
    fn add_bias(&self, off: usize, outs: usize, y: &mut [f32]) {
        let bias: Vec<f32> = u16s_of_bytes(&self.buf[off..off + 2 * outs])
            .iter()
            .map(|&h| bf16(h))
            .collect();
        for row in y.chunks_exact_mut(outs) {
            row.iter_mut().zip(&bias).for_each(|(v, c)| *v += c);
        }
    }

    /// Refuses what can only be corruption in a quantized expert: a NaN
    /// E8M0 scale (0xFF), a NaN E4M3 code (0x7F, 0xFF), a non-finite FP8
    /// or INT4 scale. Names the matrix (the table's order) and the place.
    pub fn check(&self) -> std::result::Result<(), String> {
        for i in 0..3 {
            let (p, s, [r, c]) = self.parts[i];
            if r * c == 0 {
                continue;
            }
            match self.format {
                ExpertFormat::Mxfp4 | ExpertFormat::Mxfp4Bias => {
                    let m = self.matrix(i);
                    if let Some(k) = m.scales.iter().position(|&b| b == 0xFF) {
                        let g = c / 32;
                        return Err(format!(
                            "matrix {i}: E8M0 scale 0xFF (NaN) for row {}, columns {}..{}",
                            k / g,
                            k % g * 32,
                            k % g * 32 + 32
                        ));
                    }
                }
                ExpertFormat::Fp8 { block } => {
                    let q = &self.buf[p..p + r * c];
                    if let Some(k) = q.iter().position(|&b| e4m3_is_nan(b)) {
                        return Err(format!(
                            "matrix {i}: E4M3 code {:#04x} (NaN) at [{}, {}]",
                            q[k],
                            k / c,
                            k % c
                        ));
                    }
                    let gc = c.div_ceil(block[1]);
                    let scale = f32s_of_bytes(&self.buf[s..s + 4 * r.div_ceil(block[0]) * gc]);
                    if let Some(k) = scale.iter().position(|v| !v.is_finite()) {
                        return Err(format!(
                            "matrix {i}: scale {} at block [{}, {}] is not finite",
                            scale[k],
                            k / gc,
                            k % gc
                        ));
                    }
                }
                ExpertFormat::Int4 { group } => {
                    let scale = u16s_of_bytes(&self.buf[s..s + 2 * r * c / group]);
                    if let Some(k) = scale.iter().position(|&h| !bf16(h).is_finite()) {
                        let g = c / group;
                        return Err(format!(
                            "matrix {i}: scale {} for row {}, columns {}..{} is not finite",
                            bf16(scale[k]),
                            k / g,
                            k % g * group,
                            (k % g + 1) * group
                        ));
                    }
                }
                ExpertFormat::Bf16 | ExpertFormat::F32 | ExpertFormat::Bf16InputMajorBias => {}
            }
        }
        Ok(())
    }
}

/// Where one expert's tensors are on disk.
fn is_borrowed<T: Clone>(c: &Cow<'_, [T]>) -> bool {
    matches!(c, Cow::Borrowed(_))
}

impl Drop for ExpertWeights {
    fn drop(&mut self) {
        backend::forget(&self.buf[..]);
    }
}

#[derive(Debug, Clone)]
pub struct ExpertLoc {
    /// Per matrix: the weight tensor (MXFP4 packed nibbles, or bf16) and
    /// its companion (MXFP4: the scales; the input-major format: the bias).
    /// A matrix of zero bytes is absent and never read (GPT-OSS experts
    /// have two).
    pub parts: [(TensorLoc, Option<TensorLoc>); 3],
    pub format: ExpertFormat,
}

impl ExpertLoc {
    /// The expert's tensors, in order (absent ones left out).
    pub fn tensors(&self) -> impl Iterator<Item = &TensorLoc> {
        self.parts
            .iter()
            .flat_map(|(a, b)| std::iter::once(a).chain(b))
            .filter(|t| t.len > 0)
    }

    /// How the matrices are stored.
    pub fn format(&self) -> ExpertFormat {
        self.format
    }

    /// An absent matrix (a zero-byte tensor in `shard`).
    pub fn absent(shard: usize) -> TensorLoc {
        TensorLoc {
            shard,
            offset: 0,
            len: 0,
            dtype: fathom_weights::Dtype::BF16,
            shape: vec![0, 0],
        }
    }

    /// `(shard, offset, len)` of the smallest byte range holding all the
    /// tensors, if they share a shard and the range holds nothing else of
    /// consequence (in released files an expert's tensors are adjacent).
    pub fn span(&self) -> Option<(usize, u64, u64)> {
        let shard = self.parts[0].0.shard;
        if self.parts.iter().any(|(p, _)| p.len == 0) {
            return None;
        }
        let mut lo = u64::MAX;
        let mut hi = 0;
        let mut total = 0;
        for l in self.tensors() {
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
        self.tensors().map(|t| t.len).sum()
    }

    /// Builds the expert from a buffer read at `span()`'s offset.
    pub fn from_span(&self, shapes: &ExpertShapes, base: u64, buf: AlignedBuf) -> ExpertWeights {
        let mut parts = [(0, 0, [0, 0]); 3];
        for (i, shape) in shapes.iter().enumerate() {
            let (p, s) = &self.parts[i];
            let s = s.as_ref().map_or(0, |s| (s.offset - base) as usize);
            parts[i] = ((p.offset - base) as usize, s, *shape);
        }
        ExpertWeights {
            buf,
            parts,
            format: self.format(),
        }
    }

    /// Reads the expert through `read(shard, offset, len)`, which returns a
    /// buffer holding at least that range and the file offset of its first
    /// byte: one call for the whole span when the tensors are adjacent
    /// (as in the released files), else one per tensor, packed into one
    /// buffer. Returns the expert and the bytes the reads returned.
    pub fn read_with<E>(
        &self,
        shapes: &ExpertShapes,
        mut read: impl FnMut(usize, u64, u64) -> std::result::Result<(AlignedBuf, u64), E>,
    ) -> std::result::Result<(ExpertWeights, u64), E> {
        if let Some((shard, off, len)) = self.span() {
            let (buf, base) = read(shard, off, len)?;
            let n = buf.len() as u64;
            return Ok((self.from_span(shapes, base, buf), n));
        }
        let mut bytes = Vec::with_capacity(self.bytes() as usize);
        let mut parts = [(0, 0, [0, 0]); 3];
        let mut n = 0;
        for (i, shape) in shapes.iter().enumerate() {
            let mut offsets = [0; 2];
            let (p, s) = &self.parts[i];
            for (k, t) in std::iter::once(p).chain(s).enumerate() {
                if t.len == 0 {
                    continue;
                }
                // Keep every tensor 4-byte aligned in the packed buffer.
                bytes.resize(bytes.len().next_multiple_of(4), 0);
                let (b, base) = read(t.shard, t.offset, t.len)?;
                n += b.len() as u64;
                offsets[k] = bytes.len();
                bytes.extend_from_slice(&b[(t.offset - base) as usize..][..t.len as usize]);
            }
            parts[i] = (offsets[0], offsets[1], *shape);
        }
        let buf = AlignedBuf::from_slice(&bytes);
        let format = self.format();
        Ok((ExpertWeights { buf, parts, format }, n))
    }

    /// Reads the expert from a checkpoint (buffered reads; the resident path).
    pub fn read(&self, shapes: &ExpertShapes, ck: &Checkpoint) -> Result<ExpertWeights> {
        let (e, _) = self.read_with(shapes, |shard, off, len| {
            let mut buf = AlignedBuf::zeroed(len as usize);
            ck.read_into(shard, off, &mut buf)?;
            Ok::<_, ModelError>((buf, off))
        })?;
        Ok(e)
    }
}

/// Locators of every routed expert: `[layer][expert]`, built by the family.
#[derive(Debug, Clone)]
pub struct ExpertTable {
    /// Indexed by absolute layer; empty for layers without routed experts.
    pub layers: Vec<Vec<ExpertLoc>>,
    /// Shapes of the three matrices, the same for every expert.
    pub shapes: ExpertShapes,
    /// Experts each token uses per MoE layer.
    pub top_k: usize,
    /// How every expert is stored.
    pub format: ExpertFormat,
}

impl ExpertTable {
    /// Experts in all layers.
    pub fn count(&self) -> usize {
        self.layers.iter().map(Vec::len).sum()
    }

    /// Layers with routed experts.
    pub fn moe_layers(&self) -> usize {
        self.layers.iter().filter(|l| !l.is_empty()).count()
    }

    /// Bytes of one expert's tensors.
    pub fn expert_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .next()
            .map_or(0, ExpertLoc::bytes)
    }
}

/// Counters every source keeps (cumulative; diff two readings for a window).
#[derive(Debug, Default, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// Seconds the model's layer thread spent blocked on expert reads (the
    /// other compute threads may be running arrived experts meanwhile).
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

/// An expert still being read; `wait` blocks until it is in RAM.
pub trait PendingExpert: Send + Sync {
    fn wait(&self) -> Result<Arc<ExpertWeights>>;
    /// Whether `wait` would return at once (its read has ended). Default:
    /// unknown, taken as not yet.
    fn is_ready(&self) -> bool {
        false
    }
}

/// One requested expert: in RAM already, or on its way.
pub enum ExpertSlot {
    Ready(Arc<ExpertWeights>),
    Pending(Arc<dyn PendingExpert>),
}

/// What [`ExpertSource::request`] hands back: the caller's own claim on the
/// experts it asked for. Nothing about a request lives in the source, so
/// any number of passes may have requests out at once.
pub struct ExpertTicket {
    pub layer: usize,
    pub ids: Vec<u32>,
    pub slots: Vec<ExpertSlot>,
}

impl ExpertTicket {
    /// Waits for every slot, in the order asked.
    pub fn wait_all(self) -> Result<Vec<Arc<ExpertWeights>>> {
        self.slots
            .into_iter()
            .map(|s| match s {
                ExpertSlot::Ready(e) => Ok(e),
                ExpertSlot::Pending(p) => p.wait(),
            })
            .collect()
    }
}

/// Where the model gets routed experts from.
pub trait ExpertSource: Send + Sync {
    /// Starts making `ids` of `layer` available and returns the ticket to
    /// collect them with. The model calls this as soon as the router has
    /// decided and computes what does not need the experts (latent
    /// projection, shared experts) while they arrive.
    fn request(&self, layer: usize, ids: &[u32]) -> Result<ExpertTicket>;
    /// The ticket's experts, in the order asked; every one, always. The
    /// layers call it when every slot is already in RAM; a ticket with
    /// experts still being read is awaited slot by slot through
    /// [`ExpertSource::wait_one`] instead, so keep per-ticket work out of it.
    fn collect(&self, ticket: ExpertTicket) -> Result<Vec<Arc<ExpertWeights>>> {
        ticket.wait_all()
    }
    /// One expert still being read, once it is in RAM (a source may count
    /// the time the caller waited).
    fn wait_one(&self, pending: &dyn PendingExpert) -> Result<Arc<ExpertWeights>> {
        pending.wait()
    }
    /// A guess at the experts `layer` will ask for next. Default: ignored.
    fn hint(&self, _layer: usize, _ids: &[u32]) {}
    /// Whether [`ExpertSource::hint`] is worth computing for this source.
    fn wants_hints(&self) -> bool {
        false
    }
    /// Those of `ids` of `layer` already in RAM, in that order, without
    /// reading, counting or reordering anything: a device may start copying
    /// them up before they are asked for. Default: none.
    fn peek(&self, _layer: usize, _ids: &[u32]) -> Vec<Arc<ExpertWeights>> {
        Vec::new()
    }
    fn stats(&self) -> ExpertStats;
}

/// Every expert read into RAM at load.
pub struct ResidentExperts {
    layers: Vec<Vec<Arc<ExpertWeights>>>,
    served: AtomicU64,
}

impl ResidentExperts {
    /// Reads every expert, refusing corrupt quantized ones
    /// ([`ExpertWeights::check`]) by layer and expert.
    pub fn load(ck: &Checkpoint, table: &ExpertTable) -> Result<Self> {
        let layers = table
            .layers
            .iter()
            .enumerate()
            .map(|(li, l)| {
                l.iter()
                    .enumerate()
                    .map(|(ei, e)| {
                        let w = e.read(&table.shapes, ck)?;
                        w.check().map_err(|m| {
                            ModelError::Experts(format!(
                                "layer {li}, expert {ei}, {m}: the checkpoint is corrupt"
                            ))
                        })?;
                        Ok(Arc::new(w))
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let experts = ResidentExperts {
            layers,
            served: AtomicU64::new(0),
        };
        experts.warm_device();
        Ok(experts)
    }

    /// Hands every expert's matrices, layer by layer and in one list, to
    /// the installed device backend (if any) to copy up now
    /// ([`fathom_kernels::backend::Backend::preload`]: as many as its memory
    /// holds, never displacing one another, each expert's on one device): a
    /// resident model's first tokens then find their experts there instead
    /// of waiting for their first copies (at 04e112f, before this, the
    /// K3DIM decode of docs/bench.md's "where a GPU decode token goes" row
    /// copied 70 MB of experts from pageable memory during its first decode
    /// steps on an H100: `stats.gpu_decode.h2d_pageable_bytes`). The spine,
    /// copied on first use, still displaces experts when
    /// room runs out. Only copies depend on it, never a result.
    fn warm_device(&self) {
        backend::preload(|| {
            self.layers
                .iter()
                .flatten()
                .map(|e| e.device_mats())
                .collect()
        });
    }
}

impl ExpertSource for ResidentExperts {
    fn request(&self, layer: usize, ids: &[u32]) -> Result<ExpertTicket> {
        let l = self
            .layers
            .get(layer)
            .ok_or_else(|| ModelError::Experts(format!("layer {layer} has no experts")))?;
        self.served.fetch_add(ids.len() as u64, Ordering::Relaxed);
        let slots = ids
            .iter()
            .map(|&e| {
                l.get(e as usize)
                    .cloned()
                    .map(ExpertSlot::Ready)
                    .ok_or_else(|| ModelError::Experts(format!("layer {layer} has no expert {e}")))
            })
            .collect::<Result<_>>()?;
        Ok(ExpertTicket {
            layer,
            ids: ids.to_vec(),
            slots,
        })
    }

    fn peek(&self, layer: usize, ids: &[u32]) -> Vec<Arc<ExpertWeights>> {
        let Some(l) = self.layers.get(layer) else {
            return Vec::new();
        };
        ids.iter()
            .filter_map(|&e| l.get(e as usize).cloned())
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
        let spec = crate::family::read_spec::<crate::kimi_k3::KimiK3>(&dir).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        let table = crate::kimi_k3::tensors::expert_table(&spec, &ck).unwrap();
        let adjacent = &table.layers[1][5];
        let want = adjacent.read(&table.shapes, &ck).unwrap();
        // Move every tensor 10_000 bytes further than the previous one, in a
        // fake file that holds the same bytes at the new places.
        let mut scattered = adjacent.clone();
        let mut file = vec![0u8; 200_000];
        let mut at = 0u64;
        for (p, s) in scattered.parts.iter_mut() {
            for t in std::iter::once(p).chain(s.as_mut()) {
                at += 10_000;
                let bytes = ck.read(t).unwrap();
                file[at as usize..][..bytes.len()].copy_from_slice(&bytes);
                t.offset = at;
            }
        }
        assert!(scattered.span().is_none());
        let mut reads = 0;
        let (got, _) = scattered
            .read_with(&table.shapes, |_, off, len| {
                reads += 1;
                Ok::<_, ()>((
                    AlignedBuf::from_slice(&file[off as usize..][..len as usize]),
                    off,
                ))
            })
            .unwrap();
        assert_eq!(reads, 6);
        for m in 0..3 {
            let (a, b) = (got.matrix(m), want.matrix(m));
            assert_eq!((a.packed, a.scales), (b.packed, b.scales));
        }
    }
}
