//! One measured process and the figures taken from it.

use serde::Serialize;
use serde_json::Value;

use crate::peer::PeerRates;

/// The figures summarised per arm (min / median / max over measured reps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    LoadS,
    PrefillTokS,
    FirstTokenS,
    DecodeTokS,
    PeakRssBytes,
    CgroupPeakBytes,
    ExpertBytesPerToken,
    ExpertHitRate,
    SpineBytesPerToken,
    SpineBytesPerPass,
    TokensPerPass,
}

/// How a metric prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Seconds,
    TokS,
    Bytes,
    Fraction,
    /// A plain number (tokens per pass).
    Ratio,
}

impl Metric {
    pub const ALL: [Metric; 11] = [
        Metric::LoadS,
        Metric::PrefillTokS,
        Metric::FirstTokenS,
        Metric::DecodeTokS,
        Metric::PeakRssBytes,
        Metric::CgroupPeakBytes,
        Metric::ExpertBytesPerToken,
        Metric::ExpertHitRate,
        Metric::SpineBytesPerToken,
        Metric::SpineBytesPerPass,
        Metric::TokensPerPass,
    ];

    /// The key in the JSON report.
    pub fn key(self) -> &'static str {
        match self {
            Metric::LoadS => "load_s",
            Metric::PrefillTokS => "prefill_tok_s",
            Metric::FirstTokenS => "first_token_s",
            Metric::DecodeTokS => "decode_tok_s",
            Metric::PeakRssBytes => "peak_rss_bytes",
            Metric::CgroupPeakBytes => "cgroup_peak_bytes",
            Metric::ExpertBytesPerToken => "expert_bytes_per_token",
            Metric::ExpertHitRate => "expert_hit_rate",
            Metric::SpineBytesPerToken => "spine_bytes_per_token",
            Metric::SpineBytesPerPass => "spine_bytes_per_pass",
            Metric::TokensPerPass => "tokens_per_pass",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Metric::LoadS => "load",
            Metric::PrefillTokS => "prefill",
            Metric::FirstTokenS => "first token",
            Metric::DecodeTokS => "decode (steady)",
            Metric::PeakRssBytes => "peak RSS",
            Metric::CgroupPeakBytes => "cgroup peak",
            Metric::ExpertBytesPerToken => "expert bytes/token",
            Metric::ExpertHitRate => "expert hit rate",
            Metric::SpineBytesPerToken => "spine read/token",
            Metric::SpineBytesPerPass => "spine read/pass",
            Metric::TokensPerPass => "tokens/pass",
        }
    }

    pub fn unit(self) -> Unit {
        match self {
            Metric::LoadS | Metric::FirstTokenS => Unit::Seconds,
            Metric::PrefillTokS | Metric::DecodeTokS => Unit::TokS,
            Metric::PeakRssBytes
            | Metric::CgroupPeakBytes
            | Metric::ExpertBytesPerToken
            | Metric::SpineBytesPerToken
            | Metric::SpineBytesPerPass => Unit::Bytes,
            Metric::ExpertHitRate => Unit::Fraction,
            Metric::TokensPerPass => Unit::Ratio,
        }
    }
}

/// One value per [`Metric::ALL`] entry, `None` where the run did not report it.
pub type Metrics = [Option<f64>; 11];

/// Reads the metrics from `fathom run --json`'s `stats` object. Expert bytes
/// per token divide by every position processed (prompt and generated), as
/// the run reports only the total. The streamed spine's figures are over
/// decode (the tokens after the first, as `decode_tok_s`), and absent when
/// the spine was resident.
pub fn fathom_metrics(stats: &Value, cgroup_peak: Option<u64>) -> Metrics {
    let f = |k: &str| stats.get(k).and_then(Value::as_f64);
    let positions = f("prompt_tokens").unwrap_or(0.0) + f("generated_tokens").unwrap_or(0.0);
    let per_token = match f("expert_bytes_read") {
        Some(b) if positions > 0.0 => Some(b / positions),
        _ => None,
    };
    let decoded = f("generated_tokens").unwrap_or(0.0) - 1.0;
    let passes = f("spine_decode_passes").filter(|&p| p > 0.0);
    let spine = f("spine_decode_bytes_read").filter(|_| passes.is_some());
    let per = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let decoded = (decoded > 0.0).then_some(decoded);
    [
        f("load_s"),
        f("prefill_tok_s"),
        f("first_token_s"),
        f("decode_tok_s"),
        f("peak_rss_bytes"),
        cgroup_peak.map(|b| b as f64),
        per_token,
        f("expert_hit_rate"),
        per(spine, decoded),
        per(spine, passes),
        per(decoded, passes),
    ]
}

/// The metrics a peer reports about itself (plus the cgroup's peak).
pub fn peer_metrics(r: &PeerRates, cgroup_peak: Option<u64>) -> Metrics {
    let mut m: Metrics = [None; 11];
    m[0] = r.load_s;
    m[1] = r.prefill_tok_s;
    m[3] = r.decode_tok_s;
    m[5] = cgroup_peak.map(|b| b as f64);
    m
}

/// Everything kept about one process.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub arm: String,
    /// 0-based; reps below the warmup count are discarded from the summaries.
    pub rep: usize,
    pub warmup: bool,
    pub prompt: usize,
    pub ok: bool,
    pub error: Option<String>,
    pub output_ids: Option<Vec<u32>>,
    pub wall_s: f64,
    pub exit_code: Option<i32>,
    pub cgroup_peak_bytes: Option<u64>,
    pub oom_kills: Option<u64>,
    /// The `stats` object of `fathom run --json`, or the rates parsed from a peer.
    pub raw: Value,
    #[serde(serialize_with = "metrics_as_object")]
    pub metrics: Metrics,
}

fn metrics_as_object<S: serde::Serializer>(m: &Metrics, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut map = s.serialize_map(Some(m.len()))?;
    for (k, v) in Metric::ALL.iter().zip(m) {
        map.serialize_entry(k.key(), v)?;
    }
    map.end()
}

/// Parses `fathom run --json` stdout: `(output_ids, stats)`.
pub fn parse_run_json(stdout: &str) -> Result<(Vec<u32>, Value), String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or("fathom run printed no JSON object")?;
    let v: Value = serde_json::from_str(line).map_err(|e| format!("fathom run's JSON: {e}"))?;
    let ids = v
        .get("output_ids")
        .and_then(Value::as_array)
        .ok_or("fathom run's JSON has no output_ids")?
        .iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or("fathom run's output_ids are not token ids")?;
    let stats = v
        .get("stats")
        .cloned()
        .ok_or("fathom run's JSON has no stats")?;
    Ok((ids, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_run_json() {
        let out = r#"{"prompt_ids":[1,2],"output_ids":[5,6,7],"stats":{"prompt_tokens":2,"generated_tokens":3,"expert_bytes_read":500,"decode_tok_s":4.5,"load_s":0.1,"expert_hit_rate":null}}"#;
        let (ids, stats) = parse_run_json(&format!("noise\n{out}\n")).unwrap();
        assert_eq!(ids, [5, 6, 7]);
        let m = fathom_metrics(&stats, Some(1000));
        assert_eq!(m[Metric::DecodeTokS as usize], Some(4.5));
        assert_eq!(m[Metric::ExpertBytesPerToken as usize], Some(100.0));
        assert_eq!(m[Metric::CgroupPeakBytes as usize], Some(1000.0));
        assert_eq!(m[Metric::ExpertHitRate as usize], None);
        assert_eq!(
            m[Metric::SpineBytesPerToken as usize],
            None,
            "a resident spine"
        );
        // A streamed spine: 4 passes of 1 MB for the 8 tokens after the first.
        let streamed = r#"{"output_ids":[1],"stats":{"prompt_tokens":2,"generated_tokens":9,"spine_passes":5,"spine_bytes_read":5000000,"spine_decode_passes":4,"spine_decode_bytes_read":4000000}}"#;
        let (_, stats) = parse_run_json(streamed).unwrap();
        let m = fathom_metrics(&stats, None);
        assert_eq!(m[Metric::SpineBytesPerToken as usize], Some(500_000.0));
        assert_eq!(m[Metric::SpineBytesPerPass as usize], Some(1_000_000.0));
        assert_eq!(m[Metric::TokensPerPass as usize], Some(2.0));
        assert!(parse_run_json("").is_err());
        assert!(parse_run_json("{\"output_ids\":[-1],\"stats\":{}}").is_err());
        assert!(parse_run_json("{\"output_ids\":[1]}").is_err());
    }

    #[test]
    fn metric_order_matches_all() {
        for (i, m) in Metric::ALL.iter().enumerate() {
            assert_eq!(*m as usize, i);
        }
    }
}
