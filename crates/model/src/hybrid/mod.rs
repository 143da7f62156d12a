//! The hybrid attention of the Kimi line (Kimi-Linear and its successor K3):
//! Kimi Delta Attention layers with a carried recurrent state, NoPE MLA
//! layers over a compressed latent cache, and the sequence state that holds
//! both. Families bring their own projections (K3: a full-rank KDA output
//! gate, low-rank MLA queries and a gated MLA output; Kimi-Linear: a
//! low-rank KDA output gate, full-rank MLA queries, no MLA gate) and call
//! the shared cores here with their dimensions. DeepSeek-V3 / Kimi K2 use
//! the MLA core alone, with its rotary step.

pub mod kda;
pub mod mla;
pub mod state;
pub mod state_io;

/// Which attention a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttnKind {
    Kda,
    Mla,
}

/// Dimensions of the KDA layers.
pub use fathom_kernels::kda::KdaDims;

/// Dimensions of the MLA layers.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaDims {
    pub heads: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    /// The shared-key part (rotated only where the family passes an
    /// [`mla::MlaRope`]; the Kimi line's is NoPE).
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Epsilon of `kv_a_layernorm`.
    pub norm_eps: f32,
    /// Multiplies every attention score: [`MlaDims::plain_scale`], or more
    /// with YaRN (DeepSeek-V3).
    pub softmax_scale: f32,
}

impl MlaDims {
    /// `1/sqrt(qk_nope + qk_rope)`, the plain softmax scale.
    pub fn plain_scale(qk_nope_head_dim: usize, qk_rope_head_dim: usize) -> f32 {
        1.0 / ((qk_nope_head_dim + qk_rope_head_dim) as f32).sqrt()
    }
    /// Query/key head width (nope + "rope" part).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
    /// Floats cached per token: the normalised latent + the shared key part.
    pub fn cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// What a hybrid sequence state is shaped by.
#[derive(Debug, Clone, PartialEq)]
pub struct HybridDims {
    /// Layer kinds, 0-based.
    pub attn_kinds: Vec<AttnKind>,
    pub kda: KdaDims,
    pub mla: MlaDims,
    /// The family, for saved-state errors (`"Kimi K3"`).
    pub family: &'static str,
    /// The saved-state magic of the family.
    pub magic: [u8; 4],
}

impl HybridDims {
    /// Per-sequence state bytes that do not grow with the context: each KDA
    /// layer's recurrent state and its three convolution windows (f32).
    pub fn fixed_state_bytes(&self) -> u64 {
        let k = &self.kda;
        let layer = 4 * (k.heads * k.head_dim * k.head_dim + 3 * (k.conv_kernel - 1) * k.width());
        self.count(AttnKind::Kda) * layer as u64
    }

    /// Latent-cache floats per token over the MLA layers.
    pub fn cache_floats_per_token(&self) -> u64 {
        self.count(AttnKind::Mla) * self.mla.cache_width() as u64
    }

    fn count(&self, kind: AttnKind) -> u64 {
        self.attn_kinds.iter().filter(|k| **k == kind).count() as u64
    }
}

/// What a loaded hybrid model keeps besides its weights: its states' shape.
pub type HybridParts = std::sync::Arc<HybridDims>;
