//! Where pulled files live. Either the Hub cache other clients share:
//!
//! ```text
//! $HF_HUB_CACHE/models--ORG--NAME/blobs/<etag>             the bytes
//! $HF_HUB_CACHE/models--ORG--NAME/snapshots/<commit>/<path> relative symlink to ../../blobs/<etag>
//! $HF_HUB_CACHE/models--ORG--NAME/refs/<branch>             the commit
//! $HF_HUB_CACHE/.locks/models--ORG--NAME/<etag>.lock        held while a blob is written
//! ```
//!
//! or a model directory of its own (`fathom pull --dir D`): `D/<path>` as
//! relative symlinks to `D/.fathom/blobs/<etag>`, and `D/.fathom/source.json`
//! naming the repository and commit. A blob appears under its final name
//! only once its bytes hash to the Hub's digest, so a name in `blobs/`
//! means verified bytes.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::hub_cache;
use crate::error::{HubError, Result};
use crate::repo::{RepoRef, is_commit, looks_like_repo};

/// The folders of one pull.
#[derive(Debug, Clone)]
pub struct Layout {
    pub blobs: PathBuf,
    /// The directory a model is loaded from.
    pub snapshot: PathBuf,
    pub locks: PathBuf,
    /// `refs/` (the shared cache only).
    pub refs: Option<PathBuf>,
    /// `source.json` (a `--dir` directory only).
    pub source: Option<PathBuf>,
}

/// Which repository and commit a `--dir` directory holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    pub repo: String,
    pub commit: String,
}

impl Layout {
    /// The shared cache's folders for `repo` at `commit`.
    pub fn cache(root: &Path, repo: &RepoRef, commit: &str) -> Layout {
        let dir = root.join(repo.cache_folder());
        Layout {
            blobs: dir.join("blobs"),
            snapshot: dir.join("snapshots").join(commit),
            locks: root.join(".locks").join(repo.cache_folder()),
            refs: Some(dir.join("refs")),
            source: None,
        }
    }

    /// A model directory of its own at `d`.
    pub fn dir(d: &Path) -> Layout {
        let own = d.join(".fathom");
        Layout {
            blobs: own.join("blobs"),
            snapshot: d.to_path_buf(),
            locks: own.join("locks"),
            refs: None,
            source: Some(own.join("source.json")),
        }
    }

    pub fn blob(&self, name: &str) -> PathBuf {
        self.blobs.join(name)
    }

    pub fn partial(&self, name: &str) -> PathBuf {
        self.blobs.join(format!("{name}.incomplete"))
    }

    pub fn lock(&self, name: &str) -> PathBuf {
        self.locks.join(format!("{name}.lock"))
    }

    /// `snapshot/<path>` → the blob, as a relative symlink (replaced
    /// atomically if it pointed elsewhere).
    pub fn link(&self, path: &str, blob_name: &str) -> Result<()> {
        let at = self.snapshot.join(path);
        let parent = at.parent().unwrap_or(&self.snapshot);
        std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
        let target = relative(parent, &self.blob(blob_name));
        if std::fs::read_link(&at).is_ok_and(|t| t == target) {
            return Ok(());
        }
        let tmp = parent.join(format!(
            ".{}.fathom-link",
            at.file_name().unwrap_or_default().to_string_lossy()
        ));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&target, &tmp).map_err(|e| HubError::io(&tmp, e))?;
        std::fs::rename(&tmp, &at).map_err(|e| HubError::io(&at, e))
    }

    /// Records `refs/<revision>` = commit (the shared cache; a commit
    /// revision needs no ref) or `source.json` (a `--dir` directory).
    pub fn record(&self, repo: &RepoRef, commit: &str) -> Result<()> {
        if let Some(refs) = &self.refs
            && !repo.revision_is_commit()
        {
            write_atomic(&refs.join(&repo.revision), commit.as_bytes())?;
        }
        if let Some(src) = &self.source {
            let s = Source {
                repo: repo.id(),
                commit: commit.to_string(),
            };
            let text = serde_json::to_vec_pretty(&s).expect("serialisable");
            write_atomic(src, &text)?;
        }
        Ok(())
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let parent = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| HubError::io(parent, e))?;
    let tmp = parent.join(format!(
        ".{}.tmp{}",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes).map_err(|e| HubError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| HubError::io(path, e))
}

/// The path from directory `from` to `to`, both under one root, as `../`
/// steps and the rest of `to`.
fn relative(from: &Path, to: &Path) -> PathBuf {
    let f: Vec<_> = from.components().collect();
    let t: Vec<_> = to.components().collect();
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..f.len() {
        out.push("..");
    }
    for c in &t[common..] {
        out.push(c);
    }
    out
}

/// The snapshot of `repo` in the cache at `root`, if pulled: the revision
/// if it is a commit, else the commit `refs/<revision>` names; present
/// when that snapshot holds a `config.json`.
pub fn pulled_snapshot(root: &Path, repo: &RepoRef) -> Option<PathBuf> {
    let dir = root.join(repo.cache_folder());
    let commit = if repo.revision_is_commit() {
        repo.revision.clone()
    } else {
        let text = std::fs::read_to_string(dir.join("refs").join(&repo.revision)).ok()?;
        let c = text.trim().to_string();
        is_commit(&c).then_some(c)?
    };
    let snap = dir.join("snapshots").join(commit);
    snap.join("config.json").is_file().then_some(snap)
}

/// What `--model ARG` names: an existing path as it is; else a repository
/// id `ORG/NAME[@REVISION]` pulled into the Hub cache (`HF_HUB_CACHE`, or
/// `HF_HOME/hub`) → its snapshot directory; else an error that says "no
/// such directory" and, for a repository id, how to pull it.
///
/// Its signature fits clap's `value_parser` directly.
pub fn resolve_model(arg: &str) -> Result<PathBuf> {
    resolve_model_in(arg, &hub_cache())
}

/// [`resolve_model`] with the cache root given.
pub fn resolve_model_in(arg: &str, cache: &Path) -> Result<PathBuf> {
    let p = Path::new(arg);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    let hint = if looks_like_repo(arg) {
        let repo = RepoRef::parse(arg)?;
        if let Some(snap) = pulled_snapshot(cache, &repo) {
            return Ok(snap);
        }
        format!(
            "; as a Hub repository, {} is not pulled into {}: run `fathom pull {arg}`",
            repo.id(),
            cache.display()
        )
    } else {
        String::new()
    };
    Err(HubError::NoSuchDir {
        arg: arg.to_string(),
        hint,
    })
}

/// The repository and commit a model directory came from: a snapshot of
/// the shared cache (`…/models--ORG--NAME/snapshots/<commit>`) or a
/// `--dir` directory (`.fathom/source.json`).
pub fn source_of(dir: &Path) -> Result<Source> {
    let src = dir.join(".fathom").join("source.json");
    if src.is_file() {
        let text = std::fs::read(&src).map_err(|e| HubError::io(&src, e))?;
        return serde_json::from_slice(&text).map_err(|e| {
            HubError::Store(format!(
                "{}: not fathom's source record: {e}",
                src.display()
            ))
        });
    }
    let abs = std::path::absolute(dir).map_err(|e| HubError::io(dir, e))?;
    let commit = abs
        .file_name()
        .and_then(|c| c.to_str())
        .filter(|c| is_commit(c));
    let snaps = abs
        .parent()
        .filter(|p| p.file_name().is_some_and(|n| n == "snapshots"));
    let folder = snaps
        .and_then(Path::parent)
        .and_then(Path::file_name)
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("models--"));
    match (commit, folder.and_then(|f| f.split_once("--"))) {
        (Some(c), Some((org, name))) => Ok(Source {
            repo: format!("{org}/{name}"),
            commit: c.to_string(),
        }),
        _ => Err(HubError::Store(format!(
            "{} is neither a snapshot of the Hub cache (models--ORG--NAME/snapshots/COMMIT) nor a directory made by `fathom pull --dir`: remote experts need to know the repository",
            dir.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_links() {
        assert_eq!(
            relative(Path::new("/c/m/snapshots/abc"), Path::new("/c/m/blobs/e1")),
            PathBuf::from("../../blobs/e1")
        );
        assert_eq!(
            relative(
                Path::new("/c/m/snapshots/abc/sub"),
                Path::new("/c/m/blobs/e1")
            ),
            PathBuf::from("../../../blobs/e1")
        );
        assert_eq!(
            relative(Path::new("/d"), Path::new("/d/.fathom/blobs/e1")),
            PathBuf::from(".fathom/blobs/e1")
        );
    }
}
