//! The spine's tiers in the RAM ledger: which decoder layers stay
//! resident and what reading the others for every pass costs (the ring
//! of layer buffers, the bytes a pass reads).

use fathom_model::memory::MemoryFacts;

/// Where the spine's decoder layers are.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SpineTiers {
    pub layers: usize,
    /// Layers kept in RAM (spread over the depth as
    /// `fathom_model::tiers::resident_layers` picks them).
    pub resident_layers: usize,
    /// The final norm, head and output mixing, and the embedding unless
    /// its rows are read as asked (always resident).
    pub global_bytes: u64,
    /// The embedding left in the checkpoint, a pass reading only its
    /// tokens' rows: the first weight out of RAM when the spine does not
    /// fit (never when the head is the embedding: the family then reports
    /// no embedding bytes).
    pub embedding_on_disk: bool,
    /// The head left in the checkpoint, read in row blocks for every pass
    /// (`fathom_model::head`): the last spine weight out of RAM, once no
    /// layer can stay resident (and reading it holds less).
    pub head_on_disk: bool,
    /// Bytes of the resident layers.
    pub resident_bytes: u64,
    /// Layers read for every pass, and their bytes in RAM.
    pub streamed_layers: usize,
    pub streamed_bytes: u64,
    /// What a pass reads of them: their bytes as stored (an int8 spine
    /// is read as stored and quantised after each read).
    pub read_bytes: u64,
    /// Layer buffers of the read-ahead ring (0 when nothing streams).
    pub ring: usize,
    /// RAM of the ring: the most `ring` streamed layers in a row (in the
    /// cyclic order they are read) hold, and for an int8 spine the layer
    /// being read as stored before it is quantised (the largest streamed
    /// one).
    pub ring_bytes: u64,
    /// Which layers are resident ([`fathom_model::tiers::ranked_layers`]).
    #[serde(skip)]
    pub keep: Vec<bool>,
    /// Layers held on the device instead of read for every pass
    /// ([`SpineTiers::with_device`]; counted neither resident nor
    /// streamed), and their matrices' bytes in VRAM.
    pub device_layers: usize,
    pub device_bytes: u64,
    #[serde(skip)]
    pub device: Vec<bool>,
    /// The head held on the device instead of read in row blocks (its
    /// bytes in `device_bytes`).
    pub head_on_device: bool,
}

impl SpineTiers {
    /// `resident` of the spec's layers in RAM (`usize::MAX`: all), in
    /// precision `int8`; the embedding on disk when any layer streams.
    pub fn new(spec: &MemoryFacts, int8: bool, resident: usize) -> Self {
        let n = spec.layers.len();
        let stored: Vec<u64> = spec.layers.iter().map(|l| l.stored).collect();
        let keep = fathom_model::tiers::ranked_layers(&stored, resident);
        let (mut resident_bytes, mut streamed, mut read_bytes) = (0, Vec::new(), 0);
        for (l, &k) in spec.layers.iter().zip(&keep) {
            if k {
                resident_bytes += l.bytes(int8);
            } else {
                streamed.push(l.bytes(int8));
                read_bytes += l.stored;
            }
        }
        let streamed_layers = streamed.len();
        let resident_layers = n - streamed_layers;
        let ring = if streamed_layers == 0 {
            0
        } else {
            ring_for(&keep)
        };
        let left: Vec<usize> = (0..n).filter(|&i| !keep[i]).collect();
        let as_stored = read_as_stored(spec, int8, &left);
        let t = SpineTiers {
            layers: n,
            resident_layers,
            global_bytes: spec.global_bytes(int8),
            embedding_on_disk: false,
            head_on_disk: false,
            resident_bytes,
            streamed_layers,
            streamed_bytes: streamed.iter().sum(),
            read_bytes,
            ring,
            ring_bytes: ring_window(&streamed, ring) + as_stored,
            keep,
            device_layers: 0,
            device_bytes: 0,
            device: Vec::new(),
            head_on_device: false,
        };
        if streamed_layers > 0 {
            t.with_embedding_on_disk(spec)
        } else {
            t
        }
    }

    /// These tiers with the embedding's rows read as asked (no change when
    /// the family reports no embedding apart from the head).
    pub fn with_embedding_on_disk(mut self, spec: &MemoryFacts) -> Self {
        if !self.embedding_on_disk && spec.embedding_bytes > 0 {
            self.embedding_on_disk = true;
            self.global_bytes = self.global_bytes.saturating_sub(spec.embedding_bytes);
        }
        self
    }

    /// These tiers with the head read in row blocks for every pass: its
    /// bytes leave the globals, a pass reads it as stored, and its ring of
    /// blocks (and, quantising, one block as stored) joins the layers'.
    /// No change when the head is the embedding.
    pub fn with_head_on_disk(mut self, spec: &MemoryFacts, int8: bool) -> Self {
        let h = spec.head;
        if self.head_on_disk || h.stored == 0 {
            return self;
        }
        self.head_on_disk = true;
        self.global_bytes = self.global_bytes.saturating_sub(h.bytes(int8));
        self.read_bytes += h.stored;
        self.ring_bytes += head_ring(spec, int8);
        self
    }

    /// These tiers with layers that would be read for every pass held on
    /// the device instead (`fathom_model::tiers`'s device tier), the
    /// largest first, as many as `room` bytes of VRAM hold: their
    /// matrices are mapped from the checkpoint and copied up once, the
    /// rest of each (norms, small vectors) stays in RAM. A pass no longer
    /// reads them, and the ring shrinks to the layers still streamed. An
    /// int8 spine holds layers only from the int8 spine file
    /// ([`MemoryFacts::int8_as_stored`]); quantised in RAM, it holds none.
    pub fn with_device(mut self, spec: &MemoryFacts, room: u64, int8: bool) -> Self {
        if (int8 && !spec.int8_as_stored()) || self.streamed_layers == 0 || self.device_layers > 0 {
            return self;
        }
        let n = self.layers;
        let streamed: Vec<usize> = (0..n).filter(|&i| !self.keep[i]).collect();
        let sizes: Vec<u64> = streamed.iter().map(|&i| spec.layers[i].matrices).collect();
        // As many as fit, chosen as the resident ones are (the largest
        // first, spread evenly among layers of a size, so the reads of the
        // others still overlap compute all through a pass).
        let mut largest = sizes.clone();
        largest.sort_unstable_by(|a, b| b.cmp(a));
        let mut sum = 0u64;
        let k = largest
            .iter()
            .take_while(|&&b| {
                sum += b;
                sum <= room
            })
            .count();
        let used: u64 = largest[..k].iter().sum();
        let pick = fathom_model::tiers::ranked_layers(&sizes, k);
        let mut device = vec![false; n];
        for (&i, &p) in streamed.iter().zip(&pick) {
            device[i] = p && spec.layers[i].matrices > 0;
        }
        // A head read in blocks goes too where the room left holds it.
        let head_on_device = self.head_on_disk && used + spec.head.stored <= room;
        if used == 0 && !head_on_device {
            return self;
        }
        let left: Vec<usize> = streamed.iter().copied().filter(|&i| !device[i]).collect();
        let left_bytes: Vec<u64> = left.iter().map(|&i| spec.layers[i].bytes(int8)).collect();
        let placed: Vec<bool> = (0..n).map(|i| self.keep[i] || device[i]).collect();
        let head_read = self.head_on_disk && !head_on_device;
        // A held layer computes on the device, too fast to read ahead
        // behind: the ring never grows for it.
        self.ring = ring_for(&placed).min(self.ring);
        self.ring_bytes = ring_window(&left_bytes, self.ring)
            + read_as_stored(spec, int8, &left)
            + if head_read { head_ring(spec, int8) } else { 0 };
        self.streamed_layers = left.len();
        self.streamed_bytes = left_bytes.iter().sum();
        self.read_bytes = left.iter().map(|&i| spec.layers[i].stored).sum::<u64>()
            + if head_read { spec.head.stored } else { 0 };
        self.resident_bytes += (0..n)
            .filter(|&i| device[i])
            .map(|i| spec.layers[i].stored - spec.layers[i].matrices)
            .sum::<u64>();
        self.device_layers = device.iter().filter(|&&d| d).count();
        self.device_bytes = used + if head_on_device { spec.head.stored } else { 0 };
        self.device = device;
        self.head_on_device = head_on_device;
        self
    }

    /// Resident spine bytes: globals and resident layers.
    pub fn resident_spine(&self) -> u64 {
        self.global_bytes + self.resident_bytes
    }

    /// The plan the loader takes.
    pub fn plan(&self) -> fathom_model::LayerPlan {
        if self.streamed_layers == 0 && self.device_layers == 0 && !self.head_on_device {
            fathom_model::LayerPlan {
                embedding_on_disk: self.embedding_on_disk,
                head_on_disk: self.head_on_disk,
                ..fathom_model::LayerPlan::all()
            }
        } else {
            fathom_model::LayerPlan {
                keep: Some(self.keep.clone()),
                device: self.device.clone(),
                head_on_disk: self.head_on_disk,
                head_on_device: self.head_on_device,
                ..fathom_model::LayerPlan::streamed(self.resident_layers, self.ring)
            }
        }
    }

    /// Seconds a pass spends reading the streamed layers at `bandwidth`
    /// bytes per second.
    pub fn read_seconds(&self, bandwidth: f64) -> f64 {
        self.read_bytes as f64 / bandwidth.max(1.0)
    }
}

/// For an int8 spine, the largest of the `streamed` layers as stored: one
/// is read whole before it is quantised (0 for a float spine).
fn read_as_stored(spec: &MemoryFacts, int8: bool, streamed: &[usize]) -> u64 {
    if !int8 {
        return 0;
    }
    streamed
        .iter()
        .map(|&i| spec.layers[i].stored)
        .max()
        .unwrap_or(0)
}

/// RAM of the head's ring of row blocks when it is read for every pass
/// (`fathom_model::head`): `HEAD_RING` blocks, and, quantising, one block
/// as stored.
fn head_ring(spec: &MemoryFacts, int8: bool) -> u64 {
    let h = spec.head;
    let rows = spec.vocab_size.max(1) as u64;
    let block = fathom_model::head::block_rows(rows as usize, h.stored.div_ceil(rows)) as u64;
    let held = block * h.bytes(int8).div_ceil(rows);
    let as_stored = if int8 && h.stored != h.int8 {
        block * h.stored.div_ceil(rows)
    } else {
        0
    };
    fathom_model::head::HEAD_RING as u64 * held + as_stored
}

/// The most bytes `k` consecutive entries of `sizes` hold, taken
/// cyclically (all of them when `k` covers them).
pub(crate) fn ring_window(sizes: &[u64], k: usize) -> u64 {
    let m = sizes.len();
    if k >= m {
        return sizes.iter().sum();
    }
    (0..m)
        .map(|j| (0..k).map(|t| sizes[(j + t) % m]).sum::<u64>())
        .max()
        .unwrap_or(0)
}

/// Most layer buffers a ring holds.
pub const MAX_RING: usize = 8;

/// Layer buffers of the read-ahead ring: the layer computed, the one being
/// read, and one more for each resident layer between two streamed ones
/// (the reader keeps reading while those compute), at most [`MAX_RING`].
pub fn ring_layers(resident: usize, streamed: usize) -> usize {
    (2 + resident.div_ceil(streamed.max(1))).min(MAX_RING)
}

/// [`ring_layers`] for the longest run of resident layers in `keep`
/// between two streamed ones, taken cyclically (a pass's last layers and
/// the next pass's first run back to back; never shorter than
/// `⌈resident ÷ streamed⌉`, the runs' mean); 0 when none streams.
pub fn ring_for(keep: &[bool]) -> usize {
    let n = keep.len();
    if keep.iter().all(|&k| k) {
        return 0;
    }
    let (mut run, mut longest) = (0usize, 0usize);
    for i in 0..2 * n {
        if keep[i % n] {
            run += 1;
            longest = longest.max(run);
        } else {
            run = 0;
        }
    }
    (2 + longest).min(MAX_RING)
}
