//! `inspect --vram-budget`: how `--device cuda` would place the weights.
//! The CUDA backend keeps weight segments in VRAM least recently used
//! first out; every spine matrix is used every token, so in the steady
//! state the spine stays and the experts share what is left.

use fathom_model::memory::MemoryFacts;
use serde_json::{Value, json};

use super::inspect::b;

/// The plan for each spine precision: spine in VRAM (when it fits), routed
/// experts cached in the rest, the others computed from RAM or disk copies.
pub fn plan(f: &MemoryFacts, vram: u64) -> Value {
    let total = f.total_experts() as u64;
    let one = f.expert_bytes.max(1);
    let per = |spine: u64| {
        let fits = spine <= vram;
        let left = vram.saturating_sub(spine);
        let experts = if fits { (left / one).min(total) } else { 0 };
        json!({
            "spine_bytes": spine,
            "spine_fits": fits,
            "experts_in_vram": experts,
            "expert_bytes_in_vram": experts * one,
            "experts_elsewhere": total - experts,
            "vram_fraction_of_experts": if total > 0 { experts as f64 / total as f64 } else { 0.0 },
        })
    };
    json!({
        "budget_bytes": vram,
        "experts_total": total,
        "bf16": per(f.spine_bytes),
        "int8": per(f.spine_int8_bytes),
    })
}

pub fn print(v: &Value) {
    println!("VRAM budget {} (--device cuda):", b(&v["budget_bytes"]));
    for k in ["bf16", "int8"] {
        let p = &v[k];
        if p["spine_fits"] == true {
            println!(
                "  {k} spine {} in VRAM; {} of {} experts ({}) cached there, {} copied from RAM or disk when used",
                b(&p["spine_bytes"]),
                p["experts_in_vram"],
                v["experts_total"],
                b(&p["expert_bytes_in_vram"]),
                p["experts_elsewhere"]
            );
        } else {
            println!(
                "  {k} spine {} does not fit: matrices beyond the budget are computed on the CPU",
                b(&p["spine_bytes"])
            );
        }
    }
}
