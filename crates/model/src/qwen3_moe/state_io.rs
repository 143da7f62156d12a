//! A Qwen3-MoE sequence state as bytes, and back.
//!
//! Layout, little-endian: magic `Q3ST`, version `u32`, `pos: u64`, layer
//! count `u32`, then per layer the row width `u32` and the rows (`u64`
//! length + f32s, `pos · width` of them). Decoding checks every length
//! against the model's dimensions before allocating.

use std::sync::Arc;

use super::config::Qwen3MoeSpec;
use super::state::KvState;
use crate::error::Result;
use crate::kv::KvPool;
use crate::state_codec::{Reader, bad, put_f32s, put_header, read_header};

const MAGIC: &[u8; 4] = b"Q3ST";
const VERSION: u32 = 1;

pub(crate) fn encode(s: &KvState) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(s.bytes() + 64);
    put_header(&mut out, MAGIC, VERSION, s.pos, s.layers.len());
    for l in &s.layers {
        out.extend_from_slice(&(l.width as u32).to_le_bytes());
        put_f32s(&mut out, &l.to_rows()?);
    }
    Ok(out)
}

pub(crate) fn decode(spec: &Qwen3MoeSpec, pool: &Arc<KvPool>, bytes: &[u8]) -> Result<KvState> {
    let mut r = Reader::new(bytes);
    let layers = spec.num_layers;
    let pos = read_header(&mut r, MAGIC, "Qwen3-MoE", VERSION, layers, bytes.len())?;
    let width = spec.kv_width();
    let mut s = KvState::new(layers, width, pool);
    s.pos = pos;
    for (i, l) in s.layers.iter_mut().enumerate() {
        let w = r.u32()? as usize;
        if w != width {
            return Err(bad(&format!("layer {i} rows are {w} wide, not {width}")));
        }
        let want = pos.checked_mul(w).ok_or_else(|| bad("size overflow"))?;
        l.push_rows(&r.f32s(want, &format!("layer {i} key/value cache"))?)?;
    }
    r.finish()?;
    Ok(s)
}
