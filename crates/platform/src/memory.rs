//! How much memory the machine has, and how much of it is free to take.
//!
//! * Linux: `/proc/meminfo` (`MemTotal`, `MemAvailable`), and the memory
//!   cgroup's limit ([`crate::cgroup`]).
//! * macOS: `hw.memsize`, and the VM statistics of the host
//!   (`host_statistics64`): free, speculative and inactive pages are what
//!   the system hands out without swapping or compressing.

/// Physical memory of the machine, in bytes.
pub fn total() -> Option<u64> {
    #[cfg(target_os = "linux")]
    return meminfo("MemTotal:");
    #[cfg(target_os = "macos")]
    return crate::cpu::sysctl_u64("hw.memsize");
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    None
}

/// Memory the system can give a new allocation without swapping, in bytes
/// (Linux `MemAvailable`; macOS free + speculative + inactive pages).
pub fn available() -> Option<u64> {
    #[cfg(target_os = "linux")]
    return meminfo("MemAvailable:");
    #[cfg(target_os = "macos")]
    return macos::available();
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    None
}

/// Hands the allocator's free heap pages back to the system (glibc's
/// `malloc_trim`), so what one phase of a process freed is not counted in
/// the next phase's resident set. Nothing elsewhere.
pub fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers; it only returns free pages of
    // the allocator's own arenas to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The memory limit this process lives under (its memory cgroup's, on
/// Linux), if one is set below "unlimited".
pub fn limit() -> Option<u64> {
    crate::cgroup::limit()
}

/// A `/proc/meminfo` field such as `"MemAvailable:"`, in bytes.
#[cfg(target_os = "linux")]
fn meminfo(key: &str) -> Option<u64> {
    parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?, key)
}

/// The field `key` of a `/proc/meminfo` text (kilobytes) in bytes.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn parse_meminfo(text: &str, key: &str) -> Option<u64> {
    let l = text.lines().find(|l| l.starts_with(key))?;
    let kb = l[key.len()..].trim().trim_end_matches("kB").trim();
    kb.parse::<u64>().ok()?.checked_mul(1024)
}

#[cfg(target_os = "macos")]
mod macos {
    /// Free, speculative and inactive pages of the host's VM statistics.
    pub(super) fn available() -> Option<u64> {
        // SAFETY: an all-zero vm_statistics64 is a valid value of plain integers.
        let mut st: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
        let mut count = libc::HOST_VM_INFO64_COUNT;
        // SAFETY: `st` is writable for `count` integers, the size the call
        // is told; mach_host_self returns this task's host port.
        let kr = unsafe {
            #[allow(deprecated)]
            let host = libc::mach_host_self();
            libc::host_statistics64(host, libc::HOST_VM_INFO64, (&raw mut st).cast(), &mut count)
        };
        if kr != libc::KERN_SUCCESS {
            return None;
        }
        let pages = u64::from(st.free_count)
            + u64::from(st.speculative_count)
            + u64::from(st.inactive_count);
        pages.checked_mul(crate::io::page_size() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_reads_kilobytes_as_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree: 100 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(parse_meminfo(text, "MemTotal:"), Some(24_576_000 * 1024));
        assert_eq!(
            parse_meminfo(text, "MemAvailable:"),
            Some(12_000_000 * 1024)
        );
        assert_eq!(parse_meminfo(text, "NoSuchField:"), None);
        assert_eq!(parse_meminfo("MemTotal: lots kB\n", "MemTotal:"), None);
        assert_eq!(
            parse_meminfo("MemTotal: 18446744073709551615 kB\n", "MemTotal:"),
            None
        );
    }

    #[test]
    fn this_machine_reports_its_memory() {
        let (Some(t), Some(a)) = (total(), available()) else {
            panic!("no memory figures on {}", crate::OS_NAME);
        };
        assert!(a <= t && t > 64 << 20, "available {a} total {t}");
        if cfg!(target_os = "linux") {
            assert!(t.is_multiple_of(1024) && a.is_multiple_of(1024));
        }
    }
}
