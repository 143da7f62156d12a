//! Every way getting a model can fail, each with what to do about it.

use std::path::PathBuf;

/// An error of the Hub client, the cache or the span store. Each message
/// names the repository, file, flag or path involved and the fix.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// `--model X` where X is neither a directory nor a pulled repository.
    #[error("no such directory: {arg}{hint}")]
    NoSuchDir { arg: String, hint: String },

    /// A repository id that does not parse.
    #[error("{arg:?} is not a Hub repository id: give ORG/NAME or ORG/NAME@REVISION ({why})")]
    BadRepoId { arg: String, why: String },

    /// The Hub refused or does not have the repository or revision.
    #[error("{what}: {why}")]
    Refused { what: String, why: String },

    /// The listing or a header broke the Hub's documented shapes.
    #[error("{what}: unexpected answer from the Hub: {why}")]
    Protocol { what: String, why: String },

    /// A Range answer that is not exactly the bytes asked for.
    #[error(
        "{file}: asked for bytes {start}-{end} and the server answered {got}: refused (nothing written)"
    )]
    BadRange {
        file: String,
        start: u64,
        end: u64,
        got: String,
    },

    /// The server's ETag for a file differs from the listing's: the file
    /// changed under the same name.
    #[error("{file}: the server now has other contents (ETag {got}, listed as {expected})")]
    Changed {
        file: String,
        expected: String,
        got: String,
    },

    /// Downloaded bytes that do not hash to the Hub's digest. Nothing
    /// with these bytes is kept.
    #[error(
        "{file}: downloaded bytes have {algo} {got}, the Hub lists {expected}: discarded; run the command again"
    )]
    Digest {
        file: String,
        algo: &'static str,
        expected: String,
        got: String,
    },

    /// Transient failures that outlasted every retry.
    #[error("{what}: gave up after {tries} tries: {last}")]
    GaveUp {
        what: String,
        tries: u32,
        last: String,
    },

    /// A 429 whose Retry-After is longer than fathom waits.
    #[error(
        "{what}: the server asks to wait {secs} s (more than the {max} s fathom waits): try again later"
    )]
    TooLongWait { what: String, secs: u64, max: u64 },

    /// The disk (or the process's file-size limit) is full.
    #[error(
        "cannot write {path}: no space left (disk full or file-size limit): free {need} more bytes there, or pull into another disk with --dir; what was written so far is kept and resumed"
    )]
    DiskFull { path: PathBuf, need: u64 },

    /// Another process holds the lock on a file being downloaded.
    #[error(
        "{path} is locked by another download (fathom pull or another Hub client): wait for it or stop it"
    )]
    Locked { path: PathBuf },

    /// A span store request that cannot be met.
    #[error("{0}")]
    Store(String),

    /// The pull was stopped because another file failed.
    #[error("stopped")]
    Stopped,

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl HubError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if is_disk_full(&source) {
            return HubError::DiskFull { path, need: 0 };
        }
        HubError::Io { path, source }
    }

    pub(crate) fn protocol(what: impl Into<String>, why: impl Into<String>) -> Self {
        HubError::Protocol {
            what: what.into(),
            why: why.into(),
        }
    }
}

/// ENOSPC, EDQUOT or EFBIG (a file-size limit): the write cannot go on.
pub(crate) fn is_disk_full(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), StorageFull | QuotaExceeded | FileTooLarge)
}

pub type Result<T, E = HubError> = std::result::Result<T, E>;
