//! `fathom inspect` for every family but K3 (whose report also draws its
//! layer plan and components): what the family states about its memory —
//! spine, experts, bytes per decoded token, the attention cache at the
//! context — and, with `--ram-budget`, the ledger, from config.json alone.

use std::path::Path;

use anyhow::Result;
use fathom_model::memory::MemoryFacts;
use fathom_model::{KvDtype, Spine};
use fathom_stream::budget::{expert_ram_bytes, io_buffer_bytes, kv_bytes, scratch_bytes};
use serde_json::{Value, json};

use super::inspect::{KvArgs, b, ledger, print_ledger, shard_files};

/// The report as JSON (the text form prints from it).
fn report(f: &MemoryFacts, dir: &Path, budget: Option<u64>, kv: &KvArgs) -> Result<Value> {
    let routed = (f.top_k * f.moe_layers) as u64 * f.expert_bytes;
    let cache = kv_bytes(f, kv.context, kv.dtype);
    let ledgers = match budget {
        Some(b) => Some(json!({
            "budget_bytes": b,
            "bf16": ledger(f, Spine::Bf16, b, kv)?,
            "int8": ledger(&super::inspect::int8_facts(f, dir), Spine::Int8, b, kv)?,
        })),
        None => None,
    };
    Ok(json!({
        "model": {
            "family": f.family, "hidden_size": f.hidden_size, "vocab_size": f.vocab_size,
            "experts": f.num_experts, "top_k": f.top_k, "moe_layers": f.moe_layers,
            "max_position_embeddings": f.max_position_embeddings,
        },
        "expert_bytes": f.expert_bytes,
        "expert_ram_bytes": expert_ram_bytes(f),
        "experts_total": f.total_experts(),
        "spine": {"bf16_bytes": f.spine_bytes, "int8_bytes": f.spine_int8_bytes},
        "per_token": {
            "spine_bf16_bytes": f.spine_bytes_per_token(false),
            "spine_int8_bytes": f.spine_bytes_per_token(true),
            "routed_expert_bytes": routed,
        },
        "state": {"context": kv.context, "fixed_bytes": f.fixed_state_bytes,
                  "cache_bytes": cache, "total_bytes": f.fixed_state_bytes + cache,
                  "kv_dtype": kv.dtype.name()},
        "pass_tokens": super::inspect::positions(),
        "scratch_bytes": scratch_bytes(f, super::inspect::positions()),
        "io_buffers_bytes": io_buffer_bytes(f, super::inspect::positions(), 2 * f.top_k),
        "ledger": ledgers,
        "files": shard_files(dir)?.map(|(n, b)| json!({"shards": n, "bytes": b})),
    }))
}

pub fn run(
    (f, dir): (&MemoryFacts, &Path),
    budget: Option<u64>,
    context: Option<usize>,
    kv_ram: Option<u64>,
    dtype: KvDtype,
    (json, vram, disk_bw): (bool, Option<Value>, u64),
) -> Result<()> {
    let kv = KvArgs {
        context: context
            .or(f.max_position_embeddings)
            .unwrap_or(crate::load::ASSUMED_CONTEXT),
        ram: kv_ram,
        dtype,
        index: fathom_runtime::plan::index_ram(fathom_runtime::plan::index_bytes(dir)),
        disk_bw,
        vram: vram.as_ref().and_then(|v| v["budget_bytes"].as_u64()),
    };
    let mut r = report(f, dir, budget, &kv)?;
    if let Some(v) = &vram {
        r["vram"] = v.clone();
    }
    if json {
        println!("{r}");
        return Ok(());
    }
    let m = &r["model"];
    println!(
        "{}: hidden {}, vocab {}, {} routed experts (top-{}) in {} MoE layers",
        f.family, m["hidden_size"], m["vocab_size"], m["experts"], m["top_k"], m["moe_layers"]
    );
    println!(
        "resident spine {} (bf16) or {} (int8); one expert {} ({} in RAM), all {} experts",
        b(&r["spine"]["bf16_bytes"]),
        b(&r["spine"]["int8_bytes"]),
        b(&r["expert_bytes"]),
        b(&r["expert_ram_bytes"]),
        r["experts_total"]
    );
    let p = &r["per_token"];
    println!(
        "per decode token: spine {} (bf16) or {} (int8), routed experts {}",
        b(&p["spine_bf16_bytes"]),
        b(&p["spine_int8_bytes"]),
        b(&p["routed_expert_bytes"])
    );
    let st = &r["state"];
    println!(
        "sequence state at {} tokens: {} (fixed {}, attention cache {} as {})",
        st["context"],
        b(&st["total_bytes"]),
        b(&st["fixed_bytes"]),
        b(&st["cache_bytes"]),
        st["kv_dtype"].as_str().unwrap_or("")
    );
    if let Some(fl) = r["files"].as_object() {
        println!("on disk: {} shard files, {}", fl["shards"], b(&fl["bytes"]));
    }
    if let Some(l) = r["ledger"].as_object() {
        print_ledger(l);
    }
    if let Some(v) = &vram {
        super::inspect_vram::print(v, r.get("ledger").filter(|l| !l.is_null()));
    }
    Ok(())
}
