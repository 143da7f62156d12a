//! `fathom bench --suite standard`: a fixed set of prompts people can run on
//! their own machines and post as they are. The result card carries what a
//! reader needs to compare like with like — the machine (CPU, cores, RAM,
//! the storage and memory bandwidth measured in the same run, the GPU if
//! any), fathom's version and the model's identity (a SHA-256 of its
//! `config.json` and a digest of its shards' names, sizes and headers) — and
//! every figure beside its ceiling. Written as JSON, Markdown and SVG.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::arm::Prompt;
use crate::ceiling::{Bound, decode_ceiling};
use crate::machine::Machine;
use crate::report::{Report, Status, sig3};
use crate::sample::{Metric, Sample};
use crate::stats::summarize;

/// One prompt of a suite.
#[derive(Debug, Clone)]
pub struct SuitePrompt {
    pub name: &'static str,
    pub kind: &'static str,
    pub prompt: Prompt,
}

/// The suites by name.
pub fn suite(name: &str) -> Result<Vec<SuitePrompt>> {
    match name {
        "standard" => Ok(standard()),
        other => bail!("--suite {other:?}: the only suite is \"standard\""),
    }
}

/// The standard suite: two short factual prompts, a code continuation, a
/// chat turn and a long-context prompt (about 2,000 tokens of a numbered
/// inventory followed by a question about an early line). A prompt that does
/// not fit the model's context with the new tokens is skipped, and the card
/// says so.
pub fn standard() -> Vec<SuitePrompt> {
    let p = |name, kind, prompt| SuitePrompt { name, kind, prompt };
    vec![
        p(
            "capital",
            "factual",
            Prompt::Text("The capital of France is".into()),
        ),
        p(
            "planet",
            "factual",
            Prompt::Text("The largest planet in our solar system is".into()),
        ),
        p(
            "code",
            "code",
            Prompt::Text(
                "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".into(),
            ),
        ),
        p(
            "chat",
            "chat",
            Prompt::Chat(
                "Explain in two sentences what a mixture-of-experts language model is.".into(),
            ),
        ),
        p("long", "long context", Prompt::Text(long_prompt())),
    ]
}

/// A fixed long prompt: 80 numbered inventory lines, then a question
/// (1,800–2,500 tokens with the tokenizers of the fixtures and k3-code-small).
fn long_prompt() -> String {
    const ITEMS: [&str; 8] = [
        "copper wire",
        "glass jars",
        "oak planks",
        "wool blankets",
        "iron nails",
        "clay bricks",
        "linen sheets",
        "tin cans",
    ];
    const PLACES: [&str; 5] = ["north shed", "cellar", "loft", "east barn", "workshop"];
    let mut s = String::from("Inventory of the farm, one line per entry:\n");
    for i in 1..=80usize {
        let _ = writeln!(
            s,
            "Line {i}: {} boxes of {} stored in the {}.",
            (i * 7) % 23 + 2,
            ITEMS[i % ITEMS.len()],
            PLACES[(i * 3) % PLACES.len()]
        );
    }
    s.push_str(
        "\nQuestion: how many boxes are listed on line 12, and where are they stored?\nAnswer:",
    );
    s
}

/// What identifies a model across machines.
#[derive(Debug, Clone, Serialize)]
pub struct ModelId {
    pub dir: String,
    pub model_type: Option<String>,
    /// SHA-256 of `config.json`.
    pub config_sha256: String,
    /// SHA-256 over every shard's name, size and safetensors header, in name
    /// order (cheap: no tensor data is read).
    pub checkpoint_digest: String,
    pub shard_bytes: u64,
}

/// Reads `dir`'s identity.
pub fn model_id(dir: &Path) -> Result<ModelId> {
    let cfg_path = dir.join("config.json");
    let cfg =
        std::fs::read(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?;
    let model_type = serde_json::from_slice::<serde_json::Value>(&cfg)
        .ok()
        .and_then(|v| v.get("model_type")?.as_str().map(String::from));
    let ck = fathom_weights::Checkpoint::open(dir)
        .with_context(|| format!("opening the checkpoint in {}", dir.display()))?;
    let mut shards: Vec<_> = ck.shards().iter().map(|s| s.path.clone()).collect();
    shards.sort();
    let mut h = Sha256::new();
    let mut total = 0u64;
    for p in &shards {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (size, header) = shard_header(p)?;
        total += size;
        h.update(name.as_bytes());
        h.update(size.to_le_bytes());
        h.update(&header);
    }
    Ok(ModelId {
        dir: dir.display().to_string(),
        model_type,
        config_sha256: hex(&Sha256::digest(&cfg)),
        checkpoint_digest: hex(&h.finalize()),
        shard_bytes: total,
    })
}

/// A shard's size and its header bytes (length prefix included).
fn shard_header(p: &Path) -> Result<(u64, Vec<u8>)> {
    use std::io::Read;
    let mut f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
    let size = f.metadata()?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .with_context(|| format!("reading the header of {}", p.display()))?;
    let n = u64::from_le_bytes(len);
    // The checkpoint opened, so the header length is within the file and the
    // reader's cap; bound it again before allocating.
    if n > size.saturating_sub(8) || n > 100 << 20 {
        bail!("{}: header length {n} does not fit the file", p.display());
    }
    let mut header = len.to_vec();
    header.resize(8 + n as usize, 0);
    f.read_exact(&mut header[8..])
        .with_context(|| format!("reading the header of {}", p.display()))?;
    Ok((size, header))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The GPU, as `nvidia-smi` names it (absent without one).
pub fn gpu() -> Option<String> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name,memory.total", "--format=csv,noheader"])
        .output()
        .ok()?;
    let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !s.is_empty()).then(|| s.replace('\n', "; "))
}

/// The result card.
#[derive(Debug, Clone, Serialize)]
pub struct Card {
    pub schema: &'static str,
    pub suite: String,
    pub date_utc: String,
    pub fathom_version: String,
    pub argv: Vec<String>,
    pub machine: Machine,
    pub gpu: Option<String>,
    /// Bandwidths measured in this run (the ceilings' inputs).
    pub storage_bytes_per_s: f64,
    pub storage_direct_io: bool,
    pub memory_bytes_per_s: f64,
    pub model: ModelId,
    pub max_new: usize,
    pub reps: usize,
    /// Prompts of the suite not run, and why.
    pub skipped: Vec<String>,
    pub arms: Vec<CardArm>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CardArm {
    pub name: String,
    pub spec: String,
    pub status: Status,
    pub message: Option<String>,
    pub prompts: Vec<CardPrompt>,
}

/// Medians over the measured reps of one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct CardPrompt {
    pub name: String,
    pub kind: String,
    pub prompt: serde_json::Value,
    pub prompt_tokens: Option<f64>,
    pub prefill_tok_s: Option<f64>,
    pub first_token_s: Option<f64>,
    pub decode_tok_s: Option<f64>,
    pub decode_ceiling_tok_s: Option<f64>,
    pub bound: Option<Bound>,
    pub decode_vs_ceiling: Option<f64>,
    pub expert_hit_rate: Option<f64>,
}

/// Builds the card from a bench report run over `prompts`.
pub fn card(r: &Report, suite_name: &str, prompts: &[SuitePrompt], model: ModelId) -> Card {
    let arms = r
        .arms
        .iter()
        .map(|a| CardArm {
            name: a.name.clone(),
            spec: a.spec.clone(),
            status: a.status,
            message: a.message.clone(),
            prompts: prompts
                .iter()
                .enumerate()
                .map(|(pi, p)| {
                    let mine: Vec<&Sample> = r
                        .samples
                        .iter()
                        .filter(|s| s.arm == a.name && s.prompt == pi && s.ok && !s.warmup)
                        .collect();
                    prompt_figures(
                        r,
                        a.kind == "fathom" && a.status == Status::Accepted,
                        p,
                        &mine,
                    )
                })
                .collect(),
        })
        .collect();
    Card {
        schema: "fathom-suite/1",
        suite: suite_name.into(),
        date_utc: r.date_utc.clone(),
        fathom_version: r.fathom.version.clone(),
        argv: r.fathom.argv.clone(),
        machine: r.machine.clone(),
        gpu: gpu(),
        storage_bytes_per_s: r.ceilings.storage.bytes_per_s,
        storage_direct_io: r.ceilings.storage.direct,
        memory_bytes_per_s: r.ceilings.memory.bytes_per_s,
        model,
        max_new: r.config.max_new,
        reps: r.config.reps,
        skipped: Vec::new(),
        arms,
    }
}

fn prompt_figures(r: &Report, rated: bool, p: &SuitePrompt, mine: &[&Sample]) -> CardPrompt {
    let med = |m: Metric| {
        summarize(
            &mine
                .iter()
                .filter_map(|s| s.metrics[m as usize])
                .collect::<Vec<_>>(),
        )
        .map(|s| s.median)
    };
    let raw = |k: &str| {
        summarize(
            &mine
                .iter()
                .filter_map(|s| s.raw.get(k)?.as_f64())
                .collect::<Vec<_>>(),
        )
        .map(|s| s.median)
    };
    let decode = med(Metric::DecodeTokS);
    let c = &r.ceilings;
    let spine = c.spine_bytes_of(mine);
    let (ceil, bound) = if rated && !mine.is_empty() {
        let per_token = med(Metric::ExpertBytesPerToken).unwrap_or(0.0);
        let (v, b) = decode_ceiling(
            c.storage.bytes_per_s,
            c.memory.bytes_per_s,
            per_token,
            spine,
        );
        (Some(v), Some(b))
    } else {
        (None, None)
    };
    CardPrompt {
        name: p.name.into(),
        kind: p.kind.into(),
        prompt: p.prompt.to_json(),
        prompt_tokens: raw("prompt_tokens"),
        prefill_tok_s: med(Metric::PrefillTokS),
        first_token_s: med(Metric::FirstTokenS),
        decode_tok_s: decode,
        decode_ceiling_tok_s: ceil,
        bound,
        decode_vs_ceiling: decode.zip(ceil).map(|(d, c)| d / c),
        expert_hit_rate: med(Metric::ExpertHitRate),
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or("–".into(), sig3)
}

/// The card as Markdown.
pub fn markdown(c: &Card) -> String {
    let mut s = header_md(c);
    for a in &c.arms {
        let _ = writeln!(
            s,
            "## arm `{}` ({}) — {}\n",
            a.name,
            a.spec,
            a.status.word()
        );
        if let Some(msg) = &a.message {
            let _ = writeln!(s, "{msg}\n");
        }
        let _ = writeln!(
            s,
            "| prompt | kind | prompt tokens | prefill tok/s | first token s | decode tok/s | ceiling tok/s | ÷ ceiling | bound |\n|---|---|---|---|---|---|---|---|---|"
        );
        for p in &a.prompts {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                p.name,
                p.kind,
                opt(p.prompt_tokens),
                opt(p.prefill_tok_s),
                opt(p.first_token_s),
                opt(p.decode_tok_s),
                opt(p.decode_ceiling_tok_s),
                opt(p.decode_vs_ceiling),
                p.bound.map_or("–", Bound::word)
            );
        }
        s.push('\n');
    }
    s
}

/// The card's identity table: machine, bandwidths, fathom, model, run.
fn header_md(c: &Card) -> String {
    let gb = |b: f64| format!("{:.2} GB/s", b / 1e9);
    let m = &c.machine;
    let mut s = String::new();
    let _ = writeln!(s, "# fathom bench — suite `{}`\n", c.suite);
    let _ = writeln!(s, "| | |\n|---|---|");
    let _ = writeln!(s, "| date (UTC) | {} |", c.date_utc);
    let _ = writeln!(s, "| fathom | {} |", c.fathom_version);
    let _ = writeln!(
        s,
        "| CPU | {} ({} logical CPUs) |",
        m.cpu_model.as_deref().unwrap_or("unknown"),
        m.logical_cpus
    );
    let _ = writeln!(
        s,
        "| RAM | {} |",
        m.ram_bytes
            .map_or("unknown".into(), fathom_weights::units::format_bytes)
    );
    let _ = writeln!(s, "| GPU | {} |", c.gpu.as_deref().unwrap_or("none"));
    let _ = writeln!(
        s,
        "| storage (measured) | {}{} |",
        gb(c.storage_bytes_per_s),
        if c.storage_direct_io {
            ", O_DIRECT"
        } else {
            ", buffered"
        }
    );
    let _ = writeln!(
        s,
        "| memory (measured triad) | {} |",
        gb(c.memory_bytes_per_s)
    );
    let _ = writeln!(
        s,
        "| model | `{}` ({}), config sha256 `{}`, checkpoint digest `{}`, {} |",
        c.model.dir,
        c.model.model_type.as_deref().unwrap_or("?"),
        &c.model.config_sha256[..16],
        &c.model.checkpoint_digest[..16],
        fathom_weights::units::format_bytes(c.model.shard_bytes)
    );
    let _ = writeln!(
        s,
        "| run | {} new tokens, median of {} reps |",
        c.max_new, c.reps
    );
    for k in &c.skipped {
        let _ = writeln!(s, "| skipped | {k} |");
    }
    s.push('\n');
    s
}

/// The card as an SVG: per arm and prompt, decode tok/s as a bar and its
/// ceiling as a tick, with the identity lines above.
pub fn svg(c: &Card) -> String {
    let rows: Vec<(String, Option<f64>, Option<f64>)> = c
        .arms
        .iter()
        .flat_map(|a| {
            a.prompts.iter().map(move |p| {
                (
                    format!("{} · {}", a.name, p.name),
                    p.decode_tok_s,
                    p.decode_ceiling_tok_s,
                )
            })
        })
        .collect();
    let top = rows
        .iter()
        .flat_map(|r| [r.1, r.2])
        .flatten()
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let (w, row_h, head) = (760.0, 22.0, 96.0);
    let h = head + row_h * rows.len() as f64 + 30.0;
    let (x0, bar_w) = (200.0, 440.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    for (i, l) in svg_lines(c).iter().enumerate() {
        let _ = writeln!(
            s,
            r#"<text x="12" y="{}">{}</text>"#,
            20.0 + 18.0 * i as f64,
            esc(l)
        );
    }
    for (i, (label, d, ceil)) in rows.iter().enumerate() {
        let y = head + row_h * i as f64;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            x0 - 8.0,
            y + 14.0,
            esc(label)
        );
        if let Some(d) = d {
            let bw = bar_w * d / top;
            let _ = writeln!(
                s,
                r##"<rect x="{x0}" y="{}" width="{bw:.1}" height="{}" fill="#4a78b5"/>"##,
                y + 3.0,
                row_h - 6.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{}">{}</text>"#,
                x0 + bw + 4.0,
                y + 14.0,
                sig3(*d)
            );
        }
        if let Some(c) = ceil {
            let cx = x0 + bar_w * c / top;
            let _ = writeln!(
                s,
                r#"<line x1="{cx:.1}" x2="{cx:.1}" y1="{}" y2="{}" stroke="black" stroke-width="2"/>"#,
                y + 1.0,
                y + row_h - 1.0
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

/// The SVG card's identity lines.
fn svg_lines(c: &Card) -> [String; 4] {
    let m = &c.machine;
    [
        format!(
            "fathom {} — suite {} — {} new tokens, median of {} reps",
            c.fathom_version, c.suite, c.max_new, c.reps
        ),
        format!(
            "{} · {} CPUs · {} RAM · GPU {}",
            m.cpu_model.as_deref().unwrap_or("unknown CPU"),
            m.logical_cpus,
            m.ram_bytes
                .map_or("?".into(), fathom_weights::units::format_bytes),
            c.gpu.as_deref().unwrap_or("none")
        ),
        format!(
            "measured: storage {:.2} GB/s, memory {:.1} GB/s · model {} config {} digest {}",
            c.storage_bytes_per_s / 1e9,
            c.memory_bytes_per_s / 1e9,
            c.model.model_type.as_deref().unwrap_or("?"),
            &c.model.config_sha256[..12],
            &c.model.checkpoint_digest[..12]
        ),
        "decode tok/s (bar) and its ceiling (tick)".to_string(),
    ]
}

fn esc(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_standard_suite_is_fixed() {
        let s = standard();
        let names: Vec<_> = s.iter().map(|p| p.name).collect();
        assert_eq!(names, ["capital", "planet", "code", "chat", "long"]);
        assert_eq!(s[0].prompt, Prompt::Text("The capital of France is".into()));
        assert!(matches!(s[3].prompt, Prompt::Chat(_)));
        let long = long_prompt();
        assert!(
            long.contains("Line 12: 17 boxes of iron nails stored in the cellar."),
            "{}",
            &long[..400]
        );
        assert_eq!(long.lines().count(), 84);
        assert!(suite("quick").unwrap_err().to_string().contains("standard"));
    }
}
