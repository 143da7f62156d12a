//! Device bounds of an arm whose runs computed on a GPU (`--device cuda`):
//! each run measures its device's memory and host → device bandwidths when
//! its backend opens and counts, over the decode steps, the weight bytes its
//! products read from device memory and the bytes it copied up. The bounds
//! are those bytes per decoded token at those rates, so every ratio here
//! sets decode beside figures taken in the same process.

use serde::Serialize;
use serde_json::Value;

use crate::sample::Sample;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuBounds {
    /// Device memory bandwidth (bytes/s, read + written by a copy).
    pub hbm_bytes_per_s: f64,
    /// Host → device bandwidth from page-locked memory (bytes/s).
    pub h2d_bytes_per_s: f64,
    /// Weight bytes the device read per decoded token.
    pub weight_bytes_per_token: f64,
    /// Bytes copied host → device per decoded token (weight misses and activations).
    pub h2d_bytes_per_token: f64,
    /// Decode rate if reading the weights from device memory were all it took.
    pub hbm_tok_s: f64,
    /// Decode rate if the copies up were all it took (absent with no copies).
    pub pcie_tok_s: Option<f64>,
    /// Weight bytes of cold experts the CPU computed per decoded token
    /// instead of copying them up (`cpu_expert_bytes`).
    pub cpu_expert_bytes_per_token: f64,
    /// Decode rate if every cold byte had been copied up (those copied and
    /// those the CPU computed) and the copies were all it took: the PCIe
    /// bound of a build that copies every miss (absent when the CPU
    /// computed none).
    pub copy_all_tok_s: Option<f64>,
}

/// One run's bounds, from its `stats` (`None` without `gpu_decode` or decode steps).
fn of_run(raw: &Value) -> Option<GpuBounds> {
    let g = raw.get("gpu_decode")?;
    let f = |k: &str| g.get(k).and_then(Value::as_f64);
    let steps = raw.get("generated_tokens").and_then(Value::as_f64)? - 1.0;
    let (hbm, h2d) = (f("hbm_bytes_per_s")?, f("h2d_bytes_per_s")?);
    let (read, up) = (f("weight_bytes_read")?, f("h2d_bytes")?);
    if steps < 1.0 || hbm <= 0.0 || read <= 0.0 {
        return None;
    }
    let (per_read, per_up) = (read / steps, up / steps);
    let per_cpu = f("cpu_expert_bytes").unwrap_or(0.0) / steps;
    Some(GpuBounds {
        hbm_bytes_per_s: hbm,
        h2d_bytes_per_s: h2d,
        weight_bytes_per_token: per_read,
        h2d_bytes_per_token: per_up,
        hbm_tok_s: hbm / per_read,
        pcie_tok_s: (per_up > 0.0 && h2d > 0.0).then(|| h2d / per_up),
        cpu_expert_bytes_per_token: per_cpu,
        copy_all_tok_s: (per_cpu > 0.0 && h2d > 0.0).then(|| h2d / (per_up + per_cpu)),
    })
}

/// The median of every field over an arm's measured runs.
pub fn bounds(samples: &[&Sample]) -> Option<GpuBounds> {
    let runs: Vec<GpuBounds> = samples.iter().filter_map(|s| of_run(&s.raw)).collect();
    let pick = |f: fn(&GpuBounds) -> Option<f64>| {
        let v: Vec<f64> = runs.iter().filter_map(f).collect();
        crate::stats::summarize(&v).map(|s| s.median)
    };
    Some(GpuBounds {
        hbm_bytes_per_s: pick(|b| Some(b.hbm_bytes_per_s))?,
        h2d_bytes_per_s: pick(|b| Some(b.h2d_bytes_per_s))?,
        weight_bytes_per_token: pick(|b| Some(b.weight_bytes_per_token))?,
        h2d_bytes_per_token: pick(|b| Some(b.h2d_bytes_per_token))?,
        hbm_tok_s: pick(|b| Some(b.hbm_tok_s))?,
        pcie_tok_s: pick(|b| b.pcie_tok_s),
        cpu_expert_bytes_per_token: pick(|b| Some(b.cpu_expert_bytes_per_token))?,
        copy_all_tok_s: pick(|b| b.copy_all_tok_s),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_divide_decode_bytes_by_decoded_tokens() {
        let raw: Value = serde_json::from_str(
            r#"{"generated_tokens":5,"gpu_decode":{"hbm_bytes_per_s":4e12,
            "h2d_bytes_per_s":5e10,"weight_bytes_read":8e9,"h2d_bytes":2e8}}"#,
        )
        .unwrap();
        let b = of_run(&raw).unwrap();
        assert_eq!(b.weight_bytes_per_token, 2e9);
        assert_eq!(b.hbm_tok_s, 2000.0);
        assert_eq!(b.pcie_tok_s, Some(1000.0));
        assert_eq!(b.copy_all_tok_s, None, "the CPU computed no cold expert");
        let split: Value = serde_json::from_str(
            r#"{"generated_tokens":5,"gpu_decode":{"hbm_bytes_per_s":4e12,
            "h2d_bytes_per_s":5e10,"weight_bytes_read":8e9,"h2d_bytes":2e8,
            "cpu_expert_bytes":3e8}}"#,
        )
        .unwrap();
        let b = of_run(&split).unwrap();
        assert_eq!(b.cpu_expert_bytes_per_token, 7.5e7);
        assert_eq!(b.pcie_tok_s, Some(1000.0));
        assert_eq!(b.copy_all_tok_s, Some(400.0), "5e10 / (5e7 + 7.5e7)");
        let cpu: Value = serde_json::from_str(r#"{"generated_tokens":5}"#).unwrap();
        assert!(of_run(&cpu).is_none());
        let one: Value = serde_json::from_str(
            r#"{"generated_tokens":1,"gpu_decode":{"hbm_bytes_per_s":4e12,
            "h2d_bytes_per_s":5e10,"weight_bytes_read":8e9,"h2d_bytes":0}}"#,
        )
        .unwrap();
        assert!(of_run(&one).is_none(), "no decode step, no bound");
    }
}
