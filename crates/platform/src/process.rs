//! Facts about this process, and signals to its children.
//!
//! * Linux: resident and peak resident memory from `/proc/self/status`
//!   (`VmRSS`, `VmHWM`, in KiB there).
//! * macOS: `proc_pidinfo(PROC_PIDTASKINFO)` for the resident size, and
//!   `getrusage`'s `ru_maxrss` for the peak — in bytes on macOS (Linux
//!   counts it in KiB, which is why Linux reads `/proc` instead).

use std::ffi::CString;
use std::io;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};

/// Peak resident set size of this process, in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    return status_kib("VmHWM:").map(|k| k * 1024);
    #[cfg(target_os = "macos")]
    {
        // SAFETY: an all-zero rusage is a valid value of plain integers.
        let mut r: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `r` is writable and of the type getrusage fills.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) } != 0 {
            return None;
        }
        // ru_maxrss is in bytes on macOS.
        return u64::try_from(r.ru_maxrss).ok();
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    None
}

/// Current resident set size of this process, in bytes.
pub fn rss_bytes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    return status_kib("VmRSS:").map(|k| k * 1024);
    #[cfg(target_os = "macos")]
    {
        // SAFETY: an all-zero proc_taskinfo is a valid value of plain integers.
        let mut info: libc::proc_taskinfo = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::proc_taskinfo>() as libc::c_int;
        // SAFETY: `info` is writable for `size` bytes, the size passed;
        // getpid has no preconditions.
        let n = unsafe {
            libc::proc_pidinfo(
                libc::getpid(),
                libc::PROC_PIDTASKINFO,
                0,
                (&raw mut info).cast(),
                size,
            )
        };
        return (n == size).then_some(info.pti_resident_size);
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    None
}

#[cfg(target_os = "linux")]
fn status_kib(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Asks `child` to end (`SIGTERM`), as a service manager would.
pub fn terminate(child: &Child) -> io::Result<()> {
    let pid = libc::pid_t::try_from(child.id())
        .map_err(|_| io::Error::other(format!("pid {} out of range", child.id())))?;
    // SAFETY: kill(2) with our own child's pid and a plain signal.
    if unsafe { libc::kill(pid, libc::SIGTERM) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Makes `cmd`'s process write `bytes` to the file `path` between `fork`
/// and `exec` (a cgroup's `cgroup.procs`, say, so the child moves itself
/// there before it runs anything). The spawn fails with the error of the
/// open or the write.
pub fn write_before_exec(cmd: &mut Command, path: CString, bytes: &'static [u8]) {
    // SAFETY: the hook runs in the forked child before exec, where only
    // async-signal-safe calls are allowed: it uses open/write/close on a
    // path allocated before the fork and allocates nothing itself
    // (io::Error::last_os_error only reads errno).
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let n = libc::write(fd, bytes.as_ptr().cast(), bytes.len());
            let err = io::Error::last_os_error();
            libc::close(fd);
            if n != bytes.len() as isize {
                return Err(err);
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_is_readable() {
        // RSS first: reading /proc can itself raise the peak a little.
        let rss = rss_bytes().unwrap();
        let peak = peak_rss_bytes().unwrap();
        assert!(peak >= rss && rss > 1 << 20, "rss {rss} peak {peak}");
    }

    #[test]
    fn a_child_writes_before_it_runs_and_ends_on_terminate() {
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target");
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join(format!("platform-exec-{}", std::process::id()));
        std::fs::write(&f, b"").unwrap();
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        use std::os::unix::ffi::OsStrExt;
        write_before_exec(
            &mut cmd,
            CString::new(f.as_os_str().as_bytes()).unwrap(),
            b"0",
        );
        let mut child = cmd.spawn().unwrap();
        terminate(&child).unwrap();
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGTERM));
        assert_eq!(std::fs::read(&f).unwrap(), b"0");
        // A path that cannot be opened fails the spawn.
        let mut bad = Command::new("true");
        write_before_exec(
            &mut bad,
            CString::new("/nonexistent-fathom/x").unwrap(),
            b"0",
        );
        assert_eq!(bad.spawn().unwrap_err().kind(), io::ErrorKind::NotFound);
        std::fs::remove_file(&f).unwrap();
    }
}
