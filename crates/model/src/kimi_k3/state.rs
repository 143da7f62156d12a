//! Everything a sequence carries between passes, and O(1)-in-length snapshots.
//!
//! * KDA layers: the recurrent state `S [H, K, V]` (fp32) and, per q/k/v
//!   projection, the last `kernel − 1` pre-convolution rows.
//! * MLA layers: per token, the compressed latent after `kv_a_layernorm`
//!   (`kv_lora_rank` floats) and the shared key part `kr` (`qk_rope_head_dim`
//!   floats) — not per-head K/V, which would be `H·(dq+dv)` floats per token
//!   (K3: 576 vs 30,720 floats).
//!
//! A [`Snapshot`] copies only the fixed-size KDA pieces and remembers the
//! MLA cache lengths; [`SequenceState::restore`] truncates the caches back.
//! Rows appended after a snapshot are the only thing a rollback discards.

use super::config::{AttnKind, K3Spec};

#[derive(Debug, Clone)]
pub struct KdaState {
    /// Pre-convolution rows for q, k, v: `[kernel − 1, P]` each, oldest first.
    pub conv: [Vec<f32>; 3],
    /// `S_h ∈ R^{K×V}` per head, row-major `[H, K, V]`.
    pub s: Vec<f32>,
}

#[derive(Debug, Clone, Default)]
pub struct MlaCache {
    /// `[tokens, kv_lora_rank + qk_rope_head_dim]`: (normalised latent, kr).
    pub rows: Vec<f32>,
    pub width: usize,
}

impl MlaCache {
    pub fn len(&self) -> usize {
        self.rows.len() / self.width
    }
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

#[derive(Debug, Clone)]
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaCache),
}

/// The state of one sequence.
#[derive(Debug, Clone)]
pub struct SequenceState {
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub pos: usize,
}

/// A restorable point in a sequence.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pos: usize,
    kda: Vec<Option<KdaState>>,
    mla_len: Vec<usize>,
}

impl Snapshot {
    /// Bytes this snapshot holds (KDA state only; independent of sequence length).
    pub fn bytes(&self) -> usize {
        self.kda
            .iter()
            .flatten()
            .map(|k| 4 * (k.s.len() + k.conv.iter().map(Vec::len).sum::<usize>()))
            .sum()
    }
}

impl SequenceState {
    pub fn new(spec: &K3Spec) -> Self {
        let p = spec.kda_width();
        let layers = spec
            .attn_kinds
            .iter()
            .map(|k| match k {
                AttnKind::Kda => LayerState::Kda(KdaState {
                    conv: std::array::from_fn(|_| vec![0.0; (spec.conv_kernel - 1) * p]),
                    s: vec![0.0; spec.kda_heads * spec.kda_head_dim * spec.kda_head_dim],
                }),
                AttnKind::Mla => LayerState::Mla(MlaCache {
                    rows: Vec::new(),
                    width: spec.mla_cache_width(),
                }),
            })
            .collect();
        SequenceState { layers, pos: 0 }
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut kda = Vec::with_capacity(self.layers.len());
        let mut mla_len = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            match l {
                LayerState::Kda(k) => {
                    kda.push(Some(k.clone()));
                    mla_len.push(0);
                }
                LayerState::Mla(m) => {
                    kda.push(None);
                    mla_len.push(m.len());
                }
            }
        }
        Snapshot {
            pos: self.pos,
            kda,
            mla_len,
        }
    }

    /// Returns to `snap`, which must have been taken from this sequence at or
    /// before its current position.
    pub fn restore(&mut self, snap: &Snapshot) {
        assert!(
            snap.pos <= self.pos,
            "snapshot is from the future of this sequence"
        );
        for (i, l) in self.layers.iter_mut().enumerate() {
            match l {
                LayerState::Kda(k) => {
                    let saved = snap.kda[i].as_ref().expect("layer kinds do not change");
                    k.s.copy_from_slice(&saved.s);
                    for (c, sc) in k.conv.iter_mut().zip(&saved.conv) {
                        c.copy_from_slice(sc);
                    }
                }
                LayerState::Mla(m) => {
                    let w = m.width;
                    m.rows.truncate(snap.mla_len[i] * w);
                }
            }
        }
        self.pos = snap.pos;
    }

    /// Bytes held by this sequence's state.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(k) => 4 * (k.s.len() + k.conv.iter().map(Vec::len).sum::<usize>()),
                LayerState::Mla(m) => 4 * m.rows.len(),
            })
            .sum()
    }
}
