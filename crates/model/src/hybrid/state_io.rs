//! A sequence state as bytes (for prefix caches kept on disk), and back.
//!
//! Layout, little-endian: the family's magic (K3: `K3ST`), version `u32`, `pos: u64`, layer
//! count `u32`, then per layer a kind byte — KDA (`0`): three conv windows
//! and the recurrent state, each `u64` length + f32s; MLA (`1`): width `u32`,
//! row count `u64`, f32s. Decoding checks every length against the model's
//! dimensions before allocating, so a foreign or truncated file is an error.

use std::sync::Arc;

use fathom_kernels::state_buf::StateError;

use super::state::{LayerState, SequenceState};
use super::{AttnKind, HybridDims};
use crate::error::{ModelError, Result};
use crate::kv::KvPool;
use crate::state_codec::{Reader, bad, put_f32s, put_header, read_header};

const VERSION: u32 = 1;

/// The state as bytes.
pub fn encode(s: &SequenceState) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(s.bytes() + 64);
    put_header(&mut out, &s.dims().magic, VERSION, s.pos, s.layers.len());
    for l in &s.layers {
        match l {
            LayerState::Kda(k) => {
                out.push(0);
                for v in k.conv.iter().chain(std::iter::once(&k.s)) {
                    let v = v.read().map_err(|e| ModelError::State(e.to_string()))?;
                    put_f32s(&mut out, &v);
                }
            }
            LayerState::Mla(m) => {
                out.push(1);
                out.extend_from_slice(&(m.width as u32).to_le_bytes());
                put_f32s(&mut out, &m.to_rows()?);
            }
        }
    }
    Ok(out)
}

/// A state of the model shaped by `dims`, from [`encode`]'s bytes.
pub fn decode(dims: &Arc<HybridDims>, pool: &Arc<KvPool>, bytes: &[u8]) -> Result<SequenceState> {
    let mut r = Reader::new(bytes);
    // Every MLA layer holds pos rows: the header bounds pos by the bytes.
    let layers = dims.attn_kinds.len();
    let pos = read_header(
        &mut r,
        &dims.magic,
        dims.family,
        VERSION,
        layers,
        bytes.len(),
    )?;
    let mut s = SequenceState::new(dims, pool);
    s.pos = pos;
    for (i, (l, kind)) in s.layers.iter_mut().zip(&dims.attn_kinds).enumerate() {
        let tag = r.take(1)?[0];
        match (l, kind, tag) {
            (LayerState::Kda(k), AttnKind::Kda, 0) => {
                for (j, c) in k.conv.iter_mut().enumerate() {
                    *c = r
                        .f32s(c.len(), &format!("layer {i} conv window {j}"))?
                        .into();
                }
                k.s = r
                    .f32s(k.s.len(), &format!("layer {i} recurrent state"))?
                    .into();
            }
            (LayerState::Mla(m), AttnKind::Mla, 1) => {
                let w = r.u32()? as usize;
                if w != m.width {
                    return Err(bad(&format!(
                        "layer {i} rows are {w} wide, not {}",
                        m.width
                    )));
                }
                let want = pos.checked_mul(w).ok_or_else(|| bad("size overflow"))?;
                m.push_rows(&r.f32s(want, &format!("layer {i} latent cache"))?)?;
            }
            _ => return Err(bad(&format!("layer {i} is of another kind"))),
        }
    }
    r.finish()?;
    Ok(s)
}

/// A state at `depth` with pseudo-random KDA state (small) and latent rows
/// (unit scale, like the normalised latent).
pub fn synthetic(
    dims: &Arc<HybridDims>,
    pool: &Arc<KvPool>,
    depth: usize,
    seed: u64,
) -> Result<SequenceState> {
    let mut x = seed ^ 0x5DEE_CE66_D1CE_4E5B;
    let mut next = move |amp: f32| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
    };
    let mut s = SequenceState::new(dims, pool);
    s.pos = depth;
    for l in &mut s.layers {
        match l {
            LayerState::Kda(k) => {
                let err = |e: StateError| ModelError::State(e.to_string());
                k.s.host_mut()
                    .map_err(err)?
                    .iter_mut()
                    .for_each(|v| *v = next(0.02));
                for c in &mut k.conv {
                    c.host_mut()
                        .map_err(err)?
                        .iter_mut()
                        .for_each(|v| *v = next(0.5));
                }
            }
            LayerState::Mla(m) => {
                let w = m.width;
                let mut block = vec![0f32; w * super::state::BLOCK_ROWS];
                let mut left = depth;
                while left > 0 {
                    let k = left.min(super::state::BLOCK_ROWS);
                    block[..k * w].iter_mut().for_each(|v| *v = next(1.7));
                    m.push_rows(&block[..k * w])?;
                    left -= k;
                }
            }
        }
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use crate::lm::{CausalLm, Logits};

    fn tiny() -> std::sync::Arc<dyn CausalLm> {
        let p =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3-tiny/checkpoint");
        crate::load(&p, Default::default()).unwrap()
    }

    #[test]
    fn encoded_state_continues_bit_identically() {
        let m = tiny();
        let mut a = m.new_state();
        m.forward(a.as_mut(), &[1, 5, 9, 7, 3], Logits::None)
            .unwrap();
        let bytes = a.encode().unwrap();
        let mut b = m.decode_state(&bytes).unwrap();
        let mut c = a.fork();
        assert_eq!(b.pos(), 5);
        let la = m.forward(a.as_mut(), &[4, 2], Logits::All).unwrap();
        let lb = m.forward(b.as_mut(), &[4, 2], Logits::All).unwrap();
        let lc = m.forward(c.as_mut(), &[4, 2], Logits::All).unwrap();
        assert_eq!(la, lb);
        assert_eq!(la, lc);
        assert_eq!(b.encode().unwrap(), a.encode().unwrap());
    }

    #[test]
    fn foreign_or_damaged_bytes_are_refused() {
        let m = tiny();
        let mut a = m.new_state();
        m.forward(a.as_mut(), &[1, 5, 9], Logits::None).unwrap();
        let bytes = a.encode().unwrap();
        let err = |b: &[u8]| m.decode_state(b).err().expect("refused").to_string();
        assert!(err(&bytes[..bytes.len() - 3]).contains("ends early"));
        assert!(err(b"GGUF....").contains("magic"));
        let mut more = bytes.clone();
        more.push(0);
        assert!(err(&more).contains("left over"));
        let mut huge = bytes.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(&huge).contains("position"));
        let mut nan = bytes.clone();
        let at = nan.len() - 4;
        nan[at..].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(err(&nan).contains("non-finite"));
    }
}
