//! The pieces of a saved sequence state shared by the families' encoders:
//! little-endian lengths and f32 runs, read back with every length checked
//! against the model before anything is allocated.

use crate::error::{ModelError, Result};

/// Appends `v` as a `u64` length and little-endian f32s.
pub(crate) fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Reads what [`put_f32s`] and plain little-endian integers wrote, checking
/// every length before allocating.
pub(crate) struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.b.len() < n {
            return Err(bad("the data ends early"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    /// `want` floats (length checked before reading).
    pub(crate) fn f32s(&mut self, want: usize, what: &str) -> Result<Vec<f32>> {
        let n = self.u64()?;
        if n != want as u64 {
            return Err(bad(&format!(
                "{what} has {n} values, the model needs {want}"
            )));
        }
        let raw = self.take(want.checked_mul(4).ok_or_else(|| bad("size overflow"))?)?;
        let v: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
            .collect();
        if v.iter().any(|x| !x.is_finite()) {
            return Err(bad(&format!("{what} holds non-finite values")));
        }
        Ok(v)
    }
    /// Fails if bytes are left over.
    pub(crate) fn finish(&self) -> Result<()> {
        if !self.b.is_empty() {
            return Err(bad(&format!("{} bytes left over", self.b.len())));
        }
        Ok(())
    }
}

/// A decoding error.
pub(crate) fn bad(why: &str) -> ModelError {
    ModelError::State(format!("saved state does not fit this model: {why}"))
}

/// Writes the common head: magic, format version, position, layer count.
pub(crate) fn put_header(
    out: &mut Vec<u8>,
    magic: &[u8; 4],
    version: u32,
    pos: usize,
    layers: usize,
) {
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(pos as u64).to_le_bytes());
    out.extend_from_slice(&(layers as u32).to_le_bytes());
}

/// Reads and checks the head [`put_header`] wrote (`family` names the state
/// kind in errors); returns the position. The position is bounded by the
/// bytes' length (every cached layer holds at least a byte per position).
pub(crate) fn read_header(
    r: &mut Reader<'_>,
    magic: &[u8; 4],
    family: &str,
    version: u32,
    layers: usize,
    total: usize,
) -> Result<usize> {
    if r.take(4)? != magic {
        return Err(bad(&format!("not a {family} state (magic)")));
    }
    let v = r.u32()?;
    if v != version {
        return Err(bad(&format!(
            "format version {v}, this build reads {version}"
        )));
    }
    let pos = r.u64()?;
    if pos > total as u64 {
        return Err(bad(&format!("position {pos} exceeds what the data holds")));
    }
    let n = r.u32()? as usize;
    if n != layers {
        return Err(bad(&format!("{n} layers, the model has {layers}")));
    }
    Ok(pos as usize)
}
