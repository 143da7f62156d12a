//! The digests the Hub lists: an LFS file's SHA-256, and a small file's
//! git blob id (SHA-1 of `blob {len}\0` followed by the bytes).

use sha1::Sha1;
use sha2::{Digest, Sha256};

/// What a file's bytes must hash to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    /// An LFS file: SHA-256 of the bytes, 64 lowercase hex digits.
    Sha256(String),
    /// A small file kept in git: its blob id, when the listing gives one.
    GitBlob(Option<String>),
}

impl Expected {
    pub(crate) fn algo(&self) -> &'static str {
        match self {
            Expected::Sha256(_) => "SHA-256",
            Expected::GitBlob(_) => "git blob id",
        }
    }

    /// The listed digest, if any.
    pub fn digest(&self) -> Option<&str> {
        match self {
            Expected::Sha256(s) => Some(s),
            Expected::GitBlob(s) => s.as_deref(),
        }
    }
}

/// A running hash of a file of known length in the form its
/// [`Expected`] needs.
pub(crate) enum Hasher {
    Sha256(Sha256),
    Git(Sha1),
}

impl Hasher {
    pub(crate) fn new(expected: &Expected, len: u64) -> Hasher {
        match expected {
            Expected::Sha256(_) => Hasher::Sha256(Sha256::new()),
            Expected::GitBlob(_) => {
                let mut h = Sha1::new();
                h.update(format!("blob {len}\0").as_bytes());
                Hasher::Git(h)
            }
        }
    }

    pub(crate) fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(bytes),
            Hasher::Git(h) => h.update(bytes),
        }
    }

    pub(crate) fn hex(self) -> String {
        match self {
            Hasher::Sha256(h) => hex(&h.finalize()),
            Hasher::Git(h) => hex(&h.finalize()),
        }
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of `bytes` in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// The git blob id of `bytes` in hex.
pub fn git_blob_id(bytes: &[u8]) -> String {
    let mut h = Hasher::new(&Expected::GitBlob(None), bytes.len() as u64);
    h.update(bytes);
    h.hex()
}

/// Whether `s` is `n` lowercase hex digits.
pub(crate) fn is_hex(s: &str, n: usize) -> bool {
    s.len() == n
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn git_blob_ids_match_git() {
        // `printf 'hello\n' | git hash-object --stdin` and the empty blob.
        assert_eq!(
            git_blob_id(b"hello\n"),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
        assert_eq!(git_blob_id(b""), "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391");
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
