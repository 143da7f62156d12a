//! `fathom inspect`: what a checkpoint is and what running it costs,
//! from `config.json` alone (so it answers before a download), plus the
//! actual shard sizes when they are present.
//!
//! The report below is for a family that draws its layer plan and
//! components ([`fathom_model::anatomy::Anatomy`]); every other family's is
//! `inspect_facts`'s.
//!
//! Representations: the spine (everything but routed experts) as stored
//! (bf16, a few f32 vectors) or as `--spine int8` leaves it (row-wise int8
//! projection matrices, 1 byte per weight plus a 4-byte scale per row; the
//! embedding, routers and vectors stay as stored); routed experts always in
//! their MXFP4 form. A decode token reads the whole spine once except the
//! embedding, of which it reads one row, and `top_k` experts in each MoE
//! layer. State, scratch, I/O buffers and the RAM ledger are
//! [`fathom_stream::budget`]'s, the ones the loader sizes its cache with,
//! for a run's default pass (a verification of 8 drafted tokens) with
//! next-layer prefetch on (the `run` defaults).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use fathom_model::Spine;
use fathom_model::anatomy::Anatomy;
use fathom_model::memory::MemoryFacts;
use fathom_stream::budget::{
    KvPlan, Ledger, expert_ram_bytes, io_buffer_bytes, kda_state_bytes, kv_bytes, scratch_bytes,
    spine_bytes_for,
};
use fathom_weights::units::{format_bytes, parse_size};
use serde_json::{Value, json};

/// Describe a model: layer plan, parameters and bytes by component,
/// bytes per decode token, and (with --ram-budget) how memory would be split.
#[derive(Args)]
pub struct InspectArgs {
    /// Model directory; only config.json is needed, shards are optional.
    dir: PathBuf,
    /// RAM available to the engine (e.g. 8GB, 24GiB): prints a ledger of
    /// spine, sequence state, scratch and the expert cache that is left.
    #[arg(long, value_parser = parse_size)]
    ram_budget: Option<u64>,
    /// Context length the sequence state is sized for (tokens; default: the
    /// model's max_position_embeddings).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=(1 << 26)))]
    context: Option<usize>,
    /// RAM share of the attention cache (default: what the context needs,
    /// at most a quarter of the budget); the rest is planned on disk.
    #[arg(long, value_parser = parse_size)]
    kv_ram: Option<u64>,
    /// Attention-cache row format.
    #[arg(long, value_enum, default_value_t = crate::load::KvDtypeArg::F32)]
    kv_dtype: crate::load::KvDtypeArg,
    /// Device memory for weights: also prints how `--device cuda` would
    /// place the spine and the routed experts (e.g. 80GB).
    #[arg(long, value_parser = parse_size)]
    vram_budget: Option<u64>,
    /// With --vram-budget: plan for these CUDA devices, as `run --gpus`
    /// takes them (a count or a list), each with that budget.
    #[arg(long, value_parser = crate::device::parse_gpus, requires = "vram_budget")]
    gpus: Option<crate::device::Gpus>,
    /// Disk read bandwidth the projected seconds per pass assume (bytes
    /// per second, e.g. 7GB: a fast NVMe drive; `fathom bench` measures
    /// yours).
    #[arg(long, value_parser = parse_size, default_value = "7GB")]
    disk_bw: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Shard files present next to config.json: (count, bytes).
pub(crate) fn shard_files(dir: &Path) -> Result<Option<(usize, u64)>> {
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

/// Tokens per pass the ledger is planned for: a run's pass with its
/// default drafting (a verification of `--draft-max` drafted tokens), the
/// pass `fathom run` plans for a short prompt.
pub(crate) fn positions() -> usize {
    super::run::default_pass()
}

/// The budget ledger of one spine representation: its fields, plus whether
/// it fits, the least budget that would, and the cached share of experts.
pub(crate) fn ledger(facts: &MemoryFacts, spine: Spine, budget: u64, kv: &KvArgs) -> Result<Value> {
    // The parsed tensor index is set aside first, as a run does.
    let rest = budget.saturating_sub(kv.index);
    let plan = KvPlan::new(facts, kv.context, 1, kv.dtype, kv.ram, rest);
    let inflight = 2 * facts.top_k;
    let min = Ledger::minimum(facts, spine, kv.context, plan, positions(), inflight);
    // The least budget: every spine layer read for every pass (and the
    // head, where reading it in blocks holds less).
    let least = min.clone().all_streamed(facts);
    let fixed = least.least_budget().max(least.load_peak) + kv.index;
    let (fits, l) = match min.clone().with_budget(facts, rest) {
        Ok(l) => {
            let l = match kv.vram {
                Some(v) => {
                    let room = fathom_runtime::device_room(v, l.state);
                    l.with_device(facts, room)
                }
                None => l,
            };
            (true, Ledger { budget, ..l })
        }
        Err(_) => (
            false,
            Ledger {
                budget,
                ..least.clone()
            },
        ),
    };
    let all = facts.total_experts();
    let verdict = verdict(&least, &l, fits, fixed, all, kv.index);
    let cached = if all > 0 {
        l.cache_experts as f64 / all as f64
    } else {
        0.0
    };
    // A pass reads the streamed layers once and, with experts hit in
    // proportion to the cache (no heat assumed), the missed share of its
    // top-k experts in each MoE layer.
    let bw = kv.disk_bw.max(1) as f64;
    let routed = (facts.top_k * facts.moe_layers) as u64 * facts.expert_bytes;
    let (spine_s, expert_s) = (
        l.tiers.read_seconds(bw),
        routed as f64 * (1.0 - cached) / bw,
    );
    let mut v = serde_json::to_value(&l)?;
    let extra = json!({
        "spine_bytes": l.spine,
        "state_bytes": l.state,
        "scratch_bytes": l.scratch,
        "io_buffers_bytes": l.io_buffers,
        "cache_bytes": l.cache,
        "kv_ram_bytes": l.kv.ram,
        "kv_disk_bytes": l.kv.disk,
        "load_peak_bytes": l.load_peak,
        "peak_bytes": l.peak(),
        "fits": fits,
        "min_budget_bytes": fixed,
        "tensor_index_bytes": kv.index,
        "verdict": verdict,
        "cache_fraction": cached,
        "projected": {
            "disk_bw": kv.disk_bw,
            "spine_read_s": spine_s,
            "expert_read_s": expert_s,
            "seconds_per_pass": spine_s + expert_s,
        },
    });
    for (k, x) in extra.as_object().into_iter().flatten() {
        v[k] = x.clone();
    }
    Ok(v)
}

/// One column's verdict: fits or not, why, and the least budget that
/// works (`least`: the plan with every spine layer read for every pass).
fn verdict(
    least: &Ledger,
    l: &Ledger,
    fits: bool,
    mb_least: u64,
    all: usize,
    index: u64,
) -> String {
    let mb = mb_least.div_ceil(1_000_000);
    let every = if least.tiers.head_on_disk {
        "every layer and the head"
    } else {
        "every layer"
    };
    if fits {
        return format!(
            "fits: {} of {} layers resident, {} of {all} experts cached; the least budget that works is --ram-budget {mb}MB ({every} read for every pass, no expert cache)",
            l.tiers.resident_layers, l.tiers.layers, l.cache_experts
        );
    }
    if least.least_budget() >= least.load_peak {
        format!(
            "does not fit: with {every} read for every pass, the spine's globals and ring, state, scratch, I/O buffers and tensor index need {} — give at least --ram-budget {mb}MB",
            format_bytes(least.least_budget() + index)
        )
    } else {
        format!(
            "does not fit: loading holds the spine's globals and ring, one layer as stored, scratch and the tensor index ({}) before it is quantised to {} — give at least --ram-budget {mb}MB",
            format_bytes(least.load_peak + index),
            least.spine_repr
        )
    }
}

/// The attention-cache plan asked for, the RAM set aside for the tensor
/// index, and the disk bandwidth the projections assume.
pub(crate) struct KvArgs {
    pub context: usize,
    pub ram: Option<u64>,
    pub dtype: fathom_model::KvDtype,
    /// RAM for the parsed tensor index (`fathom_runtime::plan::index_ram`).
    pub index: u64,
    pub disk_bw: u64,
    /// `--vram-budget`: layers the plan reads for every pass are held on
    /// the device as far as it goes (as `run --device cuda` places them).
    pub vram: Option<u64>,
}

/// The facts an int8 plan of `dir` uses: beside an int8 spine file, a
/// streamed layer reads its int8 bytes (as `fathom_runtime::plan` plans).
pub(crate) fn int8_facts(facts: &MemoryFacts, dir: &Path) -> MemoryFacts {
    if dir.join(fathom_weights::int8_spine::FILE_NAME).is_file() {
        facts.clone().with_int8_file()
    } else {
        facts.clone()
    }
}

fn report(
    facts: &MemoryFacts,
    an: &Anatomy,
    dir: &Path,
    budget: Option<u64>,
    kv: &KvArgs,
) -> Result<Value> {
    let context = kv.context;
    let moe_layers = facts.moe_layers as u64;
    let eb = facts.expert_bytes;
    let routed_per_token = facts.top_k as u64 * eb * moe_layers;
    let (kda, mla) = (kda_state_bytes(facts), kv_bytes(facts, context, kv.dtype));
    let (bf16, int8) = (
        spine_bytes_for(facts, Spine::Bf16),
        spine_bytes_for(facts, Spine::Int8),
    );
    let mut comps = serde_json::Map::new();
    for c in &an.components {
        comps.insert(c.name.into(), json!({"params": c.params, "bytes": c.bytes}));
    }
    let params: u64 = an.components.iter().map(|c| c.params).sum();
    let bytes: u64 = an.components.iter().map(|c| c.bytes).sum();
    let files = shard_files(dir)?.map(|(n, b)| json!({"shards": n, "bytes": b}));
    let ledgers = match budget {
        Some(b) => Some(json!({
            "budget_bytes": b,
            "bf16": ledger(facts, Spine::Bf16, b, kv)?,
            "int8": ledger(&int8_facts(facts, dir), Spine::Int8, b, kv)?,
        })),
        None => None,
    };
    Ok(json!({
        "model": {
            "family": facts.family, "layers": an.layers, "hidden_size": facts.hidden_size,
            "vocab_size": facts.vocab_size, "experts": facts.num_experts,
            "top_k": facts.top_k, "moe_layers": moe_layers,
            "attention": an.attention.letters, "ffn": an.ffn.letters,
            "legend": {"attention": an.attention.legend, "ffn": an.ffn.legend},
            "attn_res_blocks": an.blocks,
        },
        "components": comps,
        "total": {"params": params, "bytes": bytes},
        "expert_bytes": eb,
        "expert_ram_bytes": expert_ram_bytes(facts),
        "experts_total": facts.total_experts(),
        "spine": {"bf16_bytes": bf16, "int8_bytes": int8},
        "per_token": {
            "spine_bf16_bytes": facts.spine_bytes_per_token(false),
            "spine_int8_bytes": facts.spine_bytes_per_token(true),
            "routed_expert_bytes": routed_per_token,
        },
        "state": {"context": context, "kda_bytes": kda, "mla_bytes": mla, "total_bytes": kda + mla,
                  "kv_dtype": kv.dtype.name()},
        "pass_tokens": positions(),
        "scratch_bytes": scratch_bytes(facts, positions()),
        // Expert reads in flight with next-layer prefetch on (as a load plans).
        "io_buffers_bytes": io_buffer_bytes(facts, positions(), 2 * facts.top_k),
        "ledger": ledgers,
        "files": files,
    }))
}

pub fn run(a: InspectArgs) -> Result<()> {
    if !a.dir.join("config.json").is_file() {
        bail!("{} has no config.json", a.dir.display());
    }
    let config = fathom_model::ModelConfig::read(&a.dir)
        .with_context(|| format!("cannot read the model config in {}", a.dir.display()))?;
    let cannot = || format!("cannot read the model config in {}", a.dir.display());
    let facts = config.memory_facts().with_context(cannot)?;
    let vram = a
        .vram_budget
        .map(|v| super::inspect_vram::plan(&facts, v, a.gpus.as_ref().map_or(1, |g| g.0.len())));
    let Some(anatomy) = config.anatomy().with_context(cannot)? else {
        return super::inspect_facts::run(
            (&facts, &a.dir),
            a.ram_budget,
            a.context,
            a.kv_ram,
            a.kv_dtype.into(),
            (a.json, vram, a.disk_bw),
        );
    };
    let kv = KvArgs {
        context: a
            .context
            .or(facts.max_position_embeddings)
            .unwrap_or(crate::load::ASSUMED_CONTEXT),
        ram: a.kv_ram,
        dtype: a.kv_dtype.into(),
        index: fathom_runtime::plan::index_ram(fathom_runtime::plan::index_bytes(&a.dir)),
        disk_bw: a.disk_bw,
        vram: a.vram_budget,
    };
    let mut r = report(&facts, &anatomy, &a.dir, a.ram_budget, &kv)?;
    if let Some(v) = &vram {
        r["vram"] = v.clone();
    }
    if a.json {
        println!("{r}");
    } else {
        print_text(&r);
        if let Some(v) = &vram {
            super::inspect_vram::print(v, r.get("ledger").filter(|l| !l.is_null()));
        }
    }
    Ok(())
}

pub(crate) fn b(v: &Value) -> String {
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
        "{}: {} layers, hidden {}, vocab {}, {} routed experts (top-{}) in {} MoE layers",
        m["family"].as_str().unwrap_or(""),
        m["layers"],
        m["hidden_size"],
        m["vocab_size"],
        m["experts"],
        m["top_k"],
        m["moe_layers"]
    );
    let attn = m["attention"].as_str().unwrap_or("");
    let ffn = m["ffn"].as_str().unwrap_or("");
    let legend = |k: &str| m["legend"][k].as_str().unwrap_or("").to_string();
    println!("  attention  {}   ({})", runs(attn), legend("attention"));
    println!("  ffn        {}   ({})", runs(ffn), legend("ffn"));
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
        "one expert: {} ({} in RAM); all {} experts: {}",
        b(&r["expert_bytes"]),
        b(&r["expert_ram_bytes"]),
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
        "sequence state at {} tokens: {} (KDA {}, MLA {} as {}); scratch ≈ {}; I/O buffers {} (a pass of {} tokens, as run plans)",
        st["context"],
        b(&st["total_bytes"]),
        b(&st["kda_bytes"]),
        b(&st["mla_bytes"]),
        st["kv_dtype"].as_str().unwrap_or(""),
        b(&r["scratch_bytes"]),
        b(&r["io_buffers_bytes"]),
        r["pass_tokens"]
    );
    if let Some(f) = r["files"].as_object() {
        println!("on disk: {} shard files, {}", f["shards"], b(&f["bytes"]));
    }
    if let Some(l) = r["ledger"].as_object() {
        print_ledger(l);
    }
}

pub(crate) fn print_ledger(l: &serde_json::Map<String, Value>) {
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
    let tier = |k: &str, f: &dyn Fn(&Value) -> String| {
        println!(
            "{k:<22} {:>14} {:>14}",
            f(&l["bf16"]["tiers"]),
            f(&l["int8"]["tiers"])
        )
    };
    tier("  of it globals", &|t| b(&t["global_bytes"]));
    tier("  resident layers", &|t| {
        format!("{}/{}", t["resident_layers"], t["layers"])
    });
    tier("  of them bytes", &|t| b(&t["resident_bytes"]));
    if l["bf16"]["tiers"]["device_layers"].as_u64().unwrap_or(0) > 0 {
        tier("on the device", &|t| {
            format!("{} layers {}", t["device_layers"], b(&t["device_bytes"]))
        });
    }
    tier("streamed layers", &|t| t["streamed_layers"].to_string());
    tier("  head", &|t| {
        if t["head_on_device"] == true {
            "on the device".into()
        } else if t["head_on_disk"] == true {
            "row blocks".into()
        } else {
            "resident".into()
        }
    });
    tier("  read per pass", &|t| b(&t["read_bytes"]));
    tier("spine ring", &|t| {
        format!("{} layers {}", t["ring"], b(&t["ring_bytes"]))
    });
    row("sequence state", "state_bytes");
    row("  of it latent cache", "kv_ram_bytes");
    row("latent cache spilled", "kv_disk_bytes");
    row("scratch", "scratch_bytes");
    row("I/O buffers", "io_buffers_bytes");
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
    let proj = |k: &str, f: &str| l[k]["projected"][f].as_f64().unwrap_or(0.0);
    let secs = |f: &str| {
        println!(
            "{:<22} {:>14} {:>14}",
            match f {
                "spine_read_s" => "spine read s/pass",
                "expert_read_s" => "expert misses s/pass",
                _ => "projected s/pass",
            },
            format!("{:.2}", proj("bf16", f)),
            format!("{:.2}", proj("int8", f))
        )
    };
    for f in ["spine_read_s", "expert_read_s", "seconds_per_pass"] {
        secs(f);
    }
    println!(
        "  (reads at {}/s; --disk-bw sets it)",
        b(&l["bf16"]["projected"]["disk_bw"])
    );
    for k in ["bf16", "int8"] {
        println!("{k} spine: {}", l[k]["verdict"].as_str().unwrap_or(""));
    }
}
