//! Turning samples into per-arm verdicts, summaries and ratios, and printing
//! them. The JSON report is these structs serialised (schema `fathom-bench/1`);
//! the table is for people.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use fathom_weights::units::format_bytes;
use serde::Serialize;

use crate::arm::{Arm, ArmKind, Prompt, join_ids};
use crate::ceiling::{Bound, MemoryCeiling, StorageCeiling, decode_ceiling};
use crate::machine::Machine;
use crate::sample::{Metric, Sample, Unit};
use crate::session::BenchConfig;
use crate::stats::{Summary, summarize};

/// The whole report (`--json OUT`).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub schema: &'static str,
    pub date_utc: String,
    pub fathom: FathomInfo,
    pub machine: Machine,
    pub config: Config,
    pub ceilings: Ceilings,
    pub arms: Vec<ArmReport>,
    /// Every process run, warmups and failures included.
    pub samples: Vec<Sample>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FathomInfo {
    pub version: String,
    pub exe: String,
    pub argv: Vec<String>,
}

/// The run's settings as used.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    pub model: String,
    /// Each prompt as `{"ids": [..]}` or `{"text": ".."}`.
    pub prompts: Vec<serde_json::Value>,
    pub max_new: usize,
    pub reps: usize,
    pub warmup: usize,
    pub memory_cap_bytes: Option<u64>,
    pub expect_ids: Option<Vec<u32>>,
    pub timeout_s: f64,
    /// How the page cache was treated: the files each rep reads are evicted first.
    pub page_cache: &'static str,
}

impl From<&BenchConfig> for Config {
    fn from(c: &BenchConfig) -> Self {
        Config {
            model: c.model.display().to_string(),
            prompts: c.prompts.iter().map(Prompt::to_json).collect(),
            max_new: c.max_new,
            reps: c.reps,
            warmup: c.warmup,
            memory_cap_bytes: c.memory_cap,
            expect_ids: c.expect_ids.clone(),
            timeout_s: c.timeout.as_secs_f64(),
            page_cache: "evicted before every rep (POSIX_FADV_DONTNEED on the model's files and a peer's file arguments)",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Ceilings {
    pub storage: StorageCeiling,
    pub memory: MemoryCeiling,
    /// Spine bytes one decoded token touches (embedding: one row), as stored.
    pub spine_bytes_per_token: u64,
    /// The same for an arm that reports `"spine": "int8"` (an estimate from the tensor table).
    pub spine_bytes_per_token_int8: u64,
    /// Bytes of one routed expert.
    pub expert_bytes: u64,
}

impl Ceilings {
    /// Spine bytes per token for runs `samples`: the int8 estimate when
    /// their runs report `"spine": "int8"`, else the stored precision's.
    pub fn spine_bytes_of(&self, samples: &[&Sample]) -> u64 {
        let int8 = samples
            .iter()
            .any(|s| s.raw.get("spine").and_then(|v| v.as_str()) == Some("int8"));
        if int8 {
            self.spine_bytes_per_token_int8
        } else {
            self.spine_bytes_per_token
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Accepted,
    /// Output ids differ from the reference: excluded from ratios.
    Rejected,
    /// A process failed (exit status, timeout, unreadable output).
    Failed,
}

impl Status {
    pub fn word(self) -> &'static str {
        match self {
            Status::Accepted => "accepted",
            Status::Rejected => "REJECTED",
            Status::Failed => "FAILED",
        }
    }
}

/// One arm's verdict and figures.
#[derive(Debug, Clone, Serialize)]
pub struct ArmReport {
    pub name: String,
    pub kind: &'static str,
    pub spec: String,
    pub status: Status,
    pub message: Option<String>,
    /// Measured (non-warmup) samples that succeeded.
    pub samples: usize,
    /// Metric key → min / median / max (absent: not reported).
    pub summary: BTreeMap<&'static str, Summary>,
    pub ceiling_tok_s: Option<f64>,
    pub bound: Option<Bound>,
    /// Spine bytes per token the memory bound used (int8 where the arm's runs say so).
    pub spine_bytes_per_token: Option<u64>,
    /// Median steady decode ÷ ceiling.
    pub decode_vs_ceiling: Option<f64>,
    /// Peer name → this arm's median decode ÷ the peer's.
    pub vs_peers: BTreeMap<String, f64>,
    /// Peer name → this arm's median prefill rate ÷ the peer's.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub vs_peers_prefill: BTreeMap<String, f64>,
    /// Device bounds, for an arm whose runs computed on a GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<crate::gpu::GpuBounds>,
}

impl ArmReport {
    pub fn median(&self, m: Metric) -> Option<f64> {
        self.summary.get(m.key()).map(|s| s.median)
    }
}

/// The reference output per prompt: `--expect-ids`, else the first arm's
/// first successful output (else any fathom arm's).
fn references(cfg: &BenchConfig, samples: &[Sample]) -> Vec<Option<(Vec<u32>, String)>> {
    let fathom: Vec<&Arm> = cfg.arms.iter().filter(|a| !a.is_peer()).collect();
    (0..cfg.prompts.len())
        .map(|pi| {
            if let Some(ids) = &cfg.expect_ids {
                return Some((ids.clone(), "--expect-ids".to_string()));
            }
            let ok = |s: &&Sample| s.prompt == pi && s.ok && s.output_ids.is_some();
            let first = samples
                .iter()
                .filter(ok)
                .find(|s| s.arm == fathom[0].name)
                .or_else(|| {
                    samples
                        .iter()
                        .filter(ok)
                        .find(|s| fathom.iter().any(|a| a.name == s.arm))
                })?;
            let what = format!("arm {} rep {}", first.arm, first.rep);
            Some((first.output_ids.clone()?, what))
        })
        .collect()
}

/// Verdicts, summaries and ratios for every arm.
pub fn summarize_arms(cfg: &BenchConfig, samples: &[Sample], c: &Ceilings) -> Vec<ArmReport> {
    let refs = references(cfg, samples);
    let mut reports: Vec<ArmReport> = cfg
        .arms
        .iter()
        .map(|arm| {
            let mine: Vec<&Sample> = samples.iter().filter(|s| s.arm == arm.name).collect();
            let (status, message) = verdict(arm, &mine, &refs);
            let measured: Vec<&Sample> =
                mine.iter().copied().filter(|s| !s.warmup && s.ok).collect();
            let mut summary = BTreeMap::new();
            for m in Metric::ALL {
                let v: Vec<f64> = measured
                    .iter()
                    .filter_map(|s| s.metrics[m as usize])
                    .collect();
                if let Some(s) = summarize(&v) {
                    summary.insert(m.key(), s);
                }
            }
            let mut r = ArmReport {
                name: arm.name.clone(),
                kind: if arm.is_peer() { "peer" } else { "fathom" },
                spec: arm.spec.clone(),
                status,
                message,
                samples: measured.len(),
                summary,
                ceiling_tok_s: None,
                bound: None,
                spine_bytes_per_token: None,
                decode_vs_ceiling: None,
                vs_peers: BTreeMap::new(),
                vs_peers_prefill: BTreeMap::new(),
                gpu: crate::gpu::bounds(&measured),
            };
            if !arm.is_peer() {
                // Storage reads per token: missed experts and the spine's
                // streamed layers.
                let per_token = r.median(Metric::ExpertBytesPerToken).unwrap_or(0.0)
                    + r.median(Metric::SpineBytesPerToken).unwrap_or(0.0);
                let spine = c.spine_bytes_of(&measured);
                let (ceil, bound) = decode_ceiling(
                    c.storage.bytes_per_s,
                    c.memory.bytes_per_s,
                    per_token,
                    spine,
                );
                r.spine_bytes_per_token = Some(spine);
                r.ceiling_tok_s = Some(ceil);
                r.bound = Some(bound);
                if status == Status::Accepted {
                    r.decode_vs_ceiling = r.median(Metric::DecodeTokS).map(|d| d / ceil);
                }
            }
            r
        })
        .collect();
    for (metric, prefill) in [(Metric::DecodeTokS, false), (Metric::PrefillTokS, true)] {
        let peers: Vec<(String, f64)> = reports
            .iter()
            .filter(|r| r.kind == "peer" && r.status == Status::Accepted)
            .filter_map(|r| Some((r.name.clone(), r.median(metric)?)))
            .collect();
        for r in reports
            .iter_mut()
            .filter(|r| r.kind == "fathom" && r.status == Status::Accepted)
        {
            let Some(d) = r.median(metric).filter(|d| *d > 0.0) else {
                continue;
            };
            let into = if prefill {
                &mut r.vs_peers_prefill
            } else {
                &mut r.vs_peers
            };
            for (p, pd) in &peers {
                if *pd > 0.0 {
                    into.insert(p.clone(), d / pd);
                }
            }
        }
    }
    reports
}

fn verdict(
    arm: &Arm,
    mine: &[&Sample],
    refs: &[Option<(Vec<u32>, String)>],
) -> (Status, Option<String>) {
    if let ArmKind::Fathom { .. } = arm.kind {
        for s in mine.iter().filter(|s| s.ok) {
            let (Some(got), Some(Some((want, from)))) = (&s.output_ids, refs.get(s.prompt)) else {
                continue;
            };
            if got != want {
                let at = got
                    .iter()
                    .zip(want)
                    .position(|(a, b)| a != b)
                    .unwrap_or(got.len().min(want.len()));
                return (
                    Status::Rejected,
                    Some(format!(
                        "REJECTED: output ids differ from the reference ({from}) at position {at} (rep {}, prompt {}): got [{}], expected [{}]",
                        s.rep,
                        s.prompt,
                        join_ids(got),
                        join_ids(want)
                    )),
                );
            }
        }
    }
    if let Some(s) = mine.iter().find(|s| !s.ok) {
        return (
            Status::Failed,
            Some(format!(
                "FAILED (rep {}): {}",
                s.rep,
                s.error.as_deref().unwrap_or("no result")
            )),
        );
    }
    if !mine.iter().any(|s| s.ok && !s.warmup) {
        return (Status::Failed, Some("FAILED: no measured sample".into()));
    }
    (Status::Accepted, None)
}

/// [`format_bytes`] of a measured byte count or rate (rounded to whole bytes).
fn human_bytes(b: f64) -> String {
    format_bytes(b.round() as u64)
}

/// The `device:` line of a GPU arm: decode beside its HBM and PCIe bounds.
fn device_line(a: &ArmReport, g: &crate::gpu::GpuBounds) -> String {
    let d = a
        .median(Metric::DecodeTokS)
        .filter(|_| a.status == Status::Accepted);
    let vs = |b: f64| d.map_or("n/a".into(), |d| sig3(d / b));
    let mut pcie = g.pcie_tok_s.map_or("no bound".into(), |p| {
        format!("{} tok/s (achieved ÷ {})", sig3(p), vs(p))
    });
    if let Some(c) = g.copy_all_tok_s {
        pcie += &format!(
            "; with the {} of cold experts the CPU computed also copied → {} tok/s (achieved ÷ {})",
            human_bytes(g.cpu_expert_bytes_per_token),
            sig3(c),
            vs(c)
        );
    }
    format!(
        "  device: memory {}/s, {} of weights read per token → {} tok/s (achieved ÷ {}); host→device {}/s, {} copied per token → {pcie}",
        human_bytes(g.hbm_bytes_per_s),
        human_bytes(g.weight_bytes_per_token),
        sig3(g.hbm_tok_s),
        vs(g.hbm_tok_s),
        human_bytes(g.h2d_bytes_per_s),
        human_bytes(g.h2d_bytes_per_token),
    )
}

/// Three significant figures for rates and ratios.
pub fn sig3(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn fmt_value(m: Metric, v: f64) -> String {
    match m.unit() {
        Unit::Seconds => format!("{} s", sig3(v)),
        Unit::TokS => format!("{} tok/s", sig3(v)),
        Unit::Bytes => human_bytes(v),
        Unit::Fraction => format!("{:.1} %", v * 100.0),
        Unit::Ratio => sig3(v),
    }
}

/// The report as a table for stdout.
pub fn render_table(r: &Report) -> String {
    let mut o = String::new();
    let c = &r.config;
    let prompts = if c.prompts.len() == 1 {
        "1 prompt".to_string()
    } else {
        format!("{} prompts", c.prompts.len())
    };
    let _ = writeln!(
        o,
        "fathom bench: {}, {prompts}, {} new tokens, {} reps (+{} warmup discarded), memory cap {}",
        c.model,
        c.max_new,
        c.reps,
        c.warmup,
        c.memory_cap_bytes.map_or("none".into(), format_bytes)
    );
    let m = &r.machine;
    let _ = writeln!(
        o,
        "machine: {}, {} CPUs, {} RAM, kernel {}, load {}",
        m.cpu_model.as_deref().unwrap_or("?"),
        m.logical_cpus,
        m.ram_bytes.map_or("?".into(), format_bytes),
        m.kernel.as_deref().unwrap_or("?"),
        m.loadavg.as_deref().unwrap_or("?")
    );
    let (s, mem) = (&r.ceilings.storage, &r.ceilings.memory);
    let _ = writeln!(
        o,
        "ceilings (this run): storage {}/s ({}, {} threads, {} in {:.2} s, {} reads over {} expert spans), memory {}/s (triad, {} threads, 3 × {})",
        human_bytes(s.bytes_per_s),
        if s.direct {
            "O_DIRECT"
        } else {
            "buffered, O_DIRECT refused"
        },
        s.threads,
        format_bytes(s.bytes),
        s.seconds,
        s.reads,
        s.spans,
        human_bytes(mem.bytes_per_s),
        mem.threads,
        format_bytes(mem.array_bytes)
    );
    let _ = writeln!(
        o,
        "  spine touched per token {} (int8 spine: {}), one expert {}",
        format_bytes(r.ceilings.spine_bytes_per_token),
        format_bytes(r.ceilings.spine_bytes_per_token_int8),
        format_bytes(r.ceilings.expert_bytes)
    );
    for a in &r.arms {
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "arm {} ({}: {:?}): {}, {} measured samples",
            a.name,
            a.kind,
            a.spec,
            a.status.word(),
            a.samples
        );
        if let Some(msg) = &a.message {
            let _ = writeln!(o, "  {msg}");
        }
        if !a.summary.is_empty() {
            let _ = writeln!(
                o,
                "  {:<20} {:>14} {:>14} {:>14}",
                "", "min", "median", "max"
            );
        }
        for m in Metric::ALL {
            if let Some(s) = a.summary.get(m.key()) {
                let _ = writeln!(
                    o,
                    "  {:<20} {:>14} {:>14} {:>14}",
                    m.label(),
                    fmt_value(m, s.min),
                    fmt_value(m, s.median),
                    fmt_value(m, s.max)
                );
            }
        }
        if let (Some(ceil), Some(b)) = (a.ceiling_tok_s, a.bound) {
            let _ = writeln!(
                o,
                "  decode ceiling {} tok/s ({}-bound, spine {}/token); achieved ÷ ceiling {}",
                sig3(ceil),
                if b == Bound::Storage {
                    "storage"
                } else {
                    "memory"
                },
                format_bytes(a.spine_bytes_per_token.unwrap_or(0)),
                a.decode_vs_ceiling
                    .map_or("n/a (not accepted)".into(), sig3)
            );
        }
        if let Some(g) = &a.gpu {
            let _ = writeln!(o, "{}", device_line(a, g));
        }
    }
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<14} {:<9} {:>28} {:>16} {:>10}  ÷ peer",
        "arm", "status", "decode tok/s median [min–max]", "ceiling tok/s", "÷ ceiling"
    );
    for a in &r.arms {
        let d = a
            .summary
            .get(Metric::DecodeTokS.key())
            .map_or("-".into(), |s| {
                format!("{} [{}–{}]", sig3(s.median), sig3(s.min), sig3(s.max))
            });
        let ceil = match (a.ceiling_tok_s, a.bound) {
            (Some(c), Some(b)) => format!(
                "{} ({})",
                sig3(c),
                if b == Bound::Storage { "I/O" } else { "mem" }
            ),
            _ => "-".into(),
        };
        let peers: Vec<String> = a
            .vs_peers
            .iter()
            .map(|(p, v)| format!("{}× {p}", sig3(*v)))
            .collect();
        let _ = writeln!(
            o,
            "{:<14} {:<9} {:>28} {:>16} {:>10}  {}",
            a.name,
            a.status.word(),
            d,
            ceil,
            a.decode_vs_ceiling.map_or("-".into(), sig3),
            if peers.is_empty() {
                "-".into()
            } else {
                peers.join(", ")
            }
        );
    }
    if r.arms.iter().any(|a| !a.vs_peers_prefill.is_empty()) {
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "{:<14} {:>30}  ÷ peer (prefill)",
            "arm", "prefill tok/s median [min–max]"
        );
        for a in r
            .arms
            .iter()
            .filter(|a| a.kind == "fathom" || a.median(Metric::PrefillTokS).is_some())
        {
            let p = a
                .summary
                .get(Metric::PrefillTokS.key())
                .map_or("-".into(), |s| {
                    format!("{} [{}–{}]", sig3(s.median), sig3(s.min), sig3(s.max))
                });
            let vs: Vec<String> = a
                .vs_peers_prefill
                .iter()
                .map(|(p, v)| format!("{}× {p}", sig3(*v)))
                .collect();
            let vs = if vs.is_empty() {
                "-".into()
            } else {
                vs.join(", ")
            };
            let _ = writeln!(o, "{:<14} {:>30}  {vs}", a.name, p);
        }
    }
    o
}
