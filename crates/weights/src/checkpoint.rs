//! Safetensors checkpoints: the shard index, validated headers, tensor locators.
//!
//! A safetensors file is `u64 LE header length n`, `n` bytes of JSON
//! (`name → {dtype, shape, data_offsets: [begin, end]}` relative to the data
//! section), then the data section. We read only the header here and check,
//! for every tensor, that its byte range lies inside the file, does not
//! overlap another tensor, and has exactly `dtype size × Π shape` bytes.
//! After [`Checkpoint::open`] succeeds, every [`TensorLoc`] can be read with a
//! single positional read and nothing else about the file needs trusting.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::Dtype;
use safetensors::tensor::TensorInfo;

use crate::error::{Result, WeightsError};

/// Largest header we accept (the safetensors reference uses the same cap).
/// Tensor bytes read through [`Checkpoint::read_into`] by this process (for
/// load progress; expert streaming reads through its own reader).
static BYTES_READ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Tensor bytes this process has read from checkpoints so far.
pub fn bytes_read() -> u64 {
    BYTES_READ.load(std::sync::atomic::Ordering::Relaxed)
}

thread_local! {
    static THREAD_BYTES_READ: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Tensor bytes the calling thread has read through
/// [`Checkpoint::read_into`] so far (what one reader's reads cost, with
/// other threads reading beside it).
pub fn thread_bytes_read() -> u64 {
    THREAD_BYTES_READ.with(|c| c.get())
}

thread_local! {
    static THREAD_DIRECT_BYTES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Of [`thread_bytes_read`], the bytes read uncached (page cache bypassed).
pub fn thread_direct_bytes_read() -> u64 {
    THREAD_DIRECT_BYTES.with(|c| c.get())
}

fn count_read(n: usize) {
    BYTES_READ.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    THREAD_BYTES_READ.with(|c| c.set(c.get() + n as u64));
}

/// Largest shard header (JSON) read; writers must stay under it.
pub const MAX_HEADER: u64 = 100 << 20;

/// Shards that are not on disk, read from where the checkpoint came from
/// (a Hub repository): its headers, and spans of it on demand.
pub trait RemoteShards: Send + Sync {
    /// The size of `file` (a name of the index's `weight_map`), if the
    /// source has it.
    fn size(&self, file: &str) -> Option<u64>;
    /// `file`'s safetensors header: its 8-byte length and the JSON after it.
    fn header(&self, file: &str) -> std::result::Result<Vec<u8>, String>;
    /// The bytes `[offset, offset + len)` of `file`: from local storage if
    /// there, else fetched when `fetch` (a read the model needs now), else
    /// `None` (a guess never reaches the network). Errors name the file.
    fn span(
        &self,
        file: &str,
        offset: u64,
        len: u64,
        fetch: bool,
    ) -> std::result::Result<Option<Vec<u8>>, String>;
}

/// Where a shard's bytes are.
#[derive(Clone)]
pub enum ShardData {
    /// The file, open.
    Local(Arc<File>),
    /// Not on disk: read through the checkpoint's remote source.
    Remote(Arc<dyn RemoteShards>),
}

impl std::fmt::Debug for ShardData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShardData::Local(_) => "Local",
            ShardData::Remote(_) => "Remote",
        })
    }
}

/// One opened shard.
#[derive(Debug)]
pub struct ShardFile {
    pub path: PathBuf,
    /// Its name in the model directory (the index's shard name).
    pub name: String,
    pub data: ShardData,
    pub len: u64,
    /// Its uncached handle, for large reads.
    uncached: crate::direct::Uncached,
}

impl ShardFile {
    /// Whether its bytes come from the remote source.
    pub fn is_remote(&self) -> bool {
        matches!(self.data, ShardData::Remote(_))
    }
}

/// Where a tensor's bytes are: shard index, absolute byte offset and length,
/// plus its dtype and shape. Cheap to copy around; the streamer reads experts
/// through these without ever loading the rest of the shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorLoc {
    pub shard: usize,
    pub offset: u64,
    pub len: u64,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorLoc {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An opened, header-validated checkpoint.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<ShardFile>,
    tensors: BTreeMap<String, TensorLoc>,
    /// Tensors of a file attached beside the shards (the int8 spine
    /// file): found by [`Checkpoint::get`], not listed by
    /// [`Checkpoint::tensors`] (they are not the checkpoint's).
    companion: HashMap<String, TensorLoc>,
    /// Whether large reads bypass the page cache (on by default).
    buffered_only: std::sync::atomic::AtomicBool,
    /// Each local shard's read-only map, made on the first [`Checkpoint::map`].
    maps: Vec<std::sync::OnceLock<Option<Arc<crate::mapped::ShardMap>>>>,
}

#[derive(serde::Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` (+ shards) or `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        Self::open_with(dir, None)
    }

    /// As [`Checkpoint::open`]; a shard the index names that is not in
    /// `dir` is opened through `remote` (its header fetched from there,
    /// its bytes read through it) when `remote` has it.
    pub fn open_with(dir: &Path, remote: Option<Arc<dyn RemoteShards>>) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        if index_path.is_file() {
            Self::open_indexed(dir, &index_path, remote)
        } else if single.is_file() {
            let mut ck = Checkpoint {
                dir: dir.to_path_buf(),
                shards: Vec::new(),
                tensors: BTreeMap::new(),
                companion: HashMap::new(),
                buffered_only: Default::default(),
                maps: Vec::new(),
            };
            let header = ck.add_shard(&single, "model.safetensors")?;
            for (name, loc) in header {
                ck.tensors.insert(name, loc);
            }
            Ok(ck)
        } else {
            Err(WeightsError::NoCheckpoint {
                path: dir.to_path_buf(),
            })
        }
    }

    fn open_indexed(
        dir: &Path,
        index_path: &Path,
        remote: Option<Arc<dyn RemoteShards>>,
    ) -> Result<Self> {
        let text = std::fs::read(index_path).map_err(|e| WeightsError::io(index_path, e))?;
        let index: IndexFile =
            serde_json::from_slice(&text).map_err(|e| WeightsError::BadIndex {
                path: index_path.to_path_buf(),
                msg: e.to_string(),
            })?;
        let mut ck = Checkpoint {
            dir: dir.to_path_buf(),
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            companion: HashMap::new(),
            buffered_only: Default::default(),
            maps: Vec::new(),
        };
        let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, file) in &index.weight_map {
            if file.contains('/') || file.contains("..") {
                return Err(WeightsError::BadIndex {
                    path: index_path.to_path_buf(),
                    msg: format!("tensor {name}: shard name {file:?} leaves the model directory"),
                });
            }
            by_file.entry(file).or_default().push(name);
        }
        for (file, names) in by_file {
            let path = dir.join(file);
            let mut header = match &remote {
                Some(r) if !path.exists() && r.size(file).is_some() => {
                    ck.add_remote_shard(&path, file, r.clone())?
                }
                _ => ck.add_shard(&path, file)?,
            };
            for name in names {
                let loc = header.remove(name).ok_or_else(|| WeightsError::BadTensor {
                    path: path.clone(),
                    tensor: name.to_string(),
                    msg: "listed in the index but absent from this shard".into(),
                })?;
                ck.tensors.insert(name.to_string(), loc);
            }
            if let Some(extra) = header.keys().next() {
                return Err(WeightsError::BadTensor {
                    path,
                    tensor: extra.clone(),
                    msg: "present in the shard but not listed in the index".into(),
                });
            }
        }
        Ok(ck)
    }

    /// Opens one shard, validates its header, returns its tensors.
    fn add_shard(&mut self, path: &Path, name: &str) -> Result<HashMap<String, TensorLoc>> {
        // A FIFO, device or directory would block or mislead a read: refuse
        // anything but a regular file (symlinks to one are fine) before opening.
        let meta = std::fs::metadata(path).map_err(|e| WeightsError::io(path, e))?;
        if !meta.is_file() {
            let kind = std::io::Error::other("not a regular file (a FIFO, device or directory?)");
            return Err(WeightsError::io(path, kind));
        }
        let file = File::open(path).map_err(|e| WeightsError::io(path, e))?;
        let len = file
            .metadata()
            .map_err(|e| WeightsError::io(path, e))?
            .len();
        let shard = self.shards.len();
        let tensors = read_header(path, &file, len, shard)?;
        self.shards.push(ShardFile {
            path: path.to_path_buf(),
            name: name.to_string(),
            data: ShardData::Local(Arc::new(file)),
            len,
            uncached: Default::default(),
        });
        self.maps.push(Default::default());
        Ok(tensors)
    }

    /// A shard not on disk: its header from `remote`, validated as a
    /// local one is.
    fn add_remote_shard(
        &mut self,
        path: &Path,
        name: &str,
        remote: Arc<dyn RemoteShards>,
    ) -> Result<HashMap<String, TensorLoc>> {
        let len = remote.size(name).unwrap_or(0);
        let header = remote
            .header(name)
            .map_err(|e| WeightsError::io(path, std::io::Error::other(e)))?;
        let shard = self.shards.len();
        let tensors = parse_header(path, &header, len, shard)?;
        self.shards.push(ShardFile {
            path: path.to_path_buf(),
            name: name.to_string(),
            data: ShardData::Remote(remote),
            len,
            uncached: Default::default(),
        });
        self.maps.push(Default::default());
        Ok(tensors)
    }

    /// Opens `path`, a safetensors file beside the shards that is not in
    /// the index (`crate::int8_spine`), validating its header as a shard's:
    /// its tensors, not yet visible, for [`Checkpoint::insert_companion`].
    pub(crate) fn add_companion(
        &mut self,
        path: &Path,
        name: &str,
    ) -> Result<HashMap<String, TensorLoc>> {
        let added = self.add_shard(path, name)?;
        if let Some(t) = added.keys().find(|t| self.tensors.contains_key(*t)) {
            return Err(WeightsError::BadTensor {
                path: path.to_path_buf(),
                tensor: t.clone(),
                msg: "also a tensor of the checkpoint".into(),
            });
        }
        Ok(added)
    }

    /// Makes a companion file's tensors found by [`Checkpoint::get`].
    pub(crate) fn insert_companion(&mut self, tensors: HashMap<String, TensorLoc>) {
        self.companion.extend(tensors);
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn shards(&self) -> &[ShardFile] {
        &self.shards
    }

    /// A tensor of the checkpoint, or of a file attached beside it.
    pub fn get(&self, name: &str) -> Option<&TensorLoc> {
        self.tensors.get(name).or_else(|| self.companion.get(name))
    }

    /// All tensors, sorted by name.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &TensorLoc)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Total bytes of tensor data.
    pub fn data_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.len).sum()
    }

    /// Reads a tensor's bytes (one positional read).
    pub fn read(&self, loc: &TensorLoc) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; loc.len as usize];
        self.read_into(loc.shard, loc.offset, &mut buf)?;
        Ok(buf)
    }

    /// `true` reads every range buffered; `false` (the default) reads
    /// ranges from [`crate::direct::DIRECT_MIN`] up uncached where the
    /// filesystem allows. Either gives the same bytes.
    pub fn set_buffered_only(&self, on: bool) {
        self.buffered_only
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Reads `buf.len()` bytes at absolute `offset` of shard `shard`:
    /// uncached from [`crate::direct::DIRECT_MIN`] up where the filesystem
    /// allows (`crate::direct`), else buffered and then dropped from the
    /// page cache where the system can (Linux): what fathom keeps, it
    /// keeps in its own (budgeted) memory, not twice, and a streamed
    /// spine's every pass is read from storage.
    /// A shard not on disk is read through its remote source (fetched
    /// when not stored locally).
    pub fn read_into(&self, shard: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        let s = &self.shards[shard];
        let file = match &s.data {
            ShardData::Local(f) => f,
            ShardData::Remote(r) => {
                let io = |e: String| WeightsError::io(&s.path, std::io::Error::other(e));
                let got = r
                    .span(&s.name, offset, buf.len() as u64, true)
                    .map_err(io)?
                    .ok_or_else(|| io("the span was not returned".into()))?;
                if got.len() != buf.len() {
                    return Err(io(format!(
                        "{} bytes came back for a span of {}",
                        got.len(),
                        buf.len()
                    )));
                }
                buf.copy_from_slice(&got);
                count_read(buf.len());
                return Ok(());
            }
        };
        // A range past the file's end is read buffered, which reports it.
        if buf.len() >= crate::direct::DIRECT_MIN
            && offset.saturating_add(buf.len() as u64) <= s.len
            && !self
                .buffered_only
                .load(std::sync::atomic::Ordering::Relaxed)
            && s.uncached
                .read(&s.path, offset, buf)
                .map_err(|e| WeightsError::io(&s.path, e))?
        {
            count_read(buf.len());
            THREAD_DIRECT_BYTES.with(|c| c.set(c.get() + buf.len() as u64));
            return Ok(());
        }
        file.read_exact_at(buf, offset)
            .map_err(|e| WeightsError::io(&s.path, e))?;
        count_read(buf.len());
        // A refused hint only leaves the range cached.
        fathom_platform::io::advise(
            file,
            offset,
            buf.len() as u64,
            fathom_platform::io::Advice::DontNeed,
        );
        Ok(())
    }

    /// A tensor's bytes mapped read-only instead of read (`crate::mapped`):
    /// `None` for a shard not on disk or one the system will not map (the
    /// caller reads it instead).
    pub fn map(&self, loc: &TensorLoc) -> Result<Option<crate::mapped::Mapped>> {
        let s = &self.shards[loc.shard];
        let ShardData::Local(file) = &s.data else {
            return Ok(None);
        };
        let (Ok(off), Ok(len), Ok(whole)) = (
            usize::try_from(loc.offset),
            usize::try_from(loc.len),
            usize::try_from(s.len),
        ) else {
            return Ok(None);
        };
        let Some(cell) = self.maps.get(loc.shard) else {
            return Ok(None);
        };
        let map = cell.get_or_init(|| crate::mapped::ShardMap::new(file.clone(), whole));
        match map {
            Some(m) => crate::mapped::Mapped::new(m.clone(), off, len)
                .map(Some)
                .ok_or_else(|| {
                    WeightsError::io(
                        &s.path,
                        std::io::Error::other(format!(
                            "bytes {off}..{} lie past the file's {whole}",
                            off + len
                        )),
                    )
                }),
            None => Ok(None),
        }
    }

    /// Reads a 16-bit tensor (BF16/F16) straight into its element vector, with
    /// no intermediate byte copy (the spine's largest tensors are 100s of MB).
    pub fn read_u16(&self, loc: &TensorLoc) -> Result<Vec<u16>> {
        let mut v = vec![0u16; loc.len as usize / 2];
        // SAFETY: u16 has no invalid bit patterns and the byte view covers
        // exactly the vector's initialised storage. Files are little-endian,
        // as are all targets fathom builds for (checked below).
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), v.len() * 2) };
        self.read_into(loc.shard, loc.offset, bytes)?;
        if cfg!(target_endian = "big") {
            v.iter_mut().for_each(|x| *x = u16::from_le(*x));
        }
        Ok(v)
    }
}

/// A JSON object's entries in order, duplicates kept (a map would keep
/// only the last, hiding the duplicate).
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = m.next_entry()? {
                    v.push(e);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// The tensors must cover the data section exactly, as the reference
/// safetensors reader requires: no hole between two tensors and nothing
/// after the last. A header length off by a few bytes (every tensor then
/// read a few bytes early) shows up here.
fn check_coverage(spans: &[(u64, u64, String)], data_len: u64) -> std::result::Result<(), String> {
    let mut at = 0u64;
    for (begin, end, name) in spans {
        if *begin > at {
            return Err(format!(
                "{} bytes of the data section before tensor {name} belong to no tensor",
                begin - at
            ));
        }
        at = at.max(*end);
    }
    if at != data_len {
        return Err(format!(
            "{} bytes after the last tensor's data belong to no tensor (is the header length prefix right?)",
            data_len - at
        ));
    }
    Ok(())
}

/// Reads and validates a shard header. Offsets returned are absolute.
fn read_header(
    path: &Path,
    file: &File,
    file_len: u64,
    shard: usize,
) -> Result<HashMap<String, TensorLoc>> {
    let mut n = [0u8; 8];
    if file_len >= 8 {
        file.read_exact_at(&mut n, 0)
            .map_err(|e| WeightsError::io(path, e))?;
    }
    let len = u64::from_le_bytes(n);
    let mut header = n.to_vec();
    if file_len >= 8 && len <= MAX_HEADER && 8 + len <= file_len {
        header.resize(8 + len as usize, 0);
        file.read_exact_at(&mut header[8..], 8)
            .map_err(|e| WeightsError::io(path, e))?;
    }
    parse_header(path, &header, file_len, shard)
}

/// Validates a shard header (`header`: the 8-byte length and the JSON)
/// of a `file_len`-byte file. Offsets returned are absolute.
fn parse_header(
    path: &Path,
    header: &[u8],
    file_len: u64,
    shard: usize,
) -> Result<HashMap<String, TensorLoc>> {
    let bad = |msg: String| WeightsError::BadHeader {
        path: path.to_path_buf(),
        msg,
    };
    if file_len < 8 || header.len() < 8 {
        return Err(bad(format!(
            "file is {file_len} bytes, too short for a header"
        )));
    }
    let n = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER || 8 + n > file_len || header.len() as u64 != 8 + n {
        return Err(bad(format!(
            "header length {n} does not fit a {file_len}-byte file"
        )));
    }
    let json = &header[8..];
    let entries: Entries = serde_json::from_slice(json)
        .map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    let mut raw = BTreeMap::new();
    for (name, value) in entries.0 {
        if raw.insert(name.clone(), value).is_some() {
            return Err(WeightsError::BadTensor {
                path: path.to_path_buf(),
                tensor: name,
                msg: "listed twice in the header (duplicate key)".into(),
            });
        }
    }
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut out = HashMap::with_capacity(raw.len());
    let mut spans = Vec::with_capacity(raw.len());
    for (name, value) in raw {
        if name == "__metadata__" {
            continue;
        }
        let bad_t = |msg: String| WeightsError::BadTensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            msg,
        };
        let info: TensorInfo =
            serde_json::from_value(value).map_err(|e| bad_t(format!("bad entry: {e}")))?;
        let (begin, end) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        if begin > end || end > data_len {
            return Err(bad_t(format!(
                "data_offsets [{begin}, {end}] outside the {data_len}-byte data section"
            )));
        }
        let numel = info
            .shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(|| bad_t("shape overflows".into()))?;
        let bits = numel as u128 * info.dtype.bitsize() as u128;
        if !bits.is_multiple_of(8) || (bits / 8) as u64 != end - begin {
            return Err(bad_t(format!(
                "{:?} {:?} needs {} bytes but data_offsets span {}",
                info.dtype,
                info.shape,
                bits as f64 / 8.0,
                end - begin
            )));
        }
        spans.push((begin, end, name.clone()));
        out.insert(
            name,
            TensorLoc {
                shard,
                offset: data_start + begin,
                len: end - begin,
                dtype: info.dtype,
                shape: info.shape,
            },
        );
    }
    spans.sort();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(WeightsError::BadTensor {
                path: path.to_path_buf(),
                tensor: w[1].2.clone(),
                msg: format!("overlaps tensor {}", w[0].2),
            });
        }
    }
    check_coverage(&spans, data_len).map_err(bad)?;
    Ok(out)
}
