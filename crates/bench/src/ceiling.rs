//! The machine's ceilings, measured in the same run as the arms (machines
//! here are shared and drift, so a ceiling from yesterday says little).
//!
//! * Storage: fathom's own reader ([`ShardReader`], `O_DIRECT`) on the
//!   model's real expert spans, in random order, from as many threads as the
//!   engine's default I/O pool — the exact access pattern of a cold decode,
//!   without compute. Bounded in bytes and seconds.
//! * Memory: a STREAM-style triad `a = b + s·c` on arrays far larger than
//!   any cache, split across all cores; the best pass counts (as STREAM does).
//!
//! A decode step must read the missed experts and touch the spine once, so
//! `ceiling tok/s = min(storage bw ÷ expert bytes read per token,
//!                      memory bw ÷ spine bytes touched per token)`.

use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use fathom_model::memory::MemoryFacts;
use fathom_stream::reader::ShardReader;
use fathom_weights::Checkpoint;
use serde::Serialize;

/// Storage read bandwidth on the model's expert spans.
#[derive(Debug, Clone, Serialize)]
pub struct StorageCeiling {
    pub bytes_per_s: f64,
    pub bytes: u64,
    pub seconds: f64,
    pub reads: u64,
    pub threads: usize,
    /// Whether every shard was opened with O_DIRECT (else buffered + dropped).
    pub direct: bool,
    /// Distinct spans available, and their total size.
    pub spans: usize,
    pub span_bytes: u64,
}

/// Memory bandwidth from a multi-threaded triad.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryCeiling {
    pub bytes_per_s: f64,
    /// Size of each of the three arrays.
    pub array_bytes: u64,
    pub threads: usize,
    pub passes: usize,
}

/// Limits on how long the ceilings may take.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub storage_bytes: u64,
    pub seconds: f64,
    pub io_threads: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            storage_bytes: 2_000_000_000,
            seconds: 5.0,
            io_threads: 16,
        }
    }
}

/// `(shard, offset, len)` of every routed expert of the checkpoint `ck` in
/// `dir`, any family (one span each where an expert's tensors are adjacent,
/// else each tensor on its own).
pub fn expert_spans(dir: &Path, ck: &Checkpoint) -> Result<Vec<(usize, u64, u64)>> {
    let config = fathom_model::ModelConfig::read(dir)
        .with_context(|| format!("reading {}/config.json", dir.display()))?;
    let table =
        fathom_model::registry::expert_table(&config, ck).context("locating the routed experts")?;
    let mut spans = Vec::new();
    for loc in table.layers.iter().flatten() {
        match loc.span() {
            Some(s) => spans.push(s),
            None => {
                for t in loc.tensors() {
                    spans.push((t.shard, t.offset, t.len));
                }
            }
        }
    }
    Ok(spans)
}

/// Reads random expert spans with `limits.io_threads` threads until
/// `limits.storage_bytes` are read or `limits.seconds` pass (at least one read).
pub fn measure_storage(
    ck: &Checkpoint,
    spans: &[(usize, u64, u64)],
    limits: Limits,
) -> Result<StorageCeiling> {
    anyhow::ensure!(!spans.is_empty(), "the model has no routed experts to read");
    let readers = ck
        .shards()
        .iter()
        .map(|s| {
            ShardReader::open(&s.path, true)
                .with_context(|| format!("opening {}", s.path.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    let direct = readers.iter().all(ShardReader::is_direct);
    // A long random sequence over the spans: a fresh shuffle per pass.
    let passes =
        (limits.storage_bytes / spans.iter().map(|s| s.2).sum::<u64>().max(1) + 1).min(64) as usize;
    let mut rng = SplitMix(SEED);
    let mut order: Vec<usize> = Vec::with_capacity(passes * spans.len());
    for _ in 0..passes {
        let mut p: Vec<usize> = (0..spans.len()).collect();
        for i in (1..p.len()).rev() {
            p.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        order.extend(p);
    }
    let next = AtomicUsize::new(0);
    let bytes = AtomicU64::new(0);
    let reads = AtomicU64::new(0);
    let deadline = Duration::from_secs_f64(limits.seconds.max(0.01));
    let start = Instant::now();
    let threads = limits.io_threads.max(1);
    let err = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    loop {
                        if bytes.load(Ordering::Relaxed) >= limits.storage_bytes
                            || start.elapsed() >= deadline
                        {
                            return Ok(());
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&k) = order.get(i % order.len()) else {
                            return Ok(());
                        };
                        let (shard, off, len) = spans[k];
                        let (buf, _) = readers[shard].read_span(off, len)?;
                        bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .find_map(|w| w.join().ok().and_then(|r| r.err()))
    });
    if let Some(e) = err {
        return Err(e).context("reading expert spans");
    }
    let seconds = start.elapsed().as_secs_f64();
    let bytes = bytes.into_inner();
    Ok(StorageCeiling {
        bytes_per_s: bytes as f64 / seconds.max(1e-9),
        bytes,
        seconds,
        reads: reads.into_inner(),
        threads,
        direct,
        spans: spans.len(),
        span_bytes: spans.iter().map(|s| s.2).sum(),
    })
}

/// A tiny seeded generator: the read order only needs to defeat readahead.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// A fixed seed, so two runs read in the same order.
const SEED: u64 = 0x5eed_fa7c;

/// Triad bandwidth: counts 24 bytes per element (read b, read c, write a),
/// as STREAM does; arrays of `array_bytes` each, best of the passes that fit in `seconds`.
pub fn measure_memory(array_bytes: u64, seconds: f64) -> MemoryCeiling {
    let n = (array_bytes / 8).max(1 << 16) as usize;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = n.div_ceil(threads);
    let mut a = vec![0.0f64; n];
    let b = vec![1.0f64; n];
    let c = vec![2.0f64; n];
    let s = 3.0f64;
    let start = Instant::now();
    let mut best = 0.0f64;
    let mut passes = 0;
    // At least three passes (the first also faults pages in), at most 50.
    while passes < 3 || (passes < 50 && start.elapsed().as_secs_f64() < seconds) {
        let t = Instant::now();
        std::thread::scope(|sc| {
            for ((a, b), c) in a
                .chunks_mut(chunk)
                .zip(b.chunks(chunk))
                .zip(c.chunks(chunk))
            {
                sc.spawn(move || {
                    for ((x, y), z) in a.iter_mut().zip(b).zip(c) {
                        *x = y + s * z;
                    }
                });
            }
        });
        let dt = t.elapsed().as_secs_f64();
        best = best.max(24.0 * n as f64 / dt.max(1e-9));
        passes += 1;
    }
    std::hint::black_box(&a);
    MemoryCeiling {
        bytes_per_s: best,
        array_bytes: 8 * n as u64,
        threads,
        passes,
    }
}

/// Array size for the triad: far above any last-level cache (256 MiB each)
/// but at most 1/16 of the available memory per array.
pub fn triad_array_bytes() -> u64 {
    let avail = fathom_platform::memory::available().unwrap_or(4 << 30);
    (256u64 << 20).min(avail / 16).max(16 << 20)
}

/// Bytes of spine one decoded token touches: the resident spine, except that
/// only one row of the embedding table is read. With `int8` (`--spine int8`)
/// the matrices the family quantises count as per-row int8 (a byte per
/// weight plus an f32 scale per row); the rest stays as stored.
pub fn spine_bytes_per_token(facts: &MemoryFacts, int8: bool) -> u64 {
    facts.spine_bytes_per_token(int8)
}

/// Which resource bounds an arm's decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    Storage,
    Memory,
}

impl Bound {
    pub fn word(self) -> &'static str {
        match self {
            Bound::Storage => "storage",
            Bound::Memory => "memory",
        }
    }
}

/// The decode ceiling in tok/s for an arm that reads `expert_bytes_per_token`
/// (zero: resident or all hits, so no storage bound).
pub fn decode_ceiling(
    storage_bps: f64,
    memory_bps: f64,
    expert_bytes_per_token: f64,
    spine_bytes_per_token: u64,
) -> (f64, Bound) {
    let mem = memory_bps / spine_bytes_per_token.max(1) as f64;
    if expert_bytes_per_token > 0.0 {
        let sto = storage_bps / expert_bytes_per_token;
        if sto < mem {
            return (sto, Bound::Storage);
        }
    }
    (mem, Bound::Memory)
}

/// Opens the model for the ceilings: what the ledger knows of it (any
/// family, from config.json) and its checkpoint.
pub fn open_model(dir: &Path) -> Result<(MemoryFacts, Checkpoint)> {
    let facts = fathom_model::registry::memory_facts(dir)
        .with_context(|| format!("reading {}/config.json", dir.display()))?;
    let ck = Checkpoint::open(dir)
        .with_context(|| format!("opening the checkpoint in {}", dir.display()))?;
    Ok((facts, ck))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_takes_the_tighter_bound() {
        // 2 GB/s storage, 10 GB/s memory, 1 GB per token of experts, 1 GB of spine.
        assert_eq!(
            decode_ceiling(2e9, 10e9, 1e9, 1_000_000_000),
            (2.0, Bound::Storage)
        );
        assert_eq!(
            decode_ceiling(2e9, 10e9, 0.0, 1_000_000_000),
            (10.0, Bound::Memory)
        );
        assert_eq!(
            decode_ceiling(2e9, 1e9, 1e8, 1_000_000_000),
            (1.0, Bound::Memory)
        );
    }

    #[test]
    fn triad_measures_something() {
        let m = measure_memory(8 << 20, 0.01);
        assert!(m.bytes_per_s > 1e8 && m.passes >= 3, "{m:?}");
    }

    fn tiny_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/data/k3-tiny/checkpoint")
    }

    #[test]
    fn storage_reads_the_tiny_model_spans() {
        let (facts, ck) = open_model(&tiny_dir()).unwrap();
        let spans = expert_spans(&tiny_dir(), &ck).unwrap();
        assert_eq!(spans.len(), 8 * 32);
        let limits = Limits {
            storage_bytes: 1 << 20,
            seconds: 1.0,
            io_threads: 4,
        };
        let s = measure_storage(&ck, &spans, limits).unwrap();
        assert!(s.bytes >= 1 << 20 && s.bytes_per_s > 0.0, "{s:?}");
        let sp = spine_bytes_per_token(&facts, false);
        assert!(sp > 0 && sp < facts.spine_bytes);
        let q = spine_bytes_per_token(&facts, true);
        assert!(q < sp && q > sp / 3, "{q} vs {sp}");
    }

    /// Every family's experts are located through the registry.
    #[test]
    fn other_families_have_spans_and_bounds() {
        for name in [
            "qwen3_moe-tiny",
            "gpt_oss-tiny",
            "deepseek_v3-tiny",
            "kimi_linear-tiny",
        ] {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../model/tests/data")
                .join(name);
            let (facts, ck) = open_model(&dir).unwrap();
            let got = expert_spans(&dir, &ck).unwrap();
            let experts = facts.moe_layers * facts.num_experts;
            assert!(
                got.len() >= experts && experts > 0,
                "{name}: {} spans",
                got.len()
            );
            assert!(spine_bytes_per_token(&facts, false) > 0, "{name}");
        }
    }
}
