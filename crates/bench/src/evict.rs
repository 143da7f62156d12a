//! Every rep of every arm and peer starts with its files out of the page
//! cache: the model directory's files, and for a peer each argument that
//! names an existing file (its GGUF, say). Otherwise the first rep warms the
//! cache and later reps — of any arm — read from RAM, which a memory cap
//! cannot account fairly.

use std::fs::File;
use std::path::{Path, PathBuf};

use fathom_platform::io::{Advice, advise};

/// The regular files of `dir` (symlinks followed), sorted.
pub fn files_of(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

/// The arguments of a peer's command that are existing files.
pub fn files_in_args(args: &[String]) -> Vec<PathBuf> {
    args.iter()
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .collect()
}

/// Writes back and drops every page of `paths` from the page cache;
/// returns the bytes advised. A file that cannot be opened is skipped
/// (the arm then reports its own error). Where the system cannot drop
/// cached pages (macOS: [`fathom_platform::io::drop_cache_support`]) the
/// files are only written back.
pub fn evict(paths: &[PathBuf]) -> u64 {
    let mut bytes = 0;
    for p in paths {
        let Ok(f) = File::open(p) else { continue };
        // Dirty pages (a model just written) are not dropped until written back.
        let _ = f.sync_data();
        advise(&f, 0, 0, Advice::DontNeed);
        bytes += f.metadata().map_or(0, |m| m.len());
    }
    bytes
}

/// Bytes of `path` now in the page cache (`mincore` over a read-only map).
pub fn cached_bytes(path: &Path) -> std::io::Result<u64> {
    fathom_platform::io::cached_bytes(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_file_leaves_the_page_cache() {
        if !fathom_platform::io::drop_cache_support().is_available() {
            let s = fathom_platform::io::drop_cache_support();
            eprintln!("skipped: dropping a file's cached pages is {s}");
            return;
        }
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/evict-test");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("weights.bin");
        std::fs::write(&p, vec![7u8; 8 << 20]).unwrap();
        std::fs::read(&p).unwrap();
        let before = cached_bytes(&p).unwrap();
        if before == 0 {
            eprintln!("skipped: this filesystem keeps no page cache for the file");
            return;
        }
        assert_eq!(evict(&files_of(&dir)), 8 << 20);
        let after = cached_bytes(&p).unwrap();
        if after == before {
            eprintln!("skipped: this filesystem ignores POSIX_FADV_DONTNEED (tmpfs?)");
            return;
        }
        assert_eq!(after, 0, "{before} cached before, {after} after");
        let args = vec!["-m".to_string(), p.display().to_string(), "-n".into()];
        assert_eq!(files_in_args(&args), vec![p]);
    }
}
