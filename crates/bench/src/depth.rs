//! Decode step time against context depth: the cache filled by a real
//! prefill or with synthetic rows and state (labelled as such; a step's cost
//! does not depend on the values), then a few greedy steps timed.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use fathom_engine::argmax;
use fathom_model::{CausalLm, Logits, SeqState};

/// How the cache is filled before timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DepthFill {
    Prefill,
    Synthetic,
}

/// Tokens of the largest pass a sweep makes, the one the RAM ledger plans
/// scratch and I/O buffers for: a decode step (`decode` tokens, as
/// `fathom inspect` plans one) when the cache is filled synthetically, and
/// also a prefill chunk of `chunk` tokens when a real prefill fills it.
pub fn pass_tokens(how: DepthFill, chunk: usize, decode: usize) -> usize {
    match how {
        DepthFill::Synthetic => decode.max(1),
        DepthFill::Prefill => chunk.max(decode).max(1),
    }
}

/// One depth's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DepthResult {
    pub depth: usize,
    pub fill: DepthFill,
    pub decode_tok_s: f64,
    /// Median decode step.
    pub step_ms: f64,
    pub step_ms_min: f64,
    pub step_ms_max: f64,
    /// Attention-cache blocks in RAM at that depth.
    pub kv_bytes_ram: u64,
    /// Attention-cache blocks spilled to disk (beyond `--kv-ram`).
    pub kv_bytes_disk: u64,
    /// Bytes read back from disk per timed step.
    pub kv_bytes_read_per_step: u64,
    /// With `prefill` fill: prompt tokens per second of the fill.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_tok_s: Option<f64>,
}

/// Figures of the whole sweep (`--json` gets this object).
#[derive(Debug, Clone, serde::Serialize)]
pub struct DepthReport {
    pub model: String,
    pub threads: usize,
    pub steps: usize,
    pub depths: Vec<DepthResult>,
}

fn fill(
    lm: &Arc<dyn CausalLm>,
    depth: usize,
    how: DepthFill,
    chunk: usize,
) -> Result<(Box<dyn SeqState>, Option<f64>)> {
    match how {
        DepthFill::Synthetic => Ok((lm.synthetic_state(depth, depth as u64)?, None)),
        DepthFill::Prefill => {
            let vocab = lm.info().vocab_size as u32;
            let tokens: Vec<u32> = (0..depth as u32)
                .map(|i| (i * 7919 + 13) % vocab.max(1))
                .collect();
            let mut st = lm.new_state();
            let t = Instant::now();
            for c in tokens.chunks(chunk.max(1)) {
                lm.forward(st.as_mut(), c, Logits::None)?;
            }
            let secs = t.elapsed().as_secs_f64();
            Ok((st, Some(depth as f64 / secs.max(1e-9))))
        }
    }
}

/// Times `steps` greedy decode steps (after one untimed) at each depth.
pub fn run_depths(
    lm: &Arc<dyn CausalLm>,
    depths: &[usize],
    how: DepthFill,
    steps: usize,
    chunk: usize,
    mut log: impl FnMut(&str),
) -> Result<Vec<DepthResult>> {
    if steps == 0 {
        bail!("--depth-steps must be at least 1");
    }
    let mut out = Vec::new();
    for &depth in depths {
        log(&format!("depth {depth}: filling ({how:?})"));
        let (mut st, prefill_tok_s) = fill(lm, depth, how, chunk)?;
        let mut tok = 1u32;
        let mut times = Vec::with_capacity(steps);
        let mut read0 = lm.kv_stats().bytes_read;
        for i in 0..=steps {
            if i == 1 {
                read0 = lm.kv_stats().bytes_read;
            }
            let t = Instant::now();
            let logits = lm.forward(st.as_mut(), &[tok], Logits::Last)?;
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
            tok = argmax(&logits);
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        let r = DepthResult {
            depth,
            fill: how,
            decode_tok_s: 1.0 / med,
            step_ms: med * 1e3,
            step_ms_min: times[0] * 1e3,
            step_ms_max: times[times.len() - 1] * 1e3,
            kv_bytes_ram: lm.kv_stats().ram_bytes,
            kv_bytes_disk: lm.kv_stats().disk_bytes,
            kv_bytes_read_per_step: (lm.kv_stats().bytes_read - read0) / steps as u64,
            prefill_tok_s,
        };
        log(&format!("depth {depth}: step {:.2} ms", r.step_ms));
        out.push(r);
    }
    Ok(out)
}

/// The table printed for a sweep.
pub fn render_depths(r: &DepthReport) -> String {
    let mut s = String::from(
        "depth      fill       step ms (min–max)        tok/s   × first   cache RAM    cache disk   prefill tok/s\n",
    );
    let base = r.depths.first().map_or(1.0, |d| d.step_ms);
    for d in &r.depths {
        s += &format!(
            "{:<9}  {:<9}  {:>8.2} ({:.2}–{:.2})  {:>9.2}  {:>7.2}×  {:>9.1} MB  {:>8.1} MB  {}\n",
            d.depth,
            format!("{:?}", d.fill).to_lowercase(),
            d.step_ms,
            d.step_ms_min,
            d.step_ms_max,
            d.decode_tok_s,
            d.step_ms / base,
            d.kv_bytes_ram as f64 / 1e6,
            d.kv_bytes_disk as f64 / 1e6,
            d.prefill_tok_s.map_or("-".into(), |p| format!("{p:.1}"))
        );
    }
    s
}
