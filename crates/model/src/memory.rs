//! What the RAM ledger needs to know about a model, whatever its family,
//! from `config.json` alone (before any weight is read).
//!
//! Each family computes its [`MemoryFacts`] from its own typed spec and
//! tensor table; the ledger (`fathom-stream::budget`), the loader and the
//! bench read only these numbers.

/// A model's memory-relevant figures.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemoryFacts {
    pub family: &'static str,
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// Resident spine (everything but the routed experts) as stored.
    pub spine_bytes: u64,
    /// The same after `--spine int8` (quantised matrices: one byte per
    /// weight plus an fp32 scale per row).
    pub spine_int8_bytes: u64,
    /// The embedding table (a token reads one row of it).
    pub embedding_bytes: u64,
    /// Per-sequence state that does not grow with the context (recurrent
    /// state, convolution windows).
    pub fixed_state_bytes: u64,
    /// Attention-cache floats per token, summed over the layers that keep one.
    pub cache_floats_per_token: u64,
    pub top_k: usize,
    /// Layers with routed experts, and experts per such layer.
    pub moe_layers: usize,
    pub num_experts: usize,
    /// Bytes of one routed expert as stored.
    pub expert_bytes: u64,
    /// fp32 intermediates one expert computes per row.
    pub expert_scratch_floats: usize,
    pub max_position_embeddings: Option<usize>,
    /// Bytes of the multi-token-prediction layer's spine (what `--draft
    /// mtp` adds; its routed experts come from the expert source): 0 when
    /// the checkpoint declares none or the family reads none.
    pub mtp_bytes: u64,
    /// Cache floats per token the prediction layer's own attention keeps.
    pub mtp_cache_floats_per_token: u64,
    /// Each decoder layer's share of the spine (a spine tier's unit: a
    /// layer is resident or read for every pass); the rest of the spine
    /// (embedding, final norm, head) is [`MemoryFacts::global_bytes`].
    pub layers: Vec<LayerBytes>,
    /// The output head, part of the globals (zero when it is the
    /// embedding): read whole for every pass when it leaves RAM.
    pub head: LayerBytes,
}

/// One decoder layer's spine bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LayerBytes {
    /// As stored.
    pub stored: u64,
    /// After `--spine int8`.
    pub int8: u64,
    /// Of `stored`, the matrices (two-dimensional tensors: projections,
    /// routers): what a layer held on the device keeps out of RAM.
    pub matrices: u64,
    /// The matrices after `--spine int8`.
    pub matrices_int8: u64,
}

impl LayerBytes {
    /// Bytes in RAM for precision `int8`.
    pub fn bytes(&self, int8: bool) -> u64 {
        if int8 { self.int8 } else { self.stored }
    }
}

impl MemoryFacts {
    /// The facts of a `--spine int8` load beside an int8 spine file
    /// (`fathom_weights::int8_spine`): a streamed layer then reads its
    /// int8 bytes, not the bytes stored in the checkpoint.
    pub fn with_int8_file(mut self) -> Self {
        for l in &mut self.layers {
            // The globals (the spine less its layers) keep their bytes.
            self.spine_bytes = self
                .spine_bytes
                .saturating_sub(l.stored.saturating_sub(l.int8));
            l.stored = l.int8;
            l.matrices = l.matrices_int8;
        }
        // A head read in blocks reads its codes and scales from the file.
        self.head.stored = self.head.int8;
        self
    }

    /// Whether an int8 spine's layers are stored as int8 (these are the
    /// facts [`MemoryFacts::with_int8_file`] gives, or nothing is
    /// quantised): their matrices can then be mapped as they are.
    pub fn int8_as_stored(&self) -> bool {
        self.layers.iter().all(|l| l.matrices == l.matrices_int8)
    }

    /// The facts of the model loaded with its multi-token-prediction layer
    /// (`--draft mtp`): one more MoE layer of routed experts and one more
    /// layer of attention cache (its spine, `mtp_bytes`, is set aside by
    /// the caller). Unchanged when the model has none.
    pub fn with_mtp(mut self) -> Self {
        if self.mtp_bytes > 0 {
            self.moe_layers += 1;
            self.cache_floats_per_token += self.mtp_cache_floats_per_token;
        }
        self
    }

    /// The spine outside the decoder layers (embedding, final norm, head),
    /// stored or after `--spine int8`.
    pub fn global_bytes(&self, int8: bool) -> u64 {
        let spine = if int8 {
            self.spine_int8_bytes
        } else {
            self.spine_bytes
        };
        spine.saturating_sub(self.layers.iter().map(|l| l.bytes(int8)).sum())
    }

    /// Every routed expert of the model.
    pub fn total_experts(&self) -> usize {
        self.moe_layers * self.num_experts
    }

    /// Spine bytes one decoded token touches: the resident spine (stored,
    /// or after `--spine int8`) less the embedding table, of which a token
    /// reads one row (the embedding is never quantised).
    pub fn spine_bytes_per_token(&self, int8: bool) -> u64 {
        let spine = if int8 {
            self.spine_int8_bytes
        } else {
            self.spine_bytes
        };
        spine - self.embedding_bytes + self.embedding_bytes / self.vocab_size.max(1) as u64
    }
}

/// Bytes of a spine tensor of `shape` stored in `stored` bytes after
/// `--spine int8`, when `quantised` (2-D matrices only) — else as stored.
pub fn int8_bytes(shape: &[usize], stored: u64, quantised: bool) -> u64 {
    match shape {
        [rows, cols] if quantised => (rows * cols + 4 * rows) as u64,
        _ => stored,
    }
}

/// One tensor of a family's table as the ledger sees it.
pub struct TensorBytes<'a> {
    /// The decoder layer it belongs to (`None`: embedding, final norm, head).
    pub layer: Option<usize>,
    pub shape: &'a [usize],
    pub bytes: u64,
    pub embedding: bool,
    /// The output head (not one tied to the embedding).
    pub head: bool,
    pub routed_expert: bool,
    /// Quantised by `--spine int8`.
    pub int8: bool,
}

/// (spine, spine after int8, embedding, routed experts) bytes of a table.
pub fn table_sums<'a>(table: impl Iterator<Item = TensorBytes<'a>>) -> [u64; 4] {
    let mut s = [0u64; 4];
    for t in table {
        if t.routed_expert {
            s[3] += t.bytes;
            continue;
        }
        s[0] += t.bytes;
        s[1] += int8_bytes(t.shape, t.bytes, t.int8);
        if t.embedding {
            s[2] += t.bytes;
        }
    }
    s
}

/// The head's bytes (stored, int8) in a table.
pub fn head_sums<'a>(table: impl Iterator<Item = TensorBytes<'a>>) -> LayerBytes {
    let mut h = LayerBytes::default();
    for t in table.filter(|t| t.head) {
        h.stored += t.bytes;
        h.int8 += int8_bytes(t.shape, t.bytes, t.int8);
    }
    h
}

/// Each of `layers` decoder layers' spine bytes (stored, int8) from a
/// table (routed experts and tensors of other layers left out).
pub fn layer_sums<'a>(
    layers: usize,
    table: impl Iterator<Item = TensorBytes<'a>>,
) -> Vec<LayerBytes> {
    let mut v = vec![LayerBytes::default(); layers];
    for t in table {
        match t.layer {
            Some(l) if l < layers && !t.routed_expert => {
                v[l].stored += t.bytes;
                v[l].int8 += int8_bytes(t.shape, t.bytes, t.int8);
                if t.shape.len() == 2 {
                    v[l].matrices += t.bytes;
                    v[l].matrices_int8 += int8_bytes(t.shape, t.bytes, t.int8);
                }
            }
            _ => {}
        }
    }
    v
}
