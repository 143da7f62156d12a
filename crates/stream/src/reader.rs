//! Positional reads of whole experts, bypassing the page cache.
//!
//! The enclosing 4 KiB-aligned range of an expert's span is read into an
//! aligned buffer with the page cache bypassed (`O_DIRECT` on Linux,
//! `F_NOCACHE` on macOS: [`fathom_platform::io::open_uncached`]), so the
//! bytes come from the device, are not cached twice, and are not charged to
//! the memory cgroup as page cache. Where the filesystem refuses (tmpfs,
//! some overlays) the file is read buffered and the range dropped from the
//! page cache right after.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use fathom_platform::io::{Advice, advise, open_uncached};

use fathom_model::experts::{ExpertLoc, ExpertShapes, ExpertWeights};
use fathom_weights::{AlignedBuf, IO_ALIGN};

/// One shard opened for expert reads.
pub struct ShardReader {
    file: File,
    len: u64,
    direct: bool,
}

impl ShardReader {
    /// Opens `path` uncached if `want_direct` and the filesystem allows it.
    pub fn open(path: &Path, want_direct: bool) -> std::io::Result<Self> {
        let len = std::fs::metadata(path)?.len();
        if want_direct {
            if let Ok(file) = open_uncached(path) {
                // Probe: some filesystems accept the flag but fail the read.
                let mut probe = AlignedBuf::zeroed(IO_ALIGN);
                if file.read_at(&mut probe, 0).is_ok() {
                    return Ok(ShardReader {
                        file,
                        len,
                        direct: true,
                    });
                }
            }
        }
        let file = File::open(path)?;
        // A refused hint only leaves read-ahead on.
        advise(&file, 0, 0, Advice::Random);
        Ok(ShardReader {
            file,
            len,
            direct: false,
        })
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Reads `[offset, offset + len)` (and the alignment slack around it) into
    /// an aligned buffer. Returns the buffer and the file offset of its first byte.
    pub fn read_span(&self, offset: u64, len: u64) -> std::io::Result<(AlignedBuf, u64)> {
        let a = IO_ALIGN as u64;
        let start = offset / a * a;
        let end = (offset + len).div_ceil(a) * a;
        let mut buf = AlignedBuf::for_reading((end - start) as usize);
        let need = (offset + len - start) as usize;
        let mut got = 0usize;
        while got < need {
            // A direct read must stay aligned: read whole remaining aligned blocks.
            let n = self.file.read_at(&mut buf[got..], start + got as u64)?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("shard ends at {} before byte {}", self.len, offset + len),
                ));
            }
            got += n;
        }
        if !self.direct {
            // A refused hint only leaves the range cached.
            advise(&self.file, start, end - start, Advice::DontNeed);
        }
        Ok((buf, start))
    }
}

/// Reads one expert with a single positional read of its span (or one per
/// tensor if a checkpoint scatters them).
pub fn read_expert(
    shapes: &ExpertShapes,
    shards: &[ShardReader],
    loc: &ExpertLoc,
) -> std::io::Result<(ExpertWeights, u64)> {
    loc.read_with(shapes, |shard, off, len| shards[shard].read_span(off, len))
}
