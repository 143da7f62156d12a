//! A memory cgroup per measured process, so "larger than RAM" is simulated
//! honestly: the page cache a process pulls in is charged to its cgroup, so a
//! 10 GB model under a 4 GB cap really cannot sit in RAM.
//!
//! The cgroup is created as a child of fathom's own memory cgroup (which is
//! where a non-root user can be delegated rights, and which keeps the
//! experiment inside whatever limits the caller already lives under). Only the
//! measured child process ever enters it: it moves itself in between `fork`
//! and `exec` (a `pre_exec` hook writing `0` to `cgroup.procs`), so no byte it
//! allocates is charged elsewhere, and fathom itself never changes cgroup.
//! After the process exits its peak usage is read and the directory removed.
//!
//! Both hierarchies are handled: v1 (`memory.limit_in_bytes`,
//! `memory.max_usage_in_bytes`) and v2 (`memory.max`, `memory.peak`); which
//! one, and where fathom's own cgroup is, comes from [`fathom_platform::cgroup`]
//! (Linux only: elsewhere `--memory-cap` says the system has no cgroups).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result, bail};

pub use fathom_platform::cgroup::{Place, Version, own_memory_cgroup};

/// This process's memory cgroup, read from `/proc`.
pub fn own() -> Result<Place> {
    fathom_platform::cgroup::own().map_err(|e| anyhow::anyhow!("--memory-cap: {e}"))
}

/// A child memory cgroup with a limit, removed on [`Child::remove`] or drop.
#[derive(Debug)]
pub struct Child {
    pub place: Place,
    /// `cgroup.procs` of the new cgroup, ready for the async-signal-safe hook.
    procs: CString,
    removed: bool,
}

/// What a finished process's cgroup recorded.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Usage {
    /// Peak memory charged (RSS + page cache + kernel), if the kernel reports it.
    pub peak_bytes: Option<u64>,
    /// OOM kills inside the cgroup, if reported.
    pub oom_kills: Option<u64>,
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

impl Child {
    /// Creates `<parent>/fathom-bench-<pid>-<n>` with a memory limit of `limit` bytes.
    pub fn create(parent: &Place, limit: u64) -> Result<Child> {
        let name = format!(
            "fathom-bench-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let dir = parent.dir.join(name);
        std::fs::create_dir(&dir).map_err(|e| {
            anyhow::anyhow!(
                "--memory-cap: cannot create memory cgroup {}: {e}; it needs write access to this process's memory cgroup {} (root, or a delegated cgroup v2 subtree) on a writable cgroupfs",
                dir.display(),
                parent.dir.display()
            )
        })?;
        let procs = CString::new(dir.join("cgroup.procs").as_os_str().as_bytes())
            .context("cgroup path holds a NUL byte")?;
        let mut child = Child {
            place: Place {
                version: parent.version,
                dir,
            },
            procs,
            removed: false,
        };
        child.set_limit(parent, limit)?;
        Ok(child)
    }

    fn set_limit(&mut self, parent: &Place, limit: u64) -> Result<()> {
        let d = &self.place.dir;
        match self.place.version {
            Version::V1 => {
                write(&d.join("memory.limit_in_bytes"), limit)?;
                // With swap on, memory+swap must be capped too or the cap leaks into swap.
                let memsw = d.join("memory.memsw.limit_in_bytes");
                if memsw.exists() {
                    let _ = write(&memsw, limit);
                }
            }
            Version::V2 => {
                if !d.join("memory.max").exists() {
                    // The controller must be enabled for the parent's children;
                    // v2 refuses that while the parent itself holds processes.
                    let ctl = parent.dir.join("cgroup.subtree_control");
                    std::fs::write(&ctl, "+memory").map_err(|e| {
                        anyhow::anyhow!(
                            "--memory-cap: the memory controller is not enabled below {} and enabling it failed ({e}); run fathom bench from a cgroup with memory delegated to its children (e.g. systemd-run --scope -p Delegate=yes)",
                            parent.dir.display()
                        )
                    })?;
                }
                write(&d.join("memory.max"), limit)?;
                let swap = d.join("memory.swap.max");
                if swap.exists() {
                    let _ = write(&swap, 0);
                }
            }
        }
        Ok(())
    }

    /// Makes `cmd`'s process move itself into this cgroup before `exec`, so
    /// nothing it does is charged anywhere else.
    pub fn attach_on_exec(&self, cmd: &mut Command) {
        // "0" means the writing process itself, in v1 and v2 alike.
        fathom_platform::process::write_before_exec(cmd, self.procs.clone(), b"0");
    }

    /// Peak usage and OOM kills recorded so far.
    pub fn usage(&self) -> Usage {
        let d = &self.place.dir;
        let (peak, events, key) = match self.place.version {
            Version::V1 => (
                "memory.max_usage_in_bytes",
                "memory.oom_control",
                "oom_kill",
            ),
            Version::V2 => ("memory.peak", "memory.events", "oom_kill"),
        };
        let peak_bytes = std::fs::read_to_string(d.join(peak))
            .ok()
            .and_then(|s| s.trim().parse().ok());
        let oom_kills = std::fs::read_to_string(d.join(events)).ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
        });
        Usage {
            peak_bytes,
            oom_kills,
        }
    }

    /// Removes the (now empty) cgroup. The kernel may need a moment after the
    /// last process exits before `rmdir` succeeds, so it retries briefly.
    pub fn remove(mut self) -> Result<()> {
        self.removed = true;
        let mut last = None;
        for _ in 0..50 {
            match std::fs::remove_dir(&self.place.dir) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) => last = Some(e),
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        bail!(
            "cannot remove memory cgroup {}: {}",
            self.place.dir.display(),
            last.map(|e| e.to_string()).unwrap_or_default()
        )
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if !self.removed {
            let _ = std::fs::remove_dir(&self.place.dir);
        }
    }
}

fn write(path: &Path, v: u64) -> Result<()> {
    std::fs::write(path, v.to_string())
        .with_context(|| format!("--memory-cap: writing {v} to {}", path.display()))
}
