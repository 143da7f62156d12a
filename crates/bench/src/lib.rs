//! `fathom bench`: the numbers fathom reports about itself, measured the way
//! `docs/performance.md` asks — ratios within one run, never a lone absolute.
//!
//! One run measures the machine's ceilings ([`ceiling`]: storage bandwidth
//! with fathom's own direct-I/O reader on the model's expert spans, memory
//! bandwidth with a triad), then runs every arm — a set of `fathom run`
//! flags ([`arm`]) or a peer engine's command ([`peer`]) — in fresh
//! processes ([`runner`]), interleaved rep by rep ([`session`]), optionally
//! each in its own capped memory cgroup ([`cgroup`]). An arm whose tokens
//! differ from the reference is rejected: speed that changes the output is
//! not speed. Medians with min/max ([`stats`]) and achieved ÷ ceiling per
//! arm go to a table, a JSON file with every raw sample and the machine
//! description ([`report`], [`machine`]) and an SVG chart ([`svg`]);
//! `--suite standard` ([`suite`]) runs a fixed prompt set and writes a
//! result card (JSON, Markdown, SVG) with the machine's and model's identity.

pub mod arm;
pub mod batch;
pub mod ceiling;
pub mod cgroup;
pub mod depth;
pub mod evict;
pub mod gpu;
pub mod machine;
pub mod peer;
pub mod report;
pub mod runner;
pub mod sample;
pub mod session;
pub mod stats;
pub mod suite;
pub mod svg;

pub use report::{Report, render_table};
pub use session::{BenchConfig, run_bench};

/// Fails early, naming the path, when `dir` is not a model directory.
pub(crate) fn load_check(dir: &std::path::Path) -> anyhow::Result<()> {
    if !dir.join("config.json").is_file() {
        anyhow::bail!(
            "{} is not a model directory: it has no config.json",
            dir.display()
        );
    }
    Ok(())
}
