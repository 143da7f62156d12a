//! The span store on disk: one file per span under `spans/`, and a
//! journal of what is there (`add OFFSET LEN FILE`, `del OFFSET LEN FILE`,
//! `ok FILE` when a whole shard hashed right), replayed and compacted when
//! the store opens, so a restart reuses every span it had. A span's file is
//! written and synced before its journal line; a line whose span file is
//! missing or the wrong size, a torn last line, and a span file no line
//! names are dropped on open.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{HubError, Result};
use crate::verify::sha256_hex;

/// (file, offset, len).
pub(crate) type Key = (String, u64, u64);

/// What the store holds, in least-recently-used order.
pub(crate) struct Spans {
    dir: PathBuf,
    journal: File,
    /// Span → its use tick.
    pub(crate) map: BTreeMap<Key, u64>,
    /// Use tick → span (the oldest first).
    lru: BTreeMap<u64, Key>,
    tick: u64,
    pub(crate) used: u64,
    /// Files whose spans were found whole and hashed right.
    pub(crate) verified: BTreeSet<String>,
}

/// The folder of a file's spans: a digest of its name, so any repository
/// path maps to one safe component.
fn file_dir(dir: &Path, file: &str) -> PathBuf {
    dir.join("spans").join(&sha256_hex(file.as_bytes())[..24])
}

pub(crate) fn span_path(dir: &Path, k: &Key) -> PathBuf {
    file_dir(dir, &k.0).join(format!("{}-{}", k.1, k.2))
}

fn journal_path(dir: &Path) -> PathBuf {
    dir.join("journal")
}

impl Spans {
    /// Replays the journal in `dir`, drops what does not check out, and
    /// rewrites it compacted.
    pub(crate) fn open(dir: &Path) -> Result<Spans> {
        std::fs::create_dir_all(dir.join("spans")).map_err(|e| HubError::io(dir, e))?;
        let jp = journal_path(dir);
        let text = match std::fs::read(&jp) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(HubError::io(&jp, e)),
        };
        let mut order: Vec<Key> = Vec::new();
        let mut live: BTreeSet<Key> = BTreeSet::new();
        let mut verified = BTreeSet::new();
        // Only whole lines count: a crash can tear the last one.
        let complete = text.rfind('\n').map_or("", |i| &text[..i]);
        for line in complete.lines() {
            match parse_line(line) {
                Some(Entry::Add(k)) => {
                    if live.insert(k.clone()) {
                        order.push(k);
                    }
                }
                Some(Entry::Del(k)) => {
                    live.remove(&k);
                    verified.remove(&k.0);
                }
                Some(Entry::Ok(f)) => {
                    verified.insert(f);
                }
                None => {}
            }
        }
        let mut s = Spans {
            dir: dir.to_path_buf(),
            journal: File::create(dir.join("journal.new")).map_err(|e| HubError::io(dir, e))?,
            map: BTreeMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            used: 0,
            verified: BTreeSet::new(),
        };
        for k in order.into_iter().filter(|k| live.contains(k)) {
            let ok = std::fs::metadata(span_path(dir, &k)).is_ok_and(|m| m.len() == k.2);
            if ok {
                s.track(k);
            }
        }
        s.verified = verified
            .into_iter()
            .filter(|f| s.map.keys().any(|k| &k.0 == f))
            .collect();
        s.remove_orphans()?;
        let mut text = String::new();
        for k in s.lru.values() {
            text.push_str(&line("add", k));
        }
        for f in &s.verified {
            text.push_str(&format!("ok {f}\n"));
        }
        s.journal
            .write_all(text.as_bytes())
            .map_err(|e| HubError::io(&jp, e))?;
        s.journal.sync_all().map_err(|e| HubError::io(&jp, e))?;
        std::fs::rename(dir.join("journal.new"), &jp).map_err(|e| HubError::io(&jp, e))?;
        s.journal = std::fs::OpenOptions::new()
            .append(true)
            .open(&jp)
            .map_err(|e| HubError::io(&jp, e))?;
        Ok(s)
    }

    /// Deletes span files (and temporaries) that no live span names.
    fn remove_orphans(&self) -> Result<()> {
        let root = self.dir.join("spans");
        let keep: BTreeSet<PathBuf> = self.map.keys().map(|k| span_path(&self.dir, k)).collect();
        let dirs = std::fs::read_dir(&root).map_err(|e| HubError::io(&root, e))?;
        for d in dirs.flatten() {
            let Ok(files) = std::fs::read_dir(d.path()) else {
                continue;
            };
            for f in files.flatten() {
                if !keep.contains(&f.path()) {
                    let _ = std::fs::remove_file(f.path());
                }
            }
        }
        Ok(())
    }

    fn track(&mut self, k: Key) {
        self.tick += 1;
        self.used += k.2;
        self.lru.insert(self.tick, k.clone());
        self.map.insert(k, self.tick);
    }

    /// Marks `k` as just used.
    pub(crate) fn touch(&mut self, k: &Key) {
        if let Some(t) = self.map.get_mut(k) {
            self.lru.remove(t);
            self.tick += 1;
            *t = self.tick;
            self.lru.insert(self.tick, k.clone());
        }
    }

    /// The span of `file` holding `[offset, offset + len)`, if any.
    pub(crate) fn covering(&self, file: &str, offset: u64, len: u64) -> Option<Key> {
        let lo = (file.to_string(), 0, 0);
        let hi = (file.to_string(), offset, u64::MAX);
        self.map
            .range(lo..=hi)
            .rev()
            .take(64)
            .map(|(k, _)| k)
            .find(|k| k.1 + k.2 >= offset + len)
            .cloned()
    }

    fn log(&mut self, text: &str) -> Result<()> {
        let jp = journal_path(&self.dir);
        self.journal
            .write_all(text.as_bytes())
            .map_err(|e| HubError::io(&jp, e))
    }

    /// Records a span whose file is already in place.
    pub(crate) fn add(&mut self, k: Key) -> Result<()> {
        if self.map.contains_key(&k) {
            self.touch(&k);
            return Ok(());
        }
        self.log(&line("add", &k))?;
        self.track(k);
        Ok(())
    }

    /// Drops a span and its file.
    pub(crate) fn remove(&mut self, k: &Key) -> Result<()> {
        let Some(t) = self.map.remove(k) else {
            return Ok(());
        };
        self.lru.remove(&t);
        self.used -= k.2;
        self.verified.remove(&k.0);
        self.log(&line("del", k))?;
        let _ = std::fs::remove_file(span_path(&self.dir, k));
        Ok(())
    }

    /// The least recently used span.
    pub(crate) fn oldest(&self) -> Option<Key> {
        self.lru.values().next().cloned()
    }

    /// Records that `file`'s spans cover it and hash right.
    pub(crate) fn mark_verified(&mut self, file: &str) -> Result<()> {
        if self.verified.insert(file.to_string()) {
            self.log(&format!("ok {file}\n"))?;
        }
        Ok(())
    }

    /// Every span of `file`, by offset.
    pub(crate) fn of_file(&self, file: &str) -> Vec<Key> {
        let lo = (file.to_string(), 0, 0);
        let hi = (file.to_string(), u64::MAX, u64::MAX);
        self.map.range(lo..=hi).map(|(k, _)| k.clone()).collect()
    }

    /// A temporary path beside the span files for one being written.
    pub(crate) fn temp_path(&self, k: &Key, n: u64) -> PathBuf {
        file_dir(&self.dir, &k.0).join(format!(".{}-{}.tmp{n}", k.1, k.2))
    }
}

enum Entry {
    Add(Key),
    Del(Key),
    Ok(String),
}

fn line(op: &str, k: &Key) -> String {
    format!("{op} {} {} {}\n", k.1, k.2, k.0)
}

fn parse_line(l: &str) -> Option<Entry> {
    let (op, rest) = l.split_once(' ')?;
    if op == "ok" {
        return Some(Entry::Ok(rest.to_string()));
    }
    let mut it = rest.splitn(3, ' ');
    let off: u64 = it.next()?.parse().ok()?;
    let len: u64 = it.next()?.parse().ok()?;
    let file = it.next()?.to_string();
    let k = (file, off, len);
    match op {
        "add" => Some(Entry::Add(k)),
        "del" => Some(Entry::Del(k)),
        _ => None,
    }
}

/// Whether the spans (sorted by offset) cover `[from, size)`.
pub(crate) fn covers_from(spans: &[Key], from: u64, size: u64) -> bool {
    let mut reach = from;
    for k in spans {
        if k.1 > reach {
            return false;
        }
        reach = reach.max(k.1 + k.2);
    }
    reach >= size
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(off: u64, len: u64) -> Key {
        ("f".into(), off, len)
    }

    fn covers(spans: &[Key], size: u64) -> bool {
        covers_from(spans, 0, size)
    }

    #[test]
    fn coverage() {
        assert!(covers(&[k(0, 5), k(5, 5)], 10));
        assert!(covers(&[k(0, 6), k(3, 7)], 10));
        assert!(!covers(&[k(0, 5), k(6, 4)], 10));
        assert!(!covers(&[k(1, 9)], 10));
        assert!(!covers(&[k(0, 9)], 10));
        assert!(covers_from(&[k(4, 6)], 4, 10));
        assert!(!covers_from(&[k(5, 5)], 4, 10));
    }

    #[test]
    fn journal_replays_and_drops_what_does_not_check_out() {
        let dir = std::env::temp_dir().join(format!("fathom-spans-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        {
            let mut s = Spans::open(&dir).unwrap();
            for key in [k(0, 4), k(4, 4), k(8, 2)] {
                let p = span_path(&dir, &key);
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::write(&p, vec![7u8; key.2 as usize]).unwrap();
                s.add(key).unwrap();
            }
            s.remove(&k(4, 4)).unwrap();
            s.touch(&k(0, 4));
            assert_eq!(s.oldest(), Some(k(8, 2)));
            assert_eq!(s.used, 6);
        }
        // A span file cut short, a torn last line, and an orphan.
        std::fs::write(span_path(&dir, &k(8, 2)), [1u8]).unwrap();
        let orphan = span_path(&dir, &k(20, 1));
        std::fs::write(&orphan, [1u8]).unwrap();
        let mut j = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join("journal"))
            .unwrap();
        j.write_all(b"add 30 1 f").unwrap();
        drop(j);
        let s = Spans::open(&dir).unwrap();
        assert_eq!(s.map.keys().cloned().collect::<Vec<_>>(), [k(0, 4)]);
        assert_eq!(s.used, 4);
        assert!(!orphan.exists());
        assert_eq!(
            std::fs::read_to_string(dir.join("journal")).unwrap(),
            "add 0 4 f\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
