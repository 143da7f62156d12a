//! Where memory and compute threads sit on the host, as the process
//! decided at start. The OS facts themselves (NUMA nodes, pinning,
//! interleaving) are [`fathom_platform::cpu`]'s, re-exported here.

pub use fathom_platform::cpu::{
    MAX_CPUS, Topology, allowed_cpus, interleave, numa_policy, parse_cpu_list, pin_current_thread,
    thread_pinning,
};

/// What the process decided at start: how many nodes, whether memory is
/// interleaved over them and whether compute threads are pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Placement {
    pub nodes: usize,
    pub interleaved: bool,
    pub pinned: bool,
}

static PLACEMENT: std::sync::OnceLock<Placement> = std::sync::OnceLock::new();

/// Records the process's placement (the first call wins).
pub fn set_placement(p: Placement) {
    let _ = PLACEMENT.set(p);
}

/// The recorded placement (one node, nothing pinned, if none was recorded).
pub fn placement() -> Placement {
    PLACEMENT.get().copied().unwrap_or(Placement {
        nodes: 1,
        ..Placement::default()
    })
}
