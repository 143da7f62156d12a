//! Spine tiers: a family's decoder layers, each resident in RAM or read
//! from the checkpoint for every pass.
//!
//! A streamed layer is built by the family's own per-layer loader from the
//! same checkpoint bytes as a resident one (the same binding, the same
//! int8 quantisation when asked), so what is resident never changes a bit
//! of output. Streamed layers are needed in layer order, pass after pass:
//! a reader thread reads them ahead, cyclically, into a ring of at most
//! `ring` layers (the one being computed included), and
//! [`Layers::get`] waits for the one asked for. A pass therefore reads
//! each streamed layer once, whatever the batch or the drafted tokens it
//! verifies. A read that fails is handed to the pass that asks for that
//! layer, as its error; nothing else changes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use fathom_weights::Checkpoint;

use crate::error::{ModelError, Result};
use crate::linear::Spine;

/// Which decoder layers stay in RAM; the rest are read for every pass.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LayerPlan {
    /// How many layers stay resident (spread evenly over the depth, see
    /// [`resident_layers`]); `usize::MAX`: all of them.
    pub resident: usize,
    /// Layers held at once by the read-ahead ring (at least 2: the one
    /// being computed and the one being read).
    pub ring: usize,
    /// The token embedding left in the checkpoint, its rows read as a pass
    /// asks (`crate::embedding`; a family whose head is the embedding
    /// keeps it resident).
    pub embedding_on_disk: bool,
    /// The head left in the checkpoint and read in row blocks for every
    /// pass (`crate::head`; the last spine weight out of RAM).
    pub head_on_disk: bool,
    /// Which layers stay resident, as the ledger ranked them
    /// ([`ranked_layers`]); `None`: `resident` of them spread evenly
    /// ([`resident_layers`]).
    pub keep: Option<Vec<bool>>,
    /// Layers held on the device instead of read for every pass (the
    /// device tier; empty: none): their matrices are the checkpoint's bytes
    /// mapped (`crate::linear::loading_held`), copied up on first use and
    /// then out of RAM. Only layers not kept resident are held.
    pub device: Vec<bool>,
    /// The head held on the device the same way instead of read in row
    /// blocks for every pass (only with `head_on_disk`).
    pub head_on_device: bool,
}

/// Where the output head lives ([`LayerPlan::head_place`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadPlace {
    /// Resident in RAM.
    Ram,
    /// Read in row blocks for every pass (`crate::head`).
    Disk,
    /// Mapped from the checkpoint and held on the device.
    Device,
}

impl Default for LayerPlan {
    fn default() -> Self {
        LayerPlan::all()
    }
}

impl LayerPlan {
    /// Every layer and the embedding resident.
    pub const fn all() -> Self {
        LayerPlan {
            resident: usize::MAX,
            ring: 2,
            embedding_on_disk: false,
            head_on_disk: false,
            keep: None,
            device: Vec::new(),
            head_on_device: false,
        }
    }

    /// `resident` layers in RAM, the others read ahead through a ring of
    /// `ring` layers (at least 2); the embedding's rows read as asked.
    pub fn streamed(resident: usize, ring: usize) -> Self {
        LayerPlan {
            resident,
            ring: ring.max(2),
            embedding_on_disk: true,
            head_on_disk: false,
            keep: None,
            device: Vec::new(),
            head_on_device: false,
        }
    }

    /// Where the head lives.
    pub fn head_place(&self) -> HeadPlace {
        match (self.head_on_disk, self.head_on_device) {
            (false, _) => HeadPlace::Ram,
            (true, false) => HeadPlace::Disk,
            (true, true) => HeadPlace::Device,
        }
    }

    /// Whether layer `i` is held on the device.
    pub fn on_device(&self, i: usize) -> bool {
        self.device.get(i).copied().unwrap_or(false)
    }

    /// Whether every one of `layers` layers is resident.
    pub fn all_resident(&self, layers: usize) -> bool {
        self.resident >= layers
    }
}

/// Which of `layers` layers are resident when `resident` of them are:
/// spread evenly over the depth (layer `i` is resident when
/// `⌊(i+1)·r/L⌋ > ⌊i·r/L⌋`), so the reads of the streamed ones overlap
/// the resident layers' compute all through a pass.
pub fn resident_layers(layers: usize, resident: usize) -> Vec<bool> {
    if resident >= layers {
        return vec![true; layers];
    }
    (0..layers)
        .map(|i| (i + 1) * resident / layers > i * resident / layers)
        .collect()
}

/// Which layers stay resident when `resident` of them fit, ranked by the
/// bytes a pass reads of each (`sizes`) when streamed: the largest stay, so
/// the fewest bytes are read; among layers of one size, those kept are
/// spread evenly over that size's layers ([`resident_layers`]; models whose
/// layers are all alike get exactly that).
pub fn ranked_layers(sizes: &[u64], resident: usize) -> Vec<bool> {
    let mut keep = vec![false; sizes.len()];
    let mut classes: Vec<u64> = sizes.to_vec();
    classes.sort_unstable_by(|a, b| b.cmp(a));
    classes.dedup();
    let mut left = resident.min(sizes.len());
    for size in classes {
        if left == 0 {
            break;
        }
        let members: Vec<usize> = (0..sizes.len()).filter(|&i| sizes[i] == size).collect();
        let take = resident_layers(members.len(), left);
        for (&i, k) in members.iter().zip(take) {
            keep[i] = k;
        }
        left -= left.min(members.len());
    }
    keep
}

/// What reading the streamed layers has cost so far (all zero when every
/// layer is resident).
#[derive(Debug, Default, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SpineReads {
    /// Passes over the layers while some were streamed.
    pub passes: u64,
    /// Streamed layers read (a read the pass no longer wanted included).
    pub layers_read: u64,
    /// Checkpoint bytes those reads took.
    pub bytes_read: u64,
    /// Of those, the bytes read uncached (the page cache bypassed: every
    /// one came from storage).
    pub direct_bytes_read: u64,
    /// Seconds the reads took (read and build, on the reader's thread).
    pub read_s: f64,
    /// Seconds passes spent waiting for a layer not yet read.
    pub wait_s: f64,
}

impl SpineReads {
    /// These layer reads with the head's block reads (`crate::head`)
    /// added: their bytes and seconds; passes and layers are the layers'.
    pub fn with_head(self, head: SpineReads) -> SpineReads {
        SpineReads {
            passes: self.passes.max(head.passes),
            bytes_read: self.bytes_read + head.bytes_read,
            direct_bytes_read: self.direct_bytes_read + head.direct_bytes_read,
            read_s: self.read_s + head.read_s,
            wait_s: self.wait_s + head.wait_s,
            ..self
        }
    }

    /// Counters accumulated since `before`.
    pub fn since(&self, before: &SpineReads) -> SpineReads {
        SpineReads {
            passes: self.passes.saturating_sub(before.passes),
            layers_read: self.layers_read.saturating_sub(before.layers_read),
            bytes_read: self.bytes_read.saturating_sub(before.bytes_read),
            direct_bytes_read: self
                .direct_bytes_read
                .saturating_sub(before.direct_bytes_read),
            read_s: (self.read_s - before.read_s).max(0.0),
            wait_s: (self.wait_s - before.wait_s).max(0.0),
        }
    }
}

/// The ring's counters (nanoseconds for the times).
#[derive(Default)]
struct Counters {
    passes: AtomicU64,
    layers: AtomicU64,
    bytes: AtomicU64,
    direct: AtomicU64,
    read_ns: AtomicU64,
    wait_ns: AtomicU64,
}

impl Counters {
    fn read(&self) -> SpineReads {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        SpineReads {
            passes: l(&self.passes),
            layers_read: l(&self.layers),
            bytes_read: l(&self.bytes),
            direct_bytes_read: l(&self.direct),
            read_s: l(&self.read_ns) as f64 * 1e-9,
            wait_s: l(&self.wait_ns) as f64 * 1e-9,
        }
    }

    /// Builds `layer` with `load`, counting its bytes and time.
    fn timed<L>(&self, load: &LoadLayer<L>, layer: usize) -> Result<L> {
        let (t0, b0) = (Instant::now(), fathom_weights::thread_bytes_read());
        let d0 = fathom_weights::thread_direct_bytes_read();
        let r = load(layer);
        let ns = t0.elapsed().as_nanos() as u64;
        let bytes = fathom_weights::thread_bytes_read() - b0;
        let direct = fathom_weights::thread_direct_bytes_read() - d0;
        self.layers.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.direct.fetch_add(direct, Ordering::Relaxed);
        self.read_ns.fetch_add(ns, Ordering::Relaxed);
        r
    }
}

/// Builds layer `i` from the checkpoint, in the given spine precision.
pub type LoadLayer<L> = Arc<dyn Fn(usize) -> Result<L> + Send + Sync>;

/// A family's decoder layers, resident or streamed.
pub struct Layers<L> {
    /// `Some` for a resident layer.
    resident: Vec<Option<L>>,
    ring: Option<Ring<L>>,
    /// Held by a pass while layers are streamed: one pass at a time reads
    /// the ring in order.
    pass: Mutex<()>,
    /// Layers held on the device (counted among the resident ones).
    held: usize,
}

/// One layer's weights for the pass that asked: borrowed when resident,
/// shared with the ring when streamed.
pub enum LayerRef<'a, L> {
    Resident(&'a L),
    Streamed(Arc<L>),
}

impl<L> std::ops::Deref for LayerRef<'_, L> {
    type Target = L;
    fn deref(&self) -> &L {
        match self {
            LayerRef::Resident(l) => l,
            LayerRef::Streamed(l) => l,
        }
    }
}

impl<L: std::fmt::Debug> std::fmt::Debug for Layers<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layers")
            .field("layers", &self.resident.len())
            .field("streamed", &self.streamed())
            .finish()
    }
}

impl<L> Layers<L> {
    /// Number of layers.
    pub fn len(&self) -> usize {
        self.resident.len()
    }

    pub fn is_empty(&self) -> bool {
        self.resident.is_empty()
    }

    /// Layers read for every pass.
    pub fn streamed(&self) -> usize {
        self.resident.iter().filter(|l| l.is_none()).count()
    }

    /// Layers held on the device: their matrices mapped from the
    /// checkpoint, not read for every pass.
    pub fn on_device(&self) -> usize {
        self.held
    }
}

impl<L: Send + Sync + 'static> Layers<L> {
    /// Every layer resident.
    pub fn resident(layers: Vec<L>) -> Self {
        Layers {
            resident: layers.into_iter().map(Some).collect(),
            ring: None,
            pass: Mutex::new(()),
            held: 0,
        }
    }

    /// `layers` layers placed by `plan`: the resident ones built now, in
    /// order; the reader of the streamed ones started.
    pub fn load(layers: usize, plan: &LayerPlan, load: LoadLayer<L>) -> Result<Self> {
        let keep = match &plan.keep {
            Some(k) if k.len() == layers => k.clone(),
            _ => resident_layers(layers, plan.resident),
        };
        let mut resident = Vec::with_capacity(layers);
        let mut held = 0;
        for (i, &k) in keep.iter().enumerate() {
            resident.push(if k {
                Some(load(i)?)
            } else if plan.on_device(i) {
                held += 1;
                Some(crate::linear::loading_held(|| load(i))?)
            } else {
                None
            });
        }
        // The ring reads only the layers neither resident nor held.
        let order: Vec<usize> = (0..layers).filter(|&i| resident[i].is_none()).collect();
        let ring = (!order.is_empty()).then(|| Ring::start(order, plan.ring.max(2), load, layers));
        Ok(Layers {
            resident,
            ring,
            pass: Mutex::new(()),
            held,
        })
    }

    /// Layer `i`, waiting for its read when it is streamed; a failed read
    /// is the error.
    pub fn get(&self, i: usize) -> Result<LayerRef<'_, L>> {
        match (&self.resident[i], &self.ring) {
            (Some(l), _) => Ok(LayerRef::Resident(l)),
            (None, Some(r)) => r.get(i).map(LayerRef::Streamed),
            (None, None) => unreachable!("a layer that is not resident is streamed"),
        }
    }

    /// Layer `i` if it is at hand now (resident, or already read): for
    /// hints about the next layer, which never change the output.
    pub fn peek(&self, i: usize) -> Option<LayerRef<'_, L>> {
        match (self.resident.get(i)?, &self.ring) {
            (Some(l), _) => Some(LayerRef::Resident(l)),
            (None, Some(r)) => r.peek(i).map(LayerRef::Streamed),
            (None, None) => None,
        }
    }

    /// Held for a pass over the layers while some are streamed (`None`
    /// when all are resident: passes may then run side by side).
    pub fn pass(&self) -> Option<MutexGuard<'_, ()>> {
        self.ring.as_ref().map(|r| {
            let g = self.pass.lock().unwrap_or_else(|e| e.into_inner());
            r.shared.counters.passes.fetch_add(1, Ordering::Relaxed);
            g
        })
    }

    /// What the streamed layers' reads have cost so far.
    pub fn reads(&self) -> SpineReads {
        self.ring
            .as_ref()
            .map_or_else(SpineReads::default, |r| r.shared.counters.read())
    }

    /// The resident layers, by index (tools and tests that edit weights).
    pub fn resident_mut(&mut self) -> impl Iterator<Item = (usize, &mut L)> {
        self.resident
            .iter_mut()
            .enumerate()
            .filter_map(|(i, l)| l.as_mut().map(|l| (i, l)))
    }

    /// Layer `i` when it is resident.
    pub fn resident_layer(&self, i: usize) -> Option<&L> {
        self.resident.get(i)?.as_ref()
    }
}

/// `n` layers of a family, placed by `plan`, each built by `layer(spec,
/// ck, i, spine)` — at load for the resident ones, for every pass for the
/// others (the same function, so the same values).
pub fn load_layers<S, L>(
    spec: &Arc<S>,
    ck: &Arc<Checkpoint>,
    spine: Spine,
    plan: &LayerPlan,
    n: usize,
    layer: fn(&S, &Checkpoint, usize, Spine) -> Result<L>,
) -> Result<Layers<L>>
where
    S: Send + Sync + 'static,
    L: Send + Sync + 'static,
{
    let (spec, ck) = (spec.clone(), ck.clone());
    Layers::load(n, plan, Arc::new(move |i| layer(&spec, &ck, i, spine)))
}

/// The read-ahead of the streamed layers.
struct Ring<L> {
    shared: Arc<Shared<L>>,
    /// Position of each layer in `order` (`None`: resident).
    pos_of: Vec<Option<usize>>,
    reader: Option<JoinHandle<()>>,
}

struct Shared<L> {
    state: Mutex<RingState<L>>,
    wake: Condvar,
    /// The streamed layers, in layer order.
    order: Vec<usize>,
    /// Layers held at once: computed + ready + being read.
    depth: usize,
    load: LoadLayer<L>,
    counters: Counters,
}

struct RingState<L> {
    /// Layers read, by position in `order`, oldest first.
    ready: VecDeque<(usize, Result<Arc<L>>)>,
    /// The position the reader reads next.
    next: usize,
    /// Bumped when the reader is sent elsewhere: a read of an older
    /// generation is dropped when it lands.
    generation: u64,
    /// The read in flight: (position, generation).
    reading: Option<(usize, u64)>,
    stop: bool,
}

impl<L: Send + Sync + 'static> Ring<L> {
    fn start(order: Vec<usize>, depth: usize, load: LoadLayer<L>, layers: usize) -> Self {
        let mut pos_of = vec![None; layers];
        for (p, &i) in order.iter().enumerate() {
            pos_of[i] = Some(p);
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(RingState {
                ready: VecDeque::new(),
                next: 0,
                generation: 0,
                reading: None,
                stop: false,
            }),
            wake: Condvar::new(),
            order,
            depth,
            load,
            counters: Counters::default(),
        });
        let s = shared.clone();
        let reader = std::thread::Builder::new()
            .name("fathom-spine-read".into())
            .spawn(move || s.read_ahead())
            .ok();
        Ring {
            shared,
            pos_of,
            reader,
        }
    }

    fn get(&self, layer: usize) -> Result<Arc<L>> {
        let pos = self.pos_of[layer].expect("a streamed layer has a position");
        let sh = &*self.shared;
        if self.reader.is_none() {
            // No reader thread could be started: read in place.
            return sh
                .counters
                .timed(&sh.load, layer)
                .map(Arc::new)
                .map_err(|e| layer_error(layer, e));
        }
        let t0 = Instant::now();
        let mut s = sh.lock();
        loop {
            if let Some(at) = s.ready.iter().position(|e| e.0 == pos) {
                s.ready.drain(..at);
                let (_, r) = s.ready.pop_front().expect("found above");
                sh.wake.notify_all();
                drop(s);
                let waited = t0.elapsed().as_nanos() as u64;
                sh.counters.wait_ns.fetch_add(waited, Ordering::Relaxed);
                // A read ahead that failed may have failed before the fault
                // was mended (a file restored after a failed pass): it is
                // read once more, in place, before the pass fails.
                let r = match r {
                    Ok(l) => Ok(l),
                    Err(_) => sh.counters.timed(&sh.load, layer).map(Arc::new),
                };
                return r.map_err(|e| layer_error(layer, e));
            }
            // What is ready comes before or after `pos` in another pass
            // (one that stopped part-way): of no use now.
            if !s.ready.is_empty() {
                s.ready.clear();
                sh.wake.notify_all();
            }
            let coming =
                s.reading == Some((pos, s.generation)) || (s.reading.is_none() && s.next == pos);
            if !coming {
                s.generation += 1;
                s.next = pos;
                sh.wake.notify_all();
            }
            s = sh.wake.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn peek(&self, layer: usize) -> Option<Arc<L>> {
        let pos = self.pos_of[layer]?;
        let s = self.shared.lock();
        s.ready.iter().find_map(|(p, r)| match r {
            Ok(l) if *p == pos => Some(l.clone()),
            _ => None,
        })
    }
}

impl<L: Send + Sync + 'static> Shared<L> {
    fn lock(&self) -> MutexGuard<'_, RingState<L>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reader: the next streamed layer whenever the ring has room.
    fn read_ahead(&self) {
        loop {
            let (pos, generation) = {
                let mut s = self.lock();
                while !s.stop && s.ready.len() + 2 > self.depth {
                    s = self.wake.wait(s).unwrap_or_else(|e| e.into_inner());
                }
                if s.stop {
                    return;
                }
                let pos = s.next;
                s.next = (pos + 1) % self.order.len();
                s.reading = Some((pos, s.generation));
                (pos, s.generation)
            };
            let r = self
                .counters
                .timed(&self.load, self.order[pos])
                .map(Arc::new);
            let mut s = self.lock();
            s.reading = None;
            if s.generation == generation && !s.stop {
                s.ready.push_back((pos, r));
            }
            self.wake.notify_all();
        }
    }
}

impl<L> Drop for Ring<L> {
    fn drop(&mut self) {
        {
            let mut s = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            s.stop = true;
        }
        self.shared.wake.notify_all();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

fn layer_error(layer: usize, e: ModelError) -> ModelError {
    ModelError::Spine {
        layer,
        msg: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranking_keeps_the_largest_and_spreads_alike_layers() {
        // All alike: the even spread.
        for r in 0..=7 {
            assert_eq!(ranked_layers(&[5; 7], r), resident_layers(7, r), "{r}");
        }
        // A large first layer and large every fourth: those first, then
        // the small ones spread over the small ones.
        let sizes = [9, 2, 2, 4, 2, 2, 2, 4, 2];
        let keep = |r| -> Vec<usize> {
            let k = ranked_layers(&sizes, r);
            (0..sizes.len()).filter(|&i| k[i]).collect()
        };
        assert_eq!(keep(1), vec![0]);
        assert_eq!(keep(2), vec![0, 7]);
        assert_eq!(keep(3), vec![0, 3, 7]);
        assert_eq!(keep(5), vec![0, 3, 4, 7, 8]);
        assert_eq!(keep(9), (0..9).collect::<Vec<_>>());
        assert_eq!(keep(20), (0..9).collect::<Vec<_>>());
    }
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn counting(fail: Option<usize>) -> (LoadLayer<usize>, Arc<AtomicUsize>) {
        let reads = Arc::new(AtomicUsize::new(0));
        let r = reads.clone();
        let load: LoadLayer<usize> = Arc::new(move |i| {
            r.fetch_add(1, Ordering::SeqCst);
            if Some(i) == fail {
                return Err(ModelError::Tensor(format!("layer {i} unreadable")));
            }
            Ok(i * 10)
        });
        (load, reads)
    }

    #[test]
    fn resident_layers_are_spread_evenly() {
        let pick = |l, r| {
            resident_layers(l, r)
                .iter()
                .enumerate()
                .filter(|x| *x.1)
                .map(|x| x.0)
                .collect::<Vec<_>>()
        };
        assert_eq!(pick(8, 0), Vec::<usize>::new());
        assert_eq!(pick(8, 2), vec![3, 7]);
        assert_eq!(pick(8, 4), vec![1, 3, 5, 7]);
        assert_eq!(pick(3, 9), vec![0, 1, 2]);
        assert_eq!(pick(5, 1), vec![4]);
    }

    #[test]
    fn passes_read_each_streamed_layer_once_and_in_order() {
        let (load, reads) = counting(None);
        let layers = Layers::load(6, &LayerPlan::streamed(2, 3), load).unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 2, "the resident ones at load");
        assert_eq!(layers.streamed(), 4);
        for pass in 0..3 {
            let _p = layers.pass().expect("streamed layers hold a pass lock");
            for i in 0..6 {
                assert_eq!(*layers.get(i).unwrap(), i * 10, "pass {pass}");
            }
        }
        // Each pass reads the four streamed layers once; the reader may be
        // ahead by the ring's room (two layers) at most.
        let n = reads.load(Ordering::SeqCst);
        assert!((2 + 12..=2 + 12 + 2).contains(&n), "{n} reads");
        let r = layers.reads();
        assert_eq!(r.passes, 3);
        assert_eq!(
            r.layers_read,
            n as u64 - 2,
            "only streamed reads are counted"
        );
        // The stand-in loader reads no checkpoint bytes.
        assert_eq!(r.bytes_read, 0);
        let all = Layers::load(3, &LayerPlan::all(), counting(None).0).unwrap();
        assert!(all.pass().is_none());
        assert_eq!(all.reads(), SpineReads::default());
    }

    #[test]
    fn an_aborted_pass_and_a_failed_read_are_recovered() {
        let (load, _) = counting(Some(3));
        let layers = Layers::load(5, &LayerPlan::streamed(0, 2), load).unwrap();
        assert_eq!(*layers.get(0).unwrap(), 0);
        assert_eq!(*layers.get(1).unwrap(), 10);
        // The pass stops here; the next starts again from layer 0.
        assert_eq!(*layers.get(0).unwrap(), 0);
        assert_eq!(*layers.get(1).unwrap(), 10);
        assert_eq!(*layers.get(2).unwrap(), 20);
        let e = layers.get(3).err().unwrap().to_string();
        assert_eq!(e, "spine layer 3: tensor layer 3 unreadable");
        assert_eq!(*layers.get(4).unwrap(), 40);
        assert_eq!(*layers.get(0).unwrap(), 0);
        assert!(layers.peek(9).is_none());
    }

    #[test]
    fn a_read_ahead_that_failed_before_a_fault_was_mended_is_read_again() {
        use std::sync::atomic::AtomicBool;
        let broken = Arc::new(AtomicBool::new(false));
        let reads: Arc<[AtomicUsize; 3]> = Arc::new(Default::default());
        let (b, r) = (broken.clone(), reads.clone());
        let load: LoadLayer<usize> = Arc::new(move |i| {
            let cut = b.load(Ordering::SeqCst);
            r[i].fetch_add(1, Ordering::SeqCst);
            if cut {
                return Err(ModelError::Tensor(format!("layer {i} cut")));
            }
            Ok(i * 10)
        });
        // Waits until layer `i` has been read `n` times, and for the read
        // to land in the ring.
        let t0 = Instant::now();
        let read = |i: usize, n: usize| {
            while reads[i].load(Ordering::SeqCst) < n {
                assert!(
                    t0.elapsed().as_secs() < 20,
                    "layer {i} never read {n} times"
                );
                std::thread::yield_now();
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let layers = Layers::load(3, &LayerPlan::streamed(0, 2), load).unwrap();
        assert_eq!(*layers.get(0).unwrap(), 0);
        read(1, 1);
        broken.store(true, Ordering::SeqCst);
        assert_eq!(*layers.get(1).unwrap(), 10, "read before the cut");
        // Layer 2 is read ahead while the file is cut: the pass fails there
        // (read again in place, still cut).
        read(2, 1);
        let e = layers.get(2).err().unwrap().to_string();
        assert_eq!(e, "spine layer 2: tensor layer 2 cut");
        assert_eq!(reads[2].load(Ordering::SeqCst), 2);
        // The next pass's layer 0 is read ahead while cut, then the fault
        // is mended: the stale failure is read again.
        read(0, 2);
        broken.store(false, Ordering::SeqCst);
        assert_eq!(*layers.get(0).unwrap(), 0, "a stale failure is read again");
        assert_eq!(*layers.get(1).unwrap(), 10);
        assert_eq!(*layers.get(2).unwrap(), 20);
    }

    #[test]
    fn all_resident_needs_no_pass_lock() {
        let (load, reads) = counting(None);
        let layers = Layers::load(4, &LayerPlan::all(), load).unwrap();
        assert!(layers.pass().is_none());
        assert_eq!(reads.load(Ordering::SeqCst), 4);
        assert_eq!(*layers.peek(3).unwrap(), 30);
    }
}
