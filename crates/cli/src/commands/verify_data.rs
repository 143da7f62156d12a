//! `fathom verify --data`: scans every tensor's values for what would make
//! the forward pass silently wrong — non-finite bf16/f16/f32 values and
//! E8M0 scale bytes of 0xFF (NaN scales of MXFP4 experts).

use anyhow::Result;
use fathom_weights::{Checkpoint, Dtype, TensorLoc};
use rayon::prelude::*;

/// Bytes read per chunk (bounded memory whatever the tensor size).
const CHUNK: u64 = 16 << 20;

/// How many bad values a tensor holds, and the first one's index.
fn scan(ck: &Checkpoint, name: &str, loc: &TensorLoc) -> Result<Option<(u64, u64)>> {
    let elem = match loc.dtype {
        Dtype::BF16 | Dtype::F16 => 2,
        Dtype::F32 => 4,
        Dtype::U8 if name.ends_with("weight_scale") => 1,
        _ => return Ok(None),
    };
    let mut bad = 0u64;
    let mut first = None;
    let mut buf = vec![0u8; CHUNK.min(loc.len) as usize];
    let mut done = 0u64;
    while done < loc.len {
        let n = (loc.len - done).min(CHUNK) as usize;
        ck.read_into(loc.shard, loc.offset + done, &mut buf[..n])?;
        for (i, c) in buf[..n].chunks_exact(elem).enumerate() {
            let nonfinite = match (loc.dtype, elem) {
                (Dtype::BF16, _) => u16::from_le_bytes([c[0], c[1]]) & 0x7F80 == 0x7F80,
                (Dtype::F16, _) => u16::from_le_bytes([c[0], c[1]]) & 0x7C00 == 0x7C00,
                (Dtype::F32, _) => !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite(),
                _ => c[0] == 0xFF,
            };
            if nonfinite {
                bad += 1;
                first.get_or_insert(done / elem as u64 + i as u64);
            }
        }
        done += n as u64;
    }
    Ok(first.map(|f| (bad, f)))
}

/// Every problem found, one line each (file, tensor, count, first index).
pub fn check_values(ck: &Checkpoint, bar: &crate::progress::ByteProgress) -> Result<Vec<String>> {
    let mut tensors: Vec<(&str, &TensorLoc)> = ck.tensors().collect();
    tensors.sort_by_key(|(n, _)| *n);
    let found: Vec<Result<Option<String>>> = tensors
        .par_iter()
        .map(|(name, loc)| {
            let r = scan(ck, name, loc)?;
            bar.inc(loc.len);
            Ok(r.map(|(n, first)| {
                let what = if loc.dtype == Dtype::U8 {
                    "E8M0 scale bytes 0xFF (NaN)"
                } else {
                    "non-finite values"
                };
                format!(
                    "{}: tensor {name}: {n} {what}, the first at element {first}",
                    ck.shards()[loc.shard].path.display()
                )
            }))
        })
        .collect();
    let mut out = Vec::new();
    for f in found {
        out.extend(f?);
    }
    Ok(out)
}
