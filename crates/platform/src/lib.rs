//! The operating system under fathom, in one place.
//!
//! Everything fathom asks of the OS beyond `std` lives here, with one
//! implementation per system (Linux and macOS; other Unix systems get the
//! portable parts and "not supported" for the rest):
//!
//! * [`io`]: positional reads and writes that bypass the page cache
//!   (`O_DIRECT` on Linux, `F_NOCACHE` with read-ahead off on macOS), the
//!   alignment they need, page-cache advice, page-cache residency, free
//!   disk space and anonymous mappings.
//! * [`memory`]: the machine's total and available memory and the memory
//!   limit this process lives under ([`cgroup`]: v1 or v2, Linux only).
//! * [`cpu`]: NUMA nodes and the CPUs this process may use, pinning a
//!   thread, interleaving memory over nodes, and on Apple Silicon the
//!   performance and efficiency cores.
//! * [`process`]: this process's resident and peak memory, ending a child.
//! * [`host`]: what the machine is (CPU model, kernel, OS, load, the
//!   filesystem under a directory), for the record of a measurement.
//!
//! What a system does not have is reported as [`Support::Unsupported`] (or
//! an `io::ErrorKind::Unsupported` error naming the system), never
//! silently pretended.

pub mod cgroup;
pub mod cpu;
pub mod host;
pub mod io;
pub mod memory;
pub mod process;

/// The system this build runs on, as its users call it.
pub const OS_NAME: &str = if cfg!(target_os = "macos") {
    "macOS"
} else if cfg!(target_os = "linux") {
    "Linux"
} else {
    std::env::consts::OS
};

/// Whether the system offers a facility.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// The system has it; the calls act.
    Available,
    /// The system has no such facility: the calls do nothing (or return an
    /// `Unsupported` error) and say so.
    Unsupported {
        /// The system, as [`OS_NAME`] names it.
        os: &'static str,
    },
}

impl Support {
    pub fn is_available(self) -> bool {
        self == Support::Available
    }

    const fn on(linux: bool) -> Support {
        if linux {
            Support::Available
        } else {
            Support::Unsupported { os: OS_NAME }
        }
    }
}

impl std::fmt::Display for Support {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Support::Available => f.write_str("supported"),
            Support::Unsupported { os } => write!(f, "not supported on {os}"),
        }
    }
}

/// An `Unsupported` error for `what` on this system.
#[cfg_attr(target_os = "linux", allow(dead_code))]
pub(crate) fn unsupported(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        format!("{what} is not supported on {OS_NAME}"),
    )
}

/// Whether the CPU and the GPU share one memory (Apple Silicon): RAM is
/// then the GPU's memory too, so the RAM budget is of the whole machine's
/// memory (no separate device budget is added to it) and host buffers are
/// never page-locked for copies (there is nothing to copy across).
pub const fn unified_memory() -> bool {
    cfg!(all(target_os = "macos", target_arch = "aarch64"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn support_says_which_system_lacks_it() {
        assert_eq!(Support::Available.to_string(), "supported");
        let s = Support::Unsupported { os: "macOS" };
        assert_eq!(s.to_string(), "not supported on macOS");
        assert!(!s.is_available());
        let e = unsupported("pinning a thread to a CPU");
        assert_eq!(e.kind(), std::io::ErrorKind::Unsupported);
        assert_eq!(
            e.to_string(),
            format!("pinning a thread to a CPU is not supported on {OS_NAME}")
        );
    }

    #[test]
    fn linux_memory_is_not_unified() {
        if cfg!(target_os = "linux") {
            assert!(!unified_memory());
            assert_eq!(OS_NAME, "Linux");
        }
    }
}
