//! Repository ids: `ORG/NAME` with an optional `@REVISION`.

use crate::error::{HubError, Result};

/// The revision pulled when none is given.
pub const DEFAULT_REVISION: &str = "main";

/// A model repository on the Hub and the revision asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoRef {
    pub org: String,
    pub name: String,
    /// A branch, a tag or a 40-hex-digit commit.
    pub revision: String,
}

impl RepoRef {
    /// Parses `ORG/NAME` or `ORG/NAME@REVISION`.
    pub fn parse(arg: &str) -> Result<RepoRef> {
        let bad = |why: &str| HubError::BadRepoId {
            arg: arg.to_string(),
            why: why.to_string(),
        };
        let (id, revision) = match arg.split_once('@') {
            Some((id, rev)) => (id, rev),
            None => (arg, DEFAULT_REVISION),
        };
        let (org, name) = id.split_once('/').ok_or_else(|| bad("no '/'"))?;
        check_part(org).map_err(|w| bad(&format!("organisation: {w}")))?;
        check_part(name).map_err(|w| bad(&format!("name: {w}")))?;
        check_revision(revision).map_err(|w| bad(&format!("revision: {w}")))?;
        Ok(RepoRef {
            org: org.to_string(),
            name: name.to_string(),
            revision: revision.to_string(),
        })
    }

    /// `ORG/NAME`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.org, self.name)
    }

    /// The cache folder name other Hub clients use: `models--ORG--NAME`.
    pub fn cache_folder(&self) -> String {
        format!("models--{}--{}", self.org, self.name)
    }

    /// Whether the revision is itself a commit id.
    pub fn revision_is_commit(&self) -> bool {
        is_commit(&self.revision)
    }
}

/// Whether `arg` has the shape of a repository id (so a missing directory
/// of that name is reported as "not pulled").
pub fn looks_like_repo(arg: &str) -> bool {
    !arg.starts_with('.') && !arg.starts_with('/') && RepoRef::parse(arg).is_ok()
}

/// A 40-digit lowercase hex commit id.
pub fn is_commit(s: &str) -> bool {
    s.len() == 40
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn check_part(s: &str) -> std::result::Result<(), String> {
    if s.is_empty() || s.len() > 96 {
        return Err("1 to 96 characters".into());
    }
    if s.starts_with(['.', '-']) || s.ends_with('.') || s.contains("..") || s.contains("--") {
        return Err(format!("{s:?} has a leading '.' or '-', '..' or '--'"));
    }
    match s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        Some(c) => Err(format!(
            "{c:?} is not allowed (letters, digits, '-', '_', '.')"
        )),
        None => Ok(()),
    }
}

fn check_revision(s: &str) -> std::result::Result<(), String> {
    if s.is_empty() || s.len() > 200 {
        return Err("1 to 200 characters".into());
    }
    if s.starts_with('/') || s.ends_with('/') || s.split('/').any(|p| p.is_empty() || p == "..") {
        return Err(format!("{s:?} has an empty or '..' component"));
    }
    match s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/')))
    {
        Some(c) => Err(format!("{c:?} is not allowed")),
        None => Ok(()),
    }
}

/// Percent-encodes a revision for one URL path segment (`/` → `%2F`).
pub(crate) fn encode_revision(rev: &str) -> String {
    rev.replace('/', "%2F")
}

/// Checks a file path from a listing: relative, `/`-separated, no empty,
/// `.` or `..` component, no backslash or control character, bounded.
pub(crate) fn check_file_path(p: &str) -> std::result::Result<(), String> {
    if p.is_empty() || p.len() > 1024 {
        return Err("1 to 1024 bytes".into());
    }
    if p.starts_with('/') || p.contains('\\') || p.chars().any(char::is_control) {
        return Err("absolute, or holds a backslash or control character".into());
    }
    if p.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err("has an empty, '.' or '..' component".into());
    }
    if p.split('/').count() > 32 {
        return Err("more than 32 levels deep".into());
    }
    Ok(())
}

/// Percent-encodes a file path for a URL (each component; `/` kept).
pub(crate) fn encode_path(p: &str) -> String {
    let mut out = String::with_capacity(p.len());
    for b in p.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ids_and_revisions() {
        let r = RepoRef::parse("moonshotai/Kimi-K3").unwrap();
        assert_eq!((r.org.as_str(), r.name.as_str()), ("moonshotai", "Kimi-K3"));
        assert_eq!(r.revision, "main");
        assert_eq!(r.cache_folder(), "models--moonshotai--Kimi-K3");
        let r = RepoRef::parse("a/b@refs/pr/1").unwrap();
        assert_eq!(r.revision, "refs/pr/1");
        assert_eq!(encode_revision(&r.revision), "refs%2Fpr%2F1");
        assert!(
            RepoRef::parse("a/b@0123456789abcdef0123456789abcdef01234567")
                .unwrap()
                .revision_is_commit()
        );
    }

    #[test]
    fn refuses_bad_ids() {
        for bad in [
            "k3",
            "a/b/c",
            "/abs/path",
            "./k3",
            "a/..",
            "a/b@",
            "a/b@x/../y",
            "a b/c",
            "a/b@x y",
        ] {
            assert!(RepoRef::parse(bad).is_err(), "{bad}");
            assert!(!looks_like_repo(bad), "{bad}");
        }
        let e = RepoRef::parse("k3").unwrap_err().to_string();
        assert_eq!(
            e,
            "\"k3\" is not a Hub repository id: give ORG/NAME or ORG/NAME@REVISION (no '/')"
        );
    }

    #[test]
    fn file_paths() {
        assert!(check_file_path("model-00001-of-000002.safetensors").is_ok());
        assert!(check_file_path("original/tokenizer.model").is_ok());
        for bad in ["", "/etc/passwd", "a/../b", "a//b", "./a", "a\\b", "a\nb"] {
            assert!(check_file_path(bad).is_err(), "{bad:?}");
        }
        assert_eq!(encode_path("a b/c+d.json"), "a%20b/c%2Bd.json");
    }
}
