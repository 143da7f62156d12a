//! A device call's operations on the compute stream, written down before
//! any is issued ([`Tape`]), so that a call whose operations repeat
//! exactly — the same kernels, launch shapes and arguments, the same copies
//! between the same buffers, as a decode step's calls do from one token to
//! the next — runs as one CUDA graph launch instead of a driver call per
//! operation.
//!
//! A call's operations are issued together when it ends ([`Tape::flush`]):
//! one the backend has seen before is captured into a graph (stream
//! capture, thread-local mode) and launched; one it has a graph for is
//! that graph's launch; any other is issued one by one as before. A graph
//! holds only copies between page-locked host memory and device buffers
//! and kernel launches: a call that waits for a weight copy still running
//! is always issued one by one. The graph runs the very operations the
//! call would have issued, in their order, on the same stream, so the
//! bits cannot depend on it. If the driver refuses a capture, graphs are
//! turned off for the backend (counted, with the reason) and the call is
//! issued one by one.
//!
//! What a call issues directly on the compute stream before its flush
//! (weights and states copied up, a scratch buffer grown) runs before the
//! written operations, so it touches only what they come after or do not
//! name: a call grows each staging and scratch buffer before anything is
//! written that names it. The copy stream's work is ordered by events as
//! before. A kept graph is launched only when its operations, every
//! address included, equal the current call's, which names only live
//! memory; all are also dropped when one of the backend's staging or
//! scratch buffers is reallocated.

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::ffi::c_void;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaFunction, CudaGraph, CudaStream, LaunchConfig, result, sys};
use fathom_kernels::backend::BackendStats;

use crate::CudaError;

#[cfg(target_endian = "big")]
compile_error!("kernel arguments are kept in the low bytes of 64-bit slots (little-endian)");

/// The most graphs kept (the least recently used goes first): well above
/// one decode step's distinct calls on a full-depth model (a few hundred),
/// so a step's graphs are never evicted by its own later calls.
const GRAPHS: usize = 4096;
/// The most operation lists remembered as seen once (then forgotten together).
const SEEN: usize = 4096;

/// One operation on the compute stream.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
enum Op {
    /// Host → device from page-locked memory.
    Up {
        dst: u64,
        src: usize,
        bytes: usize,
    },
    /// Device → page-locked host memory.
    Down {
        dst: usize,
        src: u64,
        bytes: usize,
    },
    Kernel(Launch),
    /// Waits for an event (a weight copy's end on the copy stream).
    Wait(usize),
    /// The call's clock: its start (`false`) or end event recorded.
    Clock(bool),
}

/// A kernel launch: the function, its shape, and each argument's bytes in
/// the low bytes of a 64-bit slot; then, when `tail` is not empty, one
/// more argument: a structure of `tail.len()` 64-bit values.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct Launch {
    f: usize,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared: u32,
    args: Vec<u64>,
    tail: Vec<u64>,
}

/// A kernel argument as the kernel reads it: its bytes, in a 64-bit slot.
pub(super) trait Arg {
    fn slot(&self) -> u64;
}

impl Arg for u64 {
    fn slot(&self) -> u64 {
        *self
    }
}

impl Arg for i64 {
    fn slot(&self) -> u64 {
        *self as u64
    }
}

impl Arg for i32 {
    fn slot(&self) -> u64 {
        u64::from(*self as u32)
    }
}

impl Arg for f32 {
    fn slot(&self) -> u64 {
        u64::from(self.to_bits())
    }
}

/// A graph kept between calls.
struct Kept(CudaGraph);

// SAFETY: a kept graph is used only by the call holding the backend's
// lock (one thread at a time, as the driver asks of graph objects).
unsafe impl Send for Kept {}

/// A call's operations, and the graphs of calls seen before (see the module).
pub(super) struct Tape {
    ops: Vec<Op>,
    /// When the call's list was begun (its staging time is counted at the flush).
    begun: Option<std::time::Instant>,
    /// Whether calls may run as graphs.
    graphs_on: bool,
    /// Graphs by the operations they run, each with its last use.
    built: HashMap<Vec<Op>, (Kept, u64)>,
    /// Hashes of operation lists seen once.
    seen: HashSet<u64>,
    tick: u64,
    /// The backend's count of staging and scratch reallocations when the
    /// kept graphs were made (they may name the old buffers: a new count
    /// drops them). Each backend counts its own, so another backend's
    /// buffers never drop this one's graphs.
    generation: u64,
    /// Launches of the tiled kernels written since the call began
    /// (`BackendStats::tiled_launches`).
    tiled: u64,
}

impl Tape {
    pub(super) fn new() -> Self {
        Tape {
            ops: Vec::new(),
            begun: None,
            graphs_on: true,
            built: HashMap::new(),
            seen: HashSet::new(),
            tick: 0,
            generation: 0,
            tiled: 0,
        }
    }

    /// Drops the kept graphs (and the lists seen once).
    pub(super) fn clear(&mut self) {
        self.built.clear();
        self.seen.clear();
    }

    /// Lets calls run as graphs, or makes every call issue its operations
    /// one by one (dropping the graphs kept).
    pub(super) fn set_graphs(&mut self, on: bool) {
        self.graphs_on = on;
        if !on {
            self.clear();
        }
    }

    /// Starts a call: anything written by a call that failed before its
    /// flush is dropped unissued.
    pub(super) fn begin(&mut self) {
        self.ops.clear();
        self.tiled = 0;
        self.begun = Some(std::time::Instant::now());
    }

    /// Writes a copy of `src` (page-locked host memory) to `dst`; nothing
    /// for an empty `src`.
    pub(super) fn up<T>(&mut self, dst: u64, src: &[T]) {
        if src.is_empty() {
            return;
        }
        self.ops.push(Op::Up {
            dst,
            src: src.as_ptr() as usize,
            bytes: std::mem::size_of_val(src),
        });
    }

    /// Writes a copy of `src` into `dst` (page-locked host memory), which
    /// must stay put and unread until the call's synchronisation; nothing
    /// for an empty `dst`.
    pub(super) fn down<T>(&mut self, dst: &mut [T], src: u64) {
        if dst.is_empty() {
            return;
        }
        self.ops.push(Op::Down {
            dst: dst.as_mut_ptr() as usize,
            src,
            bytes: std::mem::size_of_val(dst),
        });
    }

    /// Writes a launch of `f` with `args` (each as [`Arg::slot`] gives it;
    /// a caller's own `Vec` is kept as it is).
    pub(super) fn kernel(
        &mut self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: impl Into<Vec<u64>>,
    ) {
        self.kernel_with(f, cfg, args, Vec::new());
    }

    /// [`Tape::kernel`] with a last argument that is a structure of the
    /// 64-bit values `tail` (by value, as the kernel declares it).
    pub(super) fn kernel_with(
        &mut self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: impl Into<Vec<u64>>,
        tail: Vec<u64>,
    ) {
        self.ops.push(Op::Kernel(Launch {
            f: f.cu_function() as usize,
            grid: cfg.grid_dim,
            block: cfg.block_dim,
            shared: cfg.shared_mem_bytes,
            args: args.into(),
            tail,
        }));
    }

    /// Counts a launch of a tiled kernel written just before.
    pub(super) fn tiled(&mut self) {
        self.tiled += 1;
    }

    /// Writes a wait for `e`, which must outlive the call's flush.
    pub(super) fn wait(&mut self, e: &CudaEvent) {
        self.ops.push(Op::Wait(e.cu_event() as usize));
    }

    /// Writes the recording of the call's clock: its start (once: a call
    /// made of parts starts at its first) or its end (once: at its last).
    pub(super) fn clock(&mut self, end: bool) {
        if end {
            self.ops.retain(|o| *o != Op::Clock(true));
        } else if self.ops.contains(&Op::Clock(false)) {
            return;
        }
        self.ops.push(Op::Clock(end));
    }

    /// Issues the call's operations on `stream` (see the module); `clock`
    /// holds the events [`Tape::clock`] names. With a graph the clock's
    /// events are recorded around its launch.
    pub(super) fn flush(
        &mut self,
        stream: &Arc<CudaStream>,
        clock: Option<&(CudaEvent, CudaEvent)>,
        stats: &mut BackendStats,
        reallocs: u64,
    ) -> Result<(), CudaError> {
        let started = std::time::Instant::now();
        if let Some(b) = self.begun.take() {
            stats.stage_ms += started.duration_since(b).as_secs_f64() * 1e3;
        }
        let issued = self.issue(stream, clock, stats, reallocs);
        stats.issue_ms += started.elapsed().as_secs_f64() * 1e3;
        issued
    }

    /// [`Tape::flush`]'s work.
    fn issue(
        &mut self,
        stream: &Arc<CudaStream>,
        clock: Option<&(CudaEvent, CudaEvent)>,
        stats: &mut BackendStats,
        reallocs: u64,
    ) -> Result<(), CudaError> {
        let ops = std::mem::take(&mut self.ops);
        let kernels = ops.iter().filter(|o| matches!(o, Op::Kernel(_))).count();
        stats.kernel_launches += kernels as u64;
        stats.tiled_launches += std::mem::take(&mut self.tiled);
        // The raw driver calls below act on this thread's current context.
        stream.context().bind_to_thread()?;
        if reallocs != self.generation {
            self.clear();
            self.generation = reallocs;
        }
        if self.graphs_on && graphable(&ops) {
            self.tick += 1;
            let tick = self.tick;
            if let Some((g, used)) = self.built.get_mut(&ops) {
                *used = tick;
                stats.graph_launches += 1;
                return launch_graph(&g.0, stream, &ops, clock);
            }
            let h = hash_of(&ops);
            if self.seen.remove(&h) {
                match capture(stream, &ops) {
                    Ok(g) => {
                        stats.graph_builds += 1;
                        stats.graph_launches += 1;
                        launch_graph(&g, stream, &ops, clock)?;
                        self.keep(ops, g);
                        return Ok(());
                    }
                    Err(e) => {
                        self.set_graphs(false);
                        stats.graph_failures += 1;
                        stats.last_error = Some(format!(
                            "CUDA graphs turned off (every call now issues its operations \
                             one by one): capturing a call failed: {e}"
                        ));
                    }
                }
            } else {
                if self.seen.len() >= SEEN {
                    self.seen.clear();
                }
                self.seen.insert(h);
            }
        }
        ops.iter().try_for_each(|op| issue(stream, op, clock))
    }

    /// Keeps `g` for `ops`, the least recently used graph going when full.
    fn keep(&mut self, ops: Vec<Op>, g: CudaGraph) {
        if self.built.len() >= GRAPHS
            && let Some(old) = self
                .built
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
        {
            self.built.remove(&old);
        }
        self.built.insert(ops, (Kept(g), self.tick));
    }
}

/// Whether a graph can hold `ops`: a kernel among them, no wait.
fn graphable(ops: &[Op]) -> bool {
    ops.iter().any(|o| matches!(o, Op::Kernel(_))) && !ops.iter().any(|o| matches!(o, Op::Wait(_)))
}

fn hash_of(ops: &[Op]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ops.hash(&mut h);
    h.finish()
}

/// `ops` captured from `stream` into a graph (its clock left out).
fn capture(stream: &Arc<CudaStream>, ops: &[Op]) -> Result<CudaGraph, CudaError> {
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let issued = ops
        .iter()
        .filter(|op| !matches!(op, Op::Clock(_)))
        .try_for_each(|op| issue(stream, op, None));
    // The capture ends whatever happened, so the stream runs work again.
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    issued?;
    graph?.ok_or_else(|| CudaError::Driver("the captured call made an empty graph".into()))
}

/// Launches `g` (the graph of `ops`), with the call's clock around it when
/// `ops` record one.
fn launch_graph(
    g: &CudaGraph,
    stream: &Arc<CudaStream>,
    ops: &[Op],
    clock: Option<&(CudaEvent, CudaEvent)>,
) -> Result<(), CudaError> {
    let clocked = clock.filter(|_| ops.contains(&Op::Clock(false)));
    if let Some((start, _)) = clocked {
        start.record(stream)?;
    }
    g.launch()?;
    if let Some((_, end)) = clocked {
        end.record(stream)?;
    }
    Ok(())
}

/// Launches `f` with `args` (each as [`Arg::slot`] gives it) on `stream`
/// at once, outside any tape: work a copy needs before its event (the
/// caller checks the arguments as for [`Tape::kernel`]).
pub(super) fn launch_now(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: Vec<u64>,
) -> Result<(), CudaError> {
    stream.context().bind_to_thread()?;
    let op = Op::Kernel(Launch {
        f: f.cu_function() as usize,
        grid: cfg.grid_dim,
        block: cfg.block_dim,
        shared: cfg.shared_mem_bytes,
        args,
        tail: Vec::new(),
    });
    issue(stream, &op, None)
}

/// Issues one operation on `stream`.
fn issue(
    stream: &Arc<CudaStream>,
    op: &Op,
    clock: Option<&(CudaEvent, CudaEvent)>,
) -> Result<(), CudaError> {
    let cu = stream.cu_stream();
    match op {
        // SAFETY: the caller wrote a page-locked host range and a device
        // buffer of `bytes` that stay put until the call's synchronisation.
        Op::Up { dst, src, bytes } => unsafe {
            sys::cuMemcpyHtoDAsync_v2(*dst, *src as *const c_void, *bytes, cu).result()?
        },
        // SAFETY: as above, the host range written only by this copy.
        Op::Down { dst, src, bytes } => unsafe {
            sys::cuMemcpyDtoHAsync_v2(*dst as *mut c_void, *src, *bytes, cu).result()?
        },
        Op::Kernel(l) => {
            // The driver only reads the slots (it copies them before returning).
            let mut params: Vec<*mut c_void> = l
                .args
                .iter()
                .map(|s| (s as *const u64).cast_mut().cast())
                .collect();
            if !l.tail.is_empty() {
                params.push(l.tail.as_ptr().cast_mut().cast());
            }
            // SAFETY: each launch site checked that its arguments match the
            // kernel's parameters (each read from the low bytes of its
            // slot, a tail as the structure of 64-bit values the kernel
            // declares last) and name device buffers of the shapes it
            // launches; the driver copies the arguments before returning.
            unsafe {
                result::launch_kernel(
                    l.f as sys::CUfunction,
                    l.grid,
                    l.block,
                    l.shared,
                    cu,
                    &mut params,
                )?
            }
        }
        // SAFETY: the event outlives the flush (its cache entry stays while
        // the call holds the lock).
        Op::Wait(e) => unsafe {
            result::stream::wait_event(
                cu,
                *e as sys::CUevent,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )?
        },
        Op::Clock(end) => {
            if let Some((start, stop)) = clock {
                if *end { stop } else { start }.record(stream)?;
            }
        }
    }
    Ok(())
}
