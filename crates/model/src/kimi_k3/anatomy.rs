//! K3's layer plan and its parameters by component, from the tensor table
//! (what `fathom inspect` draws).

use super::config::{AttnKind, FfnKind, K3Spec};
use super::tensors::{Role, tensor_table};
use crate::anatomy::{Anatomy, Component, LayerPlan};

/// Components reported, in order, with the roles each sums.
const COMPONENTS: [(&str, &[Role]); 9] = [
    ("embedding", &[Role::Embedding]),
    ("attention", &[Role::Attention]),
    ("dense_mlp", &[Role::DenseMlp]),
    ("router", &[Role::Router]),
    ("latent", &[Role::Latent]),
    ("shared_experts", &[Role::SharedExpert]),
    ("routed_experts", &[Role::RoutedExpert]),
    ("head", &[Role::Head]),
    ("norms_attn_res", &[Role::Norm, Role::AttnRes]),
];

/// The layer plan (`K` = KDA, `M` = MLA; `D` = dense MLP, `E` = MoE), the
/// blocks of attention residuals and every component's parameters and
/// stored bytes (a routed expert's MXFP4 byte holds two parameters; its
/// scales count as bytes only).
pub fn anatomy(spec: &K3Spec) -> Anatomy {
    let mut components: Vec<Component> = COMPONENTS
        .iter()
        .map(|&(name, _)| Component {
            name,
            params: 0,
            bytes: 0,
        })
        .collect();
    for t in tensor_table(spec) {
        let numel = t.shape.iter().product::<usize>() as u64;
        let params = match t.role {
            Role::RoutedExpert if t.name.ends_with("weight_packed") => 2 * numel,
            Role::RoutedExpert => 0,
            _ => numel,
        };
        if let Some(c) = COMPONENTS
            .iter()
            .position(|(_, roles)| roles.contains(&t.role))
            .map(|i| &mut components[i])
        {
            c.params += params;
            c.bytes += t.bytes();
        }
    }
    let attention = spec
        .attn_kinds
        .iter()
        .map(|k| if *k == AttnKind::Kda { 'K' } else { 'M' })
        .collect();
    let ffn = (0..spec.num_layers)
        .map(|i| match spec.ffn_kind(i) {
            FfnKind::Dense => 'D',
            FfnKind::Moe => 'E',
        })
        .collect();
    Anatomy {
        layers: spec.num_layers,
        attention: LayerPlan {
            letters: attention,
            legend: "K = KDA, M = MLA",
        },
        ffn: LayerPlan {
            letters: ffn,
            legend: "D = dense MLP, E = LatentMoE",
        },
        blocks: (0..spec.num_layers)
            .step_by(spec.attn_res_block_size)
            .collect(),
        components,
    }
}
