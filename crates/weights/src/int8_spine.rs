//! The int8 spine file: a model's spine matrices quantised once to
//! per-row int8 (`fathom convert --spine int8`), kept beside the
//! checkpoint as one file in the safetensors format, [`FILE_NAME`] (not
//! named `*.safetensors`, so nothing that lists a checkpoint's shards
//! counts it). A `--spine int8`
//! load reads each matrix the file holds as its codes and row scales
//! instead of reading the stored matrix and quantising it, so a streamed
//! int8 layer reads about half the bytes, and no bf16 copy is ever made.
//!
//! Matrix `NAME` of the checkpoint is held as `NAME#int8` (`I8`, the
//! matrix's shape) and `NAME#int8.scale` (`F32`, one per row). The
//! header's metadata is the receipt: the format and quantiser this file
//! was written with and [`source_digest`] of the matrices it was made
//! from. [`Checkpoint::attach_int8_spine`] refuses a file whose receipt
//! does not match the checkpoint beside it, naming the fix. The file is
//! lossy, as `--spine int8` is; bf16 loads never read it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

use crate::Dtype;
use crate::checkpoint::{Checkpoint, MAX_HEADER};
use crate::error::{Result, WeightsError};

/// The file's name in the model directory.
pub const FILE_NAME: &str = "spine-int8.fathom";
/// The format this build writes and reads (the receipt's `format`).
pub const FORMAT: &str = "fathom int8 spine 1";
/// The quantiser (the receipt's `quantiser`): a file made by another is
/// refused rather than read as if it were this one's output.
pub const QUANTISER: &str =
    "per-row symmetric int8: scale = absmax/127 (f32), q = round-half-even(w/scale) in ±127";
/// Bytes of the start and of the end of each source matrix that
/// [`source_digest`] hashes.
pub const SAMPLE: u64 = 4096;

/// The codes' tensor name of matrix `name`.
pub fn q_name(name: &str) -> String {
    format!("{name}#int8")
}

/// The row scales' tensor name of matrix `name`.
pub fn scale_name(name: &str) -> String {
    format!("{name}#int8.scale")
}

/// Where quantised matrices go as they are made.
pub trait Int8Sink: Send + Sync {
    /// Matrix `name` (`rows × cols`) as codes `q` and row scales `scale`.
    fn put(&self, name: &str, rows: usize, cols: usize, q: &[i8], scale: &[f32]);
}

/// The SHA-256 (hex) of the source matrices `names`, in name order: each
/// name, its dtype and shape, and the first and last [`SAMPLE`] bytes of
/// its stored data. Cheap (a few kB read per matrix) and changed by any
/// retrained or replaced checkpoint, whose every matrix differs.
pub fn source_digest<'a>(
    ck: &Checkpoint,
    names: impl IntoIterator<Item = &'a str>,
) -> Result<String> {
    let names: BTreeSet<&str> = names.into_iter().collect();
    let mut h = Sha256::new();
    for name in names {
        let loc = ck
            .get(name)
            .ok_or_else(|| WeightsError::Missing(name.to_string()))?;
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(format!("{:?}{:?}", loc.dtype, loc.shape).as_bytes());
        let head = loc.len.min(SAMPLE);
        let mut buf = vec![0u8; head as usize];
        ck.read_into(loc.shard, loc.offset, &mut buf)?;
        h.update(&buf);
        let tail = loc.len.min(SAMPLE);
        buf.resize(tail as usize, 0);
        ck.read_into(loc.shard, loc.offset + loc.len - tail, &mut buf)?;
        h.update(&buf);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes an int8 spine file: matrices as they come ([`Int8Sink::put`];
/// a name seen again is skipped), then [`Int8Writer::finish`] writes the
/// header with its receipt and renames the file into place. The header's
/// room is reserved up front (from the checkpoint's float matrices, every
/// one the file could hold), so data is written once, in place.
pub struct Int8Writer {
    inner: Mutex<Inner>,
}

struct Inner {
    file: File,
    part: PathBuf,
    dest: PathBuf,
    /// Bytes reserved for the 8-byte length and the header.
    reserved: u64,
    /// Data bytes written.
    end: u64,
    entries: BTreeMap<String, (Dtype, Vec<usize>, u64, u64)>,
    /// Source matrices written.
    sources: BTreeSet<String>,
    error: Option<std::io::Error>,
    closed: bool,
}

impl Int8Writer {
    /// A writer of `dir`'s int8 spine file (written as `FILE_NAME.part`
    /// until finished), with header room for any of `ck`'s float matrices.
    pub fn create(dir: &Path, ck: &Checkpoint) -> Result<Self> {
        let dest = dir.join(FILE_NAME);
        let part = dir.join(format!("{FILE_NAME}.part"));
        let room: u64 = ck
            .tensors()
            .filter(|(_, l)| matches!(l.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32))
            .map(|(n, _)| 2 * n.len() as u64 + 256)
            .sum::<u64>()
            + 4096;
        let reserved = (8 + room).next_multiple_of(8).min(8 + MAX_HEADER);
        let file = File::create(&part).map_err(|e| WeightsError::io(&part, e))?;
        Ok(Int8Writer {
            inner: Mutex::new(Inner {
                file,
                part,
                dest,
                reserved,
                end: 0,
                entries: BTreeMap::new(),
                sources: BTreeSet::new(),
                error: None,
                closed: false,
            }),
        })
    }

    /// The source matrices written so far.
    pub fn sources(&self) -> Vec<String> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.sources.iter().cloned().collect()
    }

    /// Writes the header with the receipt (`digest`: [`source_digest`] of
    /// [`Int8Writer::sources`]), syncs and renames the file into place.
    /// Returns the file's path and its size.
    pub fn finish(&self, digest: &str) -> Result<(PathBuf, u64)> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.closed = true;
        let part = g.part.clone();
        if let Some(e) = g.error.take() {
            return Err(WeightsError::io(&part, e));
        }
        let mut header = serde_json::Map::new();
        header.insert(
            "__metadata__".into(),
            serde_json::json!({
                "format": FORMAT,
                "quantiser": QUANTISER,
                "source_digest": digest,
                "lossy": "yes: read only by --spine int8, in place of quantising at load",
            }),
        );
        for (name, (dtype, shape, a, b)) in &g.entries {
            header.insert(
                name.clone(),
                serde_json::json!({
                    "dtype": format!("{dtype:?}"),
                    "shape": shape,
                    "data_offsets": [a, b],
                }),
            );
        }
        let mut json = serde_json::to_vec(&serde_json::Value::Object(header))
            .expect("a JSON map serialises into memory");
        let room = g.reserved - 8;
        if json.len() as u64 > room {
            return Err(WeightsError::io(
                &part,
                std::io::Error::other(format!(
                    "the header needs {} bytes, over the {room} reserved",
                    json.len()
                )),
            ));
        }
        json.resize(room as usize, b' ');
        let io = |e| WeightsError::io(&part, e);
        g.file.write_all_at(&room.to_le_bytes(), 0).map_err(io)?;
        g.file.write_all_at(&json, 8).map_err(io)?;
        g.file.flush().map_err(io)?;
        g.file.sync_all().map_err(io)?;
        std::fs::rename(&part, &g.dest).map_err(io)?;
        if let Some(dir) = g.dest.parent()
            && let Ok(d) = File::open(dir)
        {
            // A refused directory sync leaves the rename to the next
            // write-back; the file is whole either way.
            let _ = d.sync_all();
        }
        Ok((g.dest.clone(), g.reserved + g.end))
    }
}

impl Int8Sink for Int8Writer {
    fn put(&self, name: &str, rows: usize, cols: usize, q: &[i8], scale: &[f32]) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if g.closed || g.error.is_some() || !g.sources.insert(name.to_string()) {
            return;
        }
        // SAFETY: i8 and u8 have the same size and every bit pattern is
        // valid for both; the view covers exactly `q`.
        let qb = unsafe { std::slice::from_raw_parts(q.as_ptr().cast::<u8>(), q.len()) };
        let sb: Vec<u8> = scale.iter().flat_map(|s| s.to_le_bytes()).collect();
        for (tensor, dtype, shape, bytes) in [
            (q_name(name), Dtype::I8, vec![rows, cols], qb),
            (scale_name(name), Dtype::F32, vec![rows], &sb[..]),
        ] {
            let at = g.reserved + g.end;
            if let Err(e) = g.file.write_all_at(bytes, at) {
                g.error = Some(e);
                return;
            }
            let a = g.end;
            g.end += bytes.len() as u64;
            let b = g.end;
            g.entries.insert(tensor, (dtype, shape, a, b));
        }
    }
}

/// What an attached int8 spine file says of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    pub path: PathBuf,
    /// Matrices it holds.
    pub matrices: usize,
    /// Its data bytes.
    pub bytes: u64,
    pub source_digest: String,
}

impl Checkpoint {
    /// Attaches the int8 spine file beside the checkpoint, if there is
    /// one: its matrices become tensors `NAME#int8` and `NAME#int8.scale`
    /// ([`q_name`], [`scale_name`]). Refused, naming the file and the fix,
    /// when its receipt is not this build's format and quantiser, when a
    /// matrix it holds is not the checkpoint's (name, shape), or when the
    /// checkpoint's matrices are not the ones it was made from.
    pub fn attach_int8_spine(&mut self) -> Result<Option<Receipt>> {
        let path = self.dir().join(FILE_NAME);
        if !path.exists() {
            return Ok(None);
        }
        let dir = self.dir().to_path_buf();
        let stale = |why: String| WeightsError::BadHeader {
            path: path.clone(),
            msg: format!(
                "{why}: run `fathom convert --model {} --spine int8 --force` to write it again, or delete it",
                dir.display()
            ),
        };
        let meta = read_metadata(&path)?;
        let field = |k: &str| meta.get(k).and_then(|v| v.as_str()).unwrap_or("");
        if field("format") != FORMAT || field("quantiser") != QUANTISER {
            return Err(stale(format!(
                "written as {:?} with {:?}, where this build reads {FORMAT:?} with {QUANTISER:?}",
                field("format"),
                field("quantiser")
            )));
        }
        let added = self.add_companion(&path, FILE_NAME)?;
        let mut sources = Vec::new();
        let mut bytes = 0;
        for (name, loc) in &added {
            bytes += loc.len;
            let Some(src) = name.strip_suffix("#int8") else {
                continue;
            };
            let want = |t: &str, dtype: Dtype, shape: &[usize]| -> Result<()> {
                match added.get(t) {
                    Some(l) if l.dtype == dtype && l.shape == shape => Ok(()),
                    _ => Err(stale(format!("{t} is missing or not {dtype:?} {shape:?}"))),
                }
            };
            let Some(s) = self.get(src) else {
                return Err(stale(format!(
                    "it holds {src}, which the checkpoint has not"
                )));
            };
            let (rows, cols) = match s.shape[..] {
                [r, c] | [r, 1, c] => (r, c),
                _ => return Err(stale(format!("{src} is not a matrix in the checkpoint"))),
            };
            want(name, Dtype::I8, &[rows, cols])?;
            want(&scale_name(src), Dtype::F32, &[rows])?;
            sources.push(src.to_string());
        }
        let digest = source_digest(self, sources.iter().map(String::as_str))?;
        if digest != field("source_digest") {
            return Err(stale(format!(
                "it was made from other weights than these (source digest {} ≠ {digest})",
                field("source_digest")
            )));
        }
        let receipt = Receipt {
            path,
            matrices: sources.len(),
            bytes,
            source_digest: digest,
        };
        self.insert_companion(added);
        Ok(Some(receipt))
    }
}

/// The `__metadata__` map of a safetensors file's header.
fn read_metadata(path: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    let file = File::open(path).map_err(|e| WeightsError::io(path, e))?;
    let bad = |msg: String| WeightsError::BadHeader {
        path: path.to_path_buf(),
        msg,
    };
    let mut n = [0u8; 8];
    file.read_exact_at(&mut n, 0)
        .map_err(|e| WeightsError::io(path, e))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER {
        return Err(bad(format!("header length {n} is over {MAX_HEADER}")));
    }
    let mut json = vec![0u8; n as usize];
    file.read_exact_at(&mut json, 8)
        .map_err(|e| WeightsError::io(path, e))?;
    #[derive(serde::Deserialize)]
    struct Head {
        #[serde(rename = "__metadata__", default)]
        meta: serde_json::Map<String, serde_json::Value>,
    }
    let head: Head =
        serde_json::from_slice(&json).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    Ok(head.meta)
}
