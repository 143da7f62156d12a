//! What the machine is, for the record a measurement keeps: its CPU model,
//! kernel and OS release, load, and the filesystem holding a directory.
//!
//! * Linux: `/proc/cpuinfo`, `/proc/sys/kernel/osrelease`,
//!   `/etc/os-release`, `/proc/loadavg`, `/proc/mounts`.
//! * macOS: `machdep.cpu.brand_string`, `kern.osrelease`,
//!   `kern.osproductversion`, `getloadavg`, `statfs`.

use std::path::Path;

/// The CPU's model name (`AMD EPYC 9654 96-Core Processor`, `Apple M2 Pro`).
pub fn cpu_model() -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        cpuinfo
            .lines()
            .find(|l| l.starts_with("model name") || l.starts_with("Model"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    }
    #[cfg(target_os = "macos")]
    return sysctl_string("machdep.cpu.brand_string");
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    None
}

/// The kernel's release (`6.8.0-45-generic`, Darwin's `23.5.0`).
pub fn kernel_release() -> Option<String> {
    #[cfg(target_os = "linux")]
    return std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|s| s.trim().to_string());
    #[cfg(target_os = "macos")]
    return sysctl_string("kern.osrelease");
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    None
}

/// The operating system's name and version (`Debian GNU/Linux 13
/// (trixie)`, `macOS 14.5`).
pub fn os_release() -> Option<String> {
    #[cfg(target_os = "linux")]
    return std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim_matches('"').to_string())
        });
    #[cfg(target_os = "macos")]
    return sysctl_string("kern.osproductversion").map(|v| format!("macOS {v}"));
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    None
}

/// The load averages over 1, 5 and 15 minutes as the system words them
/// (Linux: the whole `/proc/loadavg` line).
pub fn load_average() -> Option<String> {
    #[cfg(target_os = "linux")]
    return std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.trim().to_string());
    #[cfg(not(target_os = "linux"))]
    {
        let mut l = [0f64; 3];
        // SAFETY: `l` is writable for the 3 doubles asked for.
        let n = unsafe { libc::getloadavg(l.as_mut_ptr(), 3) };
        (n == 3).then(|| format!("{:.2} {:.2} {:.2}", l[0], l[1], l[2]))
    }
}

/// The filesystem holding `dir`: (device, mount point, filesystem type).
pub fn mount_of(dir: &Path) -> Option<(String, String, String)> {
    #[cfg(target_os = "linux")]
    return mount_in(dir, &std::fs::read_to_string("/proc/mounts").ok()?);
    #[cfg(target_os = "macos")]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: an all-zero statfs is a valid value of integers and arrays.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is NUL-terminated and `st` is writable, of the type filled.
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
            return None;
        }
        let text = |a: &[libc::c_char]| {
            let b: Vec<u8> = a
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&b).into_owned()
        };
        return Some((
            text(&st.f_mntfromname),
            text(&st.f_mntonname),
            text(&st.f_fstypename),
        ));
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        let _ = dir;
        None
    }
}

/// The `/proc/mounts` entry with the longest mount point containing `dir`:
/// `(device, mount point, fstype)`.
pub fn mount_in(dir: &Path, mounts: &str) -> Option<(String, String, String)> {
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let point = f.get(1)?.replace("\\040", " ");
            dir.starts_with(&point)
                .then(|| (f[0].to_string(), point, f.get(2).unwrap_or(&"").to_string()))
        })
        .max_by_key(|(_, p, _)| p.len())
}

/// A string sysctl by name.
#[cfg(target_os = "macos")]
fn sysctl_string(name: &str) -> Option<String> {
    let c = std::ffi::CString::new(name).ok()?;
    let mut v = [0u8; 256];
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
    if rc != 0 {
        return None;
    }
    let s = &v[..len.min(v.len())];
    let s = s.split(|&b| b == 0).next().unwrap_or(s);
    Some(String::from_utf8_lossy(s).trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_mount_wins() {
        let m = "/dev/vda / ext4 rw 0 0\n/dev/vdb /data xfs rw 0 0\ntmpfs /data/tmp tmpfs rw 0 0\n";
        let r = mount_in(Path::new("/data/models/x"), m).unwrap();
        assert_eq!(r, ("/dev/vdb".into(), "/data".into(), "xfs".into()));
        let r = mount_in(Path::new("/home/x"), m).unwrap();
        assert_eq!(r.0, "/dev/vda");
        // A path prefix is not a parent directory.
        assert_eq!(mount_in(Path::new("/database"), m).unwrap().1, "/");
    }

    #[test]
    fn this_machine_describes_itself() {
        assert!(kernel_release().is_some_and(|k| !k.is_empty()));
        let l = load_average().unwrap();
        assert!(l.split_whitespace().count() >= 3, "{l}");
        let here = Path::new(env!("CARGO_MANIFEST_DIR"))
            .canonicalize()
            .unwrap();
        let (_, point, fstype) = mount_of(&here).unwrap();
        assert!(here.starts_with(&point) && !fstype.is_empty(), "{point}");
    }
}
