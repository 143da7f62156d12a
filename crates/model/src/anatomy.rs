//! What `fathom inspect` draws of a model beyond its memory facts: the
//! plan of its layers and its parameters by component, from `config.json`
//! alone. A family that can say it implements
//! [`crate::family::Family::anatomy`].

/// One row of letters, a layer each, and what the letters mean.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    /// One letter a layer (`KKKM`).
    pub letters: String,
    /// What the letters stand for (`K = KDA, M = MLA`).
    pub legend: &'static str,
}

/// One component's parameters and stored bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Component {
    pub name: &'static str,
    pub params: u64,
    pub bytes: u64,
}

/// A model's layer plan and components.
#[derive(Debug, Clone, PartialEq)]
pub struct Anatomy {
    pub layers: usize,
    /// The attention side of each layer.
    pub attention: LayerPlan,
    /// The MLP side of each layer.
    pub ffn: LayerPlan,
    /// Layers where a block of attention residuals opens (none when the
    /// residual is plain).
    pub blocks: Vec<usize>,
    /// Every component in report order; together they are the checkpoint.
    pub components: Vec<Component>,
}
