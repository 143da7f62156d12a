//! [`StreamedExperts`]: the expert source that reads from the shards.
//!
//! Request path (`experts(layer, ids)`): cached experts are used at once;
//! experts already being read (prefetched) are waited for; the rest are
//! queued as demand reads, which I/O threads take before any prefetch. All
//! of `ids` are returned — nothing is skipped or substituted.
//!
//! Prefetch (`hint(layer, ids)`): the model's guess for the next layer
//! queues background reads, bounded by `max_inflight` so the budget holds.
//! When that layer's real request arrives, guesses it did not ask for and
//! that have not started are cancelled; finished ones go to the cache like
//! any other expert and age out by LRU.
//!
//! Shards that are not on disk (read through the checkpoint's remote
//! source) are fetched only for an expert a request asked for: a guess
//! (a hint, or a heat warm-up) reads only spans stored locally and is
//! dropped when they are not.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use fathom_model::experts::{
    ExpertSlot, ExpertSource, ExpertStats, ExpertTable, ExpertTicket, ExpertWeights, PendingExpert,
};
use fathom_model::{ModelError, Result};
use fathom_weights::Checkpoint;

use crate::cache::{Key, LruCache};
use crate::heat::Heat;
use crate::reader::{ReadError, ShardReader, read_expert_as};

/// How the store runs.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// Experts the cache may hold (0: every request is read from storage).
    pub cache_experts: usize,
    /// Reader threads (parallel positional reads).
    pub io_threads: usize,
    /// Try `O_DIRECT`.
    pub direct: bool,
    /// Act on next-layer hints.
    pub prefetch: bool,
    /// Reads (demand + prefetch) allowed in flight; bounds I/O buffer memory.
    pub max_inflight: usize,
    /// How many of a hint's guesses (most confident first) to prefetch. A
    /// wrong guess costs read bandwidth the demand reads then lack.
    pub prefetch_depth: usize,
    /// Prefetch only while the guesses' recent precision is at least this.
    /// When storage bandwidth is the bottleneck a wrong guess costs a whole
    /// expert read, so below ~½ prefetching slows decoding (as on a
    /// random-weight synth, whose routing has nothing to learn); trained
    /// models guess far better (k3-code-small's `prefetch_precision` in
    /// `fathom run --json`: about 0.76). Hints keep being
    /// scored while prefetch is paused, so it resumes when guesses improve.
    pub prefetch_min_precision: f64,
}

impl StreamConfig {
    /// Defaults for a model whose tokens use `top_k` experts per layer.
    pub fn new(top_k: usize, cache_experts: usize) -> Self {
        StreamConfig {
            cache_experts,
            io_threads: 16,
            direct: true,
            prefetch: true,
            max_inflight: 2 * top_k,
            prefetch_depth: top_k,
            prefetch_min_precision: 0.5,
        }
    }
}

enum Done {
    Ready(Arc<ExpertWeights>),
    Failed(String),
    Cancelled,
}

struct Pending {
    done: Mutex<Option<Done>>,
    cv: Condvar,
    started: AtomicBool,
    cancelled: AtomicBool,
    /// A request asked for it (else it is a guess, which may not fetch
    /// from a remote source). Set under `Inner`'s lock.
    demanded: AtomicBool,
}

impl Pending {
    fn new(demanded: bool) -> Arc<Self> {
        Arc::new(Pending {
            done: Mutex::new(None),
            cv: Condvar::new(),
            started: AtomicBool::new(false),
            cancelled: AtomicBool::new(false),
            demanded: AtomicBool::new(demanded),
        })
    }
    fn finish(&self, d: Done) {
        *self.done.lock().unwrap() = Some(d);
        self.cv.notify_all();
    }
    fn wait(&self) -> std::result::Result<Arc<ExpertWeights>, String> {
        let mut g = self.done.lock().unwrap();
        loop {
            match g.as_ref() {
                Some(Done::Ready(e)) => return Ok(e.clone()),
                Some(Done::Failed(m)) => return Err(m.clone()),
                Some(Done::Cancelled) => return Err("read was cancelled".into()),
                None => g = self.cv.wait(g).unwrap(),
            }
        }
    }
}

impl PendingExpert for Pending {
    fn wait(&self) -> Result<Arc<ExpertWeights>> {
        Pending::wait(self).map_err(ModelError::Experts)
    }
    fn is_ready(&self) -> bool {
        self.done.lock().unwrap().is_some()
    }
}

struct Job {
    key: Key,
    pending: Arc<Pending>,
    /// Goes into the cache's pinned tier (a heat warm-up read).
    pin: bool,
}

#[derive(Default)]
struct Queues {
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
    shutdown: bool,
}

struct Inner {
    cache: LruCache,
    inflight: HashMap<Key, Arc<Pending>>,
    /// Last hint per layer (to measure precision and cancel wrong guesses).
    hints: HashMap<u32, Vec<u32>>,
    /// Exponential average of the hints' precision. Starts at zero: hints are
    /// scored from the first layer on, and prefetching begins once they have
    /// shown they are right often enough (about one token on k3-code-small).
    precision: f64,
    /// Requests per (layer, expert), for `--heat-out`.
    heat: Vec<Vec<u64>>,
    /// Unpinned places a pin must leave (one step's union of a layer).
    keep_free: usize,
}

#[derive(Default)]
struct Counters {
    bytes_read: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    hinted: AtomicU64,
    hinted_used: AtomicU64,
    requested: AtomicU64,
    wait_ns: AtomicU64,
    read_ns: AtomicU64,
}

struct Shared {
    table: ExpertTable,
    shards: Vec<ShardReader>,
    inner: Mutex<Inner>,
    queues: Mutex<Queues>,
    queue_cv: Condvar,
    counters: Counters,
    max_inflight: usize,
    prefetch_depth: usize,
    prefetch_min_precision: f64,
    prefetch: bool,
}

/// Routed experts read on demand from the checkpoint's shards.
pub struct StreamedExperts {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl StreamedExperts {
    pub fn new(ck: &Checkpoint, table: &ExpertTable, cfg: &StreamConfig) -> Result<Self> {
        let shards = ck
            .shards()
            .iter()
            .map(|s| ShardReader::for_shard(s, cfg.direct).map_err(|e| io_err(&s.path, e)))
            .collect::<Result<Vec<_>>>()?;
        let shared = Arc::new(Shared {
            table: table.clone(),
            shards,
            inner: Mutex::new(Inner {
                cache: LruCache::new(cfg.cache_experts),
                inflight: HashMap::new(),
                hints: HashMap::new(),
                precision: 0.0,
                heat: table.layers.iter().map(|l| vec![0; l.len()]).collect(),
                keep_free: cfg.max_inflight.max(table.top_k),
            }),
            queues: Mutex::new(Queues::default()),
            queue_cv: Condvar::new(),
            counters: Counters::default(),
            max_inflight: cfg.max_inflight.max(1),
            prefetch_depth: cfg.prefetch_depth,
            prefetch_min_precision: cfg.prefetch_min_precision,
            prefetch: cfg.prefetch,
        });
        let threads = (0..cfg.io_threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("fathom-io-{i}"))
                    .spawn(move || io_loop(&s))
                    .expect("spawn I/O thread")
            })
            .collect();
        Ok(StreamedExperts { shared, threads })
    }

    /// Classifies `ids` (cached, being read, to read), queues the demand
    /// reads and returns a slot per id, which the caller owns (a zero-size
    /// cache still keeps the expert alive through it).
    fn submit(&self, layer: usize, ids: &[u32]) -> Result<Vec<ExpertSlot>> {
        let s = &*self.shared;
        if s.table.layers.get(layer).is_none_or(|l| l.is_empty()) {
            return Err(ModelError::Experts(format!(
                "layer {layer} has no routed experts"
            )));
        }
        let n_exp = s.table.layers[layer].len();
        if let Some(&bad) = ids.iter().find(|&&e| e as usize >= n_exp) {
            return Err(ModelError::Experts(format!(
                "layer {layer} has no expert {bad}"
            )));
        }
        let l = layer as u32;
        let mut demand = Vec::new();
        let mut slots = Vec::with_capacity(ids.len());
        {
            let mut inner = s.inner.lock().unwrap();
            // Score and retire this layer's hint.
            if let Some(h) = inner.hints.remove(&l) {
                let used = h.iter().filter(|e| ids.contains(e)).count();
                if !h.is_empty() {
                    let p = used as f64 / h.len() as f64;
                    inner.precision = 0.9 * inner.precision + 0.1 * p;
                }
                s.counters
                    .hinted_used
                    .fetch_add(used as u64, Ordering::Relaxed);
                for e in h.iter().filter(|e| !ids.contains(e)) {
                    if let Some(p) = inner.inflight.get(&(l, *e)) {
                        p.cancelled.store(true, Ordering::SeqCst);
                    }
                }
            }
            for &e in ids {
                let k = (l, e);
                inner.heat[layer][e as usize] += 1;
                if let Some(x) = inner.cache.get(k) {
                    slots.push(ExpertSlot::Ready(x));
                    s.counters.hits.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                s.counters.misses.fetch_add(1, Ordering::Relaxed);
                let p = match inner.inflight.get(&k) {
                    Some(p) => {
                        p.cancelled.store(false, Ordering::SeqCst);
                        p.demanded.store(true, Ordering::SeqCst);
                        if !p.started.load(Ordering::SeqCst) {
                            demand.push(Job {
                                key: k,
                                pending: p.clone(),
                                pin: false,
                            }); // promote
                        }
                        p.clone()
                    }
                    None => {
                        let p = Pending::new(true);
                        inner.inflight.insert(k, p.clone());
                        demand.push(Job {
                            key: k,
                            pending: p.clone(),
                            pin: false,
                        });
                        p
                    }
                };
                slots.push(ExpertSlot::Pending(p));
            }
        }
        s.counters
            .requested
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        if !demand.is_empty() {
            let mut q = s.queues.lock().unwrap();
            q.demand.extend(demand);
            drop(q);
            s.queue_cv.notify_all();
        }
        Ok(slots)
    }

    /// Whether reads bypass the page cache with `O_DIRECT`.
    pub fn direct_io(&self) -> bool {
        self.shared.shards.iter().all(ShardReader::is_direct)
    }

    /// Experts the cache holds at most.
    pub fn cache_capacity(&self) -> usize {
        self.shared.inner.lock().unwrap().cache.capacity()
    }

    /// Experts in the cache's pinned tier.
    pub fn pinned(&self) -> usize {
        self.shared.inner.lock().unwrap().cache.pinned()
    }

    /// Routed experts per layer (0 for a dense layer).
    pub fn experts_per_layer(&self) -> Vec<usize> {
        self.shared.table.layers.iter().map(Vec::len).collect()
    }

    /// Request counts so far per (layer, expert), as heat for `model`
    /// (`tokens`: the positions they come from).
    pub fn heat(&self, model: &str, tokens: u64) -> Heat {
        let counts = self.shared.inner.lock().unwrap().heat.clone();
        Heat {
            format: crate::heat::FORMAT.into(),
            model: model.into(),
            tokens,
            counts,
        }
    }

    /// Reads `keys` (hottest first) into the cache before the first step,
    /// as many as it holds; the first `pin` go to its pinned tier, which
    /// always leaves a layer's worth of places to LRU. Returns the bytes
    /// read. Only what is cached changes: requests still get the experts
    /// the router chose, so output is the same with or without it.
    pub fn warm(&self, keys: &[Key], pin: usize) -> Result<u64> {
        let s = &*self.shared;
        let before = s.counters.bytes_read.load(Ordering::Relaxed);
        let mut waits = Vec::new();
        {
            let mut inner = s.inner.lock().unwrap();
            let room = inner.cache.capacity().saturating_sub(inner.cache.len());
            // The pinned tier leaves `keep_free` places to LRU, so the pins
            // are exactly the hottest keys whatever order the reads finish in.
            let pin = pin.min(inner.cache.capacity().saturating_sub(inner.keep_free));
            let mut q = s.queues.lock().unwrap();
            for (i, &k) in keys.iter().take(room).enumerate() {
                let valid = s
                    .table
                    .layers
                    .get(k.0 as usize)
                    .is_some_and(|l| (k.1 as usize) < l.len());
                if !valid || inner.cache.contains(k) || inner.inflight.contains_key(&k) {
                    continue;
                }
                // A guess: a remote shard's span is used only if stored.
                let p = Pending::new(false);
                inner.inflight.insert(k, p.clone());
                q.demand.push_back(Job {
                    key: k,
                    pending: p.clone(),
                    pin: i < pin,
                });
                waits.push(p);
            }
        }
        s.queue_cv.notify_all();
        for p in waits {
            match p.wait() {
                Ok(_) => {}
                Err(_) if matches!(*p.done.lock().unwrap(), Some(Done::Cancelled)) => {}
                Err(e) => return Err(ModelError::Experts(e)),
            }
        }
        Ok(s.counters.bytes_read.load(Ordering::Relaxed) - before)
    }

    /// Waits until no read is in flight (stray prefetches included), so that
    /// counters read afterwards cover exactly what came before.
    pub fn drain(&self) {
        while !self.shared.inner.lock().unwrap().inflight.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

fn io_err(path: &Path, e: std::io::Error) -> ModelError {
    ModelError::Experts(format!("{}: {e}", path.display()))
}

impl Drop for StreamedExperts {
    fn drop(&mut self) {
        self.shared.queues.lock().unwrap().shutdown = true;
        self.shared.queue_cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn io_loop(s: &Shared) {
    loop {
        let job = {
            let mut q = s.queues.lock().unwrap();
            loop {
                if let Some(j) = q.demand.pop_front().or_else(|| q.prefetch.pop_front()) {
                    break j;
                }
                if q.shutdown {
                    return;
                }
                q = s.queue_cv.wait(q).unwrap();
            }
        };
        // A job may be queued twice (prefetch, then promoted to demand).
        if job.pending.started.swap(true, Ordering::SeqCst) {
            continue;
        }
        {
            let mut inner = s.inner.lock().unwrap();
            if job.pending.cancelled.load(Ordering::SeqCst) {
                remove_inflight(&mut inner, job.key, &job.pending);
                drop(inner);
                job.pending.finish(Done::Cancelled);
                continue;
            }
        }
        let Some(done) = read_job(s, &job) else {
            continue;
        };
        {
            let mut inner = s.inner.lock().unwrap();
            if let Done::Ready(e) = &done {
                let keep = inner.keep_free;
                if !(job.pin && inner.cache.insert_pinned(job.key, e.clone(), keep)) {
                    inner.cache.insert(job.key, e.clone());
                }
            }
            remove_inflight(&mut inner, job.key, &job.pending);
        }
        job.pending.finish(done);
    }
}

/// Reads a job's expert. A guess whose bytes are not stored locally is
/// dropped (`None`, finished as cancelled) unless a request asked for it
/// meanwhile; then it is read as a demand read.
fn read_job(s: &Shared, job: &Job) -> Option<Done> {
    let (layer, expert) = job.key;
    let loc = &s.table.layers[layer as usize][expert as usize];
    let t0 = Instant::now();
    let read = |fetch| read_expert_as(&s.table.shapes, &s.shards, loc, fetch);
    let mut result = read(job.pending.demanded.load(Ordering::SeqCst));
    if let Err(ReadError::NotLocal) = result {
        let mut inner = s.inner.lock().unwrap();
        if !job.pending.demanded.load(Ordering::SeqCst) {
            remove_inflight(&mut inner, job.key, &job.pending);
            drop(inner);
            job.pending.finish(Done::Cancelled);
            return None;
        }
        drop(inner);
        result = read(true);
    }
    s.counters
        .read_ns
        .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    Some(match result {
        Ok((e, n)) => {
            s.counters.bytes_read.fetch_add(n, Ordering::Relaxed);
            Done::Ready(Arc::new(e))
        }
        Err(ReadError::Io(e)) => Done::Failed(format!("layer {layer} expert {expert}: {e}")),
        Err(ReadError::NotLocal) => Done::Failed(format!(
            "layer {layer} expert {expert}: its span is not stored locally"
        )),
    })
}

fn remove_inflight(inner: &mut Inner, key: Key, p: &Arc<Pending>) {
    if inner.inflight.get(&key).is_some_and(|q| Arc::ptr_eq(q, p)) {
        inner.inflight.remove(&key);
    }
}

impl StreamedExperts {
    /// Runs `wait`, counting its time as the model's wait for experts.
    fn waited<T>(&self, wait: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let out = wait();
        self.shared
            .counters
            .wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }
}

impl ExpertSource for StreamedExperts {
    fn request(&self, layer: usize, ids: &[u32]) -> Result<ExpertTicket> {
        Ok(ExpertTicket {
            layer,
            ids: ids.to_vec(),
            slots: self.submit(layer, ids)?,
        })
    }

    fn collect(&self, ticket: ExpertTicket) -> Result<Vec<Arc<ExpertWeights>>> {
        self.waited(|| ticket.wait_all())
    }

    fn wait_one(&self, pending: &dyn PendingExpert) -> Result<Arc<ExpertWeights>> {
        self.waited(|| pending.wait())
    }

    fn hint(&self, layer: usize, ids: &[u32]) {
        let s = &*self.shared;
        if !s.prefetch || s.table.layers.get(layer).is_none_or(|l| l.is_empty()) {
            return;
        }
        let l = layer as u32;
        let n_exp = s.table.layers[layer].len() as u32;
        let mut jobs = Vec::new();
        {
            let mut inner = s.inner.lock().unwrap();
            let valid: Vec<u32> = ids.iter().copied().filter(|&e| e < n_exp).collect();
            s.counters
                .hinted
                .fetch_add(valid.len() as u64, Ordering::Relaxed);
            let depth = if inner.precision >= s.prefetch_min_precision {
                s.prefetch_depth
            } else {
                0
            };
            for &e in valid.iter().take(depth) {
                let k = (l, e);
                if inner.inflight.len() >= s.max_inflight {
                    break;
                }
                if inner.cache.contains(k) || inner.inflight.contains_key(&k) {
                    continue;
                }
                let p = Pending::new(false);
                inner.inflight.insert(k, p.clone());
                jobs.push(Job {
                    key: k,
                    pending: p,
                    pin: false,
                });
            }
            inner.hints.insert(l, valid);
        }
        if !jobs.is_empty() {
            s.queues.lock().unwrap().prefetch.extend(jobs);
            s.queue_cv.notify_all();
        }
    }

    fn wants_hints(&self) -> bool {
        self.shared.prefetch
    }

    fn peek(&self, layer: usize, ids: &[u32]) -> Vec<Arc<ExpertWeights>> {
        let inner = self.shared.inner.lock().unwrap();
        ids.iter()
            .filter_map(|&e| inner.cache.peek((layer as u32, e)))
            .collect()
    }

    fn stats(&self) -> ExpertStats {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ExpertStats {
            bytes_read: g(&c.bytes_read),
            hits: g(&c.hits),
            misses: g(&c.misses),
            hinted: g(&c.hinted),
            hinted_used: g(&c.hinted_used),
            requested: g(&c.requested),
            wait_s: g(&c.wait_ns) as f64 * 1e-9,
            read_s: g(&c.read_ns) as f64 * 1e-9,
        }
    }
}
