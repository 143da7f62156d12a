//! What the numbers were measured on, recorded with them: a ratio is only
//! comparable to another taken on a similar machine and load.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpu_model: Option<String>,
    pub logical_cpus: usize,
    pub ram_bytes: Option<u64>,
    pub kernel: Option<String>,
    pub os: Option<String>,
    pub disk: Disk,
    /// The load averages when the bench started (`/proc/loadavg` on
    /// Linux): what else the machine was doing.
    pub loadavg: Option<String>,
    /// The bench process's own memory-cgroup limit, if any.
    pub cgroup_limit_bytes: Option<u64>,
}

/// The filesystem and block device holding the model.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Disk {
    pub mount_point: Option<String>,
    pub device: Option<String>,
    pub fstype: Option<String>,
    /// `lsblk -dno NAME,MODEL,SIZE,ROTA,TRAN DEVICE`, where lsblk exists.
    pub lsblk: Option<String>,
}

/// Describes this machine, with the disk under `model_dir`.
pub fn describe(model_dir: &Path) -> Machine {
    use fathom_platform::{host, memory};
    Machine {
        cpu_model: host::cpu_model(),
        logical_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        ram_bytes: memory::total(),
        kernel: host::kernel_release(),
        os: host::os_release(),
        disk: disk_of(model_dir),
        loadavg: host::load_average(),
        cgroup_limit_bytes: memory::limit(),
    }
}

fn disk_of(dir: &Path) -> Disk {
    let Ok(dir) = dir.canonicalize() else {
        return Disk::default();
    };
    let Some((device, point, fstype)) = fathom_platform::host::mount_of(&dir) else {
        return Disk::default();
    };
    let lsblk = device
        .starts_with("/dev/")
        .then(|| {
            std::process::Command::new("lsblk")
                .args(["-dno", "NAME,MODEL,SIZE,ROTA,TRAN", &device])
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        })
        .flatten();
    Disk {
        mount_point: Some(point),
        device: Some(device),
        fstype: Some(fstype),
        lsblk,
    }
}

/// Now, as `2026-05-04T12:34:56Z`.
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    utc_from_unix(secs)
}

/// Formats Unix seconds as an RFC 3339 UTC time (proleptic Gregorian calendar).
pub fn utc_from_unix(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Days since 1970-01-01 → civil date, counting in 400-year eras from 0000-03-01.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(utc_from_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_from_unix(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_from_unix(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(utc_from_unix(4_107_542_399), "2100-02-28T23:59:59Z");
    }
}
