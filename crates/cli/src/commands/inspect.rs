//! `fathom inspect`: what a K3 checkpoint is and what running it costs,
//! from `config.json` alone (so it answers before a download), plus the
//! actual shard sizes when they are present.
//!
//! Representations: the spine (everything but routed experts) as stored
//! (bf16, a few f32 vectors) or as row-wise int8 (1 byte per parameter of
//! every matrix plus a 4-byte scale per row; vectors stay as stored);
//! routed experts always in their MXFP4 form. A decode token reads the whole
//! spine once except the embedding, of which it reads one row, and
//! `top_k` experts in each MoE layer.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_model::kimi_k3::config::{AttnKind, FfnKind, K3Spec};
use fathom_model::kimi_k3::tensors::{Role, expert_bytes, tensor_table};
use fathom_synth::units::{format_bytes, parse_size};
use serde_json::{Value, json};

/// Describe a K3 model: layer plan, parameters and bytes by component,
/// bytes per decode token, and (with --ram-budget) how memory would be split.
#[derive(Args)]
pub struct InspectArgs {
    /// Model directory; only config.json is needed, shards are optional.
    dir: PathBuf,
    /// RAM available to the engine (e.g. 8GB, 24GiB): prints a ledger of
    /// spine, sequence state, scratch and the expert cache that is left.
    #[arg(long, value_parser = parse_size)]
    ram_budget: Option<u64>,
    /// Context length the sequence state is sized for (tokens).
    #[arg(long, default_value_t = 4096)]
    context: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

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

/// Sizes of one spine representation.
#[derive(Default, Clone, Copy)]
struct Spine {
    /// Everything resident.
    total: u64,
    /// What one decode token reads (one embedding row instead of the table).
    per_token: u64,
}

/// Per-component and per-representation totals from the tensor table.
struct Sizes {
    /// (name, params, stored bytes)
    components: Vec<(&'static str, u64, u64)>,
    bf16: Spine,
    int8: Spine,
}

fn sizes(spec: &K3Spec) -> Sizes {
    let mut components: Vec<(&str, u64, u64)> =
        COMPONENTS.iter().map(|(n, _)| (*n, 0, 0)).collect();
    let (mut bf16, mut int8) = (Spine::default(), Spine::default());
    for t in tensor_table(spec) {
        let numel = t.shape.iter().product::<usize>() as u64;
        let params = match t.role {
            Role::RoutedExpert if t.name.ends_with("weight_packed") => 2 * numel,
            Role::RoutedExpert => 0,
            _ => numel,
        };
        let i = COMPONENTS
            .iter()
            .position(|(_, roles)| roles.contains(&t.role))
            .expect("every role is in a component");
        components[i].1 += params;
        components[i].2 += t.bytes();
        if !t.role.is_spine() {
            continue;
        }
        let q = match t.shape.as_slice() {
            [rows, cols] => (*rows * *cols + 4 * *rows) as u64,
            _ => t.bytes(),
        };
        bf16.total += t.bytes();
        int8.total += q;
        if t.role == Role::Embedding {
            let d = spec.hidden_size as u64;
            bf16.per_token += d * t.dtype.bitsize() as u64 / 8;
            int8.per_token += d + 4;
        } else {
            bf16.per_token += t.bytes();
            int8.per_token += q;
        }
    }
    Sizes {
        components,
        bf16,
        int8,
    }
}

/// Sequence state for `context` tokens: KDA recurrent matrices `H·K·K`
/// fp32 and three conv windows of `kernel−1` rows of width `H·K` per KDA
/// layer; per MLA layer `(kv_lora + rope)` fp32 per token.
fn state_bytes(spec: &K3Spec, context: u64) -> (u64, u64) {
    let kda_layers = spec
        .attn_kinds
        .iter()
        .filter(|k| **k == AttnKind::Kda)
        .count() as u64;
    let mla_layers = spec.num_layers as u64 - kda_layers;
    let (h, k) = (spec.kda_heads as u64, spec.kda_head_dim as u64);
    let per_kda = h * k * k * 4 + 3 * (spec.conv_kernel as u64 - 1) * h * k * 4;
    let per_mla_token = spec.mla_cache_width() as u64 * 4;
    (kda_layers * per_kda, mla_layers * per_mla_token * context)
}

/// Working memory besides weights and state (an estimate): fp32 logits,
/// sixteen activation rows of the widest projection, and staging for two
/// MoE layers' experts in flight (streamed reads overlap compute).
fn scratch_bytes(spec: &K3Spec) -> u64 {
    let widest = [
        spec.hidden_size,
        spec.kda_width(),
        spec.mla_heads * spec.qk_head_dim(),
        spec.intermediate_size,
        spec.num_shared_experts * spec.moe_intermediate_size,
    ]
    .into_iter()
    .max()
    .unwrap_or(0) as u64;
    spec.vocab_size as u64 * 4 + 16 * widest * 4 + 2 * spec.top_k as u64 * expert_bytes(spec)
}

/// Compact layer plan: `K` = KDA, `M` = MLA; `D` = dense MLP, `E` = MoE.
fn layer_plan(spec: &K3Spec) -> (String, String) {
    let attn = spec
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
    (attn, ffn)
}

/// Shard files present next to config.json: (count, bytes).
fn shard_files(dir: &Path) -> Result<Option<(usize, u64)>> {
    let mut n = 0;
    let mut bytes = 0;
    for e in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") && !name.starts_with('.') {
            n += 1;
            bytes += e.metadata()?.len();
        }
    }
    Ok((n > 0).then_some((n, bytes)))
}

/// The RAM ledger of one spine representation.
fn ledger(spine: u64, state: u64, scratch: u64, budget: u64, spec: &K3Spec, moe: u64) -> Value {
    let eb = expert_bytes(spec);
    let fixed = spine + state + scratch;
    let all = spec.num_experts as u64 * moe;
    let cache = budget.saturating_sub(fixed);
    let experts = (cache / eb).min(all);
    json!({
        "spine_bytes": spine,
        "state_bytes": state,
        "scratch_bytes": scratch,
        "fits": budget >= fixed,
        "min_budget_bytes": fixed,
        "cache_bytes": experts * eb,
        "cache_experts": experts,
        "cache_fraction": if all > 0 { experts as f64 / all as f64 } else { 0.0 },
    })
}

/// Everything `inspect` reports, as JSON (the text form prints from it).
fn report(spec: &K3Spec, dir: &Path, budget: Option<u64>, context: u64) -> Result<Value> {
    let s = sizes(spec);
    let (attn, ffn) = layer_plan(spec);
    let moe_layers = spec.moe_layers().count() as u64;
    let eb = expert_bytes(spec);
    let routed_per_token = spec.top_k as u64 * eb * moe_layers;
    let (kda, mla) = state_bytes(spec, context);
    let scratch = scratch_bytes(spec);
    let blocks: Vec<usize> = (0..spec.num_layers)
        .step_by(spec.attn_res_block_size)
        .collect();
    let mut comps = serde_json::Map::new();
    for (name, p, b) in &s.components {
        comps.insert(name.to_string(), json!({"params": p, "bytes": b}));
    }
    let params: u64 = s.components.iter().map(|c| c.1).sum();
    let bytes: u64 = s.components.iter().map(|c| c.2).sum();
    let files = shard_files(dir)?.map(|(n, b)| json!({"shards": n, "bytes": b}));
    Ok(json!({
        "model": {
            "layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "vocab_size": spec.vocab_size, "experts": spec.num_experts,
            "top_k": spec.top_k, "moe_layers": moe_layers,
            "attention": attn, "ffn": ffn, "attn_res_blocks": blocks,
        },
        "components": comps,
        "total": {"params": params, "bytes": bytes},
        "expert_bytes": eb,
        "experts_total": spec.num_experts as u64 * moe_layers,
        "spine": {"bf16_bytes": s.bf16.total, "int8_bytes": s.int8.total},
        "per_token": {
            "spine_bf16_bytes": s.bf16.per_token,
            "spine_int8_bytes": s.int8.per_token,
            "routed_expert_bytes": routed_per_token,
        },
        "state": {"context": context, "kda_bytes": kda, "mla_bytes": mla, "total_bytes": kda + mla},
        "scratch_bytes": scratch,
        "ledger": budget.map(|b| json!({
            "budget_bytes": b,
            "bf16": ledger(s.bf16.total, kda + mla, scratch, b, spec, moe_layers),
            "int8": ledger(s.int8.total, kda + mla, scratch, b, spec, moe_layers),
        })),
        "files": files,
    }))
}

pub fn run(a: InspectArgs) -> Result<()> {
    if !a.dir.join("config.json").is_file() {
        bail!("{} has no config.json", a.dir.display());
    }
    let spec = K3Spec::from_dir(&a.dir)
        .with_context(|| format!("cannot read the model config in {}", a.dir.display()))?;
    let r = report(&spec, &a.dir, a.ram_budget, a.context)?;
    if a.json {
        println!("{r}");
    } else {
        print_text(&r);
    }
    Ok(())
}

fn b(v: &Value) -> String {
    format_bytes(v.as_u64().unwrap_or(0))
}

/// `1.23 B` parameters style.
fn count(v: &Value) -> String {
    let n = v.as_u64().unwrap_or(0) as f64;
    match n {
        x if x >= 1e9 => format!("{:.2} B", x / 1e9),
        x if x >= 1e6 => format!("{:.2} M", x / 1e6),
        x if x >= 1e3 => format!("{:.1} K", x / 1e3),
        x => format!("{x}"),
    }
}

/// Runs of one letter: `KKKM` → `K×3 M`.
fn runs(s: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        let mut n = 1;
        while chars.peek() == Some(&c) {
            chars.next();
            n += 1;
        }
        out.push(if n == 1 {
            c.to_string()
        } else {
            format!("{c}×{n}")
        });
    }
    out.join(" ")
}

fn print_text(r: &Value) {
    let m = &r["model"];
    println!(
        "Kimi K3: {} layers, hidden {}, vocab {}, {} routed experts (top-{}) in {} MoE layers",
        m["layers"], m["hidden_size"], m["vocab_size"], m["experts"], m["top_k"], m["moe_layers"]
    );
    let attn = m["attention"].as_str().unwrap_or("");
    let ffn = m["ffn"].as_str().unwrap_or("");
    println!("  attention  {}   (K = KDA, M = MLA)", runs(attn));
    println!(
        "  ffn        {}   (D = dense MLP, E = LatentMoE)",
        runs(ffn)
    );
    println!("  attn-res blocks open at layers {}", m["attn_res_blocks"]);
    println!();
    println!("{:<16} {:>12} {:>12}", "component", "params", "bytes");
    for (name, c) in r["components"].as_object().into_iter().flatten() {
        println!(
            "{name:<16} {:>12} {:>12}",
            count(&c["params"]),
            b(&c["bytes"])
        );
    }
    println!(
        "{:<16} {:>12} {:>12}",
        "total",
        count(&r["total"]["params"]),
        b(&r["total"]["bytes"])
    );
    println!();
    let p = &r["per_token"];
    println!(
        "one expert: {}; all {} experts: {}",
        b(&r["expert_bytes"]),
        r["experts_total"],
        b(&r["components"]["routed_experts"]["bytes"])
    );
    println!(
        "per decode token: spine {} (bf16) or {} (int8), routed experts {} (MXFP4)",
        b(&p["spine_bf16_bytes"]),
        b(&p["spine_int8_bytes"]),
        b(&p["routed_expert_bytes"])
    );
    let st = &r["state"];
    println!(
        "sequence state at {} tokens: {} (KDA {}, MLA {}); scratch ≈ {}",
        st["context"],
        b(&st["total_bytes"]),
        b(&st["kda_bytes"]),
        b(&st["mla_bytes"]),
        b(&r["scratch_bytes"])
    );
    if let Some(f) = r["files"].as_object() {
        println!("on disk: {} shard files, {}", f["shards"], b(&f["bytes"]));
    }
    if let Some(l) = r["ledger"].as_object() {
        print_ledger(l);
    }
}

fn print_ledger(l: &serde_json::Map<String, Value>) {
    println!();
    println!("RAM budget {}:", b(&l["budget_bytes"]));
    println!("{:<22} {:>14} {:>14}", "", "bf16 spine", "int8 spine");
    let row = |label: &str, key: &str| {
        println!(
            "{label:<22} {:>14} {:>14}",
            b(&l["bf16"][key]),
            b(&l["int8"][key])
        )
    };
    row("resident spine", "spine_bytes");
    row("sequence state", "state_bytes");
    row("scratch", "scratch_bytes");
    row("expert cache", "cache_bytes");
    let experts = |k: &str| {
        let x = &l[k];
        format!(
            "{} ({:.1}%)",
            x["cache_experts"],
            x["cache_fraction"].as_f64().unwrap_or(0.0) * 100.0
        )
    };
    println!(
        "{:<22} {:>14} {:>14}",
        "  in experts",
        experts("bf16"),
        experts("int8")
    );
    for k in ["bf16", "int8"] {
        if l[k]["fits"] == false {
            println!(
                "the {k} spine does not fit: it needs a budget of at least {} (with no expert cache)",
                b(&l[k]["min_budget_bytes"])
            );
        }
    }
}
