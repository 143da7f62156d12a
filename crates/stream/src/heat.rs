//! Expert heat: how often each routed expert was requested, kept across runs.
//!
//! A run with `--heat-out FILE` adds its request counts to FILE (made if
//! absent). A later run with `--heat FILE` reads the hottest experts into
//! the cache before its first step and pins the hottest part of them (the
//! pinned tier) so LRU never evicts them. Heat only decides what is *kept*:
//! every requested expert is still the one the router chose, read from the
//! same bytes, so output is unchanged (tested).
//!
//! The file is JSON: `format`, the model's identity (a digest of its
//! `config.json`, so heat from another model is refused), the routed-expert
//! count of every layer (0 for dense layers) and per-layer request counts.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::cache::Key;

/// The format tag written and required.
pub const FORMAT: &str = "fathom-expert-heat/1";

/// Largest count of layers × experts a heat file may describe (its size is
/// bounded by it before it is read).
const MAX_ENTRIES: usize = 1 << 24;

/// Request counts per (layer, expert).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heat {
    pub format: String,
    /// Digest of the model's `config.json`.
    pub model: String,
    /// Tokens (positions) the counts come from, summed over runs.
    pub tokens: u64,
    /// `counts[layer][expert]`; an empty row for a layer without experts.
    pub counts: Vec<Vec<u64>>,
}

impl Heat {
    /// Zero counts for a model with `experts[layer]` routed experts.
    pub fn empty(model: &str, experts: &[usize]) -> Heat {
        Heat {
            format: FORMAT.into(),
            model: model.into(),
            tokens: 0,
            counts: experts.iter().map(|&n| vec![0; n]).collect(),
        }
    }

    /// Reads `path`, checking the format, the model and (when given) the
    /// shape against `experts` (one error naming the file and what differs).
    pub fn read(path: &Path, model: &str, experts: Option<&[usize]>) -> Result<Heat, String> {
        let at = |m: String| format!("--heat {}: {m}", path.display());
        let meta = std::fs::metadata(path).map_err(|e| at(e.to_string()))?;
        // A count is at most 21 characters; the table is bounded.
        if meta.len() > 24 * MAX_ENTRIES as u64 + (1 << 16) {
            return Err(at(format!(
                "{} bytes is far more than a heat file for this model holds: is it the right file?",
                meta.len()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| at(e.to_string()))?;
        let h: Heat = serde_json::from_str(&text)
            .map_err(|e| at(format!("not a heat file ({e}); write one with --heat-out")))?;
        if h.format != FORMAT {
            return Err(at(format!("format {:?}, expected {FORMAT:?}", h.format)));
        }
        if h.model != model {
            return Err(at(format!(
                "recorded for another model (config digest {}, this one is {model}): \
                 record heat with this model's --heat-out",
                h.model
            )));
        }
        match experts {
            Some(x) => h.check_shape(path, x).map(|_| h),
            None => Ok(h),
        }
    }

    /// Checks that the heat's layers have `experts` routed experts each.
    pub fn check_shape(&self, path: &Path, experts: &[usize]) -> Result<(), String> {
        let shape: Vec<usize> = self.counts.iter().map(Vec::len).collect();
        if shape != experts {
            return Err(format!(
                "--heat {}: its layers have {shape:?} experts, the model's have {experts:?}",
                path.display()
            ));
        }
        Ok(())
    }

    /// Adds `other`'s counts (same shape).
    pub fn add(&mut self, other: &Heat) {
        self.tokens = self.tokens.saturating_add(other.tokens);
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            for (x, y) in a.iter_mut().zip(b) {
                *x = x.saturating_add(*y);
            }
        }
    }

    /// Writes `self` plus what `path` already holds for the same model
    /// (through a temporary file and a rename).
    pub fn merge_into(&self, path: &Path) -> Result<Heat, String> {
        let shape: Vec<usize> = self.counts.iter().map(Vec::len).collect();
        let mut total = self.clone();
        if path.exists() {
            let old = Heat::read(path, &self.model, Some(&shape))
                .map_err(|e| e.replacen("--heat ", "--heat-out ", 1))?;
            total.add(&old);
        }
        let at = |e: std::io::Error| format!("--heat-out {}: {e}", path.display());
        // Unique per process: two runs recording into one file never share a
        // temporary (the later rename wins; counts are not locked across runs).
        let tmp = path.with_extension(format!("heat.{}.tmp", std::process::id()));
        let text = serde_json::to_string(&total).map_err(|e| e.to_string())?;
        std::fs::write(&tmp, text).map_err(at)?;
        std::fs::rename(&tmp, path).map_err(at)?;
        Ok(total)
    }

    /// Every expert with a nonzero count, hottest first (ties: lower layer,
    /// then lower id), so the order is reproducible.
    pub fn ranked(&self) -> Vec<Key> {
        let mut keys: Vec<(u64, Key)> = Vec::new();
        for (l, row) in self.counts.iter().enumerate() {
            for (e, &c) in row.iter().enumerate() {
                if c > 0 {
                    keys.push((c, (l as u32, e as u32)));
                }
            }
        }
        keys.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        keys.into_iter().map(|(_, k)| k).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("fathom-heat-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&d);
        d
    }

    #[test]
    fn merge_adds_and_ranks() {
        let p = tmp("merge");
        let mut a = Heat::empty("m1", &[0, 3, 2]);
        a.counts[1] = vec![5, 0, 1];
        a.tokens = 4;
        a.merge_into(&p).unwrap();
        let mut b = Heat::empty("m1", &[0, 3, 2]);
        b.counts[2] = vec![5, 7];
        b.tokens = 2;
        let t = b.merge_into(&p).unwrap();
        assert_eq!(t.tokens, 6);
        assert_eq!(t.counts, vec![vec![], vec![5, 0, 1], vec![5, 7]]);
        assert_eq!(Heat::read(&p, "m1", Some(&[0, 3, 2])).unwrap(), t);
        assert_eq!(t.ranked(), vec![(2, 1), (1, 0), (2, 0), (1, 2)]);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn another_model_or_shape_is_refused() {
        let p = tmp("refuse");
        Heat::empty("m1", &[2]).merge_into(&p).unwrap();
        let e = Heat::read(&p, "m2", None).unwrap_err();
        assert!(e.contains("another model") && e.contains("--heat"), "{e}");
        let e = Heat::read(&p, "m1", Some(&[3])).unwrap_err();
        assert!(e.contains("[2]") && e.contains("[3]"), "{e}");
        std::fs::write(&p, "{\"x\":1}").unwrap();
        let e = Heat::read(&p, "m1", Some(&[2])).unwrap_err();
        assert!(e.contains("not a heat file"), "{e}");
        let e = Heat::empty("m2", &[2]).merge_into(&p).unwrap_err();
        assert!(e.starts_with("--heat-out"), "{e}");
        let _ = std::fs::remove_file(&p);
    }
}
