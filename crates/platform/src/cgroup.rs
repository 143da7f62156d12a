//! The memory cgroup this process lives in (Linux): where it is and what
//! limit it sets.
//!
//! Both hierarchies are handled: v1 (`memory` controller mounted on its own,
//! `memory.limit_in_bytes`) and v2 (unified, `memory.max`). Where both appear
//! (hybrid systems) the one that actually carries the memory controller for
//! this process wins: v1. The directory is found through
//! `/proc/self/mountinfo`, so bind-mounted subtrees (containers) resolve too.
//! The default RAM budget reads the limit; `fathom bench --memory-cap`
//! creates its child cgroups below the same directory. Other systems have
//! no cgroups: [`support`] says so and [`own`] returns that as its error.

use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Version {
    V1,
    V2,
}

/// A memory cgroup directory and the hierarchy it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub version: Version,
    pub dir: PathBuf,
}

/// Finds this process's memory cgroup directory from the texts of
/// `/proc/self/cgroup` and `/proc/self/mountinfo` (a pure function, so it is
/// testable with any system's files).
pub fn own_memory_cgroup(proc_cgroup: &str, mountinfo: &str) -> Result<Place, String> {
    let mounts: Vec<Mount> = mountinfo.lines().filter_map(Mount::parse).collect();
    let mut v2_path = None;
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_id), Some(ctrl), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if ctrl.is_empty() {
            v2_path = Some(path);
        } else if ctrl.split(',').any(|c| c == "memory") {
            let m = mounts
                .iter()
                .find(|m| m.fstype == "cgroup" && m.super_opts.split(',').any(|o| o == "memory"))
                .ok_or(
                    "this process is in a v1 memory cgroup but no v1 memory hierarchy is mounted",
                )?;
            return Ok(Place {
                version: Version::V1,
                dir: m.resolve(path)?,
            });
        }
    }
    let path = v2_path
        .ok_or("/proc/self/cgroup names no memory cgroup (no v1 memory line, no v2 0:: line)")?;
    let m = mounts
        .iter()
        .find(|m| m.fstype == "cgroup2")
        .ok_or("no cgroup2 filesystem is mounted")?;
    Ok(Place {
        version: Version::V2,
        dir: m.resolve(path)?,
    })
}

/// The fields of one `/proc/self/mountinfo` line that matter here.
struct Mount {
    root: String,
    point: PathBuf,
    fstype: String,
    super_opts: String,
}

impl Mount {
    /// `36 35 0:30 / /sys/fs/cgroup/memory rw,relatime shared:1 - cgroup cgroup rw,memory`
    fn parse(line: &str) -> Option<Mount> {
        let (pre, post) = line.split_once(" - ")?;
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        Some(Mount {
            root: unescape(pre.get(3)?),
            point: PathBuf::from(unescape(pre.get(4)?)),
            fstype: post.first()?.to_string(),
            super_opts: post.get(2).unwrap_or(&"").to_string(),
        })
    }

    /// The directory of cgroup `path` (relative to the hierarchy's root) under this mount.
    fn resolve(&self, path: &str) -> Result<PathBuf, String> {
        let root = self.root.trim_end_matches('/');
        let rel = path.strip_prefix(root).ok_or_else(|| {
            format!(
                "cgroup {path} is outside the part of the hierarchy mounted at {} (root {})",
                self.point.display(),
                self.root
            )
        })?;
        let rel = rel.trim_start_matches('/');
        Ok(if rel.is_empty() {
            self.point.clone()
        } else {
            self.point.join(rel)
        })
    }
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether this system has memory cgroups.
pub const fn support() -> crate::Support {
    crate::Support::on(cfg!(target_os = "linux"))
}

/// This process's memory cgroup, read from `/proc/self/cgroup` and
/// `/proc/self/mountinfo`.
pub fn own() -> Result<Place, String> {
    if !support().is_available() {
        return Err(format!(
            "memory cgroups are a Linux facility, {}",
            support()
        ));
    }
    let read = |p: &str| std::fs::read_to_string(p).map_err(|e| format!("reading {p}: {e}"));
    own_memory_cgroup(&read("/proc/self/cgroup")?, &read("/proc/self/mountinfo")?)
}

/// This process's memory-cgroup limit (v2 `memory.max`, or v1
/// `memory.limit_in_bytes`), if one is set.
pub fn limit() -> Option<u64> {
    let place = own().ok()?;
    let file = match place.version {
        Version::V1 => "memory.limit_in_bytes",
        Version::V2 => "memory.max",
    };
    let n = std::fs::read_to_string(place.dir.join(file))
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()?;
    // v2 says "max" (not a number) and v1 a huge page-rounded number for "no limit".
    (n < 1 << 60).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MI_V1: &str = "\
25 30 0:23 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
30 25 0:27 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
31 25 0:28 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 25 0:31 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn v1_memory_line_wins_on_hybrid_systems() {
        let cg = "4:memory:/process_api/abc\n1:cpu:/\n0::/\n";
        let p = own_memory_cgroup(cg, MI_V1).unwrap();
        assert_eq!(p.version, Version::V1);
        assert_eq!(
            p.dir,
            PathBuf::from("/sys/fs/cgroup/memory/process_api/abc")
        );
    }

    #[test]
    fn v1_root_cgroup_is_the_mount_point() {
        let p = own_memory_cgroup("4:memory:/\n", MI_V1).unwrap();
        assert_eq!(p.dir, PathBuf::from("/sys/fs/cgroup/memory"));
    }

    #[test]
    fn v2_unified() {
        let mi = "28 22 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let cg = "0::/user.slice/user-1000.slice/session-2.scope\n";
        let p = own_memory_cgroup(cg, mi).unwrap();
        assert_eq!(p.version, Version::V2);
        assert_eq!(
            p.dir,
            PathBuf::from("/sys/fs/cgroup/user.slice/user-1000.slice/session-2.scope")
        );
    }

    #[test]
    fn bind_mounted_subtree_and_escapes() {
        let mi = "40 22 0:26 /docker/x /sys/fs/my\\040cg rw - cgroup2 cgroup2 rw\n";
        let p = own_memory_cgroup("0::/docker/x/inner\n", mi).unwrap();
        assert_eq!(p.dir, PathBuf::from("/sys/fs/my cg/inner"));
        let e = own_memory_cgroup("0::/elsewhere\n", mi).unwrap_err();
        assert!(e.contains("outside"), "{e}");
    }

    #[test]
    fn missing_pieces_are_errors() {
        assert!(own_memory_cgroup("", MI_V1).is_err());
        assert!(own_memory_cgroup("4:memory:/a\n", "").is_err());
        assert!(own_memory_cgroup("0::/a\n", "garbage line\n").is_err());
    }
}
