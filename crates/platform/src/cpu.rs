//! Where compute threads and memory sit on the host: the NUMA nodes and
//! their CPUs (from sysfs), pinning a thread to one CPU, interleaving the
//! process's future allocations over every node, and the kinds of cores
//! (Apple Silicon's performance and efficiency cores).
//!
//! Decode streams every weight row once per token from whichever thread
//! takes it (work stealing), so on a multi-socket host the weights are
//! spread page by page over all nodes (`MPOL_INTERLEAVE`, what
//! `numactl --interleave=all` does): every node's memory controller then
//! serves its share instead of one node serving all. Pinning keeps a
//! compute thread on one CPU (threads are dealt to nodes in turn). Both
//! change where things run, never what is computed.
//!
//! macOS has neither: one node holds every CPU, [`thread_pinning`] and
//! [`numa_policy`] report [`Support::Unsupported`], and pinning returns an
//! `Unsupported` error. There the compute threads default to the
//! performance cores ([`default_compute_threads`]): a matrix product split
//! evenly over fast and slow cores waits for the slow ones.

use std::io;
use std::path::Path;

use crate::Support;

/// The host's NUMA nodes, each with the CPUs this process may use on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Per node (in node-id order), its allowed CPUs, ascending.
    pub nodes: Vec<Vec<usize>>,
    /// Node ids as the kernel numbers them (parallel to `nodes`).
    pub node_ids: Vec<usize>,
}

/// The CPUs a sysfs list names (`0-3,8,10-11`); `None` if malformed.
pub fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
            None => {
                let v: usize = part.trim().parse().ok()?;
                (v, v)
            }
        };
        if b < a || b - a > 1 << 16 {
            return None;
        }
        out.extend(a..=b);
    }
    Some(out)
}

impl Topology {
    /// The nodes under `/sys/devices/system/node` with the CPUs this
    /// process is allowed on; one node holding every allowed CPU where
    /// sysfs has no node directory (containers, other systems).
    pub fn detect() -> Topology {
        let allowed = allowed_cpus();
        Self::from_sysfs(Path::new("/sys/devices/system/node"), &allowed)
    }

    /// [`Topology::detect`] over a sysfs-like directory.
    pub fn from_sysfs(dir: &Path, allowed: &[usize]) -> Topology {
        let mut found: Vec<(usize, Vec<usize>)> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let id: usize = name.strip_prefix("node")?.parse().ok()?;
                let list = std::fs::read_to_string(e.path().join("cpulist")).ok()?;
                let cpus: Vec<usize> = parse_cpu_list(&list)?
                    .into_iter()
                    .filter(|c| allowed.contains(c))
                    .collect();
                (!cpus.is_empty()).then_some((id, cpus))
            })
            .collect();
        found.sort();
        if found.is_empty() {
            return Topology {
                nodes: vec![allowed.to_vec()],
                node_ids: vec![0],
            };
        }
        Topology {
            node_ids: found.iter().map(|f| f.0).collect(),
            nodes: found.into_iter().map(|f| f.1).collect(),
        }
    }

    /// The CPU compute thread `i` is pinned to: threads are dealt to the
    /// nodes in turn, and within a node to its CPUs in order.
    pub fn cpu_for_thread(&self, i: usize) -> usize {
        let node = &self.nodes[i % self.nodes.len()];
        node[(i / self.nodes.len()) % node.len()]
    }
}

/// Whether this system can pin a thread to one CPU.
pub const fn thread_pinning() -> Support {
    Support::on(cfg!(target_os = "linux"))
}

/// Whether this system can interleave memory over NUMA nodes.
pub const fn numa_policy() -> Support {
    Support::on(cfg!(target_os = "linux"))
}

/// The CPUs this process may run on (every online CPU if unknown, and
/// on systems without affinity masks).
pub fn allowed_cpus() -> Vec<usize> {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    #[cfg(target_os = "linux")]
    {
        // SAFETY: an all-zero cpu_set_t is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: the call writes at most size_of::<cpu_set_t>() bytes into `set`.
        let ok =
            unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        if ok == 0 {
            // SAFETY: CPU_ISSET reads the set filled above, within CPU_SETSIZE.
            return (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
                .collect();
        }
    }
    (0..n).collect()
}

/// The most CPUs [`pin_current_thread`] can name.
#[cfg(target_os = "linux")]
pub const MAX_CPUS: usize = libc::CPU_SETSIZE as usize;
/// The most CPUs [`pin_current_thread`] can name.
#[cfg(not(target_os = "linux"))]
pub const MAX_CPUS: usize = 0;

/// Pins the calling thread to `cpu` (an `Unsupported` error where the
/// system cannot, see [`thread_pinning`]).
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        if cpu >= MAX_CPUS {
            return Err(io::Error::other(format!("CPU {cpu} is beyond CPU_SETSIZE")));
        }
        // SAFETY: an all-zero cpu_set_t is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: cpu < CPU_SETSIZE (checked above), so the bit is inside the set.
        unsafe { libc::CPU_SET(cpu, &mut set) };
        // SAFETY: the set is initialised and its size is passed.
        let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpu;
        Err(crate::unsupported("pinning a thread to a CPU"))
    }
}

/// Interleaves the calling thread's future allocations (and those of the
/// threads it starts afterwards) page by page over `node_ids`. A no-op
/// returning `Ok(false)` for fewer than two nodes; an `Unsupported` error
/// for more where the system has no memory policy ([`numa_policy`]).
pub fn interleave(node_ids: &[usize]) -> io::Result<bool> {
    if node_ids.len() < 2 {
        return Ok(false);
    }
    let max = node_ids.iter().max().copied().unwrap_or(0);
    if max >= 4096 {
        return Err(io::Error::other(format!("node id {max} is out of range")));
    }
    #[cfg(target_os = "linux")]
    {
        /// `MPOL_INTERLEAVE` from `<linux/mempolicy.h>`.
        const MPOL_INTERLEAVE: libc::c_int = 3;
        let mut mask = vec![0 as libc::c_ulong; max / 64 + 1];
        for &n in node_ids {
            mask[n / 64] |= 1 << (n % 64);
        }
        // The kernel reads maxnode − 1 bits of the mask (libnuma passes its
        // bit count + 1), so with this maxnode every bit of every word is seen.
        let maxnode = (mask.len() * 64 + 1) as libc::c_ulong;
        // SAFETY: `mask` holds 64·len = maxnode − 1 bits, all that the call reads.
        let r = unsafe {
            libc::syscall(
                libc::SYS_set_mempolicy,
                MPOL_INTERLEAVE,
                mask.as_ptr(),
                maxnode,
            )
        };
        if r == 0 {
            Ok(true)
        } else {
            Err(io::Error::last_os_error())
        }
    }
    #[cfg(not(target_os = "linux"))]
    Err(crate::unsupported("interleaving memory over NUMA nodes"))
}

/// The kinds of cores of a machine that has more than one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoreKinds {
    /// Performance cores (Apple's perflevel 0).
    pub performance: usize,
    /// Efficiency cores (perflevel 1).
    pub efficiency: usize,
}

/// The performance and efficiency cores, where the system reports two
/// kinds (macOS `hw.nperflevels`, `hw.perflevel{0,1}.physicalcpu`).
pub fn core_kinds() -> Option<CoreKinds> {
    #[cfg(target_os = "macos")]
    {
        let levels = sysctl_u64("hw.nperflevels")?;
        let p = sysctl_u64("hw.perflevel0.physicalcpu")?;
        let e = if levels >= 2 {
            sysctl_u64("hw.perflevel1.physicalcpu")?
        } else {
            0
        };
        return core_kinds_from(p, e);
    }
    #[cfg(not(target_os = "macos"))]
    None
}

/// Two kinds from the counts of each (none when either is 0 or absurd).
#[cfg_attr(not(target_os = "macos"), allow(dead_code))]
fn core_kinds_from(performance: u64, efficiency: u64) -> Option<CoreKinds> {
    let ok = |n: u64| (1..=1 << 16).contains(&n).then_some(n as usize);
    Some(CoreKinds {
        performance: ok(performance)?,
        efficiency: ok(efficiency)?,
    })
}

/// How many compute threads to start when none is asked for: the
/// performance cores where the machine has two kinds; `None` (one per
/// logical CPU, the thread pool's own default) elsewhere.
pub fn default_compute_threads() -> Option<usize> {
    core_kinds().map(|k| k.performance)
}

/// An integer sysctl by name (4- or 8-byte values).
#[cfg(target_os = "macos")]
pub(crate) fn sysctl_u64(name: &str) -> Option<u64> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut v = [0u8; 8];
    let mut len: libc::size_t = v.len();
    // SAFETY: `c` is NUL-terminated; `v` is writable for `len` bytes, and
    // the call writes at most that and stores the written length in `len`.
    let rc = unsafe {
        libc::sysctlbyname(
            c.as_ptr(),
            v.as_mut_ptr().cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    match (rc, len) {
        (0, 4) => Some(u64::from(u32::from_ne_bytes(v[..4].try_into().ok()?))),
        (0, 8) => Some(u64::from_ne_bytes(v)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_sysfs_writes_them() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a-b"), None);
    }

    #[test]
    fn two_nodes_deal_threads_in_turn() {
        let dir = std::env::temp_dir().join(format!("fathom-numa-{}", std::process::id()));
        for (n, list) in [(0, "0-3\n"), (1, "4-7\n")] {
            let d = dir.join(format!("node{n}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), list).unwrap();
        }
        std::fs::write(dir.join("possible"), "0-1\n").unwrap();
        let allowed: Vec<usize> = (0..8).filter(|&c| c != 5).collect();
        let t = Topology::from_sysfs(&dir, &allowed);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(t.nodes, vec![vec![0, 1, 2, 3], vec![4, 6, 7]]);
        assert_eq!(t.node_ids, vec![0, 1]);
        let first: Vec<usize> = (0..8).map(|i| t.cpu_for_thread(i)).collect();
        assert_eq!(first, vec![0, 4, 1, 6, 2, 7, 3, 4]);
        // No node directories: one node of every allowed CPU.
        let none = Topology::from_sysfs(Path::new("/nonexistent-fathom"), &[0, 1]);
        assert_eq!(none.nodes, vec![vec![0, 1]]);
    }

    #[test]
    fn a_thread_pins_to_an_allowed_cpu() {
        let allowed = allowed_cpus();
        let cpu = *allowed.last().expect("some CPU is allowed");
        if !thread_pinning().is_available() {
            let e = pin_current_thread(cpu).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{e}");
            return;
        }
        std::thread::spawn(move || {
            pin_current_thread(cpu).unwrap();
            assert_eq!(allowed_cpus(), vec![cpu]);
        })
        .join()
        .unwrap();
        assert!(pin_current_thread(MAX_CPUS).is_err());
    }

    #[test]
    fn one_node_needs_no_interleaving() {
        assert!(!interleave(&[0]).unwrap());
        assert!(interleave(&[0, 4096]).is_err());
        if !numa_policy().is_available() {
            let e = interleave(&[0, 1]).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{e}");
        }
    }

    #[test]
    fn two_kinds_of_cores_default_to_the_fast_ones() {
        let k = core_kinds_from(8, 4).unwrap();
        assert_eq!((k.performance, k.efficiency), (8, 4));
        assert_eq!(core_kinds_from(0, 4), None);
        assert_eq!(core_kinds_from(12, 0), None);
        assert_eq!(core_kinds_from(1 << 40, 4), None);
        match core_kinds() {
            Some(k) => assert_eq!(default_compute_threads(), Some(k.performance)),
            None => assert_eq!(default_compute_threads(), None),
        }
        if cfg!(target_os = "linux") {
            assert_eq!(core_kinds(), None);
        }
    }
}
