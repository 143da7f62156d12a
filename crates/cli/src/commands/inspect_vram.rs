//! `inspect --vram-budget [--gpus N]`: how `--device cuda` would place the
//! weights. The CUDA backend keeps weight segments in VRAM least recently
//! used first out; every spine matrix is used every token, so in the
//! steady state the spine stays and the experts share what is left. With
//! several devices the spine is on the first, and the routed experts are
//! shared out evenly (the placement balances the bytes read), each
//! device caching what its budget holds of its share.

use fathom_model::memory::MemoryFacts;
use serde_json::{Value, json};

use super::inspect::b;

/// The plan for each spine precision on `devices` devices of `vram` each:
/// spine in the first's VRAM (when it fits), each device's share of the
/// routed experts cached in what its budget leaves, the others computed
/// from RAM or disk copies.
pub fn plan(f: &MemoryFacts, vram: u64, devices: usize) -> Value {
    let total = f.total_experts() as u64;
    let one = f.expert_bytes.max(1);
    let n = devices.max(1) as u64;
    let per = |spine: u64| {
        let fits = spine <= vram;
        let cached: Vec<u64> = (0..n)
            .map(|d| {
                let share = total / n + u64::from(d < total % n);
                let room = if d > 0 {
                    vram
                } else if fits {
                    vram - spine
                } else {
                    0
                };
                (room / one).min(share)
            })
            .collect();
        let experts: u64 = cached.iter().sum();
        json!({
            "spine_bytes": spine,
            "spine_fits": fits,
            "experts_in_vram": experts,
            "experts_per_device": cached,
            "expert_bytes_in_vram": experts * one,
            "experts_elsewhere": total - experts,
            "vram_fraction_of_experts": if total > 0 { experts as f64 / total as f64 } else { 0.0 },
        })
    };
    json!({
        "budget_bytes": vram,
        "devices": n,
        "experts_total": total,
        "bf16": per(f.spine_bytes),
        "int8": per(f.spine_int8_bytes),
    })
}

/// Prints the plan `v`; `ledger` (the RAM plans, when a budget was given)
/// says which layers the device tier holds.
pub fn print(v: &Value, ledger: Option<&Value>) {
    match v["devices"].as_u64() {
        Some(n) if n > 1 => println!(
            "VRAM budget {} on each of {n} devices (--device cuda --gpus; the spine on the first):",
            b(&v["budget_bytes"])
        ),
        _ => println!("VRAM budget {} (--device cuda):", b(&v["budget_bytes"])),
    }
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
        let t = ledger.map(|l| &l[k]["tiers"]);
        if let Some(t) = t.filter(|t| t["device_layers"].as_u64().unwrap_or(0) > 0) {
            println!(
                "    the device tier holds {} of the layers the RAM plan reads for every pass ({}{}), copied up once, not in RAM",
                t["device_layers"],
                b(&t["device_bytes"]),
                if t["head_on_device"] == true {
                    ", the head with them"
                } else {
                    ""
                }
            );
        }
    }
}
