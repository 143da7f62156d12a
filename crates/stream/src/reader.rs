//! Positional reads of whole experts, bypassing the page cache.
//!
//! The enclosing 4 KiB-aligned range of an expert's span is read into an
//! aligned buffer with the page cache bypassed (`O_DIRECT` on Linux,
//! `F_NOCACHE` on macOS: [`fathom_platform::io::open_uncached`]), so the
//! bytes come from the device, are not cached twice, and are not charged to
//! the memory cgroup as page cache. Where the filesystem refuses (tmpfs,
//! some overlays) the file is read buffered and the range dropped from the
//! page cache right after.
//!
//! A shard that is not on disk (opened through the checkpoint's remote
//! source) is read span by span through that source: a demand read may
//! fetch a span, a prefetch guess only reads spans stored locally.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use fathom_platform::io::{Advice, advise, open_uncached};

use fathom_model::experts::{ExpertLoc, ExpertShapes, ExpertWeights};
use fathom_weights::{AlignedBuf, IO_ALIGN, RemoteShards, ShardData, ShardFile};

/// One shard opened for expert reads: a local file, or a shard read
/// through the checkpoint's remote source.
pub struct ShardReader {
    file: Option<File>,
    remote: Option<(Arc<dyn RemoteShards>, String)>,
    len: u64,
    direct: bool,
}

/// Why an expert read gave no expert.
#[derive(Debug)]
pub enum ReadError {
    Io(std::io::Error),
    /// A read that may not fetch found the span not stored locally.
    NotLocal,
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
}

impl ShardReader {
    /// Opens a checkpoint's shard: its file (uncached if `want_direct`),
    /// or its remote source.
    pub fn for_shard(shard: &ShardFile, want_direct: bool) -> std::io::Result<Self> {
        match &shard.data {
            ShardData::Local(_) => Self::open(&shard.path, want_direct),
            ShardData::Remote(r) => Ok(ShardReader {
                file: None,
                remote: Some((r.clone(), shard.name.clone())),
                len: shard.len,
                direct: false,
            }),
        }
    }

    /// Opens `path` uncached if `want_direct` and the filesystem allows it.
    pub fn open(path: &Path, want_direct: bool) -> std::io::Result<Self> {
        let len = std::fs::metadata(path)?.len();
        if want_direct {
            if let Ok(file) = open_uncached(path) {
                // Probe: some filesystems accept the flag but fail the read.
                let mut probe = AlignedBuf::zeroed(IO_ALIGN);
                if file.read_at(&mut probe, 0).is_ok() {
                    return Ok(ShardReader {
                        file: Some(file),
                        remote: None,
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
            file: Some(file),
            remote: None,
            len,
            direct: false,
        })
    }

    /// Whether its bytes come through a remote source.
    pub fn is_remote(&self) -> bool {
        self.remote.is_some()
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// As [`Self::read_span`]; a remote shard's span comes from local
    /// storage, else is fetched only when `fetch` (else [`ReadError::NotLocal`]).
    pub fn read_span_as(
        &self,
        offset: u64,
        len: u64,
        fetch: bool,
    ) -> Result<(AlignedBuf, u64), ReadError> {
        let Some((src, name)) = &self.remote else {
            return Ok(self.read_span(offset, len)?);
        };
        match src.span(name, offset, len, fetch) {
            Ok(Some(b)) if b.len() as u64 == len => Ok((AlignedBuf::from_slice(&b), offset)),
            Ok(Some(b)) => Err(ReadError::Io(std::io::Error::other(format!(
                "{name}: {} bytes came back for a span of {len}",
                b.len()
            )))),
            Ok(None) => Err(ReadError::NotLocal),
            Err(e) => Err(ReadError::Io(std::io::Error::other(e))),
        }
    }

    /// Reads `[offset, offset + len)` (and the alignment slack around it) into
    /// an aligned buffer. Returns the buffer and the file offset of its first
    /// byte. A remote shard's span is fetched when not stored locally.
    pub fn read_span(&self, offset: u64, len: u64) -> std::io::Result<(AlignedBuf, u64)> {
        let Some(file) = &self.file else {
            return match self.read_span_as(offset, len, true) {
                Ok(r) => Ok(r),
                Err(ReadError::Io(e)) => Err(e),
                Err(ReadError::NotLocal) => Err(std::io::Error::other("span not stored")),
            };
        };
        let a = IO_ALIGN as u64;
        let start = offset / a * a;
        let end = (offset + len).div_ceil(a) * a;
        let mut buf = AlignedBuf::for_reading((end - start) as usize);
        let need = (offset + len - start) as usize;
        let mut got = 0usize;
        while got < need {
            // A direct read must stay aligned: read whole remaining aligned blocks.
            let n = file.read_at(&mut buf[got..], start + got as u64)?;
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
            advise(file, start, end - start, Advice::DontNeed);
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

/// As [`read_expert`]; spans of remote shards are fetched only when
/// `fetch` (a demand read), else must be stored locally
/// ([`ReadError::NotLocal`] when not).
pub fn read_expert_as(
    shapes: &ExpertShapes,
    shards: &[ShardReader],
    loc: &ExpertLoc,
    fetch: bool,
) -> Result<(ExpertWeights, u64), ReadError> {
    loc.read_with(shapes, |shard, off, len| {
        shards[shard].read_span_as(off, len, fetch)
    })
}
