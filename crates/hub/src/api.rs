//! The repository listing: `GET {endpoint}/api/models/{org}/{name}/revision/{rev}?blobs=true`.

use serde::{Deserialize, Serialize};

use crate::error::{HubError, Result};
use crate::http::Http;
use crate::repo::{RepoRef, check_file_path, encode_path, encode_revision, is_commit};
use crate::verify::{Expected, is_hex};

/// Largest listing body read (a repository of 100,000 files fits).
const MAX_LISTING: u64 = 64 << 20;
/// Most files a listing may name.
const MAX_FILES: usize = 100_000;
/// Largest file size believed (1 PiB).
const MAX_FILE: u64 = 1 << 50;

/// One file of a revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteFile {
    /// Path in the repository, `/`-separated.
    pub path: String,
    pub size: u64,
    /// An LFS file's SHA-256 (64 hex digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The git blob id (40 hex digits), when listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blob_id: Option<String>,
}

impl RemoteFile {
    /// What the downloaded bytes must hash to.
    pub fn expected(&self) -> Expected {
        match &self.sha256 {
            Some(s) => Expected::Sha256(s.clone()),
            None => Expected::GitBlob(self.blob_id.clone()),
        }
    }

    /// The name its bytes take in `blobs/`: the Hub's ETag for it (the
    /// SHA-256 for LFS files, the git blob id otherwise), when known
    /// before the download.
    pub fn blob_name(&self) -> Option<&str> {
        self.sha256.as_deref().or(self.blob_id.as_deref())
    }
}

/// A revision's commit and files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listing {
    /// `ORG/NAME`.
    pub repo: String,
    pub commit: String,
    pub files: Vec<RemoteFile>,
}

impl Listing {
    pub fn file(&self, path: &str) -> Option<&RemoteFile> {
        self.files.iter().find(|f| f.path == path)
    }
}

#[derive(Deserialize)]
struct RawInfo {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<RawSibling>,
}

#[derive(Deserialize)]
struct RawSibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<RawLfs>,
}

#[derive(Deserialize)]
struct RawLfs {
    sha256: String,
    size: u64,
}

/// The resolve URL of a file at a commit.
pub(crate) fn file_url(endpoint: &str, repo: &str, commit: &str, path: &str) -> String {
    format!("{endpoint}/{repo}/resolve/{commit}/{}", encode_path(path))
}

/// Fetches and checks the listing of `repo` at its revision.
pub(crate) fn fetch_listing(http: &Http, repo: &RepoRef) -> Result<Listing> {
    let what = format!("listing of {}@{}", repo.id(), repo.revision);
    let url = format!(
        "{}/api/models/{}/revision/{}?blobs=true",
        http.endpoint(),
        repo.id(),
        encode_revision(&repo.revision)
    );
    let (_, body) = http.get_small(&what, &url, MAX_LISTING)?;
    parse_listing(&what, &repo.id(), &body)
}

/// Checks a listing body: a commit id, bounded sizes, safe unique paths,
/// LFS digests of the right shape.
pub(crate) fn parse_listing(what: &str, repo: &str, body: &[u8]) -> Result<Listing> {
    let raw: RawInfo = serde_json::from_slice(body)
        .map_err(|e| HubError::protocol(what, format!("listing is not the expected JSON: {e}")))?;
    let commit = raw
        .sha
        .filter(|s| is_commit(s))
        .ok_or_else(|| HubError::protocol(what, "no 40-hex-digit commit (\"sha\")"))?;
    if raw.siblings.len() > MAX_FILES {
        return Err(HubError::protocol(
            what,
            format!("{} files, more than {MAX_FILES}", raw.siblings.len()),
        ));
    }
    let mut files = Vec::with_capacity(raw.siblings.len());
    let mut seen = std::collections::HashSet::new();
    for s in raw.siblings {
        let p = &s.rfilename;
        check_file_path(p).map_err(|w| HubError::protocol(what, format!("file {p:?}: {w}")))?;
        if !seen.insert(p.clone()) {
            return Err(HubError::protocol(what, format!("file {p:?} listed twice")));
        }
        let bad = |w: &str| HubError::protocol(what, format!("file {p:?}: {w}"));
        let (size, sha256) = match s.lfs {
            Some(l) => {
                let sha = l.sha256.to_ascii_lowercase();
                if !is_hex(&sha, 64) {
                    return Err(bad("LFS sha256 is not 64 hex digits"));
                }
                (l.size, Some(sha))
            }
            None => (
                s.size
                    .ok_or_else(|| bad("no size (was ?blobs=true honoured?)"))?,
                None,
            ),
        };
        if size > MAX_FILE {
            return Err(bad("size over 1 PiB"));
        }
        let blob_id = s
            .blob_id
            .map(|b| b.to_ascii_lowercase())
            .filter(|b| is_hex(b, 40));
        files.push(RemoteFile {
            path: p.clone(),
            size,
            sha256,
            blob_id,
        });
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(Listing {
        repo: repo.to_string(),
        commit,
        files,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_listing() {
        let sha = "a".repeat(64);
        let body = format!(
            r#"{{"id":"o/n","sha":"{}","siblings":[
              {{"rfilename":"config.json","size":12,"blobId":"{}"}},
              {{"rfilename":"model.safetensors","size":99,"lfs":{{"sha256":"{sha}","size":1000,"pointerSize":134}}}}]}}"#,
            "1".repeat(40),
            "b".repeat(40)
        );
        let l = parse_listing("t", "o/n", body.as_bytes()).unwrap();
        assert_eq!(l.commit, "1".repeat(40));
        assert_eq!(l.files[0].size, 12);
        assert_eq!(
            l.files[0].expected(),
            Expected::GitBlob(Some("b".repeat(40)))
        );
        assert_eq!(l.files[1].size, 1000);
        assert_eq!(l.files[1].blob_name(), Some(sha.as_str()));
    }

    #[test]
    fn refuses_unsafe_listings() {
        let c = "1".repeat(40);
        for (siblings, want) in [
            (
                r#"[{"rfilename":"../x","size":1}]"#,
                "file \"../x\": has an empty, '.' or '..' component",
            ),
            (
                r#"[{"rfilename":"a","size":1},{"rfilename":"a","size":1}]"#,
                "file \"a\" listed twice",
            ),
            (
                r#"[{"rfilename":"a"}]"#,
                "file \"a\": no size (was ?blobs=true honoured?)",
            ),
            (
                r#"[{"rfilename":"a","lfs":{"sha256":"zz","size":1}}]"#,
                "file \"a\": LFS sha256 is not 64 hex digits",
            ),
        ] {
            let body = format!(r#"{{"sha":"{c}","siblings":{siblings}}}"#);
            let e = parse_listing("t", "o/n", body.as_bytes())
                .unwrap_err()
                .to_string();
            assert_eq!(e, format!("t: unexpected answer from the Hub: {want}"));
        }
        let e = parse_listing("t", "o/n", br#"{"sha":"main","siblings":[]}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "t: unexpected answer from the Hub: no 40-hex-digit commit (\"sha\")"
        );
    }
}
